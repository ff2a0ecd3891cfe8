// Chapters 04-07: the guide of a scenario whose question the server grades. The server sends
// the lesson with every answer (question numbers, choices, the locked prediction, and once
// the engine has answered, the answer and the numbers the explanation names); this module
// only draws it and sends the learner's prediction and engine options.

import { S, $, api, errorText, fill, fillWords, h, last, render, t, toast, view } from "./core.js";

let typed = ""; // the number being typed, kept across redraws of one experiment
let typedFor = null; // the experiment it was typed in

async function predict(answer) {
  try {
    const data = await api("POST", "/api/lab/predict", { answer: String(answer) });
    S.lesson = data.lesson;
  } catch (err) {
    toast(errorText(err));
  }
  render();
}

function params(lesson) {
  return { ...lesson.question, ...(lesson.result ? lesson.result.params : {}) };
}

function choiceLabel(key) {
  return key === "none" ? t("choice_none") : t("seq_n", { id: key });
}

function predictPart(name, lesson) {
  const locked = lesson.prediction !== null || lesson.result !== null;
  if (lesson.kind === "choice") {
    return lesson.choices.map((key) => {
      let cls = "choice";
      if (lesson.prediction === key) cls += " chosen";
      if (lesson.result && lesson.result.answer === key && lesson.prediction !== null) cls += " right";
      if (lesson.result && lesson.prediction === key && !lesson.result.correct) cls += " wrong";
      return h("button", {
        class: cls, type: "button", "data-testid": `predict-choice-${key}`, disabled: locked,
        title: locked ? t("why_locked") : null, onclick: () => predict(key),
      }, h("code", { text: choiceLabel(key) }));
    });
  }
  const input = h("input", {
    type: "number", min: "0", step: "1", inputmode: "numeric", class: "predict-number",
    "data-testid": "predict-input", disabled: locked, "aria-label": t("predict"),
    value: lesson.prediction !== null ? lesson.prediction : typed,
    oninput: (e) => { typed = e.target.value; },
    onkeydown: (e) => { if (e.key === "Enter") lock(); },
  });
  function lock() {
    if (!/^\d+$/.test(typed.trim())) { toast(t("err_bad_number", { max: 1000000 })); return; }
    predict(typed.trim());
  }
  return [input, h("button", {
    type: "button", class: "check", "data-testid": "predict-lock", disabled: locked,
    title: locked ? t("why_locked") : null, onclick: lock,
  }, t("lock"))];
}

function knobs(name) {
  const f = view();
  const field = (key, testid, value) => h("label", { class: "inline knob" },
    h("code", { text: key }),
    h("input", { type: "number", min: "1", max: String(S.limits[key] || 999), value: String(value),
                 "data-testid": testid, "data-option": key }));
  const box = h("div", { class: "knobs", "data-testid": "knobs" },
    field("max_num_batched_tokens", "knob-budget", f.budget.max_num_batched_tokens),
    field("num_kv_blocks", "knob-blocks", f.num_blocks),
    field("max_num_seqs", "knob-seqs", f.budget.max_num_seqs));
  const apply = h("button", {
    type: "button", class: "check", "data-testid": "btn-apply",
    onclick: () => {
      const options = {};
      for (const input of box.querySelectorAll("input")) options[input.dataset.option] = Number(input.value);
      S.resetWith(name, options);
    },
  }, t("apply"));
  return [h("h3", { text: t("knobs_title") }), box, apply, h("p", { class: "hint", text: t("knobs_hint") })];
}

export function codeLinks(chapter) {
  const entry = S.chapters.find((c) => c.chapter === chapter);
  if (!entry) return [];
  return [h("h3", { text: t("read_code") }), h("div", { class: "code-links" },
    entry.code.map((link) => h("button", {
      type: "button", class: "code-link", "data-testid": "code-link",
      onclick: () => { S.codeLoc = link.location; render(); $("code-pane").scrollIntoView({ block: "nearest" }); },
    }, h("code", { text: link.function }), " ",
    h("span", { class: "hint", text: link.location.replace(/^minivllm\//, "") }))))];
}

/** A story line of the server's explanation in the page's words: `kind` and `reason` are
 *  themselves words. */
function storyText(item) {
  const p = { ...item.params };
  if (p.kind !== undefined) p.kind = t(`kind_${p.kind}`);
  if (p.reason !== undefined) p.reason = t(`reason_${p.reason}`);
  return t(item.key, p);
}

/** The runner's inputs of one step (chapters 06-07): one row per token, numbered as the
 *  explanation counts them; a block table's padding shown as padding. */
function inputsTable(x, caption) {
  if (!x) return null;
  const seqOf = [];
  x.seq_ids.forEach((id, i) => { for (let k = 0; k < x.query_lens[i]; k++) seqOf.push(id); });
  const head = h("tr", {}, ["#", "seq", "input_ids", "positions", "slot_mapping"].map((c) => h("th", { text: c })));
  const rows = x.input_ids.map((id, i) => h("tr", { class: x.logits_indices.includes(i) ? "sampled" : "" },
    h("td", { class: "row-index", text: String(i) }), h("td", { text: String(seqOf[i]) }), h("td", { text: String(id) }),
    h("td", { text: String(x.positions[i]) }), h("td", { text: String(x.slot_mapping[i]) })));
  const tables = x.seq_ids.map((id, i) => {
    const used = Math.ceil(x.seq_lens[i] / last().block_size);
    const cells = x.block_tables[i].map((b, j) => (j < used ? String(b) : "·"));
    return h("li", {},
      h("code", { text: `seq ${id}: block_table [${cells.join(", ")}]  q=${x.query_lens[i]}  seq_len=${x.seq_lens[i]}` }));
  });
  return h("div", { class: "step-inputs", "data-testid": "step-inputs" },
    h("h3", { text: caption }),
    h("div", { class: "slot-scroll" }, h("table", { class: "slots" }, head, rows)),
    h("ul", { class: "bt-list" }, tables),
    h("p", { class: "hint", text: t("inputs_hint") }));
}

/** The verdict: the engine's answer, what the frames show, then the chapter's rule, or, if
 *  the lesson's situation did not arise under these options, that, with options where it does. */
function verdict(name, lesson) {
  const r = lesson.result;
  const cls = r.correct === null ? "" : r.correct ? "ok" : "bad";
  const head = r.correct === null ? t("observed") : r.correct ? t("correct") : t("wrong");
  const shown = (x) => (lesson.kind === "choice" ? choiceLabel(x) : x);
  const diff = r.correct === false ? t("diff", { x: shown(lesson.prediction), y: shown(r.answer) })
    : t("engine_said", { y: shown(r.answer) });
  const rule = t(`s_${name}_rule`);
  const why = [...r.story.map(storyText), r.premise || rule === `s_${name}_rule` ? "" : rule]
    .filter(Boolean).join(" ");
  return h("div", { class: `verdict ${cls}`, "data-testid": "predict-feedback" },
    h("strong", { text: head }), " ", h("span", { text: diff }), " ",
    h("span", { "data-testid": "predict-why", text: why }),
    r.premise ? h("p", { class: "premise", "data-testid": "predict-premise" },
      h("strong", { text: t("premise_title") }), " ", storyText(r.premise)) : null);
}

export function renderLesson(name, lesson) {
  if (typedFor !== last().experiment) { typed = ""; typedFor = last().experiment; }
  const p = params(lesson);
  $("guide-title").textContent = `${lesson.chapter} · ${t(`s_${name}_title`)}`;
  const variant = `s_${name}_intro_${p.variant}`;
  $("guide-intro").textContent = t(t(variant) === variant ? `s_${name}_intro` : variant, p);
  $("predict-question").textContent = t(`s_${name}_q`, p);
  fill($("predict-choices"), ...predictPart(name, lesson));
  let note = "";
  if (lesson.prediction !== null) note = t("your_answer_locked", { x: lesson.prediction });
  else if (lesson.result) note = t("no_prediction");
  $("predict-note").textContent = note;

  fill($("run-steps"), ...t(`s_${name}_steps`).map((text) => fillWords(text, p)).map((text, i) => h("li", { class: lesson.result ? "done" : "" },
    h("span", { class: "tick", text: lesson.result ? "✓" : String(i + 1) }), text)));
  $("flow-predict").classList.toggle("active", lesson.prediction === null && !lesson.result);
  $("flow-run").classList.toggle("active", lesson.prediction !== null && !lesson.result);
  $("flow-explain").classList.toggle("active", Boolean(lesson.result));

  const parts = [];
  if (!lesson.result) {
    parts.push(h("p", { class: "hint", text: lesson.prediction === null ? t("not_answered") : t("run_first") }));
  } else {
    parts.push(verdict(name, lesson));
  }
  const f = view();
  if (lesson.chapter === "06" || lesson.chapter === "07") {
    // Pinned to the step the verdict describes; before it, the step on screen.
    const pinned = lesson.result && lesson.result.inputs;
    parts.push(pinned ? inputsTable(pinned, t("verdict_step", { step: lesson.result.params.step }))
      : inputsTable(f.step_inputs, t("inputs_title")));
  }
  parts.push(...knobs(name)); // every lesson holds under any options: its verdict says what happened
  parts.push(...codeLinks(lesson.chapter));
  fill($("explain-body"), ...parts);
}
