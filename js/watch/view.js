// The watch explorer: a layers × steps heatmap of one statistic, per-layer sparklines and latest values,
// the loss and global gradient norm over the same step axis, anomalies and kept steps marked at every zoom.
// Drawn from a store (store.js): each column from the finest level of detail held for its steps (full-resolution
// rows, else bins: a cell shows the bin's largest value, a series its min–max band and mean), and redrawn when it
// grows; the live widget's `requestWindow` asks the kernel for the zoomed steps at the resolution of the pixels.
// Layers fold into blocks (groups.js) that expand on a click. `openTrace(step, el)` shows a kept step's Trace
// below (the live widget asks the kernel, the standalone page uses its inlined data).
// Layer names come from user code: they are set as text only.
import { fmt } from "../shared/format.js";
import { addToScale, bins, chooseScale, colourOf, cssOf, INF_RGB, NAN_RGB, newScaleAcc, scaleOf, ZERO_RGB } from "./scale.js";
import { completeBins, newAcc, resetAcc, shown, summary } from "./bins.js";
import { series } from "./draw.js";
import { blockValue, infiniteRows, rowsOverColumns } from "./sparks.js";
import { initialExpanded, layerTree, visibleRows } from "./groups.js";
import { installWatchStyles } from "./styles.js";
import { around, bindAxis, visible, zoom } from "./axis.js";
import { leadsOf } from "./leads.js";
import { COUNTS, fmtOver, OVERFLOW_RGB, overflowAt, stepOverflowAt } from "./overflow.js";
import { anomalyColour, h, STAT_LABELS } from "./ui.js";
import { anomalyList, keptButtons, stepText } from "./text.js";

export { STAT_LABELS };
const CELL = 24; // widest step column, px: the heatmap grows rightwards until it fills the width, then compresses
const SPARK_W = 90, CHART_H = 54; // CHART_H: also .hw-w-chartlabel's height (styles.js)

/** Row height of the heatmap for `rows` rows (px): 18 for a few, down to 3 for hundreds. */
export const rowHeight = (rows) => Math.max(3, Math.min(18, Math.floor(360 / Math.max(rows, 1))));

/** Column c of the n rows shown in `cols` columns (see bins) that holds row r. */
export const columnOf = (r, n, cols) => (n <= cols ? r : Math.ceil(((r + 1) * cols) / n) - 1);

export function createWatchView({ store, el, nonce, openTrace, requestWindow = null, readonly = false, note = "" }) {
  const { meta, L } = store;
  const tree = layerTree(meta.layers), expanded = initialExpanded(tree);
  let rows = [], layerRow = [], rowH = 18;
  let stat = meta.stats.includes("grad_norm") ? "grad_norm" : meta.stats[0];
  let openStep = null, frame = 0, layout = null, scaleMemo = null, asked = null;
  let view = null, selected = null; // view: the rows shown (axis.js); selected: a clicked step
  const acc = newAcc();
  let sparkKey = null, sparkAt = 0, heatImg = null, lists = null, legendKey = null, opColour = "#8b5cf6";
  const scaleBins = completeBins(), infinite = { span: completeBins(), bad: null }; // what the whole-run figures have added
  let scaleDone = newScaleAcc();
  const redraws = []; // the last 200 redraws' durations (ms): the live benchmark reads them (tests/browser)

  const select = h("select", { "data-testid": "watch-stat", title: "the statistic the heatmap, sparklines and values show", onchange: () => { stat = select.value; redraw(); } },
    ...meta.stats.map((s) => h("option", { value: s, text: `${s} · ${STAT_LABELS[s] || s}`, selected: s === stat })));
  const summaryEl = h("span", { class: "hw-w-dim", "data-testid": "watch-summary" });
  const state = h("span", { class: "hw-w-state", "data-testid": "watch-state" });
  const legend = h("span", { class: "hw-w-legend", "data-testid": "watch-legend" });
  const zoomBy = (f) => setView(zoom(view, store.n, 0.5, f, 3));
  const zoomLabel = h("span", { class: "hw-w-dim", "data-testid": "watch-zoom-range" });
  const zoomBox = h("span", { class: "hw-w-zoom", title: "zoom the step axis (or: the wheel over a plot, a drag along the step axis)" },
    h("button", { "data-testid": "watch-zoom-in", text: "+", onclick: () => zoomBy(0.5) }),
    h("button", { "data-testid": "watch-zoom-out", text: "−", onclick: () => zoomBy(2) }),
    h("button", { "data-testid": "watch-zoom-all", text: "all steps", onclick: () => setView(null) }), zoomLabel);
  const head = h("div", { class: "hw-w-head" }, h("span", { class: "hw-w-title", text: "hw.watch" }), state, summaryEl, h("label", {}, "statistic ", select), zoomBox, legend);
  const resolution = h("div", { class: "hw-w-dim hw-w-res", "data-testid": "watch-resolution" });
  const held = h("div", { class: "hw-w-dim hw-w-res", "data-testid": "watch-held", text: note });

  const labels = h("div", { class: "hw-w-labels" }), values = h("div", { class: "hw-w-values" });
  const marks = h("canvas", { class: "hw-w-marks", height: 10, "data-testid": "watch-marks" });
  const heat = h("canvas", { class: "hw-w-heat", "data-testid": "watch-heatmap", "data-steps": "0" });
  const spark = h("canvas", { class: "hw-w-spark", width: SPARK_W, "data-testid": "watch-sparklines" });
  const lossC = h("canvas", { height: CHART_H, "data-testid": "watch-loss" });
  const normC = h("canvas", { height: CHART_H, "data-testid": "watch-grad-norm" });
  const lossV = h("div", { class: "hw-w-value" }), normV = h("div", { class: "hw-w-value" });
  // The charts' ranges sit under their names (text in the page: readable in any theme, never over the data).
  const lossR = h("div", { class: "hw-w-range", "data-testid": "watch-loss-range" }), normR = h("div", { class: "hw-w-range" });
  const axis = h("div", { class: "hw-w-axis", "data-testid": "watch-axis", title: "drag along the steps to zoom to them; the wheel zooms, shift+wheel pans" });
  const plot = h("div", { class: "hw-w-plot" }, heat);
  const grid = h("div", { class: "hw-w-grid" },
    h("div", { class: "hw-w-colhead", text: "layer" }), h("div", { class: "hw-w-colhead hw-w-heathead", text: "" }), h("div", { class: "hw-w-colhead hw-w-spark", text: "over the steps" }), h("div", { class: "hw-w-colhead", text: "latest" }),
    h("div", { class: "hw-w-rowlabel", text: "anomalies · kept" }), h("div", { class: "hw-w-plot" }, marks), h("div", { class: "hw-w-spark" }), h("div", {}),
    labels, plot, spark, values,
    h("div", { class: "hw-w-rowlabel hw-w-chartlabel" }, h("div", { text: "loss" }), lossR), h("div", { class: "hw-w-plot" }, lossC), h("div", { class: "hw-w-spark" }), lossV,
    h("div", { class: "hw-w-rowlabel hw-w-chartlabel" }, h("div", { text: "global ‖grad‖₂" }), normR), h("div", { class: "hw-w-plot" }, normC), h("div", { class: "hw-w-spark" }), normV,
    h("div", { class: "hw-w-rowlabel", text: "step" }), axis, h("div", { class: "hw-w-spark" }), h("div", {}));
  const readout = h("div", { class: "hw-w-readout", "data-testid": "watch-readout", text: "point at the heatmap or a chart to read a value; click a kept step to open its Trace, a block's name to expand it" });
  const kept = h("div", { class: "hw-w-kept", "data-testid": "watch-kept" });
  const anoms = h("details", { class: "hw-w-anoms-box", "data-testid": "watch-anomalies" });
  const status = h("div", { class: "hw-w-status", "data-testid": "watch-status", "data-state": "idle" });
  const facts = h("div", { class: "hw-w-facts", "data-testid": "watch-step-facts" });
  const traceHost = h("div", {});
  const trace = h("div", { class: "hw-w-trace", "data-testid": "watch-trace" }, facts, traceHost);
  const root = h("div", { class: "hw-watch", "data-testid": "watch" }, head, resolution, held, grid, readout, kept, anoms, status, trace);
  installWatchStyles(root, nonce);
  el.replaceChildren(root);
  layoutRows();

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
  // The plot's width from the observer, not read back on each redraw (a forced layout of the whole notebook).
  let plotW = 0;
  const ro = typeof ResizeObserver !== "undefined" ? new ResizeObserver((e) => { plotW = e[0]?.contentRect.width || 0; schedule(); }) : null;
  ro?.observe(plot);
  setStatus("idle", readonly ? "read-only page: the recorded run" : store.state === "open" ? "recording: the view grows while the loop runs" : "");
  redraw();

  function schedule() {
    if (frame) return;
    const raf = globalThis.requestAnimationFrame || ((f) => setTimeout(f, 16));
    frame = raf(() => { frame = 0; redraw(); });
  }

  function setStatus(s, text) { status.dataset.state = s; status.textContent = text; }

  /** The rows of the heatmap (blocks and layers) for the expanded blocks: labels, values, heights. */
  function layoutRows() {
    rows = visibleRows(tree, expanded);
    layerRow = new Array(L).fill(-1);
    rows.forEach((row, i) => { for (const l of row.layers) if (!rows[layerRow[l]]?.open || row.depth > rows[layerRow[l]].depth) layerRow[l] = i; });
    rowH = rowHeight(rows.length);
    const every = rowH >= 9 ? 1 : Math.ceil(12 / rowH); // rows under 9 px: every `every`-th name is written
    const style = `height:${rowH}px;line-height:${rowH}px` + (every === 1 ? `;font-size:${Math.min(11, rowH - 1)}px` : "");
    const cls = (base, i) => base + (every > 1 ? " sparse" : "") + (i % every ? " hw-w-quiet" : "");
    labels.replaceChildren(...rows.map((row, i) => h("div", {
      class: cls("hw-w-label", i) + (row.leaf ? "" : " hw-w-block"), title: row.leaf ? row.label : `${row.label}: the largest value over its layers; click to ${row.open ? "fold" : "expand"} it`,
      text: i % every ? "" : (row.leaf ? "" : row.open ? "▾ " : "▸ ") + row.label, style: style + (row.depth ? `;padding-left:${row.depth * 8}px` : ""),
      "data-row-key": row.key, "data-layers": String(row.layers.length), onclick: row.leaf ? null : () => toggle(row.key) })));
    values.replaceChildren(...rows.map((_, i) => h("div", { class: cls("hw-w-value", i), style })));
    heat.height = rows.length * rowH;
    spark.height = rows.length * rowH;
    grid.classList.toggle("no-spark", rowH < 9);
  }

  function toggle(key) {
    if (expanded.has(key)) expanded.delete(key); else expanded.add(key);
    layoutRows();
    redraw();
  }

  /** Columns of the plots: rows per column and the width of one. */
  function measure() {
    const W = Math.max(120, Math.floor(plotW || plot.clientWidth || 600));
    const [v0, v1] = visible(view, store.n), n = v1 - v0, cols = Math.min(n, W);
    const colW = n * CELL <= W ? CELL : n ? W / cols : CELL;
    return { W, n, v0, v1, cols, colW, bins: bins(n, cols).map(([a, b]) => [a + v0, b + v0]) };
  }

  /** The column that shows row r (-1 when it is outside the zoomed range). */
  function colOf(r) {
    const { v0, v1, n, cols } = layout;
    return r < v0 || r >= v1 ? -1 : columnOf(r - v0, n, cols);
  }

  function setView(next) { view = next; redraw(); }

  /** Select row r (a single step: the heatmap outlines it, the readout holds its leading statistics). */
  function select_(r) {
    selected = r;
    redraw();
    readout.textContent = stepText(store, r);
    readout.classList.add("pinned");
  }

  /** The summary of visible row i (a layer, or a block: over its layers) of statistic k over a source, into acc. */
  function rowAcc(src, i, k) {
    resetAcc(acc);
    for (const l of rows[i].layers) store.acc(src, l, k, acc);
    return acc;
  }

  function redraw() {
    const t0 = globalThis.performance?.now() ?? 0;
    draw();
    if (redraws.push((globalThis.performance?.now() ?? 0) - t0) > 200) redraws.shift();
  }

  function draw() {
    // The series' colour (the theme's --hw-op), read before this redraw writes to the page: after, it forces a style recalc.
    opColour = globalThis.getComputedStyle?.(root).getPropertyValue("--hw-op").trim() || "#8b5cf6";
    layout = measure();
    const k = meta.stats.indexOf(stat);
    const N = store.n, last = N ? store.stepOf(N - 1) : NaN, total = store.totalSteps ?? (N ? last + 1 : 0);
    const base = layout.n ? store.source(layout.v0, layout.v1, k) : null;
    layout.sources = layout.bins.map(([a, b]) => store.source(a, b, k, base));
    const size = Math.max(...layout.sources.map((s) => s.size), 1), per = Math.max(...layout.bins.map(([a, b]) => b - a), 1);
    zoomLabel.textContent = N && layout.n < N ? `steps ${fmt(store.stepOf(layout.v0))}–${fmt(store.stepOf(layout.v1 - 1))}` : "";
    zoomBox.dataset.v0 = String(layout.v0); zoomBox.dataset.v1 = String(layout.v1);
    resolution.textContent = !N ? "" : size <= 1 ? (per <= 1 ? "drawn at full resolution: a column a step" : `drawn from every step: a column the largest value of ${fmt(per)} steps (a series: their min–max band and mean)`)
      : `drawn from bins of ${fmt(size)} rows${requestWindow ? "" : " (the finest this page holds here)"}: a cell the bin's largest value, a series its min–max band and mean`;
    heat.dataset.resolution = String(size);
    summaryEl.textContent = `${fmt(L)} layer${L === 1 ? "" : "s"}${rows.length < L ? ` in ${fmt(rows.length)} rows` : ""} · ${fmt(N)} step${N === 1 ? "" : "s"} recorded${total > N ? ` (of ${fmt(total)})` : ""} · ${fmt(store.anomalies.length)} anomal${store.anomalies.length === 1 ? "y" : "ies"}`;
    state.textContent = store.state === "open" ? "recording" : "closed";
    state.className = `hw-w-state ${store.state}`;
    heat.dataset.steps = String(N);
    heat.dataset.colW = String(layout.colW);
    drawHeat(k);
    // The whole run's sparklines and the layers' Inf flags: at most once a second while rows stream (a view or
    // statistic change redraws them at once).
    const runKey = `${k}:${rows.length}:${expanded.size}`, now = Date.now();
    const whole = runKey !== sparkKey || now - sparkAt >= 1000 || store.state !== "open";
    drawSparks(k, whole);
    if (whole) {
      sparkKey = runKey; sparkAt = now;
      const bad = infiniteIn(k);
      labels.childNodes.forEach((node, i) => node.classList.toggle("bad", bad[i]));
    }
    drawMarks();
    drawChart(lossC, 0, lossV, lossR);
    drawChart(normC, 1, normV, normR);
    drawAxis();
    // The lists change with the anomalies and kept steps only: rebuilt then, not at every streamed row.
    const listKey = `${store.kept.join()}|${openStep}|${store.dropped}|${store.anomalies.length}|${[...store.nonfinite].join()}`;
    if (listKey !== lists) { lists = listKey; keptButtons(kept, store, openStep, open); anomalyList(anoms, store, showLead); }
    if (store.state === "closed" && status.dataset.state === "idle" && !readonly) setStatus("idle", `${fmt(N)} steps recorded; the watch is closed`);
    askWindow(k, size);
  }

  /** Live: the zoomed steps coarser than the pixels ask the kernel for them at full resolution (or finer bins). */
  function askWindow(k, size) {
    if (!requestWindow || !layout.n || layout.n >= store.n || size <= 1) return;
    if (size <= Math.max(1, Math.floor(layout.n / layout.cols))) return; // the bins already fit the pixels
    const key = `${layout.v0}:${layout.v1}:${k}`;
    if (asked === key) return;
    asked = key;
    requestWindow({ start: layout.v0, stop: layout.v1, bins: layout.cols, stat: k });
  }

  /** The colour scale of statistic k: over the overview's bins (every step's min and max) and the latest row, refreshed
   * at most once a second while rows stream; the complete bins are added once (bins.js completeBins). */
  function scaleOfStat(k) {
    const o = store.overview, now = Date.now(), K = store.K;
    if (scaleMemo && scaleMemo.k === k && scaleMemo.o === o && (scaleMemo.have === store.have || now - scaleMemo.t < 1000)) return scaleMemo.scale;
    const span = scaleBins(o, k), add = (acc, i) => { for (let l = 0, x = i * L * K + k; l < L; l++, x += K) { addToScale(acc, o.min[x]); addToScale(acc, o.max[x]); } };
    if (span.reset) scaleDone = newScaleAcc();
    for (let i = span.from; i < span.to; i++) add(scaleDone, i);
    const acc = { ...scaleDone };
    if (o.m) add(acc, o.m - 1); // the bin still filling
    for (let l = 0; l < L && store.n; l++) addToScale(acc, store.value(store.n - 1, l, k));
    scaleMemo = { k, o, have: store.have, t: now, scale: scaleOf(acc) };
    return scaleMemo.scale;
  }

  function drawHeat(k) {
    const { W, cols, colW, bins: bs, sources } = layout;
    heat.width = W;
    heat.style.width = `${W}px`;
    const scale = scaleOfStat(k);
    drawLegend(scale);
    const ctx = heat.getContext?.("2d");
    if (!ctx) return;
    // Cells into one image: columns that share their bins (many, where bins are wider than a pixel) share values.
    const H = Math.max(1, heat.height);
    if (heatImg?.width !== W || heatImg.height !== H) heatImg = ctx.createImageData(W, H); // reused while the size holds
    const px = new Uint32Array(heatImg.data.buffer), vals = new Float64Array(L);
    const packed = ([r, g, b]) => (255 << 24 | b << 16 | g << 8 | r) >>> 0; // RGBA bytes as one little-endian word
    let rgb = [], key = null;
    for (let c = 0; c < cols; c++) {
      const x0 = Math.floor(c * colW), x1 = Math.max(x0 + 1, Math.floor((c + 1) * colW)), src = sources[c];
      const same = src.level ? `${src.range[0]}:${src.range[1]}` : null;
      if (same === null || same !== key) {
        store.columnShown(src, k, vals);
        rgb = rows.map((row) => {
          const v = blockValue(vals, row.layers);
          let over = false;
          if (v === Infinity && src.seg) for (const l of row.layers) for (let r = bs[c][0]; r < bs[c][1] && !over; r++) over = overflowAt(store, r, l, k);
          return packed(over ? OVERFLOW_RGB : colourOf(v, scale));
        });
      }
      key = same;
      const xe = Math.min(x1, W);
      for (let i = 0; i < rows.length; i++) {
        const c32 = rgb[i];
        for (let y = i * rowH, o = y * W; y < (i + 1) * rowH; y++, o += W) for (let x = x0; x < xe; x++) px[o + x] = c32;
      }
    }
    ctx.putImageData(heatImg, 0, 0);
    // The first anomaly located at each layer (where it started): a red outline around that cell, at every zoom.
    ctx.strokeStyle = "#dc2626";
    ctx.lineWidth = 2;
    const outlined = new Set();
    for (const [step, list] of store.anomalyMap()) {
      const c = colOf(store.rowOf(step));
      if (c < 0) continue;
      for (const [where] of list) {
        const i = layerRow[meta.layers.indexOf(where)];
        if (i === undefined || i < 0 || outlined.has(i)) continue;
        outlined.add(i);
        ctx.strokeRect(Math.floor(c * colW) + 1, i * rowH + 1, Math.max(2, Math.floor(colW) - 2), Math.max(1, rowH - 2));
      }
    }
    const sc = selected === null ? -1 : colOf(selected);
    if (sc >= 0) { ctx.strokeStyle = "#2563eb"; ctx.strokeRect(Math.floor(sc * colW) + 1, 1, Math.max(2, Math.floor(colW) - 2), rows.length * rowH - 2); }
  }

  /** Per visible row, whether a layer of it held a real ±Inf of statistic k (sparks.js infiniteRows). */
  function infiniteIn(k) {
    return infiniteRows(store, rows, k, (COUNTS[stat] || []).map((c) => meta.stats.indexOf(c)).filter((j) => j >= 0), infinite);
  }

  function drawLegend(scale) {
    const key = `${scale.lo}|${scale.hi}|${scale.log}|${scale.empty}`;
    if (key === legendKey) return;
    legendKey = key;
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

  function drawSparks(k, lines = true) {
    const ctx = spark.getContext?.("2d");
    const last = store.n - 1, lastSrc = last >= 0 ? store.source(last, last + 1, k) : null;
    const latest = lastSrc ? rowsOverColumns(store, [lastSrc], rows, k) : null;
    values.childNodes.forEach((node, i) => {
      const s = latest ? summary(latest[i][0]) : null, v = s ? shown(latest[i][0]) : NaN;
      const one = rows[i].layers.length === 1 ? rows[i].layers[0] : -1;
      const over = one >= 0 && lastSrc?.seg && overflowAt(store, last, one, k);
      node.textContent = node.classList.contains("hw-w-quiet") ? "" : s ? fmtOver(v, over) : "–";
      node.title = `${rows[i].label}: ${stat} at step ${s ? fmt(store.stepOf(last)) : "–"}${one < 0 ? " (the largest over its layers)" : ""}`;
      node.classList.toggle("bad", !!s && (v === Infinity || v === -Infinity) && !over);
    });
    if (!ctx || rowH < 9 || !lines) return;
    ctx.clearRect(0, 0, SPARK_W, spark.height);
    const whole = store.n ? store.source(0, store.n, k) : null, bs = bins(store.n, SPARK_W), srcs = bs.map(([a, b]) => store.source(a, b, k, whole));
    const dx = store.n <= SPARK_W ? Math.min(CELL / 2, SPARK_W / Math.max(store.n, 1)) : 1;
    const perRow = rowsOverColumns(store, srcs, rows, k);
    for (let i = 0; i < rows.length; i++) {
      const pts = perRow[i].map(summary);
      series(ctx, pts, chooseScale(pts.flatMap((p) => [p.min, p.max])), { y: i * rowH + 1, dx, boxH: rowH - 2, colour: opColour, band: bs.some(([a, b]) => b - a > 1) || rows[i].layers.length > 1 });
    }
  }

  function drawChart(canvas, j, valueEl, rangeEl) {
    const { W, cols, colW, bins: bs, sources } = layout;
    canvas.width = W;
    canvas.style.width = `${W}px`;
    const pts = bs.map((_, c) => { const s = summary(store.stepAcc(sources[c], j, resetAcc(acc))); return s; });
    const scale = chooseScale(pts.flatMap((p) => [p.min, p.max]));
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
    series(ctx, pts, scale, { y: 3, dx: colW, boxH: CHART_H - 6, colour: opColour, band: sources.some((s, c) => s.size > 1 || bs[c][1] - bs[c][0] > 1) });
  }

  /** Anomalies (a coloured bar) and kept steps (a teal triangle) in the column holding them, whatever the zoom. */
  function drawMarks() {
    const { W, colW } = layout;
    marks.width = W;
    marks.style.width = `${W}px`;
    const ctx = marks.getContext?.("2d");
    let shownMarks = 0;
    for (const [step, list] of store.anomalyMap()) {
      const c = colOf(store.rowOf(step));
      if (c < 0) continue;
      shownMarks++;
      if (!ctx) continue;
      ctx.fillStyle = anomalyColour(list.map((a) => a[1]).join(" "));
      ctx.fillRect(Math.floor(c * colW), 0, Math.max(2, Math.floor(colW)), 5);
    }
    marks.dataset.anomalies = String(shownMarks);
    if (!ctx) return;
    ctx.fillStyle = "#0d9488";
    for (const s of store.kept) {
      const c = colOf(store.rowOf(s));
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
    axis.replaceChildren(...[...new Set(ticks)].map((r) => h("span", { style: `left:${(colOf(r) + 0.5) * colW}px`, text: fmt(store.stepOf(r)) })));
  }

  /** Zoom the axis around the lead's step (one step a clickable column) and select it. */
  function showLead(lead) {
    const span = Math.max(3, Math.min(store.n, Math.floor((layout?.W || 600) / CELL)));
    view = around(store.n, store.rowOf(lead.step), span);
    if (meta.stats.includes(lead.stat)) select.value = stat = lead.stat; // the heatmap shows the cause
    select_(store.rowOf(lead.step));
  }

  /** The rows and visible row under the pointer. */
  function locate(e, where) {
    if (!layout || !layout.n) return null;
    const box = e.currentTarget.getBoundingClientRect();
    const x = e.clientX - box.left, y = e.clientY - box.top;
    const c = Math.floor(x / layout.colW);
    if (c < 0 || c >= layout.cols) return null;
    const [first, end] = layout.bins[c];
    return { c, first, end, row: where === "heat" ? Math.min(rows.length - 1, Math.max(0, Math.floor(y / rowH))) : null };
  }

  function hover(e, where) {
    if (frame) { (globalThis.cancelAnimationFrame || clearTimeout)(frame); frame = 0; redraw(); } // rows came: fresh layout first
    const at = locate(e, where);
    if (!at) return;
    const { c, first, end, row } = at, src = layout.sources[c];
    const steps = end - first > 1 || src.size > 1 ? `steps ${fmt(store.stepOf(first))}–${fmt(store.stepOf(end - 1))} (largest value${src.size > 1 ? `, from bins of ${fmt(src.size)} rows` : ""})` : `step ${fmt(store.stepOf(first))}`;
    const overIn = (f) => { for (let r = first; r < end && src.seg; r++) if (f(r)) return true; return false; };
    let text;
    if (where === "heat") {
      const k = meta.stats.indexOf(stat), v = shown(rowAcc(src, row, k)), one = rows[row].layers.length === 1;
      text = `${rows[row].label} · ${steps} · ${stat} = ${fmtOver(v, one && v === Infinity && overIn((r) => overflowAt(store, r, rows[row].layers[0], k)))}`;
    } else {
      const j = where === "loss" ? 0 : 1, v = shown(store.stepAcc(src, j, resetAcc(acc)));
      text = `${steps} · ${where === "loss" ? "loss" : "global ‖grad‖₂"} = ${fmtOver(v, v === Infinity && overIn((r) => stepOverflowAt(store, r, j)))}`;
    }
    const byStep = store.anomalyMap(), notes = [];
    for (const [s, list] of byStep) { const r = store.rowOf(s); if (r >= first && r < end) for (const [w, why] of list) if (notes.length < 2) notes.push(`${w}: ${why}`); }
    if (notes.length) text += ` · ⚠ ${notes.join("; ")}`;
    if (store.kept.some((s) => { const r = store.rowOf(s); return r >= first && r < end; })) text += " · click to open its Trace";
    readout.textContent = text;
    readout.classList.remove("pinned");
  }

  async function open(step) {
    openStep = step;
    keptButtons(kept, store, openStep, open);
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
    facts.replaceChildren(h("div", { text: stepText(store, r) }), lead ? h("div", {}, h("span", { text: "this anomaly's " }),
      h("button", { class: "hw-w-lead", "data-lead-step": String(lead.step), title: "zoom the steps to it and select it", text: `lead: ${lead.text}`, onclick: () => showLead(lead) })) : null);
  }

  /** What the view draws, for tests: the heatmap's values of layer l (statistic `name`) column by column. */
  function shownValues(l, name = stat) {
    const k = meta.stats.indexOf(name), base = layout.n ? store.source(layout.v0, layout.v1, k) : null;
    return layout.bins.map(([a, b]) => { const src = store.source(a, b, k, base);
      return { first: store.stepOf(a), last: store.stepOf(b - 1), size: src.size, value: shown(store.acc(src, l, k, resetAcc(newAcc()))) }; });
  }
  /** Where each anomaly is marked: [{step, x}] of those in the zoomed range. */
  const markColumns = () => [...store.anomalyMap().keys()].map((step) => ({ step, c: colOf(store.rowOf(step)) })).filter((m) => m.c >= 0).map(({ step, c }) => ({ step, x: c * layout.colW }));
  root.hwView = { store, shownValues, markColumns, redraws, get layout() { return layout; }, setView, toggle };

  return {
    root, redraw, open, showLead, setView, select: select_, shownValues, toggle,
    get layout() { return layout; }, get rows() { return rows; },
    destroy() { unsubscribe(); ro?.disconnect(); },
  };
}
