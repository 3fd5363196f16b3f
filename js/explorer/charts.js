// Charts on canvas: heatmaps of a 2-D tensor (diverging colour map, symmetric around 0) and bar charts.
import { interpolateRdBu } from "d3-scale-chromatic";
import { colourMap, NAN_RGB } from "../shared/colour.js";
import { h } from "../shared/dom.js";
import { fmt, fmtShape, fmtStats } from "../shared/format.js";

// RdBu runs red (0) -> blue (1): reversed so positive values are red, negative blue.
const RED_BLUE = colourMap((t) => interpolateRdBu(1 - t));

/** RGB of value v on a symmetric scale of half-width `absmax` (NaN magenta, ±Inf black/white). */
export function colourOf(v, absmax) {
  if (Number.isNaN(v)) return NAN_RGB;
  if (v === Infinity) return [0, 0, 0];
  if (v === -Infinity) return [255, 255, 255];
  const t = absmax > 0 ? Math.max(-1, Math.min(1, v / absmax)) : 0;
  return RED_BLUE((t + 1) / 2);
}

/** Paint a rows × cols block of `data` (from `offset`) into a canvas at `px` pixels per cell. */
function paint(data, offset, rows, cols, scale, px, testid) {
  const canvas = h("canvas", { width: cols, height: rows, class: "hw-heat", "data-testid": testid });
  const ctx = canvas.getContext && canvas.getContext("2d");
  if (ctx && ctx.createImageData) {
    const img = ctx.createImageData(cols, rows);
    for (let i = 0; i < rows * cols; i++) {
      const [r, g, b] = colourOf(data[offset + i], scale);
      img.data.set([r, g, b, 255], i * 4);
    }
    ctx.putImageData(img, 0, 0);
  }
  canvas.style.width = `${cols * px}px`;
  canvas.style.height = `${rows * px}px`;
  return canvas;
}

const absOf = (t) => Math.max(Math.abs(+t.min || 0), Math.abs(+t.max || 0));

/** The whole tensor's statistics (from the kernel), or the picture's range when there are none. */
function statsLine(t, testid) {
  const text = t.stats ? fmtStats(t.stats) : `picture range [${fmt(t.min)}, ${fmt(t.max)}]${t.nonfinite ? `, ${fmt(t.nonfinite)} NaN/Inf` : ""}`;
  return h("div", { class: "hw-dim hw-stats", "data-testid": testid ? `${testid}-stats` : undefined, text });
}

/** A labelled picture of a tensor that fits its shape: channel maps, a T × d sequence, or a matrix. */
export function tensorView(title, t, opts = {}) {
  if (t.layout === "channels" || t.layout === "sequence") return samplesView(title, t, opts);
  return heatmap(title, t, opts);
}

/** A labelled heatmap of tensor `t` ({data, shape:[rows, cols], true_shape, min, max, stats}); shares `absmax` if given. */
export function heatmap(title, t, { absmax, testid } = {}) {
  const [rows, cols] = t.shape.length === 2 ? t.shape : [1, t.shape[0]];
  const scale = absmax ?? absOf(t);
  const px = Math.max(1, Math.min(20, Math.floor(240 / Math.max(rows, cols))));
  const canvas = paint(t.data, 0, rows, cols, scale, px, testid);
  const shown = `${rows}×${cols}`;
  const trueShape = fmtShape(t.true_shape);
  const numel = t.true_shape.reduce((x, y) => x * y, 1);
  const note = shown === t.true_shape.join("×") ? trueShape : `${trueShape}, shown as ${shown}${rows * cols < numel ? " (block means)" : ""}`;
  return h("figure", { class: "hw-fig" },
    h("figcaption", {}, h("b", { text: title }), " ", h("span", { class: "hw-dim", text: note })),
    canvas, statsLine(t, testid));
}

/** (S, C, h, w) channel maps or (S, T, d) sequences: one sample at a time, chosen with a selector. */
function samplesView(title, t, { testid } = {}) {
  const S = t.shape[0];
  const scale = absOf(t);
  const body = h("div", { class: "hw-samples-body" });
  const select = h("select", { class: "hw-sample", "data-testid": testid ? `${testid}-sample` : undefined, title: "which sample of the batch to show" },
    ...Array.from({ length: S }, (_, i) => h("option", { value: String(i), text: `sample ${i}` })));
  const per = t.shape.slice(1).reduce((a, b) => a * b, 1);
  function draw(i) {
    if (t.layout === "channels") {
      const [C, hh, ww] = t.shape.slice(1);
      const px = Math.max(1, Math.min(8, Math.floor(48 / Math.max(hh, ww))));
      const maps = [];
      for (let c = 0; c < C; c++) {
        maps.push(h("div", { class: "hw-chan", title: `channel ${c}` }, paint(t.data, i * per + c * hh * ww, hh, ww, scale, px), h("div", { class: "hw-dim hw-chan-label", text: `c${c}` })));
      }
      body.replaceChildren(h("div", { class: "hw-chan-grid", "data-testid": testid }, ...maps));
    } else {
      const [T, d] = t.shape.slice(1);
      const px = Math.max(1, Math.min(20, Math.floor(240 / Math.max(T, d))));
      body.replaceChildren(paint(t.data, i * per, T, d, scale, px, testid));
    }
  }
  select.addEventListener("change", () => draw(Number(select.value)));
  draw(0);
  const ts = t.true_shape;
  const what = t.layout === "channels"
    ? `${fmtShape(ts)}: ${t.shape[1]}${ts[1] > t.shape[1] ? ` of ${ts[1]}` : ""} channel maps (H×W${ts[2] > t.shape[2] || ts[3] > t.shape[3] ? `, shown ${t.shape[2]}×${t.shape[3]}` : ""}) per sample`
    : `${fmtShape(ts)}: T × d per sample${ts[1] > t.shape[1] || ts[2] > t.shape[2] ? `, shown ${t.shape[1]}×${t.shape[2]}` : ""}`;
  const more = ts[0] > S ? ` (first ${S} of ${ts[0]})` : "";
  return h("figure", { class: "hw-fig hw-samples" },
    h("figcaption", {}, h("b", { text: title }), " ", h("span", { class: "hw-dim", text: what }), " ", select, h("span", { class: "hw-dim", text: more })),
    body, statsLine(t, testid));
}

/** A bar chart of a 1-D tensor (e.g. per-sample gradient norms), one bar per entry. */
export function bars(title, t, { testid } = {}) {
  const n = t.data.length;
  const W = 260, H = 90;
  const canvas = h("canvas", { width: W, height: H, class: "hw-bars", "data-testid": testid });
  const ctx = canvas.getContext && canvas.getContext("2d");
  let max = 0;
  for (const v of t.data) if (Number.isFinite(v)) max = Math.max(max, Math.abs(v));
  if (ctx && ctx.fillRect) {
    const style = getComputedStyle(document.documentElement);
    ctx.fillStyle = style.getPropertyValue("--hw-op").trim() || "#8b5cf6";
    const bw = W / Math.max(n, 1);
    for (let i = 0; i < n; i++) {
      const v = t.data[i];
      const bh = Number.isFinite(v) && max > 0 ? (Math.abs(v) / max) * (H - 4) : H - 4;
      if (!Number.isFinite(v)) ctx.fillStyle = "#ff00ff";
      ctx.fillRect(i * bw + (bw > 3 ? 1 : 0), H - bh, Math.max(1, bw - (bw > 3 ? 2 : 0)), bh);
    }
  }
  const values = Array.from(t.data.slice(0, 8), (v) => fmt(v)).join(", ") + (n > 8 ? ", …" : "");
  return h("figure", { class: "hw-fig" },
    h("figcaption", {}, h("b", { text: title }), " ", h("span", { class: "hw-dim", text: `${fmtShape(t.true_shape)}, max ${fmt(max)}` })),
    canvas,
    h("div", { class: "hw-dim", "data-testid": testid ? `${testid}-values` : undefined, text: values }));
}
