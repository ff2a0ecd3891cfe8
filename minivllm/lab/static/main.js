// The Engine Lab page: draws frames (snapshots of the engine state the server recorded) and
// sends the learner's clicks to the JSON API. This module wires the others together.

import {
  S, $, api, errorText, fill, h, isLive, last, loadAnswers, newEvents, prevOf, selectedId,
  seqIn, setRenderer, sleep, t, toast, view,
} from "./core.js";
import { renderGuide } from "./guides.js";
import { renderCode, renderLog, renderNarration } from "./log.js";
import { renderPool, renderSched } from "./pool.js";
import {
  renderBlockTable, renderDiagram, renderFields, renderSeqTabs, renderSlotCalc, renderTokens,
} from "./sequence.js";
import { renderTimebar } from "./timeline.js";

// ---- talking to the lab: one request at a time, in click order ---------------------------

let queue = Promise.resolve();

function post(path, body) {
  const answer = queue.then(() => api("POST", path, body));
  queue = answer.catch(() => {});
  return answer;
}

function absorb(data, replace, follow = true) {
  if ("lesson" in data) S.lesson = data.lesson;
  const frames = data.frames || [data];
  S.frames = replace ? frames : S.frames.concat(frames);
  if (replace) loadAnswers();
  if (follow) S.cursor = S.frames.length - 1;
  S.codeLoc = null;
}

/** Once the engine has answered the lesson, its verdict is brought into view: it may land
 *  below the window (the state, the Run buttons), and an answer out of sight seems missing. */
function showVerdict() {
  const verdict = document.querySelector("[data-testid=predict-feedback]");
  if (verdict) verdict.scrollIntoView({ block: "nearest" });
}

async function act(path, body, replace = false) {
  if (S.busy) return false;
  S.busy = true;
  renderButtons();
  const answered = Boolean(S.lesson && S.lesson.result);
  try {
    absorb(await post(path, body), replace);
    if (!replace && !answered && S.lesson && S.lesson.result) requestAnimationFrame(showVerdict);
    return true;
  } catch (err) {
    toast(errorText(err));
    return false;
  } finally {
    S.busy = false;
    render();
  }
}

function resetScenario(name, options = {}) {
  S.playing = false; // a tab clicked during Play stops it, then switches
  S.selected = null;
  S.pickPos = null;
  S.pickSlot = null;
  return act("/api/lab/reset", { scenario: name, ...options }, true);
}
S.resetWith = resetScenario;

// ---- play: the current scenario, forward in time ----------------------------------------

const unfinished = (f) => f.sequences.some((s) => s.status !== "FINISHED");

/** Replays the recorded frames from the cursor, then keeps stepping the engine (Plan, then
 *  Commit) until every sequence is FINISHED. Stop leaves the view on the frame shown. */
async function play() {
  if (S.playing) { S.playing = false; render(); return; }
  if (S.busy) return;
  S.playing = true;
  if (isLive() && !unfinished(last())) S.cursor = 0; // all done: replay from the start
  render();
  try {
    while (S.playing) {
      if (!isLive()) {
        S.cursor += 1;
        S.codeLoc = null;
        render();
        await sleep(900);
        continue;
      }
      if (!unfinished(last())) break;
      const data = await post(last().pending_plan ? "/api/lab/commit" : "/api/lab/plan");
      absorb(data, false, false); // shown one by one by the replay above
      if (S.playing) S.cursor += 1;
      render();
      await sleep(900);
    }
  } catch (err) {
    toast(errorText(err));
  } finally {
    S.playing = false;
    render();
  }
}

// ---- the page ------------------------------------------------------------------------------

function applyI18n() {
  document.documentElement.lang = S.lang === "zh" ? "zh-CN" : "en";
  for (const node of document.querySelectorAll("[data-i18n]")) node.textContent = t(node.dataset.i18n);
  $("lang-toggle").textContent = t("other_lang");
  $("add-prompt").placeholder = t("add_placeholder");
}

/** The chapter a scenario belongs to, from the server's list. */
function chapterOf(name) {
  const s = S.scenarios.find((x) => x.name === name);
  return s ? s.chapter : "03";
}

function renderScenarios() {
  const current = last().scenario;
  const groups = [];
  for (const { name, chapter } of S.scenarios) {
    let group = groups.find((g) => g.chapter === chapter);
    if (!group) groups.push(group = { chapter, names: [] });
    group.names.push(name);
  }
  fill($("scenarios"), ...groups.map((g) => h("div", {
    class: `chapter-group ${g.chapter === chapterOf(current) ? "current" : ""}`,
    "data-testid": `chapter-${g.chapter}`,
  }, h("span", { class: "chapter-name", text: `${g.chapter} · ${t(`chapter_${g.chapter}`)}` }),
  h("span", { class: "chapter-tabs" }, g.names.map((name) => h("button", {
    type: "button", class: `scenario ${name === current ? "current" : ""}`,
    "data-testid": `scenario-${name}`, onclick: () => resetScenario(name),
  }, t(`s_${name}_tab`)))))),
  // On a phone the other chapters fold into this menu (CSS shows one or the other).
  h("select", {
    class: "chapter-menu", id: "chapter-menu", "data-testid": "chapter-menu", "aria-label": t("menu_chapters"),
    onchange: (e) => resetScenario(e.target.value),
  }, groups.map((g) => h("optgroup", { label: `${g.chapter} · ${t(`chapter_${g.chapter}`)}` },
    g.names.map((name) => h("option", { value: name, selected: name === current }, t(`s_${name}_tab`)))))));
  $("subtitle").textContent = t(`subtitle_${chapterOf(current)}`);
  const f = last();
  $("real").textContent = t(f.model.runner === "ModelRunner" ? "real_note" : "real_fake",
                            { runner: `${f.model.runner}, block_size ${f.block_size}` });
}

/** Why an engine action cannot run now, or null when it can. */
function whyNot(action) {
  const live = last();
  if (S.playing) return t("why_playing");
  if (S.busy) return t("why_busy");
  if (!isLive()) return t("why_past");
  if (action === "commit") return live.pending_plan ? null : t("why_no_plan");
  if (live.pending_plan) return t("why_pending");
  return unfinished(live) ? null : t("why_finished");
}

function renderButtons() {
  const live = last();
  const focus = seqIn(live, selectedId(live));
  const reasons = [];
  for (const action of ["plan", "commit", "step"]) {
    const why = whyNot(action);
    const button = $(`btn-${action}`);
    button.disabled = why !== null;
    button.parentElement.title = why || "";
    if (why && action !== "commit" && !reasons.includes(why)) reasons.push(why);
  }
  $("run-why").textContent = reasons.join(" ");
  const prefill = focus && focus.status !== "FINISHED" && focus.num_cached_tokens < focus.num_prompt_tokens;
  $("btn-plan").querySelector(".act-name").textContent = t(prefill ? "btn_plan" : "btn_plan_again");
  $("btn-back").disabled = S.cursor === 0 || S.playing;
  $("btn-forward").disabled = isLive() || S.playing;
  $("btn-play").textContent = S.playing ? t("stop") : t("play");
  $("btn-play").classList.toggle("on", S.playing);
  document.body.classList.toggle("busy", S.busy);
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
  if (S.playing) return;
  S.cursor = Math.max(0, Math.min(S.frames.length - 1, i));
  S.codeLoc = null;
  render();
}

$("btn-plan").addEventListener("click", () => act("/api/lab/plan"));
$("btn-commit").addEventListener("click", () => act("/api/lab/commit"));
$("btn-step").addEventListener("click", () => act("/api/lab/step"));
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
  const added = await act("/api/lab/add", { prompt: $("add-prompt").value, max_tokens: Number($("add-max").value) || 6 });
  if (added) {
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
    const [history, listed] = await Promise.all([
      api("GET", "/api/lab/history"), api("GET", "/api/lab/scenarios")]);
    S.scenarios = listed.scenarios;
    S.chapters = listed.chapters;
    S.limits = listed.limits;
    absorb(history, true);
    render();
    document.body.dataset.ready = "1";
  } catch (err) {
    toast(errorText(err));
  }
})();
