// The Engine Lab page. It draws frames (snapshots of the engine state the server recorded)
// and sends the learner's clicks to the JSON API. No build step, no framework.
"use strict";

const FIELDS = ["num_tokens", "num_prompt_tokens", "num_cached_tokens", "num_scheduled_tokens"];
const SEQ_FIELDS = ["status", ...FIELDS, "block_table"];
const SCENARIOS = ["seq8", "chunked", "prefix", "preempt", "finish"];
const STATUSES = ["WAITING", "RUNNING", "FINISHED"];
const SLOT_STATES = ["committed", "written", "planned", "reserved", "cached", "free"];
const TOKEN_STATES = ["committed", "written", "planned", "uncached"];
const MATCH_KEYS = { plan: "num_scheduled_tokens", commit: "num_cached_tokens", step: "num_tokens" };

const S = {
  lang: initialLang(),
  frames: [],
  cursor: 0,
  selected: null, // seq_id shown in the sequence card; null = the scenario's focus
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

function initialLang() {
  const saved = localStorage.getItem("minivllm-lab-lang");
  if (saved === "en" || saved === "zh") return saved;
  return (navigator.language || "en").toLowerCase().startsWith("zh") ? "zh" : "en";
}

function t(key, params) {
  let s = I18N[S.lang][key];
  if (s === undefined) s = I18N.en[key];
  if (s === undefined) return key;
  if (typeof s === "string" && params) {
    s = s.replace(/\{(\w+)\}/g, (_, k) => (params[k] === undefined ? "" : String(params[k])));
  }
  return s;
}

function h(tag, attrs, ...children) {
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

const $ = (id) => document.getElementById(id);

/** node.replaceChildren, skipping null/false children (they would render as text). */
function fill(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const fmt = (v) => (Array.isArray(v) ? `[${v.join(", ")}]` : v === null ? "—" : String(v));
const shortFile = (loc) => loc.replace(/^minivllm\//, "");

function showPiece(piece) {
  if (piece === null || piece === undefined) return null;
  return piece.replace(/\n/g, "⏎").replace(/^ /, "␣") || "∅";
}

function toast(message) {
  const node = $("toast");
  node.textContent = message;
  node.classList.add("show");
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => node.classList.remove("show"), 4500);
}

// ---- frames -----------------------------------------------------------------------------

const view = () => S.frames[S.cursor];
const prevOf = (i) => (i > 0 ? S.frames[i - 1] : null);
const last = () => S.frames[S.frames.length - 1];
const isLive = () => S.cursor === S.frames.length - 1;
const seqIn = (frame, id) => (frame ? frame.sequences.find((s) => s.seq_id === id) || null : null);
const focusOf = (frame) => seqIn(frame, frame.focus_seq_id);

function selectedId(frame) {
  if (S.selected !== null && seqIn(frame, S.selected)) return S.selected;
  return frame.focus_seq_id;
}

/** Events recorded between the previous frame and `frame`. */
function newEvents(i) {
  const prev = prevOf(i);
  return S.frames[i].events.slice(prev ? prev.events.length : 0);
}

/** Frames of the learner's actions (setup excluded), grouped: [{action, from, to}]. */
function actions() {
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

function lastSetupIndex() {
  let idx = 0;
  S.frames.forEach((f, i) => { if (f.frame.action === "setup") idx = i; });
  return idx;
}

/** The Sequence fields of `seqId` that changed during frames from..to (events of the engine). */
function changedFields(from, to, seqId) {
  const start = from > 0 ? S.frames[from - 1].events.length : 0;
  const events = S.frames[to].events.slice(start).filter((e) => e.seq_id === seqId);
  return [...new Set(events.map((e) => e.field).filter((f) => SEQ_FIELDS.includes(f)))];
}

// ---- the API ----------------------------------------------------------------------------

async function api(method, path, body) {
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

function absorb(data, replace) {
  const frames = data.frames || [data];
  S.frames = replace ? frames : S.frames.concat(frames);
  S.cursor = S.frames.length - 1;
  S.codeLoc = null;
}

async function act(path, body, replace = false) {
  if (S.busy || S.playing) return;
  S.busy = true;
  renderButtons();
  try {
    absorb(await api("POST", path, body), replace);
  } catch (err) {
    toast(err.message);
  } finally {
    S.busy = false;
    render();
  }
}

function resetScenario(name) {
  S.predictions[name] = undefined;
  S.matches = {};
  S.matchChecked = false;
  S.relation = null;
  S.selected = null;
  S.pickPos = null;
  S.pickSlot = null;
  return act("/api/lab/reset", { scenario: name }, true);
}

// ---- play: the seed's animation ---------------------------------------------------------

async function play() {
  if (S.playing) { S.playing = false; render(); return; }
  if (S.busy) return;
  S.playing = true;
  render();
  try {
    const end = last();
    const done = end.scenario === "seq8" && focusOf(end) && focusOf(end).status === "FINISHED";
    if (!done) {
      // One Sequence through WAITING -> RUNNING -> FINISHED: plan, execute, commit, repeated.
      absorb(await api("POST", "/api/lab/reset", { scenario: "seq8" }), true);
      for (let i = 0; i < 32 && focusOf(last()).status !== "FINISHED"; i++) {
        absorb(await api("POST", "/api/lab/plan"), false);
        absorb(await api("POST", "/api/lab/commit"), false);
      }
    }
    for (let i = 0; i < S.frames.length && S.playing; i++) {
      S.cursor = i;
      S.codeLoc = null;
      render();
      await sleep(i === 0 ? 600 : 1100);
    }
  } catch (err) {
    toast(err.message);
  } finally {
    S.playing = false;
    S.cursor = S.frames.length - 1;
    render();
  }
}

// ---- guides: predict -> run -> explain, per scenario ------------------------------------

function firstLearnerFrame(pred) {
  return S.frames.find((f) => f.frame.action !== "setup" && pred(f)) || null;
}

function startFrame() { return S.frames[lastSetupIndex()] || S.frames[0]; }

function sharedPrefix(frame) {
  const [a, b] = frame.sequences;
  if (!a || !b) return 0;
  let n = 0;
  while (n < b.num_prompt_tokens - 1 && a.token_ids[n] === b.token_ids[n]) n++;
  return n - (n % frame.block_size);
}

const GUIDES = {
  seq8: {
    intro: (f) => t("s_seq8_intro", { text: seqLabel(focusOf(f)) }),
    choices: () => FIELDS.map((x) => [x, x]),
    actual() {
      const pf = firstLearnerFrame((f) => f.frame.stage === "plan");
      if (!pf) return null;
      const s = focusOf(pf);
      return {
        keys: FIELDS.filter((x) => s[x] === 0),
        text: t("s_seq8_ok", { sched: s.num_scheduled_tokens, cached: s.num_cached_tokens }),
      };
    },
    steps: [
      () => actions().some((a) => a.action === "plan"),
      () => actions().some((a) => a.action === "commit"),
      () => actions().some((a) => a.action === "step"),
    ],
  },
  chunked: {
    intro: (f) => t("s_chunked_intro", {
      prompt: focusOf(f).num_prompt_tokens, budget: f.budget.max_num_batched_tokens,
      text: seqLabel(focusOf(f)),
    }),
    choices: (f) => {
      const s = focusOf(f);
      return [0, Math.min(f.budget.max_num_batched_tokens, s.num_prompt_tokens), s.num_prompt_tokens]
        .map((v) => [String(v), String(v)]);
    },
    actual() {
      const cf = firstLearnerFrame((f) => f.frame.stage === "commit");
      if (!cf) return null;
      const values = [0];
      for (const f of S.frames) {
        if (f.frame.stage !== "commit") continue;
        const c = focusOf(f).num_cached_tokens;
        if (c !== values[values.length - 1]) values.push(c);
      }
      const now = focusOf(last());
      const whole = now.num_tokens > now.num_prompt_tokens;
      return { keys: [String(focusOf(cf).num_cached_tokens)],
               text: t(whole ? "s_chunked_ok" : "s_chunked_partial",
                       { seq: values.join(" → "), prompt: now.num_prompt_tokens }) };
    },
    steps: [
      () => actions().some((a) => a.action === "commit" || a.action === "step"),
      () => { const s = focusOf(last()); return s.num_cached_tokens >= s.num_prompt_tokens; },
      () => { const s = focusOf(last()); return s.num_tokens > s.num_prompt_tokens; },
    ],
  },
  prefix: {
    intro: (f) => t("s_prefix_intro", { shared: sharedPrefix(f), text: seqLabel(focusOf(f)) }),
    choices: (f) => [0, sharedPrefix(f), focusOf(f).num_prompt_tokens]
      .map((v) => [String(v), String(v)]),
    actual() {
      const pf = firstLearnerFrame((f) => f.frame.stage === "plan");
      if (!pf) return null;
      const s = focusOf(pf);
      return { keys: [String(s.num_cached_tokens)],
               text: t("s_prefix_ok", { cached: s.num_cached_tokens, sched: s.num_scheduled_tokens }) };
    },
    steps: [
      () => actions().some((a) => a.action === "plan" || a.action === "step"),
      () => actions().some((a) => a.action === "commit" || a.action === "step"),
    ],
  },
  preempt: {
    intro: (f) => t("s_preempt_intro", { n: f.num_blocks }),
    choices: () => t("s_preempt_choices"),
    actual() {
      const pf = firstLearnerFrame((f) => f.frame.stage === "plan");
      if (!pf) return null;
      const s = focusOf(pf);
      return {
        keys: [s.status === "WAITING" ? "waiting" : "running"],
        text: t("s_preempt_ok", { status: s.status, cached: s.num_cached_tokens,
                                  bt: s.block_table.join(", "), tokens: s.num_tokens }),
      };
    },
    steps: [
      () => actions().some((a) => a.action === "plan" || a.action === "step"),
      () => {
        const f = last();
        return f.sequences[0].status === "FINISHED" && focusOf(f).status !== "WAITING";
      },
    ],
  },
  finish: {
    intro: (f) => t("s_finish_intro", { prompt: focusOf(f).num_prompt_tokens, text: seqLabel(focusOf(f)) }),
    choices: () => t("s_finish_choices"),
    actual() {
      const ff = firstLearnerFrame((f) => focusOf(f).status === "FINISHED");
      if (!ff) return null;
      const s = focusOf(ff);
      return {
        keys: [s.block_table.length === 0 ? "freed" : "kept"],
        text: t("s_finish_ok", { status: s.status, reason: s.finish_reason, bt: s.block_table.join(", ") }),
      };
    },
    steps: [
      () => actions().some((a) => a.action === "commit" || a.action === "step"),
      () => focusOf(last()).status === "FINISHED",
    ],
  },
};

function seqLabel(seq) {
  if (!seq) return "";
  return seq.prompt_text !== null ? seq.prompt_text : seq.token_ids.slice(0, seq.num_prompt_tokens).join(" ");
}

function renderGuide() {
  const f = startFrame();
  const name = last().scenario;
  const guide = GUIDES[name];
  $("guide-title").textContent = t(`s_${name}_title`);
  $("guide-intro").textContent = guide.intro(f);
  $("predict-question").textContent = t(`s_${name}_q`);

  const chosen = S.predictions[name];
  const actual = guide.actual();
  const choices = $("predict-choices");
  fill(choices, ...guide.choices(f).map(([key, label]) => {
    let cls = "choice";
    if (chosen === key) cls += " chosen";
    if (actual && chosen !== undefined && actual.keys.includes(key)) cls += " right";
    if (actual && chosen === key && !actual.keys.includes(key)) cls += " wrong";
    return h("button", {
      class: cls, type: "button", "data-testid": `predict-choice-${key}`,
      onclick: () => { S.predictions[name] = key; render(); },
    }, h("code", { text: label }));
  }));
  $("predict-note").textContent = chosen === undefined ? "" : `${t("your_answer")}: ${chosen}`;

  const steps = t(`s_${name}_steps`);
  fill($("run-steps"), ...steps.map((text, i) => {
    const done = guide.steps[i] ? guide.steps[i]() : false;
    return h("li", { class: done ? "done" : "" }, h("span", { class: "tick", text: done ? "✓" : String(i + 1) }), text);
  }));
  $("flow-predict").classList.toggle("active", chosen === undefined);
  $("flow-run").classList.toggle("active", chosen !== undefined && !actual);
  $("flow-explain").classList.toggle("active", Boolean(actual));

  const body = $("explain-body");
  const parts = [];
  if (!actual) {
    parts.push(h("p", { class: "hint", text: chosen === undefined ? t("not_answered") : t("run_first") }));
  } else {
    const ok = chosen !== undefined && actual.keys.includes(chosen);
    parts.push(h("div", { class: `verdict ${chosen === undefined ? "" : ok ? "ok" : "bad"}`, "data-testid": "predict-feedback" },
      h("strong", { text: chosen === undefined ? t("observed") : ok ? t("correct") : t("wrong") }),
      chosen === undefined ? " " : ` ${t("your_answer")}: ${chosen}. `,
      h("span", { text: actual.text })));
  }
  if (name === "seq8") parts.push(...seq8Explain());
  parts.push(h("p", { class: "hint words", text: t("explain_words") }));
  fill(body, ...parts);
}

function seq8Explain() {
  const acts = actions();
  const focus = last().focus_seq_id;
  const rows = ["plan", "commit", "step"].map((action) => {
    const a = acts.find((x) => x.action === action);
    const changed = a ? changedFields(a.from, a.to, focus) : null;
    const pick = S.matches[action] || "";
    let result = "";
    let cls = "";
    if (S.matchChecked && pick) {
      if (!changed) { result = t("match_undone"); cls = "bad"; }
      else if (pick === MATCH_KEYS[action]) { result = t("match_ok", { field: pick }); cls = "ok"; }
      else if (changed.includes(pick)) { result = t("match_also", { field: pick, key: MATCH_KEYS[action] }); cls = "meh"; }
      else { result = t("match_no", { field: pick, changed: changed.join(", ") }); cls = "bad"; }
    }
    const select = h("select", {
      "data-testid": `match-${action === "step" ? "decode" : action}`,
      onchange: (e) => { S.matches[action] = e.target.value; S.matchChecked = false; render(); },
    }, h("option", { value: "", text: t("match_pick") }),
    ...SEQ_FIELDS.map((fld) => h("option", { value: fld, text: fld, selected: pick === fld })));
    return h("div", { class: "match-row" },
      h("span", { class: `match-act ${action === "step" ? "decode" : action}`, text: t("match_actions")[action] }),
      select,
      h("span", { class: `match-result ${cls}`, "data-testid": `match-result-${action === "step" ? "decode" : action}`, text: result }));
  });
  const rel = t("s_seq8_rel").map(([key, text]) => h("button", {
    type: "button", class: `choice wide ${S.relation === key ? (key === "plan" ? "chosen right" : "chosen wrong") : ""}`,
    "data-testid": `relation-choice-${key}`, onclick: () => { S.relation = key; render(); },
  }, text));
  return [
    h("h3", { text: t("match_title") }),
    h("div", { class: "matches" }, rows),
    h("button", { type: "button", class: "check", "data-testid": "btn-check",
                  onclick: () => { S.matchChecked = true; render(); } }, t("check")),
    h("h3", { text: t("relation_title") }),
    h("div", { class: "choices column" }, rel),
    S.relation ? h("p", { class: `verdict ${S.relation === "plan" ? "ok" : "bad"}`, "data-testid": "relation-feedback",
                          text: t("s_seq8_rel_fb")[S.relation] }) : null,
  ];
}

// ---- the state views -----------------------------------------------------------------------

function applyI18n() {
  document.documentElement.lang = S.lang === "zh" ? "zh-CN" : "en";
  for (const node of document.querySelectorAll("[data-i18n]")) node.textContent = t(node.dataset.i18n);
  $("lang-toggle").textContent = t("other_lang");
  $("add-prompt").placeholder = t("add_placeholder");
}

function renderScenarios() {
  const current = last().scenario;
  fill($("scenarios"), ...SCENARIOS.map((name) => h("button", {
    type: "button", class: `scenario ${name === current ? "current" : ""}`,
    "data-testid": `scenario-${name}`, onclick: () => resetScenario(name),
  }, t(`s_${name}_tab`))));
  const f = last();
  $("real").textContent = t(f.model.runner === "ModelRunner" ? "real_note" : "real_fake",
                            { runner: `${f.model.runner}, block_size ${f.block_size}` });
}

function renderButtons() {
  const live = last();
  const locked = S.busy || S.playing;
  const focus = seqIn(live, selectedId(live));
  $("btn-plan").disabled = locked || live.pending_plan;
  $("btn-commit").disabled = locked || !live.pending_plan;
  $("btn-decode").disabled = locked || live.pending_plan;
  const prefill = focus && focus.status !== "FINISHED" && focus.num_cached_tokens < focus.num_prompt_tokens;
  $("btn-plan").querySelector(".act-name").textContent = t(prefill ? "btn_plan" : "btn_plan_again");
  $("btn-back").disabled = S.cursor === 0 || S.playing;
  $("btn-forward").disabled = isLive() || S.playing;
  $("btn-play").textContent = S.playing ? t("stop") : t("play");
  $("btn-play").classList.toggle("on", S.playing);
  document.body.classList.toggle("busy", S.busy);
}

function renderTimebar() {
  const range = $("timeline");
  range.max = String(S.frames.length - 1);
  range.value = String(S.cursor);
  const f = view();
  const stage = f.frame.stage;
  fill($("frame-label"),
    h("span", { text: t("frame", { i: S.cursor + 1, n: S.frames.length }) }),
    h("span", { class: "frame-act", text: t(`act_${f.frame.action}`) }),
    h("span", { class: `pill ${stage}`, text: phaseName(stage) }),
    h("span", { class: `pill ${isLive() ? "live" : "past"}`, text: isLive() ? t("live") : t("past") }),
  );
  const dots = document.querySelector(".dots") || h("div", { class: "dots" });
  fill(dots, ...S.frames.map((fr, i) => h("button", {
    type: "button", class: `dot ${fr.frame.stage} ${i === S.cursor ? "at" : ""} ${fr.frame.action === "setup" ? "setup" : ""}`,
    title: `${i + 1}: ${fr.frame.action} · ${fr.frame.stage}`,
    onclick: () => { S.cursor = i; S.codeLoc = null; render(); },
  })));
  if (!dots.parentNode) $("timeline").after(dots);
}

function phaseName(stage) {
  const key = `phase_${stage}`;
  return t(key) === key ? stage : t(key);
}

function describe(e, pieces) {
  if (e.field === "kv_written") return `KV [${e.before}, ${e.after})`;
  if (e.field === "sampled_token") {
    const p = pieces.get(e.after);
    return `→ ${e.after}${p ? ` "${showPiece(p)}"` : ""}`;
  }
  return `${fmt(e.before)} → ${fmt(e.after)}`;
}

function piecesOf(frame) {
  const map = new Map();
  for (const s of frame.sequences) {
    if (s.pieces) s.token_ids.forEach((id, i) => map.set(id, s.pieces[i]));
    if (s.sampled_token !== null && s.sampled_piece !== null) map.set(s.sampled_token, s.sampled_piece);
  }
  return map;
}

function renderNarration() {
  const f = view();
  const stage = f.frame.stage;
  const node = $("narration");
  node.className = `narration ${stage}`;
  const pieces = piecesOf(f);
  const events = newEvents(S.cursor).filter((e) => e.field !== "finish_reason");
  let head;
  if (S.cursor === lastSetupIndex() && f.frame.action === "setup") head = t("narr_start");
  else head = t(`narr_${stage}`);
  if (f.frame.action === "setup" && S.cursor !== lastSetupIndex()) head = t("narr_setup", { what: t(`narr_${stage}`) });
  const items = events.map((e) => h("span", { class: `chg ${e.phase}` },
    h("b", { text: `seq ${e.seq_id}` }), ` ${e.field} `, h("span", { class: "mono", text: describe(e, pieces) })));
  fill(node, h("span", { class: `badge ${stage}`, text: phaseName(stage) }),
    h("span", { class: "narr-text", text: head }), h("div", { class: "narr-items" }, items));
}

function renderSeqTabs(f) {
  const sel = selectedId(f);
  fill($("seq-tabs"), ...f.sequences.map((s) => h("button", {
    type: "button", class: `seq-tab ${s.status} ${s.seq_id === sel ? "current" : ""}`,
    "data-testid": `seq-tab-${s.seq_id}`,
    onclick: () => { S.selected = s.seq_id; S.pickPos = null; render(); },
  }, `seq ${s.seq_id}`, h("small", { text: s.status }))));
}

function renderDiagram(seq, prevSeq) {
  const W = 560;
  const nodes = { WAITING: 20, RUNNING: 210, FINISHED: 400 };
  const took = prevSeq && prevSeq.status !== seq.status ? `${prevSeq.status}>${seq.status}` : "";
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} 104`);
  svg.setAttribute("class", "state-svg");
  const add = (tag, attrs, text) => {
    const n = document.createElementNS(svgNS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text) n.textContent = text;
    svg.append(n);
    return n;
  };
  const defs = add("defs", {});
  for (const [id, color] of [["arr", "#94a3b8"], ["arr-on", "#0f172a"]]) {
    const m = document.createElementNS(svgNS, "marker");
    for (const [k, v] of Object.entries({ id, viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" })) m.setAttribute(k, v);
    const p = document.createElementNS(svgNS, "path");
    p.setAttribute("d", "M0,0 L10,5 L0,10 z");
    p.setAttribute("fill", color);
    m.append(p);
    defs.append(m);
  }
  const arrow = (d, on, label, lx, ly, cls) => {
    add("path", { d, class: `edge ${on ? "on" : ""} ${cls}`, "marker-end": `url(#${on ? "arr-on" : "arr"})` });
    add("text", { x: lx, y: ly, class: `edge-label ${on ? "on" : ""}`, "text-anchor": "middle" }, label);
  };
  arrow("M162,36 L206,36", took === "WAITING>RUNNING", "schedule", 185, 26, "plan");
  arrow("M352,36 L396,36", took === "RUNNING>FINISHED" || took === "WAITING>FINISHED", "finish", 375, 26, "commit");
  arrow("M280,60 C280,96 90,96 90,62", took === "RUNNING>WAITING", t("preempt_arrow"), 185, 100, "preempt");
  for (const [status, x] of Object.entries(nodes)) {
    const on = seq.status === status;
    add("rect", { x, y: 14, width: 142, height: 44, rx: 12, class: `node ${status} ${on ? "on" : ""}` });
    add("text", { x: x + 71, y: 41, class: `node-label ${on ? "on" : ""}`, "text-anchor": "middle" }, status);
  }
  const box = h("div", { class: "diagram-inner", "data-testid": "state-diagram", "data-status": seq.status });
  box.append(svg);
  const extra = [];
  if (seq.finish_reason) extra.push(t("finish_reason", { r: seq.finish_reason }));
  if (seq.num_preemptions) extra.push(`preemptions: ${seq.num_preemptions}`);
  extra.push(`max_tokens: ${seq.max_tokens}`);
  box.append(h("div", { class: "diagram-note", text: extra.join(" · ") }));
  fill($("diagram"), box);
}

function fieldPhase(events, seqId, field) {
  const hit = events.filter((e) => e.seq_id === seqId && e.field === field);
  return hit.length ? hit[hit.length - 1] : null;
}

function renderFields(seq, prevSeq, events) {
  const tiles = ["status", ...FIELDS].map((field) => {
    const value = seq[field];
    const before = prevSeq ? prevSeq[field] : undefined;
    const changed = prevSeq && before !== value;
    const ev = fieldPhase(events, seq.seq_id, field);
    const phase = ev ? ev.phase : changed ? "commit" : "";
    return h("div", { class: `field ${field === "status" ? "status-tile " + value : ""} ${changed ? "changed " + phase : ""}` },
      h("div", { class: "f-name", text: field === "status" ? "status" : field }),
      h("div", { class: "f-value-row" },
        h("span", { class: "f-value", "data-testid": `field-${field}`, text: String(value) }),
        changed ? h("span", { class: "f-delta", text: `${before} → ${value}` }) : null),
      h("div", { class: "f-meaning", text: t(`f_${field}`) }),
      h("div", { class: "f-owner", text: changed && ev ? t("changed_by", { actor: ev.actor }) : t(`owner_${field}`) }));
  });
  fill($("fields"), ...tiles);
}

function slotOf(frame, seq, pos) {
  const bs = frame.block_size;
  const logical = Math.floor(pos / bs);
  if (logical >= seq.block_table.length) return null;
  const block = seq.block_table[logical];
  return frame.blocks[block].slots[pos % bs];
}

function tokenState(frame, seq, pos) {
  const slot = slotOf(frame, seq, pos);
  if (!slot) return "uncached";
  if (slot.state === "reserved") return "uncached";
  return slot.state === "cached" || slot.state === "free" ? "uncached" : slot.state;
}

function renderTokens(f, seq) {
  const cells = seq.token_ids.map((id, pos) => {
    const state = tokenState(f, seq, pos);
    const piece = seq.pieces ? showPiece(seq.pieces[pos]) : null;
    return h("div", {
      class: `tok ${state} ${pos >= seq.num_prompt_tokens ? "completion" : ""} ${S.pickPos === pos ? "picked" : ""}`,
      title: `pos ${pos} · token ${id} · ${t(`state_${state}`) === `state_${state}` ? t("tok_uncached") : t(`state_${state}`)}`,
      onclick: () => { S.pickPos = pos; render(); },
    }, h("span", { class: "tok-pos", text: pos }), h("span", { class: "tok-text", text: piece ?? id }),
    h("span", { class: "tok-id", text: piece !== null ? id : "" }));
  });
  if (seq.sampled_token !== null) {
    cells.push(h("div", { class: "tok sampled", title: t("tok_pending") },
      h("span", { class: "tok-pos", text: "+" }),
      h("span", { class: "tok-text", text: showPiece(seq.sampled_piece) ?? seq.sampled_token }),
      h("span", { class: "tok-id", text: t("tok_pending") })));
  }
  fill($("tokens"), ...cells);
  fill($("seq-text"), ...(seq.text === null ? [] : [
    h("span", { class: "prompt-text", text: seq.prompt_text }),
    h("span", { class: "completion-text", text: seq.completion_text }),
  ]));
  const legend = [...TOKEN_STATES.map((s) => h("span", { class: `key tok-key ${s}` },
    t(s === "uncached" ? "tok_uncached" : `state_${s}`))),
    h("span", { class: "key tok-key completion-key" }, t("tok_completion"))];
  fill($("token-legend"), ...legend);
}

function renderBlockTable(seq, prevSeq) {
  const node = $("block-table");
  node.dataset.value = JSON.stringify(seq.block_table);
  const old = prevSeq ? prevSeq.block_table : [];
  if (!seq.block_table.length) {
    fill(node, h("span", { class: "bt-empty", text: `[ ] ${t("empty")}` }));
    return;
  }
  fill(node, ...seq.block_table.map((b, i) => h("div", {
    class: `bt-cell ${old[i] !== b ? "new" : ""}`,
  }, h("span", { class: "bt-l", text: `[${i}]` }), h("span", { class: "bt-p", text: b }))));
}

function renderSlotCalc(f, seq) {
  const bs = f.block_size;
  const n = seq.token_ids.length;
  let pos = S.pickPos;
  if (pos === null || pos >= n) {
    // Default: the next position to compute (or the last one with a block).
    pos = Math.min(seq.num_cached_tokens, n - 1);
  }
  const logical = Math.floor(pos / bs);
  const offset = pos % bs;
  const phys = seq.block_table[logical];
  const formula = $("formula");
  if (phys === undefined) {
    fill(formula, h("span", { text: `pos ${pos}: logical_block = ${pos} // ${bs} = ${logical} → ${t("no_block")}` }));
  } else {
    fill(formula, 
      h("div", {}, h("code", { text: "logical_block" }), ` = ${pos} // ${bs} = `, h("b", { text: logical })),
      h("div", {}, h("code", { text: "physical_block" }), ` = block_table[${logical}] = `, h("b", { text: phys })),
      h("div", {}, h("code", { text: "slot" }), ` = ${phys} × ${bs} + ${offset} = `, h("b", { class: "slot-n", text: phys * bs + offset })));
  }
  const head = h("tr", {}, ...[t("pos"), t("token"), `pos // ${bs}`, `pos % ${bs}`, "block", t("slot")].map((x) => h("th", { text: x })));
  const rows = seq.token_ids.map((id, p) => {
    const lb = Math.floor(p / bs);
    const pb = seq.block_table[lb];
    const state = tokenState(f, seq, p);
    return h("tr", { class: `${state} ${p === pos ? "picked" : ""}`, onclick: () => { S.pickPos = p; render(); } },
      h("td", { text: p }),
      h("td", { class: "mono", text: seq.pieces ? showPiece(seq.pieces[p]) : id }),
      h("td", { text: lb }), h("td", { text: p % bs }),
      h("td", { text: pb === undefined ? "—" : pb }),
      h("td", { class: "slot-cell", text: pb === undefined ? "—" : pb * bs + (p % bs) }));
  });
  fill($("slot-table"), h("thead", {}, head), h("tbody", {}, rows));
  const picked = $("slot-table").querySelector("tr.picked");
  if (picked) picked.scrollIntoView({ block: "nearest" });
}

function renderSched(f) {
  const chip = (id) => {
    const s = seqIn(f, id);
    return h("span", { class: `qchip ${s.status} ${id === selectedId(f) ? "current" : ""}`,
      onclick: () => { S.selected = id; render(); } }, `seq ${id}`, h("small", { text: ` ${s.num_cached_tokens}/${s.num_tokens}` }));
  };
  const max = f.budget.max_num_batched_tokens;
  const segs = f.running.map((id) => seqIn(f, id)).filter((s) => s.num_scheduled_tokens > 0)
    .map((s) => h("div", { class: "seg", style: `width:${(100 * s.num_scheduled_tokens) / max}%`,
                           title: `seq ${s.seq_id}: ${s.num_scheduled_tokens}` }, `seq ${s.seq_id}: ${s.num_scheduled_tokens}`));
  const finished = f.sequences.filter((s) => s.status === "FINISHED").map((s) => s.seq_id);
  fill($("sched"), 
    h("div", { class: "queue" }, h("span", { class: "qname", text: t("waiting_queue") }),
      h("div", { class: "qchips", "data-testid": "queue-waiting" }, f.waiting.length ? f.waiting.map(chip) : h("span", { class: "hint", text: t("empty") }))),
    h("div", { class: "queue" }, h("span", { class: "qname", text: t("running_queue") }),
      h("div", { class: "qchips", "data-testid": "queue-running" }, f.running.length ? f.running.map(chip) : h("span", { class: "hint", text: t("empty") }))),
    finished.length ? h("div", { class: "queue" }, h("span", { class: "qname", text: "FINISHED" }),
      h("div", { class: "qchips" }, finished.map(chip))) : null,
    h("div", { class: "budget" },
      h("div", { class: "budget-head" }, h("span", { text: t("budget") }),
        h("b", { "data-testid": "budget", text: `${f.budget.planned_tokens} / ${max}` })),
      h("div", { class: "budget-bar" }, segs)),
  );
}

function renderPool(f) {
  const bs = f.block_size;
  const sel = selectedId(f);
  const pieces = piecesOf(f);
  const blocks = f.blocks.map((b) => h("div", {
    class: `kvblock ${b.free ? "free" : ""} ${b.ref_count > 1 ? "shared" : ""} ${b.seq_ids.includes(sel) ? "mine" : ""}`,
    "data-testid": `kv-block-${b.block_id}`,
  },
  h("div", { class: "kv-head" }, h("b", { text: `#${b.block_id}` }),
    h("span", { class: `ref ${b.ref_count > 1 ? "many" : b.ref_count === 0 ? "zero" : ""}`, text: `${t("ref")} ${b.ref_count}` })),
  h("div", { class: "kv-slots" }, b.slots.map((s) => {
    const piece = s.token_id === null ? "" : showPiece(pieces.get(s.token_id)) ?? s.token_id;
    return h("button", {
      type: "button", class: `kvslot ${s.state} ${S.pickSlot === s.slot ? "picked" : ""}`,
      "data-testid": `kv-slot-${s.slot}`, title: `slot ${s.slot}`,
      onclick: () => { S.pickSlot = s.slot; if (s.owners.length) { S.selected = s.owners[0].seq_id; S.pickPos = s.owners[0].pos; } render(); },
    }, h("span", { class: "kv-n", text: s.slot }), h("span", { class: "kv-t", text: piece }));
  })),
  h("div", { class: "kv-foot" }, b.seq_ids.length ? b.seq_ids.map((id) => `seq ${id}`).join(" + ") : t("state_free"),
    b.hash ? h("span", { class: "hash", title: b.hash, text: ` #${b.hash.slice(0, 6)}` }) : null)));
  fill($("pool"), 
    h("div", { class: "pool-sum", text: `${t("free_blocks", { free: f.num_free_blocks, n: f.num_blocks })} · block_size ${bs}` }),
    h("div", { class: "pool-grid" }, blocks));
  fill($("kv-legend"), ...SLOT_STATES.map((s) => h("span", { class: `key kv-key ${s}` }, t(`state_${s}`))));

  const info = $("slot-info");
  const picked = S.pickSlot === null ? null : f.blocks[Math.floor(S.pickSlot / bs)]?.slots[S.pickSlot % bs];
  if (!picked) { info.textContent = t("click_slot"); return; }
  const where = t("slot_is", { slot: picked.slot, block: Math.floor(picked.slot / bs), offset: picked.offset });
  let what;
  if (picked.owners.length) {
    what = picked.owners.map((o) => t("slot_holds", {
      seq: o.seq_id, pos: o.pos, token: o.token_id === null ? "—" : `${o.token_id}${pieces.get(o.token_id) ? ` "${showPiece(pieces.get(o.token_id))}"` : ""}`,
    })).join("; ") + ` — ${t(`state_${picked.state}`)}`;
  } else if (picked.state === "cached") {
    what = t("slot_cached", { token: picked.token_id });
  } else {
    what = t("slot_free");
  }
  info.textContent = `${where}: ${what}`;
}

function renderLog(f) {
  const log = $("event-log");
  const fresh = new Set(newEvents(S.cursor).map((e) => e.index));
  const pieces = piecesOf(f);
  if (!f.events.length) { fill(log, h("p", { class: "hint", text: t("no_events") })); return; }
  const groups = [];
  let step = null;
  let phase = null;
  for (const e of f.events) {
    if (!step || step.n !== e.step) {
      step = { n: e.step, phases: [] };
      groups.push(step);
      phase = null;
    }
    if (!phase || phase.name !== e.phase) {
      phase = { name: e.phase, events: [] };
      step.phases.push(phase);
    }
    phase.events.push(e);
  }
  const active = S.codeLoc || defaultLoc(f);
  fill(log, ...groups.map((g) => h("div", { class: "step-group" },
    h("div", { class: "step-head", text: t("step_n", { n: g.n }) }),
    g.phases.map((p) => h("div", { class: `phase-group ${p.name}` },
      h("div", { class: "phase-head" }, h("span", { class: `badge ${p.name}`, text: t(`phase_${p.name}`) }),
        h("span", { class: "phase-en", text: p.name })),
      p.events.map((e) => h("div", {
        class: `ev ${fresh.has(e.index) ? "fresh" : ""} ${e.source === active ? "active" : ""}`,
        "data-phase": e.phase, "data-field": e.field, "data-seq": e.seq_id,
        onclick: () => { S.codeLoc = e.source; render(); },
      },
      h("span", { class: "ev-seq", text: `seq ${e.seq_id}` }),
      h("span", { class: "ev-field", text: e.field }),
      h("span", { class: "ev-change mono", text: describe(e, pieces) }),
      h("span", { class: "ev-where" }, h("span", { class: "ev-actor", text: e.actor }),
        h("span", { class: "ev-src mono", title: e.source, text: e.source.split("/").pop() })))))))));
  const lastFresh = log.querySelector(".ev.fresh:last-of-type") || log.lastElementChild;
  if (lastFresh) lastFresh.scrollIntoView({ block: "nearest" });
}

function defaultLoc(f) {
  const fresh = newEvents(S.cursor);
  const pool = fresh.length ? fresh : f.events;
  const sel = selectedId(f);
  const mine = pool.filter((e) => e.seq_id === sel && e.field !== "sampled_token");
  const pick = (mine.length ? mine : pool)[(mine.length ? mine : pool).length - 1];
  return pick ? pick.source : null;
}

async function renderCode() {
  const loc = S.codeLoc || defaultLoc(view());
  const pane = $("code-pane");
  const where = $("code-where");
  if (!loc) { fill(pane, ); where.textContent = ""; return; }
  where.textContent = loc;
  if (!(loc in S.sources)) {
    S.sources[loc] = null;
    try { S.sources[loc] = await api("GET", `/api/lab/source?location=${encodeURIComponent(loc)}`); }
    catch (err) { S.sources[loc] = { error: err.message }; }
    if ((S.codeLoc || defaultLoc(view())) !== loc) return;
  }
  const src = S.sources[loc];
  if (!src) return;
  if (src.error) { fill(pane, h("span", { class: "hint", text: t("src_unavailable", { why: src.error }) })); return; }
  where.textContent = `${src.function} — ${shortFile(src.file)}:${src.line}`;
  fill(pane, ...src.lines.map((line, i) => {
    const n = src.start + i;
    return h("div", { class: `code-line ${n === src.line ? "hit" : ""}` },
      h("span", { class: "ln", text: n }), h("span", { class: "lc", text: line || " " }));
  }));
  const hit = pane.querySelector(".hit");
  if (hit) pane.scrollTop = Math.max(0, hit.offsetTop - pane.clientHeight / 2);
}

function render() {
  if (!S.frames.length) return;
  applyI18n();
  const f = view();
  const prev = prevOf(S.cursor);
  const sel = selectedId(f);
  const seq = seqIn(f, sel);
  const prevSeq = seqIn(prev, sel);
  renderScenarios();
  renderButtons();
  renderTimebar();
  renderNarration();
  renderGuide();
  renderSeqTabs(f);
  if (seq) {
    renderDiagram(seq, prevSeq);
    renderFields(seq, prevSeq, newEvents(S.cursor));
    renderTokens(f, seq);
    renderBlockTable(seq, prevSeq);
    renderSlotCalc(f, seq);
  }
  renderSched(f);
  renderPool(f);
  renderLog(f);
  renderCode();
}

// ---- wiring -------------------------------------------------------------------------------

function goto(i) {
  S.cursor = Math.max(0, Math.min(S.frames.length - 1, i));
  S.codeLoc = null;
  render();
}

$("btn-plan").addEventListener("click", () => act("/api/lab/plan"));
$("btn-commit").addEventListener("click", () => act("/api/lab/commit"));
$("btn-decode").addEventListener("click", () => act("/api/lab/step"));
$("btn-back").addEventListener("click", () => goto(S.cursor - 1));
$("btn-forward").addEventListener("click", () => goto(S.cursor + 1));
$("btn-play").addEventListener("click", play);
$("timeline").addEventListener("input", (e) => goto(Number(e.target.value)));
$("lang-toggle").addEventListener("click", () => {
  S.lang = S.lang === "en" ? "zh" : "en";
  localStorage.setItem("minivllm-lab-lang", S.lang);
  render();
});
$("add-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const prompt = $("add-prompt").value;
  const before = S.frames.length;
  await act("/api/lab/add", { prompt, max_tokens: Number($("add-max").value) || 6 });
  if (S.frames.length > before) {
    const f = last();
    S.selected = f.sequences[f.sequences.length - 1].seq_id;
    $("add-prompt").value = "";
    render();
  }
});
document.addEventListener("keydown", (e) => {
  if (e.target.closest("input, select, textarea")) return;
  if (e.key === "ArrowLeft") goto(S.cursor - 1);
  if (e.key === "ArrowRight") goto(S.cursor + 1);
});

(async function start() {
  try {
    const { frames } = await api("GET", "/api/lab/history");
    S.frames = frames;
    S.cursor = frames.length - 1;
    render();
    document.body.dataset.ready = "1";
  } catch (err) {
    toast(err.message);
  }
})();
