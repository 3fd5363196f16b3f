// The watch explorer: a layers × steps heatmap of one statistic, per-layer sparklines and latest values,
// the loss and global gradient norm over the same step axis, anomalies marked, kept steps to open.
// Drawn from a store (store.js) and redrawn when it grows; `openTrace(step, el)` shows a kept
// step's Trace below (the live widget asks the kernel, the standalone page uses its inlined data).
// Layer names come from user code: they are set as text only.
import { h as hh } from "../shared/dom.js";
import { fmt } from "../shared/format.js";
import { bins, chooseScale, colourOf, cssOf, INF_RGB, NAN_RGB, pick, position, ZERO_RGB } from "./scale.js";
import { installWatchStyles } from "./styles.js";
import { around, bindAxis, visible, zoom } from "./axis.js";
import { leadsOf } from "./leads.js";
import { lrText } from "./lr.js";
import { fmtOver, OVERFLOW_RGB, overflowAt, stepOverflowAt } from "./overflow.js";

export const STAT_LABELS = {
  grad_norm: "‖W.grad‖₂", delta_norm: "‖δ‖₂ (output gradient)", delta_max: "max |δ|", a_rms: "RMS of the input a",
  a_zero_frac: "fraction of a that is 0", a_nonfinite: "NaN/Inf entries of a", weight_norm: "‖W‖₂",
  update_ratio: "update ratio ‖ΔW‖/‖W‖", delta_nan: "NaN entries of δ", delta_inf: "Inf entries of δ",
  grad_nan: "NaN entries of W.grad", grad_inf: "Inf entries of W.grad", lr: "learning rate of its param group",
};
/** dom.js's h, with `style` set through the CSSOM (a strict CSP refuses style attributes). */
function h(tag, attrs = {}, ...children) {
  const { style, ...rest } = attrs || {};
  const node = hh(tag, rest, ...children);
  for (const part of (style || "").split(";")) {
    const i = part.indexOf(":");
    if (i > 0) node.style.setProperty(part.slice(0, i).trim(), part.slice(i + 1).trim());
  }
  return node;
}
const CELL = 24; // widest step column, px: the heatmap grows rightwards until it fills the width, then compresses
const SPARK_W = 90, CHART_H = 54; // CHART_H: also .hw-w-chartlabel's height (styles.js)
const anomalyColour = (reason) => (/non-finite|nan|inf/i.test(reason) ? "#dc2626" : /spike/i.test(reason) ? "#ea580c" : "#2563eb");

/** Row height of the heatmap for L layers (px): 18 for a few layers, down to 3 for hundreds. */
export const rowHeight = (L) => Math.max(3, Math.min(18, Math.floor(360 / Math.max(L, 1))));

/** Column c of the n rows shown in `cols` columns (see bins) that holds row r. */
export const columnOf = (r, n, cols) => (n <= cols ? r : Math.ceil(((r + 1) * cols) / n) - 1);

export function createWatchView({ store, el, nonce, openTrace, readonly = false }) {
  const { meta, L } = store;
  const rowH = rowHeight(L);
  let stat = meta.stats.includes("grad_norm") ? "grad_norm" : meta.stats[0];
  let openStep = null, frame = 0, layout = null;
  let view = null, selected = null; // view: the rows shown (axis.js); selected: a clicked step

  const select = h("select", { "data-testid": "watch-stat", title: "the statistic the heatmap, sparklines and values show", onchange: () => { stat = select.value; redraw(); } },
    ...meta.stats.map((s) => h("option", { value: s, text: `${s} · ${STAT_LABELS[s] || s}`, selected: s === stat })));
  const summary = h("span", { class: "hw-w-dim", "data-testid": "watch-summary" });
  const state = h("span", { class: "hw-w-state", "data-testid": "watch-state" });
  const legend = h("span", { class: "hw-w-legend", "data-testid": "watch-legend" });
  const zoomBy = (f) => setView(zoom(view, store.n, 0.5, f, 3));
  const zoomLabel = h("span", { class: "hw-w-dim", "data-testid": "watch-zoom-range" });
  const zoomBox = h("span", { class: "hw-w-zoom", title: "zoom the step axis (or: the wheel over a plot, a drag along the step axis)" },
    h("button", { "data-testid": "watch-zoom-in", text: "+", onclick: () => zoomBy(0.5) }),
    h("button", { "data-testid": "watch-zoom-out", text: "−", onclick: () => zoomBy(2) }),
    h("button", { "data-testid": "watch-zoom-all", text: "all steps", onclick: () => setView(null) }), zoomLabel);
  const head = h("div", { class: "hw-w-head" }, h("span", { class: "hw-w-title", text: "hw.watch" }), state, summary, h("label", {}, "statistic ", select), zoomBox, legend);

  // Rows under 9 px: every `every`-th name and value is written (at a readable size), all have a tooltip.
  const every = rowH >= 9 ? 1 : Math.ceil(12 / rowH);
  const rowStyle = `height:${rowH}px;line-height:${rowH}px` + (every === 1 ? `;font-size:${Math.min(11, rowH - 1)}px` : "");
  const rowCls = (base, l) => base + (every > 1 ? " sparse" : "") + (l % every ? " hw-w-quiet" : "");
  const labels = h("div", { class: "hw-w-labels" }, ...meta.layers.map((name, l) => h("div", { class: rowCls("hw-w-label", l), title: name, text: l % every ? "" : name, style: rowStyle })));
  const values = h("div", { class: "hw-w-values" }, ...meta.layers.map((_, l) => h("div", { class: rowCls("hw-w-value", l), style: rowStyle })));
  const marks = h("canvas", { class: "hw-w-marks", height: 10, "data-testid": "watch-marks" });
  const heat = h("canvas", { class: "hw-w-heat", height: L * rowH, "data-testid": "watch-heatmap", "data-steps": "0" });
  const spark = h("canvas", { class: "hw-w-spark", width: SPARK_W, height: L * rowH, "data-testid": "watch-sparklines" });
  const lossC = h("canvas", { height: CHART_H, "data-testid": "watch-loss" });
  const normC = h("canvas", { height: CHART_H, "data-testid": "watch-grad-norm" });
  const lossV = h("div", { class: "hw-w-value" }), normV = h("div", { class: "hw-w-value" });
  // The charts' ranges sit under their names (text in the page: readable in any theme, never over the data).
  const lossR = h("div", { class: "hw-w-range", "data-testid": "watch-loss-range" }), normR = h("div", { class: "hw-w-range" });
  const axis = h("div", { class: "hw-w-axis", "data-testid": "watch-axis", title: "drag along the steps to zoom to them; the wheel zooms, shift+wheel pans" });
  const plot = h("div", { class: "hw-w-plot" }, heat);
  const grid = h("div", { class: "hw-w-grid" + (rowH < 9 ? " no-spark" : "") },
    h("div", { class: "hw-w-colhead", text: "layer" }), h("div", { class: "hw-w-colhead hw-w-heathead", text: "" }), h("div", { class: "hw-w-colhead hw-w-spark", text: "over the steps" }), h("div", { class: "hw-w-colhead", text: "latest" }),
    h("div", { class: "hw-w-rowlabel", text: "anomalies · kept" }), h("div", { class: "hw-w-plot" }, marks), h("div", { class: "hw-w-spark" }), h("div", {}),
    labels, plot, spark, values,
    h("div", { class: "hw-w-rowlabel hw-w-chartlabel" }, h("div", { text: "loss" }), lossR), h("div", { class: "hw-w-plot" }, lossC), h("div", { class: "hw-w-spark" }), lossV,
    h("div", { class: "hw-w-rowlabel hw-w-chartlabel" }, h("div", { text: "global ‖grad‖₂" }), normR), h("div", { class: "hw-w-plot" }, normC), h("div", { class: "hw-w-spark" }), normV,
    h("div", { class: "hw-w-rowlabel", text: "step" }), axis, h("div", { class: "hw-w-spark" }), h("div", {}));
  const readout = h("div", { class: "hw-w-readout", "data-testid": "watch-readout", text: "point at the heatmap or a chart to read a value; click a kept step to open its Trace" });
  const kept = h("div", { class: "hw-w-kept", "data-testid": "watch-kept" });
  const anoms = h("details", { class: "hw-w-anoms-box", "data-testid": "watch-anomalies" });
  const status = h("div", { class: "hw-w-status", "data-testid": "watch-status", "data-state": "idle" });
  const facts = h("div", { class: "hw-w-facts", "data-testid": "watch-step-facts" });
  const traceHost = h("div", {});
  const trace = h("div", { class: "hw-w-trace", "data-testid": "watch-trace" }, facts, traceHost);
  const root = h("div", { class: "hw-watch", "data-testid": "watch" }, head, grid, readout, kept, anoms, status, trace);
  installWatchStyles(root, nonce);
  el.replaceChildren(root);

  heat.addEventListener("mousemove", (e) => hover(e, "heat"));
  lossC.addEventListener("mousemove", (e) => hover(e, "loss"));
  normC.addEventListener("mousemove", (e) => hover(e, "norm"));
  heat.addEventListener("click", (e) => {
    const at = locate(e, "heat");
    if (!at) return;
    if (at.end - at.first === 1) select_(at.first);
    const k = store.kept.find((s) => { const r = store.rowOf(s); return r >= at.first && r < at.end; });
    if (k !== undefined) open(k);
  });
  bindAxis({ plots: [heat, lossC, normC, axis, marks], axis, n: () => store.n, layout: () => layout, view: () => view, setView,
    rowAt: (e) => { const at = locate(e, "axis"); return at ? at.first : null; } });

  const unsubscribe = store.subscribe(schedule);
  const ro = typeof ResizeObserver !== "undefined" ? new ResizeObserver(schedule) : null;
  ro?.observe(plot);
  setStatus("idle", readonly ? "read-only page: the recorded run" : store.state === "open" ? "recording: the view grows while the loop runs" : "");
  redraw();

  function schedule() {
    if (frame) return;
    const raf = globalThis.requestAnimationFrame || ((f) => setTimeout(f, 16));
    frame = raf(() => { frame = 0; redraw(); });
  }

  function setStatus(s, text) { status.dataset.state = s; status.textContent = text; }

  /** Columns of the plots: rows per column and the width of one. */
  function measure() {
    const W = Math.max(120, Math.floor(plot.clientWidth || 600));
    const [v0, v1] = visible(view, store.n), n = v1 - v0, cols = Math.min(n, W);
    const colW = n * CELL <= W ? CELL : n ? W / cols : CELL;
    return { W, n, v0, v1, cols, colW, bins: bins(n, cols).map(([a, b]) => [a + v0, b + v0]) };
  }

  /** The column that shows row r (-1 when it is outside the zoomed range). */
  function colOf(r) {
    const { v0, v1, n, cols } = layout;
    return r < v0 || r >= v1 ? -1 : columnOf(r - v0, n, cols);
  }

  function setView(next) {
    view = next;
    redraw();
  }

  /** Select row r (a single step: the heatmap outlines it, the readout holds its leading statistics). */
  function select_(r) {
    selected = r;
    redraw();
    readout.textContent = stepText(r);
    readout.classList.add("pinned");
  }

  /** A step's leading statistics: its learning rate(s), the update ratio and gradient norm of each layer, the global gradient norm. */
  function stepText(r) {
    const parts = [];
    for (const name of ["update_ratio", "grad_norm"]) {
      const k = meta.stats.indexOf(name);
      if (k < 0) continue;
      parts.push(`${STAT_LABELS[name] || name}: ` + meta.layers.map((layer, l) => `${layer} ${fmtOver(store.value(r, l, k), overflowAt(store, r, l, k))}`).join(", "));
    }
    return `step ${fmt(store.steps[r])} · loss ${fmt(store.stepValue(r, 0))} · ${lrText(store, r)} · global ‖grad‖₂ ${fmtOver(store.stepValue(r, 1), stepOverflowAt(store, r, 1))} · ${parts.join(" · ")}`;
  }

  function redraw() {
    layout = measure();
    const { n } = layout;
    const k = meta.stats.indexOf(stat);
    const N = store.n, total = store.totalSteps ?? (N ? store.steps[N - 1] + 1 : 0);
    zoomLabel.textContent = N && layout.n < N ? `steps ${fmt(store.steps[layout.v0])}–${fmt(store.steps[layout.v1 - 1])}` : "";
    zoomBox.dataset.v0 = String(layout.v0); zoomBox.dataset.v1 = String(layout.v1);
    summary.textContent = `${fmt(L)} layer${L === 1 ? "" : "s"} · ${fmt(N)} step${N === 1 ? "" : "s"} recorded${total > N ? ` (of ${fmt(total)})` : ""} · ${fmt(store.anomalies.length)} anomal${store.anomalies.length === 1 ? "y" : "ies"}`;
    state.textContent = store.state === "open" ? "recording" : "closed";
    state.className = `hw-w-state ${store.state}`;
    heat.dataset.steps = String(N);
    heat.dataset.colW = String(layout.colW);
    drawHeat(k);
    drawSparks(k);
    drawMarks();
    drawChart(lossC, 0, lossV, lossR);
    drawChart(normC, 1, normV, normR);
    drawAxis();
    drawKept();
    drawAnomalies();
    if (store.state === "closed" && status.dataset.state === "idle" && !readonly) setStatus("idle", `${fmt(N)} steps recorded; the watch is closed`);
  }

  function scaleOfStat(k) {
    const vals = [];
    for (let r = 0; r < store.n; r++) for (let l = 0; l < L; l++) vals.push(store.value(r, l, k));
    return chooseScale(vals);
  }

  function drawHeat(k) {
    const { W, cols, colW, bins: bs } = layout;
    heat.width = W;
    heat.style.width = `${W}px`;
    const scale = scaleOfStat(k);
    drawLegend(scale);
    const ctx = heat.getContext?.("2d");
    if (!ctx) return;
    ctx.clearRect(0, 0, W, heat.height);
    const byStep = store.anomalyMap();
    for (let c = 0; c < cols; c++) {
      const [a, b] = bs[c];
      const x0 = Math.floor(c * colW), x1 = Math.floor((c + 1) * colW);
      for (let l = 0; l < L; l++) {
        const v = pick((r) => store.value(r, l, k), a, b);
        let over = false;
        for (let r = a; r < b && v === Infinity && !over; r++) over = overflowAt(store, r, l, k);
        ctx.fillStyle = cssOf(over ? OVERFLOW_RGB : colourOf(v, scale));
        ctx.fillRect(x0, l * rowH, Math.max(1, x1 - x0), rowH);
      }
    }
    // The first anomaly located at each layer (where it started): a red outline around that cell.
    ctx.strokeStyle = "#dc2626";
    ctx.lineWidth = 2;
    const outlined = new Set();
    for (const [step, list] of byStep) {
      const r = store.rowOf(step);
      if (r < 0) continue;
      const c = colOf(r);
      if (c < 0) continue;
      for (const [where] of list) {
        const l = meta.layers.indexOf(where);
        if (l < 0 || outlined.has(l)) continue;
        outlined.add(l);
        ctx.strokeRect(Math.floor(c * colW) + 1, l * rowH + 1, Math.max(2, Math.floor(colW) - 2), rowH - 2);
      }
    }
    const sc = selected === null ? -1 : colOf(selected);
    if (sc >= 0) { ctx.strokeStyle = "#2563eb"; ctx.strokeRect(Math.floor(sc * colW) + 1, 1, Math.max(2, Math.floor(colW) - 2), L * rowH - 2); }
    labels.childNodes.forEach((node, l) => {
      let bad = false;
      for (let r = 0; r < store.n && !bad; r++) { const v = store.value(r, l, k); bad = store.received(r) && !Number.isFinite(v) && !Number.isNaN(v) && !overflowAt(store, r, l, k); }
      node.classList.toggle("bad", bad);
    });
  }

  function drawLegend(scale) {
    const lo = scale.log ? 10 ** scale.lo : scale.lo, hi = scale.log ? 10 ** scale.hi : scale.hi;
    const ramp = h("canvas", { class: "hw-w-ramp", width: 110, height: 10 });
    const ctx = ramp.getContext?.("2d");
    if (ctx) for (let i = 0; i < 110; i++) {
      const t = i / 109, v = scale.log ? 10 ** (scale.lo + t * (scale.hi - scale.lo)) : scale.lo + t * (scale.hi - scale.lo);
      ctx.fillStyle = cssOf(colourOf(v, scale)); ctx.fillRect(i, 0, 1, 10);
    }
    legend.replaceChildren(
      h("span", { text: scale.empty ? "no values yet" : fmt(lo) }), ramp, h("span", { text: scale.empty ? "" : fmt(hi) }),
      h("span", { class: "hw-w-dim", text: scale.log ? "(log scale)" : "(linear)" }),
      h("span", { class: "hw-w-sw", style: `background:${cssOf(NAN_RGB)}` }), h("span", { text: "NaN (or not measured)" }),
      h("span", { class: "hw-w-sw", style: `background:${cssOf(INF_RGB)}` }), h("span", { text: "Inf" }),
      h("span", { class: "hw-w-sw", style: `background:${cssOf(OVERFLOW_RGB)}` }), h("span", { text: "overflow (entries finite)" }),
      ...(scale.log ? [h("span", { class: "hw-w-sw", style: `background:${cssOf(ZERO_RGB)}` }), h("span", { text: "0" })] : []));
  }

  function drawSparks(k) {
    const ctx = spark.getContext?.("2d");
    const last = store.n - 1;
    values.childNodes.forEach((node, l) => {
      const v = last >= 0 ? store.value(last, l, k) : NaN;
      const over = last >= 0 && overflowAt(store, last, l, k);
      node.textContent = node.classList.contains("hw-w-quiet") ? "" : last >= 0 ? fmtOver(v, over) : "–";
      node.title = `${meta.layers[l]}: ${stat} at step ${last >= 0 ? store.steps[last] : "–"}`;
      node.classList.toggle("bad", last >= 0 && !Number.isFinite(v) && !Number.isNaN(v) && !over);
    });
    if (!ctx || rowH < 9) return;
    ctx.clearRect(0, 0, SPARK_W, spark.height);
    const bs = bins(store.n, SPARK_W), step = store.n <= SPARK_W ? Math.min(CELL / 2, SPARK_W / Math.max(store.n, 1)) : 1;
    for (let l = 0; l < L; l++) {
      const pts = bs.map(([a, b]) => pick((r) => store.value(r, l, k), a, b));
      line(ctx, pts, chooseScale(pts), 0, l * rowH + 1, step, rowH - 2, getOp());
    }
  }

  function getOp() {
    const v = globalThis.getComputedStyle?.(root).getPropertyValue("--hw-op").trim();
    return v || "#8b5cf6";
  }

  /** A polyline of `pts` (one per column, `dx` apart) in the box at (x, y) of height boxH; non-finite as red ticks. */
  function line(ctx, pts, scale, x, y, dx, boxH, colour) {
    ctx.strokeStyle = colour;
    ctx.lineWidth = 1.2;
    ctx.beginPath();
    let pen = false;
    const dots = [];
    pts.forEach((v, i) => {
      const t = position(v, scale);
      const px = x + (i + 0.5) * dx;
      if (t === null) {
        pen = false;
        // NaN: a short magenta tick at the bottom; ±Inf: a red one at the top (or bottom for -Inf).
        const tick = Math.max(2, Math.min(6, boxH / 3));
        ctx.save(); ctx.fillStyle = Number.isNaN(v) ? cssOf(NAN_RGB) : cssOf(INF_RGB);
        ctx.fillRect(px - Math.max(0.5, dx * 0.3), v === Infinity ? y : y + boxH - tick, Math.max(1, dx * 0.6), tick); ctx.restore();
        return;
      }
      const py = y + boxH - (t === -1 ? 0 : t) * boxH;
      if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      pen = true;
      if (dx >= 6) dots.push([px, py]); // few steps: each one visible, a lone one too
    });
    ctx.stroke();
    ctx.fillStyle = colour;
    for (const [px, py] of dots) ctx.fillRect(px - 1.5, py - 1.5, 3, 3);
  }

  function drawChart(canvas, j, valueEl, rangeEl) {
    const { W, cols, colW, bins: bs } = layout;
    canvas.width = W;
    canvas.style.width = `${W}px`;
    const pts = bs.map(([a, b]) => pick((r) => store.stepValue(r, j), a, b));
    const scale = chooseScale(pts);
    const last = store.n - 1;
    const v = last >= 0 ? store.stepValue(last, j) : NaN;
    valueEl.textContent = last >= 0 ? fmtOver(v, stepOverflowAt(store, last, j)) : "–";
    valueEl.classList.toggle("bad", last >= 0 && !Number.isFinite(v));
    valueEl.style.lineHeight = `${CHART_H}px`;
    canvas.dataset.scale = scale.log ? "log" : "linear";
    const lo = scale.log ? 10 ** scale.lo : scale.lo, hi = scale.log ? 10 ** scale.hi : scale.hi;
    rangeEl.textContent = scale.empty ? "" : `${fmt(lo)} … ${fmt(hi)}${scale.log ? " (log)" : ""}`;
    const ctx = canvas.getContext?.("2d");
    if (!ctx) return;
    ctx.clearRect(0, 0, W, CHART_H);
    ctx.fillStyle = "rgba(127,127,127,0.08)";
    ctx.fillRect(0, 0, cols * colW, CHART_H);
    line(ctx, pts, scale, 0, 3, colW, CHART_H - 6, getOp());
  }

  function drawMarks() {
    const { W, cols, colW } = layout;
    marks.width = W;
    marks.style.width = `${W}px`;
    const ctx = marks.getContext?.("2d");
    if (!ctx) return;
    ctx.clearRect(0, 0, W, 10);
    for (const [step, list] of store.anomalyMap()) {
      const r = store.rowOf(step);
      if (r < 0) continue;
      const c = colOf(r);
      if (c < 0) continue;
      const x = Math.floor(c * colW);
      ctx.fillStyle = anomalyColour(list.map((a) => a[1]).join(" "));
      ctx.fillRect(x, 0, Math.max(2, Math.floor(colW)), 5);
    }
    ctx.fillStyle = "#0d9488";
    for (const s of store.kept) {
      const r = store.rowOf(s);
      if (r < 0) continue;
      const c = colOf(r);
      if (c < 0) continue;
      const x = (c + 0.5) * colW;
      ctx.beginPath(); ctx.moveTo(x - 4, 10); ctx.lineTo(x + 4, 10); ctx.lineTo(x, 5); ctx.fill();
    }
  }

  function drawAxis() {
    const { n, v0, cols, colW } = layout;
    const ticks = [];
    if (n) {
      const want = Math.max(2, Math.min(8, Math.floor((cols * colW) / 90)));
      for (let i = 0; i < want; i++) ticks.push(v0 + Math.round((i * (n - 1)) / Math.max(want - 1, 1)));
    }
    axis.replaceChildren(...[...new Set(ticks)].map((r) => h("span", { style: `left:${(colOf(r) + 0.5) * colW}px`, text: fmt(store.steps[r] ?? r) })));
  }

  function drawKept() {
    const byStep = store.anomalyMap();
    const buttons = store.kept.map((s) => {
      const why = byStep.get(s);
      const text = `step ${fmt(s)}` + (why ? ` · ${why[0][0]}: ${why[0][1]}` : s === store.kept[store.kept.length - 1] ? " · latest" : s === 0 ? " · first" : "");
      return h("button", { "data-kept-step": String(s), class: (why ? "anomalous" : "") + (s === openStep ? " on" : ""), title: `open the full Trace of step ${s}`, text: text.length > 80 ? text.slice(0, 79) + "…" : text, onclick: () => open(s) });
    });
    const more = store.dropped ? [h("span", { class: "hw-w-dim", text: `(${fmt(store.dropped)} anomalous step${store.dropped === 1 ? "" : "s"} not kept: max_kept reached)` })] : [];
    kept.replaceChildren(h("span", { class: "hw-w-dim", text: buttons.length ? "kept Traces:" : "no Trace kept (flight recorder off, or no step yet)" }), ...buttons, ...more);
  }

  /** Zoom the axis around the lead's step (one step a clickable column) and select it. */
  function showLead(lead) {
    const span = Math.max(3, Math.min(store.n, Math.floor((layout?.W || 600) / CELL)));
    view = around(store.n, lead.row, span);
    if (meta.stats.includes(lead.stat)) select.value = stat = lead.stat; // the heatmap shows the cause
    select_(lead.row);
  }

  function leadButton(lead) { return h("button", { class: "hw-w-lead", "data-lead-step": String(lead.step), title: "zoom the steps to it and select it", text: `lead: ${lead.text}`, onclick: () => showLead(lead) }); }

  function drawAnomalies() {
    const list = store.anomalies;
    anoms.hidden = list.length === 0;
    if (list.length && !anoms.dataset.opened) { anoms.open = true; anoms.dataset.opened = "1"; }
    const shown = list.slice(0, 200), leads = leadsOf(store), first = list.length ? leads.get(list[0][0]) : null;
    const seen = new Set();
    const item = ([step, where, reason]) => {
      const lead = seen.has(step) ? null : leads.get(step);
      seen.add(step);
      const after = store.nonfinite.get(step);
      return h("li", { "data-step": String(step) }, h("span", { text: `step ${fmt(step)} · ${where}: ${reason}` }),
        after ? h("span", { class: "hw-w-dim", "data-testid": "watch-nonfinite-after", text: ` · then ${fmt(after)} more non-finite step${after === 1 ? "" : "s"}` }) : null,
        lead ? leadButton(lead) : null);
    };
    anoms.replaceChildren(h("summary", { "data-testid": "watch-first-lead", text: `${fmt(list.length)} anomal${list.length === 1 ? "y" : "ies"}${list.length ? ` (first at step ${fmt(list[0][0])}${first ? ` · lead: ${first.text}` : ""})` : ""}` }),
      h("ul", { class: "hw-w-anoms" }, ...shown.map(item),
        list.length > shown.length ? h("li", { class: "hw-w-dim", text: `… ${fmt(list.length - shown.length)} more (w.anomalies)` }) : null));
  }

  /** The rows and layer under the pointer. */
  function locate(e, where) {
    if (!layout || !layout.n) return null;
    const box = e.currentTarget.getBoundingClientRect();
    const x = e.clientX - box.left, y = e.clientY - box.top;
    const c = Math.floor(x / layout.colW);
    if (c < 0 || c >= layout.cols) return null;
    const [first, end] = layout.bins[c];
    return { first, end, layer: where === "heat" ? Math.min(L - 1, Math.max(0, Math.floor(y / rowH))) : null };
  }

  function hover(e, where) {
    const at = locate(e, where);
    if (!at) return;
    const { first, end, layer } = at;
    const steps = end - first > 1 ? `steps ${fmt(store.steps[first])}–${fmt(store.steps[end - 1])} (largest |value|)` : `step ${fmt(store.steps[first])}`;
    let text;
    const overIn = (f) => { for (let r = first; r < end; r++) if (f(r)) return true; return false; };
    if (where === "heat") {
      const k = meta.stats.indexOf(stat), v = pick((r) => store.value(r, layer, k), first, end);
      text = `${meta.layers[layer]} · ${steps} · ${stat} = ${fmtOver(v, v === Infinity && overIn((r) => overflowAt(store, r, layer, k)))}`;
    } else {
      const j = where === "loss" ? 0 : 1, v = pick((r) => store.stepValue(r, j), first, end);
      text = `${steps} · ${where === "loss" ? "loss" : "global ‖grad‖₂"} = ${fmtOver(v, v === Infinity && overIn((r) => stepOverflowAt(store, r, j)))}`;
    }
    const byStep = store.anomalyMap();
    const notes = [];
    for (let r = first; r < end && notes.length < 2; r++) for (const [w, why] of byStep.get(store.steps[r]) || []) notes.push(`${w}: ${why}`);
    if (notes.length) text += ` · ⚠ ${notes.join("; ")}`;
    if (store.kept.some((s) => { const r = store.rowOf(s); return r >= first && r < end; })) text += " · click to open its Trace";
    readout.textContent = text;
    readout.classList.remove("pinned");
  }

  async function open(step) {
    openStep = step;
    drawKept();
    setStatus("running", `opening the Trace of step ${step}`);
    const r = await openTrace(step, traceHost);
    if (!r.ok) { setStatus("error", r.text); return; }
    drawFacts(step);
    setStatus("done", `step ${step}: its kept Trace is shown below`);
  }

  /** Above a kept step's Trace: that step's learning rate(s), update ratios and gradient norms, and the lead of its anomaly. */
  function drawFacts(step) {
    const r = store.rowOf(step);
    if (r < 0) { facts.replaceChildren(); return; }
    const lead = leadsOf(store).get(step);
    facts.replaceChildren(h("div", { text: stepText(r) }), lead ? h("div", {}, h("span", { text: "this anomaly's " }), leadButton(lead)) : null);
  }

  return {
    root, redraw, open, showLead, setView, select: select_,
    get layout() { return layout; },
    destroy() { unsubscribe(); ro?.disconnect(); },
  };
}
