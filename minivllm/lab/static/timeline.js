// Time travel: the frame label, the scrubber, the frame dots and their legend.

import { S, $, fill, h, isLive, phaseName, planKinds, render, t, view } from "./core.js";

const DOT_KINDS = ["plan", "execute", "commit", "add", "setup"];

/** The name of the action that made frame `i`; a Step says what its plan scheduled. */
export function actionName(i) {
  const f = S.frames[i];
  if (f.frame.action !== "step") return t(`act_${f.frame.action}`);
  let p = i;
  while (p > 0 && S.frames[p].frame.stage !== "plan") p--;
  const kinds = planKinds(S.frames[p]).map((k) => t(`kind_${k}`));
  return kinds.length ? t("act_step_kind", { kind: kinds.join(" + ") }) : t("act_step");
}

export function renderTimebar() {
  const range = $("timeline");
  range.max = String(S.frames.length - 1);
  range.value = String(S.cursor);
  const f = view();
  const stage = f.frame.stage;
  const live = isLive();
  fill($("frame-label"),
    h("span", { text: t("frame", { i: S.cursor + 1, n: S.frames.length }) }),
    h("span", { class: "frame-act", "data-testid": "frame-action", text: actionName(S.cursor) }),
    h("span", { class: `pill ${stage}`, text: phaseName(stage) }),
    live ? h("span", { class: "pill live", text: t("live") })
      : h("button", { type: "button", class: "pill past", "data-testid": "btn-live", title: t("go_live"),
                      onclick: () => { S.cursor = S.frames.length - 1; S.codeLoc = null; render(); } },
        `${t("past")} · ${t("go_live")}`),
  );
  fill($("dots"), ...S.frames.map((fr, i) => h("button", {
    type: "button", class: `dot ${fr.frame.stage} ${i === S.cursor ? "at" : ""} ${fr.frame.action === "setup" ? "setup" : ""}`,
    title: `${i + 1}: ${actionName(i)} · ${phaseName(fr.frame.stage)}`, "aria-label": `frame ${i + 1}`,
    onclick: () => { S.cursor = i; S.codeLoc = null; render(); },
  })));
  fill($("dot-legend"), ...DOT_KINDS.map((k) => h("span", { class: `dot-key ${k}` },
    h("span", { class: `dot ${k === "setup" ? "plan setup" : k}` }), t(`dot_${k}`))));
}
