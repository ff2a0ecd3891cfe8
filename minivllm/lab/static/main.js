// The Engine Lab page: draws frames (snapshots of the engine state the server recorded) and
// sends the learner's clicks to the JSON API. This module wires the others together.

import {
  S, $, api, fill, focusOf, h, isLive, last, newEvents, phaseName, prevOf, selectedId, seqIn,
  setRenderer, sleep, t, toast, view,
} from "./core.js";
import { renderGuide } from "./guides.js";
import { renderCode, renderLog, renderNarration } from "./log.js";
import { renderPool, renderSched } from "./pool.js";
import {
  renderBlockTable, renderDiagram, renderFields, renderSeqTabs, renderSlotCalc, renderTokens,
} from "./sequence.js";

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


// ---- the state views -----------------------------------------------------------------------

function applyI18n() {
  document.documentElement.lang = S.lang === "zh" ? "zh-CN" : "en";
  for (const node of document.querySelectorAll("[data-i18n]")) node.textContent = t(node.dataset.i18n);
  $("lang-toggle").textContent = t("other_lang");
  $("add-prompt").placeholder = t("add_placeholder");
}

function renderScenarios() {
  const current = last().scenario;
  fill($("scenarios"), ...S.scenarios.map((name) => h("button", {
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

setRenderer(render);

(async function start() {
  try {
    const [{ frames }, { scenarios }] = await Promise.all([
      api("GET", "/api/lab/history"), api("GET", "/api/lab/scenarios")]);
    S.scenarios = scenarios;
    S.frames = frames;
    S.cursor = frames.length - 1;
    render();
    document.body.dataset.ready = "1";
  } catch (err) {
    toast(err.message);
  }
})();
