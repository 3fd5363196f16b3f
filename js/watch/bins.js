// Levels of detail of a watch on the front-end: a run of rows summarised in bins of `size` rows (min, max,
// mean, last of each layer's statistic; the same of the per-step loss and gradient norm), so the view draws a
// column of pixels from the few bins under it instead of every row. The kernel's w.lod(...) sends such levels
// (a "lod" message, or a page's overview); the live view also folds each streamed row into its overview here, so
// it never needs the rows it has drawn. Pure functions of typed arrays, for vitest.
//
// Spikes survive binning: min and max are exact over a bin's finite values, and where a bin held a NaN or ±Inf
// its code says so (NAN | POS_INF | NEG_INF, per layer and statistic when the rows were seen here; per layer only
// when the kernel's bins say no more), so a column shows the spike, never an average of it.

export const NAN = 1, POS_INF = 2, NEG_INF = 4;
export const MAX_BINS = 2048; // bins a live overview holds at most: pairs merge (the size doubles) past it
export const OVERVIEW_BYTES = 48 * 2 ** 20; // and at most this much memory: 25 bytes a value a bin (floats, counts, codes)

/** Bins the live overview holds for P values a row (views/watch_widget.py overview_bins says the same). */
export const maxBinsFor = (P) => Math.max(64, Math.min(MAX_BINS, Math.floor(OVERVIEW_BYTES / (25 * Math.max(P, 1)))));

/** The non-finite code of v (0 for a finite value). */
export const codeOf = (v) => (Number.isNaN(v) ? NAN : v === Infinity ? POS_INF : v === -Infinity ? NEG_INF : 0);

/** An empty level of bins of `size` rows from row r0, for P = layers × statistics values a row. */
export function createLevel(P, size = 1, r0 = 0, cap = 64) {
  return { P, size, r0, m: 0, cap, perStat: true, ...alloc(P, cap) };
}

function alloc(P, cap) {
  const f = (n) => new Float32Array(n).fill(NaN);
  return { first: new Float64Array(cap), lastStep: new Float64Array(cap), rows: new Int32Array(cap),
    min: f(cap * P), max: f(cap * P), mean: f(cap * P), last: f(cap * P), finite: new Int32Array(cap * P),
    smin: f(cap * 2), smax: f(cap * 2), smean: f(cap * 2), slast: f(cap * 2), sfinite: new Int32Array(cap * 2),
    nf: new Uint8Array(cap * P), snf: new Uint8Array(cap * 2) };
}

function grow(level, m) {
  if (m <= level.cap) return;
  const cap = Math.max(m, level.cap * 2), next = alloc(level.P, cap);
  for (const key of Object.keys(next)) next[key].set(level[key]);
  Object.assign(level, next, { cap });
}

/** `level` with room for m bins (allocated and copied now, once, rather than when a streamed row first needs it). */
export function reserve(level, m) { grow(level, m); return level; }

/** Add one value into slot i of (min, max, mean, last, finite count, nf). */
function addValue(a, i, v) {
  a.last[i] = v;
  const c = codeOf(v);
  if (c) { a.nf[i] |= c; return; }
  const n = ++a.finite[i];
  if (n === 1) { a.min[i] = v; a.max[i] = v; a.mean[i] = v; return; }
  if (v < a.min[i]) a.min[i] = v;
  if (v > a.max[i]) a.max[i] = v;
  a.mean[i] += (v - a.mean[i]) / n;
}

const STEP_VIEW = (level) => ({ min: level.smin, max: level.smax, mean: level.smean, last: level.slast, finite: level.sfinite, nf: level.snf });

/** Fold row r (step `step`; `stats` its P values, `perStep` its loss and gradient norm) into the level; rows come
 * in order. Past MAX_BINS bins, pairs merge. */
export function foldRow(level, r, step, stats, perStep, maxBins = MAX_BINS) {
  const i = Math.floor((r - level.r0) / level.size);
  if (i < 0) return;
  grow(level, i + 1);
  for (let j = level.m; j <= i; j++) { level.first[j] = NaN; level.rows[j] = 0; }
  if (!level.rows[i]) level.first[i] = step;
  level.rows[i]++;
  level.lastStep[i] = step;
  level.m = Math.max(level.m, i + 1);
  const P = level.P;
  for (let p = 0; p < P; p++) addValue(level, i * P + p, stats[p]);
  const sv = STEP_VIEW(level);
  for (let j = 0; j < 2; j++) addValue(sv, i * 2 + j, perStep[j]);
  while (level.m > maxBins) coarsen(level);
}

/** Merge bins pairwise: the size doubles, the row alignment (bins start at multiples of the size) holds. */
export function coarsen(level) {
  const m = Math.ceil(level.m / 2), P = level.P;
  for (let i = 0; i < m; i++) {
    const a = 2 * i, b = a + 1 < level.m ? a + 1 : -1;
    copyBin(level, i, a);
    if (b >= 0) mergeBin(level, i, b);
  }
  level.m = m;
  level.size *= 2;
  for (let i = m; i < 2 * m; i++) { level.rows[i] = 0; level.first[i] = NaN; }
  level.min.fill(NaN, m * P); level.max.fill(NaN, m * P); level.mean.fill(NaN, m * P); level.last.fill(NaN, m * P);
  level.finite.fill(0, m * P); level.nf.fill(0, m * P);
  level.smin.fill(NaN, m * 2); level.smax.fill(NaN, m * 2); level.smean.fill(NaN, m * 2); level.slast.fill(NaN, m * 2);
  level.sfinite.fill(0, m * 2); level.snf.fill(0, m * 2);
}

function copyBin(level, to, from) {
  if (to === from) return;
  level.first[to] = level.first[from]; level.lastStep[to] = level.lastStep[from]; level.rows[to] = level.rows[from];
  for (const [n, w] of [[level.P, ["min", "max", "mean", "last", "finite", "nf"]], [2, ["smin", "smax", "smean", "slast", "sfinite", "snf"]]])
    for (const key of w) level[key].copyWithin(to * n, from * n, from * n + n);
}

function mergeBin(level, to, from) {
  if (!level.rows[from]) return;
  level.lastStep[to] = level.lastStep[from];
  level.rows[to] += level.rows[from];
  mergeValues(level, to, from, level.P);
  mergeValues(STEP_VIEW(level), to, from, 2);
}

function mergeValues(a, to, from, n) {
  const { nf, last, finite, min, max, mean } = a; // locals: the loop runs over every value of a bin (13,000 at 1,000 layers)
  for (let p = 0; p < n; p++) {
    const i = to * n + p, j = from * n + p;
    nf[i] |= nf[j];
    last[i] = last[j];
    const fa = finite[i], fb = finite[j];
    if (!fb) continue;
    if (!fa) { min[i] = min[j]; max[i] = max[j]; mean[i] = mean[j]; finite[i] = fb; continue; }
    if (min[j] < min[i]) min[i] = min[j];
    if (max[j] > max[i]) max[i] = max[j];
    mean[i] = (mean[i] * fa + mean[j] * fb) / (fa + fb);
    finite[i] = fa + fb;
  }
}

/** The bins [i0, i1) of `level` that hold rows [a, b) (at least one when they overlap it). */
export function binsOver(level, a, b) {
  const i0 = Math.max(0, Math.floor((a - level.r0) / level.size));
  const i1 = Math.min(level.m, Math.max(i0 + 1, Math.ceil((b - level.r0) / level.size)));
  return [i0, i1];
}

/** A running summary {min, max, sum, w, nf, last} that accumulate() adds bins or rows into (no allocation a cell). */
export const newAcc = () => ({ min: Infinity, max: -Infinity, sum: 0, w: 0, nf: 0, last: NaN });
export function resetAcc(acc) { acc.min = Infinity; acc.max = -Infinity; acc.sum = 0; acc.w = 0; acc.nf = 0; acc.last = NaN; return acc; }

/** Add bins [i0, i1) of `level`, value p (of n a bin: P, or 2 for the per-step statistics), into `acc`. The mean
 * weighs each bin by its finite values. */
export function accumulate(level, i0, i1, p, acc, step = false) {
  const n = step ? 2 : level.P;
  const mins = step ? level.smin : level.min, maxs = step ? level.smax : level.max, means = step ? level.smean : level.mean;
  const lasts = step ? level.slast : level.last, fin = step ? level.sfinite : level.finite, nfs = step ? level.snf : level.nf;
  for (let i = i0; i < i1; i++) {
    if (!level.rows[i]) continue;
    const x = i * n + p;
    acc.nf |= nfs[x];
    acc.last = lasts[x];
    const c = fin[x];
    if (!c) continue;
    if (mins[x] < acc.min) acc.min = mins[x];
    if (maxs[x] > acc.max) acc.max = maxs[x];
    acc.sum += means[x] * c; acc.w += c;
  }
  return acc;
}

/** Add one row's value v into `acc`. */
export function accumulateValue(acc, v) {
  acc.last = v;
  const c = codeOf(v);
  if (c) { acc.nf |= c; return acc; }
  if (v < acc.min) acc.min = v;
  if (v > acc.max) acc.max = v;
  acc.sum += v; acc.w++;
  return acc;
}

/** {min, max, mean, last, nf} of an accumulated summary (NaN where it saw no finite value). */
export function summary(acc) {
  return acc.w ? { min: acc.min, max: acc.max, mean: acc.sum / acc.w, last: acc.last, nf: acc.nf } : { min: NaN, max: NaN, mean: NaN, last: acc.last, nf: acc.nf };
}

/** {min, max, mean, last, nf} over bins [i0, i1) of value p. */
export const summarise = (level, i0, i1, p, step = false) => summary(accumulate(level, i0, i1, p, newAcc(), step));

/** The value a heatmap cell shows for an accumulated summary: a non-finite value wins (+Inf, -Inf, then NaN: something went
 * wrong there), else the largest |value| (every watch statistic is >= 0: the max), so a spike is never averaged. */
export function shown(acc) {
  if (acc.nf & POS_INF) return Infinity;
  if (acc.nf & NEG_INF) return -Infinity;
  if (acc.nf & NAN || !acc.w) return NaN;
  return Math.abs(acc.min) > Math.abs(acc.max) ? acc.min : acc.max;
}

/** A level from the kernel's bins (a "lod" message or a page's overview): typed arrays of m bins, which the live
 * view goes on folding rows into. The kernel does not count finite values, so a bin's are taken as its rows (where
 * its max is a number); its non-finite flags (per layer, `nonfinite` m × L) cannot say which statistic held the
 * NaN/Inf, so cells are coloured by per-statistic codes of rows seen here only (the anomalies mark the others). */
export function levelFrom({ P, K, size, r0, first, lastStep, rows, min, max, mean, last, step, nonfinite }) {
  const m = rows.length;
  const col = (q) => { const o = new Float32Array(m * 2); for (let i = 0; i < m * 2; i++) o[i] = step[Math.floor(i / 2) * 8 + q * 2 + (i % 2)]; return o; };
  const counts = (hi, n) => { // a bin's rows where its max is a number (a loop a bin: 1.3 M values at 1,000 layers)
    const c = new Int32Array(m * n);
    for (let b = 0, i = 0; b < m; b++) for (let e = i + n, r = rows[b]; i < e; i++) c[i] = hi[i] === hi[i] ? r : 0;
    return c;
  };
  const smax = col(1);
  return { P, K, size, r0, m, cap: m, perStat: true, first: Float64Array.from(first), lastStep: Float64Array.from(lastStep),
    rows: Int32Array.from(rows), min, max, mean, last: last || Float32Array.from(max), finite: counts(max, P),
    smin: col(0), smax, smean: col(2), slast: col(3), sfinite: counts(smax, 2), nf: new Uint8Array(m * P), snf: new Uint8Array(m * 2),
    nfLayer: nonfinite || null };
}

/** A tracker of a level's complete bins, for figures of the whole run redrawn while rows stream (the colour scale,
 * the layers' Inf flags): `span(level, key)` says which bins [from, to) to add to the caller's running result since
 * its last call, and `reset` when that result must start over (another level, merged bins, another key). Bins before
 * the last never change until bins merge (foldRow writes the last), so each is added once; the last, still
 * filling, is the caller's to add afresh each time. The figure is then the same as from every bin, at the cost of
 * the new ones. */
export function completeBins() {
  let level = null, size = 0, key = null, done = 0;
  return (lv, k) => {
    const reset = lv !== level || lv.size !== size || k !== key;
    if (reset) { level = lv; size = lv.size; key = k; done = 0; }
    const from = done;
    done = Math.max(done, lv.m - 1);
    return { reset, from, to: done };
  };
}

/** bfloat16 (the upper half of a float32: its range, NaN and ±Inf, 3 significant digits) to float32. */
export function fromBfloat16(u16) {
  const u32 = new Uint32Array(u16.length);
  for (let i = 0; i < u16.length; i++) u32[i] = u16[i] << 16;
  return new Float32Array(u32.buffer);
}
