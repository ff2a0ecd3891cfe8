// The Sequence card: its state diagram, its fields, its tokens, its block table, and the slot
// calculator.

import {
  FIELDS, S, TOKEN_STATES, $, breakable, fill, h, last, piecesOf, render, scrollWithin,
  selectedId, showPiece, t,
} from "./core.js";

// The function whose code explains each field when it has not changed: where it is written.
const OWNER_CODE = {
  status: "Scheduler.schedule",
  num_tokens: "Sequence.__init__",
  num_prompt_tokens: "Sequence.__init__",
  num_cached_tokens: "Scheduler.postprocess",
  num_scheduled_tokens: "Scheduler.schedule",
};

/** `text` with the code name inside it made breakable at its dots and underscores. */
function withName(text, name) {
  const at = text.indexOf(name);
  if (at < 0) return [text];
  return [text.slice(0, at), ...breakable(name), text.slice(at + name.length)];
}

function showCode(loc) {
  if (!loc) return;
  S.codeLoc = loc;
  render();
}

export function renderSeqTabs(f) {
  const sel = selectedId(f);
  fill($("seq-tabs"), ...f.sequences.map((s) => h("button", {
    type: "button", class: `seq-tab ${s.status} ${s.seq_id === sel ? "current" : ""}`,
    "data-testid": `seq-tab-${s.seq_id}`,
    onclick: () => { S.selected = s.seq_id; S.pickPos = null; render(); },
  }, `seq ${s.seq_id}`, h("small", { text: s.status }))));
}

export function renderDiagram(seq, prevSeq) {
  const W = 560;
  const nodes = { WAITING: 20, RUNNING: 210, FINISHED: 400 };
  const took = prevSeq && prevSeq.status !== seq.status ? `${prevSeq.status}>${seq.status}` : "";
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} 108`);
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
  if (seq.num_preemptions) extra.push(t("preemptions", { n: seq.num_preemptions }));
  extra.push(`max_tokens: ${seq.max_tokens}`);
  box.append(h("div", { class: "diagram-note", text: extra.join(" · ") }));
  fill($("diagram"), box);
}

function fieldPhase(events, seqId, field) {
  const hit = events.filter((e) => e.seq_id === seqId && e.field === field);
  return hit.length ? hit[hit.length - 1] : null;
}

export function renderFields(seq, prevSeq, events) {
  const code = last().code;
  const tiles = ["status", ...FIELDS].map((field) => {
    const value = seq[field];
    const before = prevSeq ? prevSeq[field] : undefined;
    const changed = prevSeq && before !== value;
    const ev = fieldPhase(events, seq.seq_id, field);
    const phase = ev ? ev.phase : changed ? "commit" : "";
    const owner = changed && ev
      ? h("button", { type: "button", class: "f-owner link", onclick: () => showCode(ev.source) },
        ...withName(t("changed_by", { actor: ev.actor }), ev.actor))
      : h("button", { type: "button", class: "f-owner link", "data-testid": `owner-${field}`,
                      onclick: () => showCode(code[OWNER_CODE[field]]) },
      ...withName(t(`owner_${field}`), OWNER_CODE[field]));
    return h("div", { class: `field ${field === "status" ? "status-tile " + value : ""} ${changed ? "changed " + phase : ""}` },
      h("div", { class: "f-name" }, breakable(field)),
      h("div", { class: "f-value-row" },
        h("span", { class: "f-value", "data-testid": `field-${field}`, text: String(value) }),
        changed ? h("span", { class: "f-delta", text: `${before} → ${value}` }) : null),
      h("div", { class: "f-meaning", text: t(`f_${field}`) }),
      owner);
  });
  const notes = [];
  if (seq.status === "FINISHED") notes.push(t("finished_note", { cached: seq.num_cached_tokens, tokens: seq.num_tokens }));
  fill($("fields"), ...tiles);
  fill($("field-note"), ...notes.map((n) => h("p", { class: "hint", "data-testid": "finished-note", text: n })));
}

function slotOf(frame, seq, pos) {
  const bs = frame.block_size;
  const logical = Math.floor(pos / bs);
  if (logical >= seq.block_table.length) return null;
  const block = seq.block_table[logical];
  return frame.blocks[block].slots[pos % bs];
}

export function tokenState(frame, seq, pos) {
  const slot = slotOf(frame, seq, pos);
  if (!slot) return "uncached";
  if (slot.state === "reserved") return "uncached";
  // A rejected draft's KV still sits in this position's slot: the token shown here has none.
  const mine = slot.owners.find((o) => o.seq_id === seq.seq_id && o.pos === pos);
  if (mine && mine.draft && pos < seq.num_tokens) return "uncached";
  return slot.state === "cached" || slot.state === "free" ? "uncached" : slot.state;
}

export function renderTokens(f, seq) {
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
  // A plan's drafts: positions after the sequence's tokens, planned (or written) like any
  // token, but not the sequence's until the commit accepts them.
  const pieces = piecesOf(f);
  seq.spec_token_ids.forEach((id, i) => {
    const pos = seq.num_tokens + i;
    const piece = pieces.has(id) ? showPiece(pieces.get(id)) : null;
    cells.push(h("div", {
      class: `tok draft ${tokenState(f, seq, pos)}`, "data-testid": "draft-token",
      title: `pos ${pos} · token ${id} · ${t("state_draft")}`,
    }, h("span", { class: "tok-pos", text: pos }), h("span", { class: "tok-text", text: piece ?? id }),
    h("span", { class: "tok-id", text: piece !== null ? `${t("tok_draft")} ${id}` : t("tok_draft") })));
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
    h("span", { class: "key tok-key completion-key" }, t("tok_completion")),
    seq.spec_token_ids.length ? h("span", { class: "key tok-key draft" }, t("state_draft")) : null];
  fill($("token-legend"), ...legend);
}

export function renderBlockTable(seq, prevSeq) {
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

export function renderSlotCalc(f, seq) {
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
  scrollWithin($("slot-table").parentElement, $("slot-table").querySelector("tr.picked"));
}

