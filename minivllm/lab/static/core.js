// Shared by every module of the page: the state, the words, small DOM helpers, the frames the
// server recorded and the JSON API. No build step, no framework: plain ES modules.

import { I18N } from "./i18n.js";
import { $, h, initialLang } from "./dom.js";

export { $, h, initialLang };

export const FIELDS = ["num_tokens", "num_prompt_tokens", "num_cached_tokens", "num_scheduled_tokens"];
export const SLOT_STATES = ["committed", "written", "planned", "reserved", "cached", "free"];
export const TOKEN_STATES = ["committed", "written", "planned", "uncached"];
// The phase in which each field grows (seq8's explain check compares with the trace).
export const GROW_FIELDS = ["num_scheduled_tokens", "num_cached_tokens", "num_tokens"];
export const PHASES = ["plan", "execute", "commit"];

export const S = {
  lang: initialLang(),
  frames: [],
  cursor: 0,
  selected: null, // seq_id shown in the sequence card; null = the scenario's focus
  scenarios: [], // [{name, chapter}], from /api/lab/scenarios
  chapters: [], // [{chapter, code: ["minivllm/...py:LINE"]}]
  limits: {}, // the engine options a learner may set, and their maxima
  lesson: null, // the server-graded question of chapters 04-06 (null in chapter 03)
  resetWith: () => {}, // main.js: reset a scenario with the learner's engine options
  answers: {}, // this experiment's prediction, explain check and sentence (see saveAnswers)
  busy: false,
  playing: false,
  codeLoc: null, // the event source shown in the code pane; null = the latest change's
  sources: {},
  pickPos: null, // position highlighted in the slot calculator
  pickSlot: null, // KV slot clicked in the pool
};

// ---- small helpers ----------------------------------------------------------------------

export function t(key, params) {
  let s = I18N[S.lang][key];
  if (s === undefined) s = I18N.en[key];
  if (s === undefined) return key;
  if (typeof s === "string" && params) s = fillWords(s, params);
  return s;
}

/** Fill `{name}` with params.name, and `{name|one|other}` with the form for that count
 *  ("1 token", "2 tokens"; the Chinese words need no plural). */
export function fillWords(text, params) {
  return text
    .replace(/\{(\w+)\|([^|}]*)\|([^}]*)\}/g, (_, k, one, other) => (Number(params[k]) === 1 ? one : other))
    .replace(/\{(\w+)\}/g, (_, k) => (params[k] === undefined ? "" : String(params[k])));
}

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
  if (!res.ok) {
    const err = new Error(data.error || res.statusText);
    err.code = data.code;
    err.params = data.params || {};
    throw err;
  }
  return data;
}

/** An API error in the page's language: its code's words, else the server's message. */
export function errorText(err) {
  const key = `err_${err.code}`;
  return err.code && t(key) !== key ? t(key, err.params) : err.message;
}

// ---- the learner's answers: kept per experiment, across reloads ---------------------------

const answersKey = () => `minivllm-lab-answers-${last().experiment}`;

export function loadAnswers() {
  try { S.answers = JSON.parse(localStorage.getItem(answersKey()) || "{}") || {}; }
  catch { S.answers = {}; }
}

export function saveAnswers() {
  try { localStorage.setItem(answersKey(), JSON.stringify(S.answers)); } catch { /* private mode */ }
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

/** A field or function name that may wrap after its underscores and dots, never inside a
 *  word. */
export function breakable(name) {
  const parts = name.split(/(?<=[_.])/);
  return parts.flatMap((p, i) => (i < parts.length - 1 ? [p, h("wbr")] : [p]));
}

/** What a step's plan scheduled: "decode", "prefill", "chunk" (a prefill not yet whole), or
 *  a mix of them, read from the plan frame's sequences. */
export function planKinds(planFrame) {
  const kinds = new Set();
  for (const s of planFrame.sequences) {
    if (!s.num_scheduled_tokens) continue;
    const upTo = s.num_cached_tokens + s.num_scheduled_tokens;
    if (s.num_scheduled_tokens === 1 && upTo === s.num_tokens && s.num_tokens > s.num_prompt_tokens) kinds.add("decode");
    else kinds.add(upTo < s.num_tokens ? "chunk" : "prefill");
  }
  return [...kinds];
}

/** Scroll `container` (not the window) just enough to show `el`. */
export function scrollWithin(container, el) {
  if (!el) return;
  const box = container.getBoundingClientRect();
  const r = el.getBoundingClientRect();
  if (r.bottom > box.bottom) container.scrollTop += r.bottom - box.bottom;
  else if (r.top < box.top) container.scrollTop -= box.top - r.top;
}
