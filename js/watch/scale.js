// Colour and value scales of the watch views: a sequential map (viridis), on a log scale where the
// values span decades; NaN, ±Inf and exact zeros (on a log scale) get colours of their own.
import { interpolateViridis } from "d3-scale-chromatic";

export const NAN_RGB = [255, 0, 255], INF_RGB = [230, 0, 0], NEG_INF_RGB = [0, 90, 255], ZERO_RGB = [200, 200, 200], EMPTY_RGB = [255, 255, 255];
const LUT = (() => {
  const n = 256, lut = new Uint8ClampedArray(n * 3);
  for (let i = 0; i < n; i++) {
    const c = interpolateViridis(i / (n - 1));
    const m = /^#([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(c) || /rgb\((\d+),\s*(\d+),\s*(\d+)\)/.exec(c);
    const rgb = !m ? [0, 0, 0] : c.startsWith("#") ? [1, 2, 3].map((j) => parseInt(m[j], 16)) : [+m[1], +m[2], +m[3]];
    lut.set(rgb, i * 3);
  }
  return lut;
})();

/** The scale of `values` (finite ones count): log10 when all are >= 0 and the positive ones span >= 2 decades. */
export function chooseScale(values) {
  let lo = Infinity, hi = -Infinity, minPos = Infinity, neg = false;
  for (const v of values) {
    if (!Number.isFinite(v)) continue;
    if (v < lo) lo = v;
    if (v > hi) hi = v;
    if (v > 0 && v < minPos) minPos = v;
    if (v < 0) neg = true;
  }
  if (lo === Infinity) return { log: false, lo: 0, hi: 1, empty: true };
  if (!neg && minPos < Infinity && hi / minPos >= 100) return { log: true, lo: Math.log10(minPos), hi: Math.log10(hi) };
  return { log: false, lo, hi };
}

/** Position of v in [0, 1] on `scale`; null for NaN/±Inf, -1 for a zero (or negative) value on a log scale. */
export function position(v, scale) {
  if (!Number.isFinite(v)) return null;
  let x = v;
  if (scale.log) { if (v <= 0) return -1; x = Math.log10(v); }
  const span = scale.hi - scale.lo;
  return span > 0 ? Math.max(0, Math.min(1, (x - scale.lo) / span)) : 0.5;
}

/** RGB of v: viridis on `scale`; NaN magenta, +Inf red, -Inf blue, zero on a log scale gray. */
export function colourOf(v, scale) {
  if (Number.isNaN(v)) return NAN_RGB;
  if (v === Infinity) return INF_RGB;
  if (v === -Infinity) return NEG_INF_RGB;
  const t = position(v, scale);
  if (t === -1) return ZERO_RGB;
  const i = Math.round(t * 255) * 3;
  return [LUT[i], LUT[i + 1], LUT[i + 2]];
}

export const cssOf = (rgb) => `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;

/** Rows 0..n-1 shown in `cols` columns: each column a [first, end) range of rows (one row each when n <= cols). */
export function bins(n, cols) {
  const out = [];
  if (n <= 0 || cols <= 0) return out;
  if (n <= cols) { for (let i = 0; i < n; i++) out.push([i, i + 1]); return out; }
  for (let c = 0; c < cols; c++) out.push([Math.floor((c * n) / cols), Math.floor(((c + 1) * n) / cols)]);
  return out;
}

/** The value a bin shows: a non-finite value wins (±Inf, then NaN: something went wrong there), else the largest |v|. */
export function pick(get, first, end) {
  let best = NaN, bestAbs = -1, inf = null, nan = false;
  for (let r = first; r < end; r++) {
    const v = get(r);
    if (Number.isNaN(v)) nan = true;
    else if (!Number.isFinite(v)) inf = v;
    else if (Math.abs(v) > bestAbs) { bestAbs = Math.abs(v); best = v; }
  }
  return inf !== null ? inf : nan ? NaN : best;
}
