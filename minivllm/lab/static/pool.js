// The scheduler's queues and token budget, and the KV cache pool slot by slot.

import {
  S, SLOT_STATES, $, fill, h, piecesOf, render, selectedId, seqIn, showPiece, t,
} from "./core.js";

export function renderSched(f) {
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

export function renderPool(f) {
  const bs = f.block_size;
  const sel = selectedId(f);
  const pieces = piecesOf(f);
  // The paged attention read of this step (chapter 06): the slots the selected sequence's
  // attention reads through its block table, once the runner has run.
  const x = f.step_inputs;
  const row = x ? x.seq_ids.indexOf(sel) : -1;
  const reads = new Set(row >= 0 ? x.read_slots[row] : []);
  const blocks = f.blocks.map((b) => h("div", {
    class: `kvblock ${b.free ? "free" : ""} ${b.ref_count > 1 ? "shared" : ""} ${b.seq_ids.includes(sel) ? "mine" : ""}`,
    "data-testid": `kv-block-${b.block_id}`,
  },
  h("div", { class: "kv-head" }, h("b", { text: `#${b.block_id}` }),
    h("span", { class: `ref ${b.ref_count > 1 ? "many" : b.ref_count === 0 ? "zero" : ""}`, text: `${t("ref")} ${b.ref_count}` })),
  h("div", { class: "kv-slots" }, b.slots.map((s) => {
    const piece = s.token_id === null ? "" : showPiece(pieceOf(f, s, pieces)) ?? s.token_id;
    return h("button", {
      type: "button",
      class: `kvslot ${s.state} ${S.pickSlot === s.slot ? "picked" : ""} ${reads.has(s.slot) ? "read" : ""} ${s.owners.some((o) => o.draft) ? "draft" : ""}`,
      "data-testid": `kv-slot-${s.slot}`, title: `slot ${s.slot}`,
      onclick: () => { S.pickSlot = s.slot; if (s.owners.length) { S.selected = s.owners[0].seq_id; S.pickPos = s.owners[0].pos; } render(); },
    }, h("span", { class: "kv-n", text: s.slot }), h("span", { class: "kv-t", text: piece }));
  })),
  h("div", { class: "kv-foot" }, b.seq_ids.length ? b.seq_ids.map((id) => `seq ${id}`).join(" + ") : t("state_free"),
    b.hash ? h("span", { class: "hash", title: b.hash, text: ` #${b.hash.slice(0, 6)}` }) : null)));
  fill($("pool"), 
    h("div", { class: "pool-sum", text: `${t("free_blocks", { free: f.num_free_blocks, n: f.num_blocks })} · block_size ${bs}` }),
    reads.size ? h("div", { class: "hint", "data-testid": "pool-reads",
                            text: t("reads_slots", { seq: sel, n: reads.size }) }) : null,
    h("div", { class: "pool-grid" }, blocks));
  const drafts = f.blocks.some((b) => b.slots.some((s) => s.owners.some((o) => o.draft)));
  fill($("kv-legend"), ...SLOT_STATES.map((s) => h("span", { class: `key kv-key ${s}` }, t(`state_${s}`))),
    drafts ? h("span", { class: "key kv-key draft" }, t("state_draft")) : null,
    reads.size ? h("span", { class: "key kv-key read", "data-testid": "legend-read" }, t("state_read")) : null);

  const info = $("slot-info");
  const picked = S.pickSlot === null ? null : f.blocks[Math.floor(S.pickSlot / bs)]?.slots[S.pickSlot % bs];
  if (!picked) { info.textContent = t("click_slot"); return; }
  const where = t("slot_is", { slot: picked.slot, block: Math.floor(picked.slot / bs), offset: picked.offset });
  let what;
  if (picked.owners.length) {
    const piece = showPiece(pieceOf(f, picked, pieces));
    what = picked.owners.map((o) => (o.draft ? `${t("tok_draft")}: ` : "") + t("slot_holds", {
      seq: o.seq_id, pos: o.pos,
      token: o.token_id === null ? "—" : `${o.token_id}${piece ? " " + t("quoted", { x: piece }) : ""}`,
    })).join(t("list_sep")) + ` — ${t(`state_${picked.state}`)}`;
  } else if (picked.state === "cached") {
    what = t("slot_cached", { token: picked.token_id });
  } else {
    what = t("slot_free");
  }
  info.textContent = t("slot_info", { where, what });
}

/** The text of a slot's token as its sequence shows it (a split character's bytes depend on
 *  the tokens around it, so the owner's own pieces come first). */
function pieceOf(f, slot, pieces) {
  const owner = slot.owners[0];
  const seq = owner && f.sequences.find((s) => s.seq_id === owner.seq_id);
  if (seq && seq.pieces && owner.pos < seq.pieces.length) return seq.pieces[owner.pos];
  return pieces.get(slot.token_id);
}

