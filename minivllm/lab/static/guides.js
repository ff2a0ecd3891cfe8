// The guided experiment of each scenario: predict -> run -> explain.

import {
  FIELDS, MATCH_KEYS, S, SEQ_FIELDS, $, actions, changedFields, fill, focusOf, h, last,
  lastSetupIndex, render, t,
} from "./core.js";

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

export function renderGuide() {
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

