// Shared by every module of the page: the state, the words, small DOM helpers, the frames the
// server recorded and the JSON API. No build step, no framework: plain ES modules.

import { I18N } from "./i18n.js";

export const FIELDS = ["num_tokens", "num_prompt_tokens", "num_cached_tokens", "num_scheduled_tokens"];
export const SEQ_FIELDS = ["status", ...FIELDS, "block_table"];
export const SLOT_STATES = ["committed", "written", "planned", "reserved", "cached", "free"];
export const TOKEN_STATES = ["committed", "written", "planned", "uncached"];
export const MATCH_KEYS = { plan: "num_scheduled_tokens", commit: "num_cached_tokens", step: "num_tokens" };

export const S = {
  lang: initialLang(),
  frames: [],
  cursor: 0,
  selected: null, // seq_id shown in the sequence card; null = the scenario's focus
  scenarios: [], // names, from /api/lab/scenarios
  predictions: {}, // scenario -> chosen key
  matches: {}, // action -> chosen field (seq8's explain step)
  matchChecked: false,
  relation: null,
  busy: false,
  playing: false,
  codeLoc: null, // the event source shown in the code pane; null = the latest change's
  sources: {},
  pickPos: null, // position highlighted in the slot calculator
  pickSlot: null, // KV slot clicked in the pool
};

// ---- small helpers ----------------------------------------------------------------------

export function initialLang() {
  const saved = localStorage.getItem("minivllm-lab-lang");
  if (saved === "en" || saved === "zh") return saved;
  return (navigator.language || "en").toLowerCase().startsWith("zh") ? "zh" : "en";
}

export function t(key, params) {
  let s = I18N[S.lang][key];
  if (s === undefined) s = I18N.en[key];
  if (s === undefined) return key;
  if (typeof s === "string" && params) {
    s = s.replace(/\{(\w+)\}/g, (_, k) => (params[k] === undefined ? "" : String(params[k])));
  }
  return s;
}

export function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export const $ = (id) => document.getElementById(id);

/** node.replaceChildren, skipping null/false children (they would render as text). */
export function fill(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}
export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
export const fmt = (v) => (Array.isArray(v) ? `[${v.join(", ")}]` : v === null ? "—" : String(v));
export const shortFile = (loc) => loc.replace(/^minivllm\//, "");

export function showPiece(piece) {
  if (piece === null || piece === undefined) return null;
  return piece.replace(/\n/g, "⏎").replace(/^ /, "␣") || "∅";
}

export function toast(message) {
  const node = $("toast");
  node.textContent = message;
  node.classList.add("show");
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => node.classList.remove("show"), 4500);
}

// ---- frames -----------------------------------------------------------------------------

export const view = () => S.frames[S.cursor];
export const prevOf = (i) => (i > 0 ? S.frames[i - 1] : null);
export const last = () => S.frames[S.frames.length - 1];
export const isLive = () => S.cursor === S.frames.length - 1;
export const seqIn = (frame, id) => (frame ? frame.sequences.find((s) => s.seq_id === id) || null : null);
export const focusOf = (frame) => seqIn(frame, frame.focus_seq_id);

export function selectedId(frame) {
  if (S.selected !== null && seqIn(frame, S.selected)) return S.selected;
  return frame.focus_seq_id;
}

/** Events recorded between the previous frame and `frame`. */
export function newEvents(i) {
  const prev = prevOf(i);
  return S.frames[i].events.slice(prev ? prev.events.length : 0);
}

/** Frames of the learner's actions (setup excluded), grouped: [{action, from, to}]. */
export function actions() {
  const out = [];
  S.frames.forEach((f, i) => {
    if (f.frame.action === "setup") return;
    const open = out[out.length - 1];
    if (open && open.to === i - 1 && open.action === f.frame.action && f.frame.stage !== "plan"
        && f.frame.stage !== "add") {
      open.to = i;
    } else {
      out.push({ action: f.frame.action, from: i, to: i });
    }
  });
  return out;
}

export function lastSetupIndex() {
  let idx = 0;
  S.frames.forEach((f, i) => { if (f.frame.action === "setup") idx = i; });
  return idx;
}

/** The Sequence fields of `seqId` that changed during frames from..to (events of the engine). */
export function changedFields(from, to, seqId) {
  const start = from > 0 ? S.frames[from - 1].events.length : 0;
  const events = S.frames[to].events.slice(start).filter((e) => e.seq_id === seqId);
  return [...new Set(events.map((e) => e.field).filter((f) => SEQ_FIELDS.includes(f)))];
}


// ---- the API ----------------------------------------------------------------------------

export async function api(method, path, body) {
  const init = { method, headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  let data;
  try { data = await res.json(); } catch { data = { error: res.statusText }; }
  if (!res.ok) throw new Error(data.error || res.statusText);
  return data;
}

export function phaseName(stage) {
  const key = `phase_${stage}`;
  return t(key) === key ? stage : t(key);
}

export function describe(e, pieces) {
  if (e.field === "kv_written") return `KV [${e.before}, ${e.after})`;
  if (e.field === "sampled_token") {
    const p = pieces.get(e.after);
    return `→ ${e.after}${p ? ` "${showPiece(p)}"` : ""}`;
  }
  return `${fmt(e.before)} → ${fmt(e.after)}`;
}

export function piecesOf(frame) {
  const map = new Map();
  for (const s of frame.sequences) {
    if (s.pieces) s.token_ids.forEach((id, i) => map.set(id, s.pieces[i]));
    if (s.sampled_token !== null && s.sampled_piece !== null) map.set(s.sampled_token, s.sampled_piece);
  }
  return map;
}

// ---- render: main.js installs the function that draws everything ---------------------------

let renderAll = () => {};
export function setRenderer(fn) { renderAll = fn; }
export function render() { renderAll(); }
