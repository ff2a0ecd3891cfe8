// The live page's two charts as plain SVG (no library, nothing fetched): the step timeline
// and one request's fields over the recorded steps.

const NS = "http://www.w3.org/2000/svg";

export function svg(tag, attrs, ...children) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, v);
  }
  for (const c of children) if (c) node.append(c);
  return node;
}

const W = 1000;
const niceMax = (v) => Math.max(1, Math.ceil(v));

/** The step timeline: stacked prefill/decode bars, the batch size as ticks, the step time as a
 * line, red marks on steps that preempted. `frames` are the page's frames; `at` the viewed
 * one; `pick(i)` is called with a frame index when a column is clicked. */
export function timelineChart(frames, at, pick, tr, onMark) {
  const H = 190, top = 18, bottom = 22, left = 40, right = 60;
  const steps = frames.map((f, i) => [f.timeline, i]).filter(([t]) => t);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "tl-svg", role: "img" });
  if (!steps.length) return root;
  const maxTok = niceMax(Math.max(...steps.map(([t]) => t.num_prefill_tokens + t.num_decode_tokens)));
  const maxMs = Math.max(0.001, ...steps.map(([t]) => t.seconds * 1000));
  const maxSeqs = niceMax(Math.max(...steps.map(([t]) => t.num_seqs)));
  const plotH = H - top - bottom;
  const colW = (W - left - right) / steps.length;
  const y = (v, max) => top + plotH - (v / max) * plotH;
  root.append(svg("line", { x1: left, x2: W - right, y1: top + plotH, y2: top + plotH, class: "axis" }));
  for (const [v, anchor, x, cls] of [[maxTok, "end", left - 4, "ax-tok"], [`${maxMs.toFixed(1)} ms`, "end", W - 2, "ax-ms"]]) {
    root.append(svg("text", { x, y: top + 4, "text-anchor": anchor, class: `ax-label ${cls}` }, document.createTextNode(v)));
  }
  const line = [];
  steps.forEach(([t, i], k) => {
    const x = left + k * colW;
    const w = Math.max(1, colW - (colW > 4 ? 1 : 0));
    const g = svg("g", { class: i === at ? "col at" : "col", "data-frame": i });
    g.append(svg("rect", { x, y: top, width: colW, height: plotH, class: "hit" }));
    const pre = t.num_prefill_tokens, dec = t.num_decode_tokens;
    g.append(svg("rect", { x, y: y(pre + dec, maxTok), width: w, height: y(pre, maxTok) - y(pre + dec, maxTok), class: "bar-decode" }));
    g.append(svg("rect", { x, y: y(pre, maxTok), width: w, height: top + plotH - y(pre, maxTok), class: "bar-prefill" }));
    // the batch size: a strip under the axis, as tall as the largest batch shown
    g.append(svg("rect", { x, y: top + plotH + 3, width: w, height: 16 * (t.num_seqs / maxSeqs), class: "bar-batch" }));
    const title = `${tr("step")} ${t.step}: ${pre} ${tr("prefill")}, ${dec} ${tr("decode")}, ` +
      `${tr("batch")} ${t.num_seqs}, ${(t.seconds * 1000).toFixed(2)} ms` +
      (t.preempted.length ? `, ${tr("preempt")}: ${t.preempted.join(", ")}` : "");
    g.append(svg("title", {}, document.createTextNode(title)));
    g.addEventListener("click", () => pick(i));
    root.append(g);
    line.push(`${(x + colW / 2).toFixed(1)},${y(t.seconds * 1000, maxMs).toFixed(1)}`);
  });
  root.append(svg("polyline", { points: line.join(" "), class: "ms-line" }));
  steps.forEach(([t, i], k) => {
    if (!t.preempted.length) return;
    const cx = left + k * colW + colW / 2;
    const mark = svg("path", {
      d: `M${cx - 6},2 L${cx + 6},2 L${cx},13 Z`, class: "preempt-mark",
      "data-testid": "preempt-mark", "data-step": t.step, "data-requests": t.preempted.join(" "),
    });
    mark.append(svg("title", {}, document.createTextNode(`${tr("preempt")} · ${tr("step")} ${t.step}: ${t.preempted.join(", ")}`)));
    mark.addEventListener("click", (e) => { e.stopPropagation(); onMark(i, t.preempted[0]); });
    root.append(mark);
  });
  return root;
}

/** One request's num_tokens, num_cached_tokens and num_prompt_tokens over the frames where it
 * appears; red marks where it was preempted. `rows` are [frame index, request or null, step]. */
export function historyChart(rows, preemptedAt, at, pick) {
  const H = 150, top = 10, bottom = 18, left = 40, right = 10;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "hist-svg", role: "img" });
  const present = rows.filter(([, r]) => r);
  if (!present.length) return root;
  const max = niceMax(Math.max(...present.map(([, r]) => r.num_tokens)));
  const n = rows.length;
  const x = (k) => left + (n === 1 ? 0 : (k / (n - 1)) * (W - left - right));
  const y = (v) => top + (H - top - bottom) * (1 - v / max);
  root.append(svg("line", { x1: left, x2: W - right, y1: y(0), y2: y(0), class: "axis" }));
  root.append(svg("text", { x: left - 4, y: top + 8, "text-anchor": "end", class: "ax-label" }, document.createTextNode(max)));
  for (const [field, cls] of [["num_prompt_tokens", "h-prompt"], ["num_tokens", "h-tokens"], ["num_cached_tokens", "h-cached"]]) {
    let d = "";
    rows.forEach(([, r], k) => {
      if (!r) return;
      const prev = k > 0 && rows[k - 1][1];
      d += `${prev ? "L" : "M"}${x(k).toFixed(1)},${y(r[field]).toFixed(1)} `;
    });
    root.append(svg("path", { d, class: `h-line ${cls}` }));
  }
  rows.forEach(([i, , step], k) => {
    if (preemptedAt.has(step)) {
      root.append(svg("line", { x1: x(k), x2: x(k), y1: top, y2: y(0), class: "h-preempt", "data-testid": "history-preempt" }));
    }
    if (i === at) root.append(svg("line", { x1: x(k), x2: x(k), y1: top, y2: y(0), class: "h-at" }));
  });
  root.addEventListener("click", (e) => {
    const box = root.getBoundingClientRect();
    const k = Math.round(((e.clientX - box.left) / box.width * W - left) / ((W - left - right) / Math.max(1, n - 1)));
    const row = rows[Math.min(n - 1, Math.max(0, k))];
    if (row) pick(row[0]);
  });
  return root;
}
