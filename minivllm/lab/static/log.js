// What the engine did and where: the narration of the current frame, the event log, and the
// source of the function that made a change.

import {
  S, $, api, describe, errorText, fill, h, lastSetupIndex, newEvents, phaseName, piecesOf, render,
  scrollWithin, selectedId, shortFile, t, view,
} from "./core.js";

export function renderNarration() {
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
  const story = narrate(stage, events, f).map((line) => h("div", { class: "narr-line", text: line }));
  fill(node, h("span", { class: `badge ${stage}`, text: phaseName(stage) }),
    h("span", { class: "narr-text", text: head }), h("div", { class: "narr-story", "data-testid": "narr-story" }, story),
    h("div", { class: "narr-items" }, items));
}

/** One sentence per sequence, built from what the engine actually changed in this frame. */
function narrate(stage, events, f) {
  const bySeq = new Map();
  for (const e of events) {
    if (!bySeq.has(e.seq_id)) bySeq.set(e.seq_id, {});
    const fields = bySeq.get(e.seq_id);
    // A field changed several times in one phase (a commit appending accepted drafts and the
    // model's token) reads as one change, from its first value to its last.
    fields[e.field] = fields[e.field] ? { ...e, before: fields[e.field].before } : e;
  }
  const lines = [];
  for (const [id, ch] of bySeq) {
    const seq = f.sequences.find((s) => s.seq_id === id);
    const parts = clauses(stage, ch, seq);
    if (parts.length) lines.push(t("n_seq", { id, what: parts.join(t("n_sep")) }));
  }
  return lines;
}

function clauses(stage, ch, seq) {
  const out = [];
  const moved = (field) => ch[field] && { a: ch[field].before, b: ch[field].after };
  const status = moved("status");
  if (status && status.b === "RUNNING") out.push(t("n_admitted"));
  if (status && status.a === "RUNNING" && status.b === "WAITING") out.push(t("n_preempted"));
  const cached = moved("num_cached_tokens");
  if (stage === "plan" && cached && cached.b > cached.a) out.push(t("n_prefix_hit", cached));
  const sched = moved("num_scheduled_tokens");
  if (stage === "plan" && sched && sched.b > 0) out.push(t("n_scheduled", { n: sched.b }));
  if (stage === "plan" && ch.block_table && ch.block_table.after.length > ch.block_table.before.length) {
    out.push(t("n_blocks", { bt: ch.block_table.after.join(", ") }));
  }
  if (stage === "execute" && ch.kv_written) {
    out.push(t("n_kv", { a: ch.kv_written.before, b: ch.kv_written.after - 1 }));
    const drafts = seq ? seq.spec_token_ids.length : 0;
    if (ch.sampled_token && drafts) out.push(t("n_verified", { k: drafts, tok: ch.sampled_token.after }));
    else out.push(ch.sampled_token ? t("n_sampled", { tok: ch.sampled_token.after }) : t("n_no_sample"));
  }
  if (stage === "commit") {
    if (cached && cached.b !== cached.a) out.push(t("n_cached", cached));
    const tokens = moved("num_tokens");
    if (tokens) out.push(t(tokens.b - tokens.a === 1 ? "n_appended" : "n_appended_many", { ...tokens, n: tokens.b - tokens.a }));
    else if (cached) out.push(t("n_no_append"));
    if (status && status.b === "FINISHED") out.push(t("n_finished", { reason: seq ? seq.finish_reason : "" }));
  }
  if (stage === "add" && !Object.keys(ch).length) out.push(t("n_added"));
  return out;
}

export function renderLog(f) {
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
  const marked = log.querySelectorAll(".ev.fresh");
  scrollWithin(log, marked.length ? marked[marked.length - 1] : log.lastElementChild);
}

function defaultLoc(f) {
  const fresh = newEvents(S.cursor);
  const pool = fresh.length ? fresh : f.events;
  const sel = selectedId(f);
  const mine = pool.filter((e) => e.seq_id === sel && e.field !== "sampled_token");
  const pick = (mine.length ? mine : pool)[(mine.length ? mine : pool).length - 1];
  return pick ? pick.source : null;
}

export async function renderCode() {
  const loc = S.codeLoc || defaultLoc(view());
  const pane = $("code-pane");
  const where = $("code-where");
  if (!loc) { fill(pane, ); where.textContent = ""; return; }
  where.textContent = loc;
  if (!(loc in S.sources)) {
    S.sources[loc] = null;
    try { S.sources[loc] = await api("GET", `/api/lab/source?location=${encodeURIComponent(loc)}`); }
    catch (err) { S.sources[loc] = { error: errorText(err) }; }
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

