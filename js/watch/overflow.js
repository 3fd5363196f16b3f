// A norm that overflowed float32: +Inf while every entry it sums is finite (the layer's NaN/Inf counts are 0).
// Shown as "overflow", not Inf: the tensor is fine, its norm is just too large for float32.
import { fmt } from "../shared/format.js";

/** Norm statistic -> the counts of non-finite entries that tell a real Inf from an overflow. */
export const COUNTS = { grad_norm: ["grad_nan", "grad_inf"], delta_norm: ["delta_nan", "delta_inf"], a_rms: ["a_nonfinite"] };
export const OVERFLOW_RGB = [245, 158, 11];

/** Whether statistic k of layer l at row r is an overflowed norm. */
export function overflowAt(store, r, l, k) {
  const counts = COUNTS[store.meta.stats[k]];
  if (!counts || store.value(r, l, k) !== Infinity) return false;
  return counts.every((c) => { const j = store.meta.stats.indexOf(c); return j >= 0 && store.value(r, l, j) === 0; });
}

/** Whether the global gradient norm at row r overflowed: Inf while no layer's gradient has a NaN or Inf. */
export function stepOverflowAt(store, r, j) {
  if (j !== 1 || store.stepValue(r, 1) !== Infinity) return false;
  const k = store.meta.stats.indexOf("grad_norm");
  if (k < 0) return false;
  for (let l = 0; l < store.L; l++) {
    const v = store.value(r, l, k);
    if (v === Infinity ? !overflowAt(store, r, l, k) : !Number.isFinite(v) && !Number.isNaN(v)) return false;
  }
  return true;
}

/** fmt(v), or "overflow" where `over` says the Inf is an overflowed norm. */
export const fmtOver = (v, over) => (over ? "overflow" : fmt(v));
