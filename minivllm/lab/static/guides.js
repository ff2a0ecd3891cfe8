// The guided experiment of each scenario: predict -> run -> explain. A prediction is locked
// once the result is on screen (kept per experiment across reloads, see core.saveAnswers).

import {
  FIELDS, GROW_FIELDS, PHASES, S, $, actions, breakable, fill, focusOf, h, last, lastSetupIndex,
  render, saveAnswers, t,
} from "./core.js";
import { codeLinks, renderLesson } from "./lesson.js";

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

const ran = (...names) => () => actions().some((a) => names.includes(a.action));

const GUIDES = {
  seq8: {
    intro: (f) => t("s_seq8_intro", { text: seqLabel(focusOf(f)), earlier: f.sequences[0].seq_id }),
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
    steps: [ran("plan"), ran("commit"), ran("step")],
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
      const now = focusOf(last());
      const values = [0];
      for (const f of S.frames) { // the prefill's chunks only: a decode is not a chunk
        const c = focusOf(f).num_cached_tokens;
        if (f.frame.stage === "commit" && c <= now.num_prompt_tokens && c !== values[values.length - 1]) values.push(c);
      }
      const whole = now.num_tokens > now.num_prompt_tokens;
      return { keys: [String(focusOf(cf).num_cached_tokens)],
               text: t(whole ? "s_chunked_ok" : "s_chunked_partial",
                       { seq: values.join(" → "), prompt: now.num_prompt_tokens }) };
    },
    steps: [
      ran("commit", "step"),
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
    steps: [ran("plan", "step"), ran("commit", "step")],
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
      ran("plan", "step"),
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
        text: t("s_finish_ok", { status: s.status, reason: s.finish_reason, bt: s.block_table.join(", "),
                                 cached: s.num_cached_tokens, tokens: s.num_tokens }),
      };
    },
    steps: [ran("commit", "step"), () => focusOf(last()).status === "FINISHED"],
  },
};

function seqLabel(seq) {
  if (!seq) return "";
  return seq.prompt_text !== null ? seq.prompt_text : seq.token_ids.slice(0, seq.num_prompt_tokens).join(" ");
}

function answer(key, value) {
  S.answers[key] = value;
  saveAnswers();
  render();
}

export function renderGuide() {
  const f = startFrame();
  const name = last().scenario;
  if (S.lesson) { renderLesson(name, S.lesson); return; }
  const guide = GUIDES[name];
  $("guide-title").textContent = t(`s_${name}_title`);
  $("guide-intro").textContent = guide.intro(f);
  $("predict-question").textContent = t(`s_${name}_q`);

  const chosen = S.answers.prediction;
  const actual = guide.actual();
  const locked = Boolean(actual); // the result is on screen: too late to choose
  fill($("predict-choices"), ...guide.choices(f).map(([key, label]) => {
    let cls = "choice";
    if (chosen === key) cls += " chosen";
    if (actual && chosen !== undefined && actual.keys.includes(key)) cls += " right";
    if (actual && chosen === key && !actual.keys.includes(key)) cls += " wrong";
    return h("button", {
      class: cls, type: "button", "data-testid": `predict-choice-${key}`, disabled: locked,
      title: locked ? t("why_locked") : null, onclick: () => answer("prediction", key),
    }, h("code", { text: label }));
  }));
  let note = "";
  if (chosen !== undefined) note = t(locked ? "your_answer_locked" : "your_answer", { x: chosen });
  else if (locked) note = t("no_prediction");
  $("predict-note").textContent = note;

  const steps = t(`s_${name}_steps`);
  fill($("run-steps"), ...steps.map((text, i) => {
    const done = guide.steps[i] ? guide.steps[i]() : false;
    return h("li", { class: done ? "done" : "" }, h("span", { class: "tick", text: done ? "✓" : String(i + 1) }), text);
  }));
  $("flow-predict").classList.toggle("active", chosen === undefined && !locked);
  $("flow-run").classList.toggle("active", chosen !== undefined && !actual);
  $("flow-explain").classList.toggle("active", Boolean(actual));

  const parts = [];
  if (!actual) {
    parts.push(h("p", { class: "hint", text: chosen === undefined ? t("not_answered") : t("run_first") }));
  } else {
    const ok = chosen !== undefined && actual.keys.includes(chosen);
    parts.push(h("div", { class: `verdict ${chosen === undefined ? "" : ok ? "ok" : "bad"}`, "data-testid": "predict-feedback" },
      h("strong", { text: chosen === undefined ? t("observed") : ok ? t("correct") : t("wrong") }),
      chosen === undefined ? " " : ` ${t("your_answer", { x: chosen })} `,
      h("span", { text: actual.text })));
  }
  if (name === "seq8") parts.push(...seq8Explain());
  parts.push(...sentenceBox());
  parts.push(...codeLinks("03"));
  fill($("explain-body"), ...parts);
}

/** The phases in which `field` of the focus sequence grew during the learner's actions. */
function grewIn(field) {
  const start = S.frames[lastSetupIndex()].events.length;
  const focus = last().focus_seq_id;
  const grew = last().events.slice(start)
    .filter((e) => e.seq_id === focus && e.field === field && e.after > e.before);
  return { phases: [...new Set(grew.map((e) => e.phase))], actors: [...new Set(grew.map((e) => e.actor))] };
}

function seq8Explain() {
  const checked = S.answers.checked;
  const rows = GROW_FIELDS.map((field) => {
    const pick = (S.answers.phases || {})[field] || "";
    const seen = grewIn(field);
    let result = "";
    let cls = "";
    if (checked && pick) {
      if (!seen.phases.length) { result = t("grow_undone"); cls = "bad"; }
      else if (seen.phases.includes(pick)) {
        result = t("grow_ok", { phase: t(`phase_${pick}`), actors: seen.actors.join(", ") }); cls = "ok";
      } else {
        result = t("grow_no", { phases: seen.phases.map((p) => t(`phase_${p}`)).join(", "), actors: seen.actors.join(", ") });
        cls = "bad";
      }
    }
    const select = h("select", {
      "data-testid": `grow-${field}`,
      onchange: (e) => {
        S.answers.phases = { ...(S.answers.phases || {}), [field]: e.target.value };
        S.answers.checked = false;
        saveAnswers();
        render();
      },
    }, h("option", { value: "", text: t("match_pick") }),
    ...PHASES.map((p) => h("option", { value: p, text: t(`phase_${p}`), selected: pick === p })));
    return h("div", { class: "match-row" },
      h("code", { class: "match-field" }, breakable(field)), select,
      h("span", { class: `match-result ${cls}`, "data-testid": `grow-result-${field}`, text: result }));
  });
  const relation = S.answers.relation;
  const rel = t("s_seq8_rel").map(([key, text]) => h("button", {
    type: "button", class: `choice wide ${relation === key ? (key === "plan" ? "chosen right" : "chosen wrong") : ""}`,
    "data-testid": `relation-choice-${key}`, onclick: () => answer("relation", key),
  }, text));
  return [
    h("h3", { text: t("grow_title") }),
    h("div", { class: "matches" }, rows),
    h("button", { type: "button", class: "check", "data-testid": "btn-check",
                  onclick: () => answer("checked", true) }, t("check")),
    checked ? h("p", { class: "hint", text: t("grow_note") }) : null,
    h("h3", { text: t("relation_title") }),
    h("div", { class: "choices column" }, rel),
    relation ? h("p", { class: `verdict ${relation === "plan" ? "ok" : "bad"}`, "data-testid": "relation-feedback",
                        text: t("s_seq8_rel_fb")[relation] }) : null,
  ];
}

/** The chapter's last step: one sentence, with the four words as a checklist. The box is
 *  built once, so redrawing never takes the caret away from a learner who is typing. */
let sentence = null;

function sentenceBox() {
  if (!sentence) {
    const box = h("textarea", {
      id: "explain-sentence", "data-testid": "explain-sentence", rows: "3",
      oninput: (e) => { S.answers.sentence = e.target.value; saveAnswers(); tickWords(); },
    });
    sentence = { title: h("h3"), box, list: h("ul", { class: "wordlist", "data-testid": "word-checklist" }) };
  }
  sentence.title.textContent = t("sentence_title");
  sentence.box.placeholder = t("sentence_placeholder");
  if (document.activeElement !== sentence.box) sentence.box.value = S.answers.sentence || "";
  tickWords();
  return [sentence.title, sentence.box, sentence.list];
}

// A word counts in either language: the page may be switched while writing.
const WORDS = { en: ["state", "plan", "execut", "commit"], zh: ["状态", "计划", "执行", "提交"] };

function tickWords() {
  const text = sentence.box.value.toLowerCase();
  fill(sentence.list, ...t("four_words").map((word, i) => {
    const done = text.includes(WORDS.en[i]) || text.includes(WORDS.zh[i]);
    return h("li", { class: done ? "done" : "" }, h("span", { class: "tick", text: done ? "✓" : "·" }), word);
  }));
}
