// What the watch view draws for rows that stand for many layers (a block of 50, the whole chain of 1,000): a
// block's heatmap cell from its layers' cells, its sparkline and latest value from each layer summarised once a
// column (store.columnAcc, one pass over the layers) then combined per row, instead of a summary call per layer per
// row per column (the first row alone holds every layer: at 1,000 layers that was 180,000 calls each time the
// sparklines were redrawn, their largest cost), and whether a row held a real ±Inf.
import { completeBins, NEG_INF, POS_INF } from "./bins.js";
import { layerSums } from "./store.js";

/** An accumulator (bins.js newAcc's fields) of the layers `layers` from per-layer sums: as adding those layers one
 * after another with store.acc. */
export function rowAcc(sums, layers, acc) {
  let mn = Infinity, mx = -Infinity, s = 0, w = 0, nf = 0, last = NaN;
  for (const l of layers) {
    nf |= sums.nf[l]; last = sums.last[l];
    if (!sums.w[l]) continue;
    if (sums.min[l] < mn) mn = sums.min[l];
    if (sums.max[l] > mx) mx = sums.max[l];
    s += sums.sum[l]; w += sums.w[l];
  }
  acc.min = mn; acc.max = mx; acc.sum = s; acc.w = w; acc.nf = nf; acc.last = last;
  return acc;
}

/** For each row (its `layers`), the accumulators of statistic k over each source in `srcs` (a column each):
 * out[row][column]. */
export function rowsOverColumns(store, srcs, rows, k) {
  const sums = layerSums(store.L), out = rows.map(() => new Array(srcs.length));
  srcs.forEach((src, c) => {
    store.columnAcc(src, k, sums);
    rows.forEach((row, i) => { out[i][c] = rowAcc(sums, row.layers, {}); });
  });
  return out;
}

/** Per row, whether one of its layers held a real ±Inf of statistic k in a bin of the overview (not an overflowed
 * norm: the statistic's `counts`, indices of its non-finite counts, say its entries were finite). With `memo`
 * ({span: bins.js completeBins(), bad}), the complete bins already looked at are not looked at again. */
export function infiniteRows(store, rows, k, counts, memo = { span: completeBins(), bad: null }) {
  const o = store.overview, L = store.L, K = store.K, nfs = o.nf, maxs = o.max, span = memo.span(o, k);
  const look = (b, bad) => {
    for (let l = 0, q = b * L * K; l < L; l++, q += K) {
      if (bad[l] || !(nfs[q + k] & (POS_INF | NEG_INF))) continue;
      if (!counts.length || counts.some((j) => maxs[q + j] > 0 || nfs[q + j])) bad[l] = 1;
    }
  };
  if (span.reset || !memo.bad) memo.bad = new Uint8Array(L);
  for (let b = span.from; b < span.to; b++) look(b, memo.bad);
  const bad = memo.bad.slice();
  if (o.m) look(o.m - 1, bad); // the bin still filling
  return rows.map((row) => row.layers.some((l) => bad[l]));
}

/** A block's cell from its layers' cells: +Inf, -Inf, then NaN win (as in bins.js shown), else the largest |value|. */
export function blockValue(vals, layers) {
  if (layers.length === 1) return vals[layers[0]];
  let best = -1, out = NaN, nf = 0;
  for (const l of layers) {
    const v = vals[l];
    if (v === Infinity) return v;
    if (v === -Infinity) nf |= 4; else if (v !== v) nf |= 1; else if (Math.abs(v) > best) { best = Math.abs(v); out = v; }
  }
  return nf & 4 ? -Infinity : nf & 1 ? NaN : out;
}
