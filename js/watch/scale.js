// Colour and value scales of the watch views: a sequential map (viridis), on a log scale where the
// values span decades; NaN, ±Inf and exact zeros (on a log scale) get colours of their own.
import { interpolateViridis } from "d3-scale-chromatic";
import { colourMap, cssOf, NAN_RGB } from "../shared/colour.js";

export { cssOf, NAN_RGB };
export const INF_RGB = [230, 0, 0], NEG_INF_RGB = [0, 90, 255], ZERO_RGB = [200, 200, 200], EMPTY_RGB = [255, 255, 255];
const VIRIDIS = colourMap(interpolateViridis);

/** The scale of `values` (finite ones count): log10 when all are >= 0 and the positive ones span >= 2 decades. */
export function chooseScale(values) {
  const acc = newScaleAcc();
  for (const v of values) addToScale(acc, v);
  return scaleOf(acc);
}

/** chooseScale in parts, for values met a few at a time: an accumulator, a value added, the scale of what it saw. */
export const newScaleAcc = () => ({ lo: Infinity, hi: -Infinity, minPos: Infinity, neg: false });
export function addToScale(acc, v) {
  if (!Number.isFinite(v)) return;
  if (v < acc.lo) acc.lo = v;
  if (v > acc.hi) acc.hi = v;
  if (v > 0 && v < acc.minPos) acc.minPos = v;
  if (v < 0) acc.neg = true;
}
export function scaleOf({ lo, hi, minPos, neg }) {
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
  return VIRIDIS(t);
}

/** Rows 0..n-1 shown in `cols` columns: each column a [first, end) range of rows (one row each when n <= cols). */
export function bins(n, cols) {
  const out = [];
  if (n <= 0 || cols <= 0) return out;
  if (n <= cols) { for (let i = 0; i < n; i++) out.push([i, i + 1]); return out; }
  for (let c = 0; c < cols; c++) out.push([Math.floor((c * n) / cols), Math.floor(((c + 1) * n) / cols)]);
  return out;
}
