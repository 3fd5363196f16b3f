// Charts on canvas: heatmaps of a 2-D tensor (diverging colour map, symmetric around 0) and bar charts.
import { interpolateRdBu } from "d3-scale-chromatic";
import { fmt, fmtShape, h } from "./dom.js";

const LUT = buildLut(256);

function buildLut(n) {
  const lut = new Uint8ClampedArray(n * 3);
  for (let i = 0; i < n; i++) {
    // RdBu runs red (0) -> blue (1): reverse it so positive values are red, negative blue.
    const m = /rgb\((\d+),\s*(\d+),\s*(\d+)\)/.exec(interpolateRdBu(1 - i / (n - 1)));
    lut.set(m ? [+m[1], +m[2], +m[3]] : [0, 0, 0], i * 3);
  }
  return lut;
}

/** RGB of value v on a symmetric scale of half-width `absmax` (NaN magenta, ±Inf black/white). */
export function colourOf(v, absmax) {
  if (Number.isNaN(v)) return [255, 0, 255];
  if (v === Infinity) return [0, 0, 0];
  if (v === -Infinity) return [255, 255, 255];
  const t = absmax > 0 ? Math.max(-1, Math.min(1, v / absmax)) : 0;
  const i = Math.round(((t + 1) / 2) * 255);
  return [LUT[i * 3], LUT[i * 3 + 1], LUT[i * 3 + 2]];
}

/** A labelled heatmap of tensor `t` ({data, shape:[rows, cols], true_shape, min, max}); shares `absmax` if given. */
export function heatmap(title, t, { absmax, testid } = {}) {
  const [rows, cols] = t.shape.length === 2 ? t.shape : [1, t.shape[0]];
  const scale = absmax ?? Math.max(Math.abs(+t.min || 0), Math.abs(+t.max || 0));
  const canvas = h("canvas", { width: cols, height: rows, class: "hw-heat", "data-testid": testid });
  const ctx = canvas.getContext && canvas.getContext("2d");
  if (ctx && ctx.createImageData) {
    const img = ctx.createImageData(cols, rows);
    for (let i = 0; i < rows * cols; i++) {
      const [r, g, b] = colourOf(t.data[i], scale);
      img.data.set([r, g, b, 255], i * 4);
    }
    ctx.putImageData(img, 0, 0);
  }
  const px = Math.max(1, Math.min(20, Math.floor(240 / Math.max(rows, cols))));
  canvas.style.width = `${cols * px}px`;
  canvas.style.height = `${rows * px}px`;
  const shown = `${rows}×${cols}`;
  const trueShape = fmtShape(t.true_shape);
  const note = shown === t.true_shape.join("×") ? trueShape : `${trueShape}, shown as ${shown}`;
  return h("figure", { class: "hw-fig" },
    h("figcaption", {}, h("b", { text: title }), " ", h("span", { class: "hw-dim", text: note })),
    canvas,
    h("div", { class: "hw-dim", text: `range [${fmt(t.min)}, ${fmt(t.max)}]${t.nonfinite ? `, ${t.nonfinite} non-finite` : ""}` }));
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
