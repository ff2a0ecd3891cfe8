// The live lab: polls the server's recorder (GET /lab/api/frames?after=N, with the API key as
// a Bearer header), keeps the last `history` frames, and draws the viewed one. Read-only: it
// never changes the server. No build step, no framework: a plain ES module.

import { $, h, initialLang } from "./dom.js";
import { WORDS } from "./live-i18n.js";
import { historyChart, timelineChart } from "./live-charts.js";

const POLL_MS = 300;
// A server of several models records each apart: the page watches the one ?model= names.
const MODEL = new URLSearchParams(location.search).get("model");
const MODEL_QUERY = MODEL ? `&model=${encodeURIComponent(MODEL)}` : "";
const FIELDS = ["num_tokens", "num_prompt_tokens", "num_cached_tokens", "num_scheduled_tokens"];
const S = {
  lang: initialLang(),
  key: sessionStorage.getItem("minivllm-live-key") || "",
  meta: null, // num_blocks, block_size, max_num_batched_tokens, history
  frames: [],
  after: -1,
  cursor: null, // index into frames while paused; null = follow the latest
  selected: null, // request id whose history is shown
  block: null, // block id clicked in the pool
  error: null,
};

function t(key, params) {
  let s = WORDS[S.lang][key] ?? WORDS.en[key] ?? key;
  if (params) s = s.replace(/\{(\w+)\}/g, (_, k) => (params[k] === undefined ? "" : String(params[k])));
  return s;
}

const viewed = () => (S.cursor === null ? S.frames.length - 1 : S.cursor);
const frame = () => S.frames[viewed()] || null;
const byStatus = (f, status) => (f ? f.requests.filter((r) => r.status === status) : []);

// ---- polling ------------------------------------------------------------------------------

async function poll() {
  if (S.cursor !== null) { // paused: the buffer stays as it is until Live
    setTimeout(poll, POLL_MS);
    return;
  }
  try {
    const res = await fetch(`/lab/api/frames?after=${S.after}${MODEL_QUERY}`, { headers: authHeaders(), cache: "no-store" });
    const body = await res.json();
    if (!res.ok) {
      S.error = res.status === 401 ? t("unauthorized", { msg: body.error?.message || res.status }) : `${res.status}: ${body.error?.message}`;
    } else {
      S.error = null;
      take(body);
    }
  } catch (exc) {
    S.error = t("unreachable", { msg: exc.message });
  }
  render();
  setTimeout(poll, POLL_MS);
}

function authHeaders() {
  return S.key ? { Authorization: `Bearer ${S.key}` } : {};
}

// The model picker, on a server of several models only (a one-model server has no
// /lab/api/models): choosing a model reloads the page on it; without ?model= the page
// moves to the first loaded model.
async function loadModels() {
  let body;
  try {
    const res = await fetch("/lab/api/models", { headers: authHeaders(), cache: "no-store" });
    if (!res.ok) return;
    body = await res.json();
  } catch {
    return;
  }
  const loaded = body.models.find((m) => m.state === "loaded");
  if (!MODEL && loaded) {
    location.replace(`?model=${encodeURIComponent(loaded.name)}`);
    return;
  }
  const select = $("model-select");
  select.replaceChildren(...body.models.map((m) =>
    h("option", { value: m.name, text: `${m.name} (${m.state})` })));
  select.value = MODEL || "";
  $("model-pick").hidden = false;
}

function take(body) {
  S.meta = body;
  for (const f of body.frames) {
    const prev = S.frames[S.frames.length - 1];
    if (f.hashed_blocks === null) f.hashed_blocks = prev ? prev.hashed_blocks : [];
    S.frames.push(f);
    S.after = f.index;
  }
  const extra = S.frames.length - body.history;
  if (extra > 0) S.frames.splice(0, extra);
}

// ---- render -------------------------------------------------------------------------------

function render() {
  const banner = $("banner");
  banner.hidden = !S.error;
  banner.textContent = S.error || "";
  const f = frame();
  renderStatus(f);
  $("timeline").replaceChildren(timelineChart(S.frames, viewed(), pause, t, (i, id) => { pause(i); select(id); }));
  renderQueues(f);
  renderRequests(f);
  renderPool(f);
  renderHistory();
  document.body.dataset.ready = "1";
}

function renderStatus(f) {
  const live = S.cursor === null;
  const mode = $("mode");
  mode.textContent = t(live ? "live" : "paused");
  mode.className = `pill ${live ? "live" : "past"}`;
  $("btn-pause").textContent = t(live ? "pause" : "resume");
  $("stat-step").textContent = f ? f.step : 0;
  $("stat-running").textContent = byStatus(f, "RUNNING").length;
  $("stat-waiting").textContent = byStatus(f, "WAITING").length;
  $("stat-preempt").textContent = f ? f.num_preemptions : 0;
  $("stat-free").textContent = f && S.meta ? `${f.num_free_blocks} / ${S.meta.num_blocks}` : "—";
  const scrub = $("scrub");
  scrub.max = Math.max(0, S.frames.length - 1);
  scrub.value = viewed();
  const ago = f ? t("ago_s", { s: Math.max(0, Date.now() / 1000 - f.time).toFixed(1) }) : "";
  $("frame-label").textContent = f ? t("frame", { i: viewed() + 1, n: S.frames.length, ago }) : t("no_frames");
}

function chip(r) {
  return h("button", {
    class: `qchip ${r.status}${r.request_id === S.selected ? " current" : ""}`, type: "button",
    "data-testid": `chip-${r.request_id}`, title: r.request_id, onclick: () => select(r.request_id),
  }, shortId(r.request_id), " ", h("small", { text: `${r.num_cached_tokens}/${r.num_tokens}` }));
}

function renderQueues(f) {
  const row = (status, key) => {
    const reqs = byStatus(f, status);
    return h("div", { class: "queue" }, h("span", { class: "qname", text: t(key) }),
      h("div", { class: "qchips" }, reqs.length ? reqs.map(chip) : h("span", { class: "hint", text: t("empty") })));
  };
  $("queues").replaceChildren(row("WAITING", "waiting"), row("RUNNING", "running"));
}

function renderRequests(f) {
  const head = h("tr", {}, ["request_id", "status", ...FIELDS, "block_table"].map((c) => h("th", { text: c })));
  const rows = (f ? f.requests : []).map((r) => h("tr", {
    class: `${r.status}${r.request_id === S.selected ? " picked" : ""}`, "data-testid": `req-${r.request_id}`,
    onclick: () => select(r.request_id),
  }, h("td", { class: "rid", title: r.request_id, text: shortId(r.request_id) }), h("td", { class: `st ${r.status}`, text: r.status }),
  FIELDS.map((k) => h("td", { class: "num", text: r[k] })), h("td", { class: "bt", text: `[${r.block_table.join(", ")}]` })));
  $("requests").replaceChildren(h("thead", {}, head), h("tbody", {}, rows));
}

function renderPool(f) {
  const pool = $("pool");
  if (!f || !S.meta) return pool.replaceChildren();
  const owners = new Map();
  for (const r of f.requests) for (const b of r.block_table) owners.set(b, [...(owners.get(b) || []), r.request_id]);
  const hashed = new Set(f.hashed_blocks);
  const mine = new Set((f.requests.find((r) => r.request_id === S.selected) || { block_table: [] }).block_table);
  let cached = 0, shared = 0;
  const cells = [];
  for (let b = 0; b < S.meta.num_blocks; b++) {
    const ref = (owners.get(b) || []).length;
    const kind = ref > 1 ? "shared" : ref === 1 ? "held" : hashed.has(b) ? "cached" : "free";
    cached += kind === "cached"; shared += kind === "shared";
    cells.push(h("span", {
      class: `blk ${kind}${mine.has(b) ? " mine" : ""}${S.block === b ? " picked" : ""}`, "data-block": b,
      title: `${b} · ref ${ref}`, text: ref > 1 ? ref : "", onclick: () => { S.block = b; render(); },
    }));
  }
  pool.style.setProperty("--cell", S.meta.num_blocks > 1024 ? "9px" : S.meta.num_blocks > 256 ? "14px" : "22px");
  pool.replaceChildren(...cells);
  $("pool-sum").textContent = t("pool_sum", { free: f.num_free_blocks, n: S.meta.num_blocks, bs: S.meta.block_size, cached, shared });
  const held = owners.get(S.block) || [];
  $("block-info").textContent = S.block === null ? t("block_hint") : t("block_info", {
    id: S.block, ref: held.length, owners: held.length ? t("block_owners", { ids: held.join(", ") }) : "",
    hash: hashed.has(S.block) ? t("block_hashed") : "",
  });
}

function renderHistory() {
  const id = S.selected;
  $("history-id").textContent = id || "";
  $("history-empty").hidden = id !== null;
  if (id === null) {
    $("history-chart").replaceChildren();
    $("history").replaceChildren();
    return;
  }
  const all = S.frames.map((f, i) => [i, f.requests.find((r) => r.request_id === id) || null, f.step, f]);
  // its lifetime within the buffer, with the frame after it left (its finish)
  const seen = all.filter(([, r]) => r).map(([i]) => i);
  const rows = seen.length ? all.slice(Math.max(0, seen[0] - 1), seen[seen.length - 1] + 2) : [];
  const preemptedAt = new Set(S.frames.filter((f) => f.timeline && f.timeline.preempted.includes(id)).map((f) => f.step));
  $("history-chart").replaceChildren(historyChart(rows, preemptedAt, viewed(), pause));
  const head = h("tr", {}, ["step", "status", "num_tokens", "num_cached_tokens", t("planned"), "block_table", t("event")].map((c) => h("th", { text: c })));
  const body = [];
  let prev = null;
  rows.forEach(([i, r, step, f]) => {
    const planned = f.timeline ? f.timeline.scheduled[id] : undefined;
    const event = historyEvent(prev, r, preemptedAt.has(step));
    const changed = event || planned !== undefined || (r && prev && (r.num_tokens !== prev.num_tokens || r.num_cached_tokens !== prev.num_cached_tokens));
    if (changed && (r || prev)) {
      body.push(h("tr", {
        class: `${r ? r.status : "gone"}${i === viewed() ? " picked" : ""}${event === "ev_preempted" ? " preempted" : ""}`,
        "data-testid": "history-row", "data-event": event || "", onclick: () => pause(i),
      }, h("td", { class: "num", text: step }), h("td", { text: r ? r.status : "—" }),
      h("td", { class: "num", text: r ? r.num_tokens : "—" }), h("td", { class: "num", text: r ? r.num_cached_tokens : "—" }),
      h("td", { class: "num", text: planned ?? "" }), h("td", { class: "bt", text: r ? `[${r.block_table.join(", ")}]` : "" }),
      h("td", { class: "ev", text: event ? t(event) : "" })));
    }
    prev = r;
  });
  $("history").replaceChildren(h("thead", {}, head), h("tbody", {}, body.reverse()));
}

function historyEvent(prev, r, preempted) {
  if (preempted) return "ev_preempted";
  if (!prev && r) return r.status === "RUNNING" ? "ev_admitted" : "ev_arrived";
  if (prev && !r) return "ev_finished";
  if (prev && r && prev.status === "WAITING" && r.status === "RUNNING") return "ev_admitted";
  return null;
}

const shortId = (id) => (id.length > 14 ? `…${id.slice(-12)}` : id);

function select(id) {
  S.selected = id;
  render();
}

function pause(i) {
  S.cursor = Math.min(Math.max(0, i), Math.max(0, S.frames.length - 1));
  render();
}

// ---- controls -----------------------------------------------------------------------------

function applyWords() {
  document.documentElement.lang = S.lang === "zh" ? "zh-CN" : "en";
  for (const node of document.querySelectorAll("[data-i18n]")) node.textContent = t(node.dataset.i18n);
  $("lang-toggle").textContent = t("other_lang");
  const key = (cls, word) => h("span", { class: `key ${cls}`, text: t(word) });
  $("timeline-legend").replaceChildren(key("k-prefill", "prefill"), key("k-decode", "decode"),
    key("k-batch", "batch"), key("k-ms", "step_ms"), key("k-preempt", "preempt"));
  $("pool-legend").replaceChildren(key("k-held", "held"), key("k-shared", "shared"),
    key("k-cached", "cached"), key("k-free", "free"), key("k-mine", "selected_blocks"));
  $("history-legend").replaceChildren(h("span", { class: "key k-tokens", text: "num_tokens" }),
    h("span", { class: "key k-cachedl", text: "num_cached_tokens" }), h("span", { class: "key k-prompt", text: "num_prompt_tokens" }),
    key("k-preempt", "preempt"));
}

function setup() {
  $("key-input").value = S.key;
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    S.key = $("key-input").value.trim();
    sessionStorage.setItem("minivllm-live-key", S.key);
    S.error = null;
    loadModels();
  });
  $("model-select").addEventListener("change", (e) => {
    location.search = `?model=${encodeURIComponent(e.target.value)}`;
  });
  $("lang-toggle").addEventListener("click", () => {
    S.lang = S.lang === "en" ? "zh" : "en";
    localStorage.setItem("minivllm-lab-lang", S.lang);
    applyWords();
    render();
  });
  $("btn-pause").addEventListener("click", () => {
    if (S.cursor === null) pause(S.frames.length - 1);
    else { S.cursor = null; render(); }
  });
  $("scrub").addEventListener("input", (e) => pause(Number(e.target.value)));
  applyWords();
  render();
  loadModels();
  poll();
}

setup();
