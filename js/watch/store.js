// What the watch view holds of a run, bounded whatever its length: an overview (bins.js: the whole run in at most
// maxBinsFor(layers × statistics) bins, 48 MiB at most, each streamed row folded in as it arrives), the latest rows
// at full resolution (tailRows of them to twice that, 32 MiB at most, in buffers reused from message to message), and the
// window the user zoomed to (full-resolution rows, or finer bins, that the kernel answered from w.rows / w.lod).
// A standalone page's data fill the same: its overview, and the full-resolution segments it embeds (the last
// steps, around each anomaly and kept step). Rows streamed in order are folded by row index; a gap is reported
// so the caller asks the kernel for what it missed (a "sync" message).
import { decodeTensor } from "../shared/protocol.js";
import { accumulate, accumulateValue, binsOver, createLevel, foldRow, levelFrom, maxBinsFor, NAN, NEG_INF, POS_INF, reserve } from "./bins.js";

export const TAIL = 1024, TAIL_BYTES = 16 * 2 ** 20; // latest rows kept at full resolution: at most, and their memory
/** Latest rows the view holds at full resolution for P values a row: TAIL, fewer where they pass TAIL_BYTES (322
 * for 1,000 layers × 13 statistics), 64 at least; views/watch_widget.py tail_rows says the same (its sync). */
export const tailRows = (P) => Math.max(64, Math.min(TAIL, Math.floor(TAIL_BYTES / (4 * Math.max(P, 1)))));

export function createStore(meta) {
  const L = meta.layers.length, K = meta.stats.length, P = L * K, maxBins = maxBinsFor(P), TAIL_ROWS = tailRows(P);
  const listeners = new Set();
  let tail = null; // {r0, n, steps, stats, step}: the latest rows, tailRows(P) to 2 × tailRows(P) of them
  const store = {
    meta, L, K, P, n: 0, have: 0, anomalies: [], kept: [], dropped: 0, totalSteps: null, state: "open",
    overview: createLevel(P), segments: [], window: null, // window: {start, stop, bins, level | seg}
    /** Onset step of each non-finite stretch -> the non-finite steps counted after it (Python's w.nonfinite). */
    nonfinite: new Map(),
    /** The full-resolution rows holding row r (statistic k: a zoomed window may hold one only), or null. */
    segmentOf(r, k = null) {
      for (const s of allSegments()) if (r >= s.r0 && r < s.r0 + s.n && (k === null || s.k === undefined || s.k === k)) return s;
      return null;
    },
    /** Statistic k of layer l at row r (NaN where the row is not held at full resolution). */
    value(r, l, k) { const s = store.segmentOf(r, k); return s ? s.stats[((r - s.r0) * L + l) * s.K + (s.k === undefined ? k : 0)] : NaN; },
    /** Per-step statistic j (0 loss, 1 global gradient norm) at row r. */
    stepValue(r, j) { const s = store.segmentOf(r); return s ? s.step[(r - s.r0) * 2 + j] : NaN; },
    received: (r, k = null) => store.segmentOf(r, k) !== null,
    subscribe(fn) { listeners.add(fn); return () => listeners.delete(fn); },
    /** Apply a rows message (streamed or a sync reply); returns true when rows or anomalies before it are missing. */
    apply(msg, buffers = []) {
      const start = msg.start | 0, count = msg.count | 0, dtype = msg.dtype || "float64";
      let gap = start > store.have;
      if (count > 0 && !gap) {
        const stats = decodeTensor({ dtype, shape: [count * P] }, buffers[0]);
        const step = decodeTensor({ dtype, shape: [count * 2] }, buffers[1]);
        for (let i = Math.max(0, store.have - start); i < count; i++)
          foldRow(store.overview, start + i, msg.steps[i], stats.subarray(i * P, (i + 1) * P), step.subarray(i * 2, i * 2 + 2), maxBins);
        addTail(start, msg.steps, stats, step);
        store.have = Math.max(store.have, start + count);
        store.n = Math.max(store.n, store.have);
      }
      applyFacts(msg);
      const a0 = msg.a_start | 0, list = Array.isArray(msg.anomalies) ? msg.anomalies : [];
      if (a0 <= store.anomalies.length) store.anomalies.splice(a0, store.anomalies.length - a0, ...list);
      else gap = true;
      notify();
      return gap;
    },
    /** Apply a "lod" message: the kernel's overview of rows [0, stop) or the zoomed window's rows or bins. */
    applyLod(msg, buffers = []) {
      const { level, seg } = decodeLod(msg, buffers, L, K);
      if (msg.role === "overview") {
        store.overview = reserve(level, maxBins + 1); // the room the stream folds into, now: no 40 MB copy mid-stream
        store.have = Math.max(store.have, msg.stop);
        store.n = Math.max(store.n, msg.stop);
      } else {
        store.window = { start: msg.start, stop: msg.stop, bins: msg.bins, level, seg };
      }
      notify();
    },
    /** Where rows [a, b) of statistic k are drawn from: full-resolution rows when held, else the finest bins (the
     * zoomed window's, else the overview's). Given `base` (the source of the whole visible range), a column is
     * drawn from the same level, so one view never mixes resolutions (a bin's spike drawn beside exact rows). */
    source(a, b, k, base = null) {
      if (base?.seg) return { seg: base.seg, a, b, size: 1 };
      if (base?.level) return { level: base.level, range: binsOver(base.level, a, b), size: base.level.size };
      for (const s of allSegments()) if (a >= s.r0 && b <= s.r0 + s.n && (s.k === undefined || s.k === k)) return { seg: s, a, b, size: 1 };
      const w = store.window?.level, o = store.overview;
      if (w && (w.k === undefined || w.k === k) && a >= w.r0 && b <= w.r0 + w.size * w.m && w.size < o.size) return { level: w, range: binsOver(w, a, b), size: w.size };
      return { level: o, range: binsOver(o, a, b), size: o.size };
    },
    /** Add layer l's statistic k over a source's rows into `acc` (bins.js). */
    acc(src, l, k, acc) {
      const x = src.seg || src.level, p = x.k === undefined ? l * K + k : l;
      if (src.level) return accumulate(src.level, src.range[0], src.range[1], p, acc);
      const K1 = src.seg.K;
      for (let r = src.a; r < src.b; r++) accumulateValue(acc, src.seg.stats[(r - src.seg.r0) * K1 * L + p]);
      return acc;
    },
    /** Fill out[l] with the value a heatmap cell of layer l shows (bins.js shown) for statistic k over a source: the
     * heatmap's inner loop, one pass over the layers without a call per cell. */
    columnShown(src, k, out) {
      const x = src.seg || src.level, one = x.k !== undefined, stride = one ? L : P;
      for (let l = 0; l < L; l++) {
        const p = one ? l : l * K + k;
        let hi = -Infinity, lo = Infinity, nf = 0, any = false;
        if (src.level) {
          const lv = src.level;
          for (let i = src.range[0]; i < src.range[1]; i++) {
            if (!lv.rows[i]) continue;
            const q = i * stride + p;
            nf |= lv.nf[q];
            if (!lv.finite[q]) continue;
            any = true;
            if (lv.max[q] > hi) hi = lv.max[q];
            if (lv.min[q] < lo) lo = lv.min[q];
          }
        } else {
          const sg = src.seg, st = sg.K * L;
          for (let r = src.a; r < src.b; r++) {
            const v = sg.stats[(r - sg.r0) * st + p];
            if (v === v && v !== Infinity && v !== -Infinity) { any = true; if (v > hi) hi = v; if (v < lo) lo = v; }
            else nf |= v !== v ? 1 : v > 0 ? 2 : 4;
          }
        }
        out[l] = nf & 2 ? Infinity : nf & 4 ? -Infinity : nf & 1 || !any ? NaN : -lo > hi ? lo : hi;
      }
      return out;
    },
    /** Each layer's summary of statistic k over a source, what acc() adds up layer by layer, in one pass over the
     * layers: into `out` ({min, max, sum, w, nf, last}, typed arrays of L; see layerSums) and returned. */
    columnAcc(src, k, out) {
      const x = src.seg || src.level, one = x.k !== undefined, stride = one ? L : P;
      const { min, max, sum, w, nf, last } = out;
      min.fill(Infinity); max.fill(-Infinity); sum.fill(0); w.fill(0); nf.fill(0); last.fill(NaN);
      if (src.level) {
        const lv = src.level, mins = lv.min, maxs = lv.max, means = lv.mean, lasts = lv.last, fin = lv.finite, nfs = lv.nf;
        for (let i = src.range[0]; i < src.range[1]; i++) {
          if (!lv.rows[i]) continue;
          for (let l = 0, q = i * stride + (one ? 0 : k); l < L; l++, q += one ? 1 : K) {
            nf[l] |= nfs[q]; last[l] = lasts[q];
            const c = fin[q];
            if (!c) continue;
            if (mins[q] < min[l]) min[l] = mins[q];
            if (maxs[q] > max[l]) max[l] = maxs[q];
            sum[l] += means[q] * c; w[l] += c;
          }
        }
        return out;
      }
      const sg = src.seg, st = sg.K * L, stats = sg.stats;
      for (let r = src.a; r < src.b; r++) {
        for (let l = 0, q = (r - sg.r0) * st + (one ? 0 : k); l < L; l++, q += one ? 1 : K) {
          const v = stats[q];
          last[l] = v;
          if (v === v && v !== Infinity && v !== -Infinity) { if (v < min[l]) min[l] = v; if (v > max[l]) max[l] = v; sum[l] += v; w[l]++; }
          else nf[l] |= v !== v ? NAN : v > 0 ? POS_INF : NEG_INF;
        }
      }
      return out;
    },
    /** Add per-step statistic j over a source's rows into `acc`. */
    stepAcc(src, j, acc) {
      if (src.level) return accumulate(src.level, src.range[0], src.range[1], j, acc, true);
      for (let r = src.a; r < src.b; r++) accumulateValue(acc, src.seg.step[(r - src.seg.r0) * 2 + j]);
      return acc;
    },
    /** Step of row r: exact where held, else from the overview's bin (its first and last step, evenly spaced). */
    stepOf(r) {
      const s = store.segmentOf(r);
      if (s) return s.steps[r - s.r0];
      const o = store.overview, i = Math.floor((r - o.r0) / o.size);
      if (i < 0 || i >= o.m || !o.rows[i]) return NaN;
      const f = o.first[i], l = o.lastStep[i], n = o.rows[i];
      return n > 1 ? Math.round(f + ((l - f) * (r - o.r0 - i * o.size)) / (n - 1)) : f;
    },
    /** Row index of step `step` (or -1): exact where held, else the nearest row of the overview's bin holding it. */
    rowOf(step) {
      for (const s of allSegments()) {
        if (!s.n || step < s.steps[0] || step > s.steps[s.n - 1]) continue;
        const i = lowerBound(s.steps, step, s.n);
        if (s.steps[i] === step) return s.r0 + i;
      }
      const o = store.overview;
      const i = lowerBound(o.lastStep, step, o.m);
      if (i >= o.m || !o.rows[i] || o.first[i] > step) return -1;
      const f = o.first[i], l = o.lastStep[i], n = o.rows[i];
      return o.r0 + i * o.size + (n > 1 && l > f ? Math.round(((step - f) * (n - 1)) / (l - f)) : 0);
    },
    /** Anomalies by step: step -> [[where, reason], ...]. */
    anomalyMap() {
      const m = new Map();
      for (const [step, where, reason] of store.anomalies) {
        if (!m.has(step)) m.set(step, []);
        m.get(step).push([where, reason]);
      }
      return m;
    },
    /** Add full-resolution rows a page embeds (around anomalies, kept steps, the last steps). */
    addSegment(seg) { store.segments.push(seg); store.segments.sort((x, y) => x.r0 - y.r0); },
  };
  function allSegments() {
    const out = [...store.segments];
    if (store.window?.seg) out.push(store.window.seg);
    if (tail) out.push(tail);
    return out;
  }
  /** Append streamed rows to the tail. Its buffers grow to 2 × tailRows rows once, then are reused: past that the
   * latest rows move to the front (copyWithin, about once every tailRows rows), so a message never allocates. */
  function addTail(start, steps, stats, step) {
    const count = steps.length, cap = 2 * TAIL_ROWS;
    if (tail && start < tail.r0 + tail.n) return; // rows the tail already holds (a sync's overlap)
    if (!tail || start > tail.r0 + tail.n) tail = { r0: start, n: 0, K, steps: [], stats: tail?.stats || new Float32Array(0), step: tail?.step || new Float32Array(0) };
    const skip = Math.max(0, count - TAIL_ROWS), add = count - skip;
    if (skip) { tail.r0 = start + skip; tail.n = 0; tail.steps = []; }
    if (tail.n + add > cap) { // compact: the latest TAIL_ROWS - add rows to the front
      const keep = Math.min(tail.n, TAIL_ROWS - add), drop = tail.n - keep;
      tail.stats.copyWithin(0, drop * P, tail.n * P); tail.step.copyWithin(0, drop * 2, tail.n * 2);
      tail.steps = tail.steps.slice(drop); tail.r0 += drop; tail.n = keep;
    }
    if ((tail.n + add) * P > tail.stats.length) { // grow (doubling, up to cap rows)
      const rows = Math.min(cap, Math.max(2 * (tail.n + add), 2 * (tail.stats.length / P | 0), 16)); // a sync's 322 rows: all 644 at once
      const s = new Float32Array(rows * P), t = new Float32Array(rows * 2);
      s.set(tail.stats.subarray(0, tail.n * P)); t.set(tail.step.subarray(0, tail.n * 2));
      tail.stats = s; tail.step = t;
    }
    tail.stats.set(stats.subarray(skip * P, count * P), tail.n * P);
    tail.step.set(step.subarray(skip * 2, count * 2), tail.n * 2);
    for (let i = skip; i < count; i++) tail.steps.push(steps[i]);
    tail.n += add;
  }
  function applyFacts(msg) {
    if (Array.isArray(msg.nonfinite)) store.nonfinite = new Map(msg.nonfinite.map(([k, v]) => [k, v]));
    if (Array.isArray(msg.kept)) store.kept = msg.kept;
    if (typeof msg.dropped === "number") store.dropped = msg.dropped;
    if (msg.total_steps !== undefined) store.totalSteps = msg.total_steps;
    if (typeof msg.n_rows === "number") store.n = Math.max(store.n, msg.n_rows);
    if (msg.state) store.state = msg.state;
  }
  function notify() { for (const fn of listeners) fn(store); }
  return store;
}

/** Per-layer summaries for store.columnAcc: min, max, the sum of finite values and their count, the non-finite codes, the last value. */
export const layerSums = (L) => ({ min: new Float64Array(L), max: new Float64Array(L), sum: new Float64Array(L), w: new Float64Array(L), nf: new Uint8Array(L), last: new Float64Array(L) });

/** First index i < n with xs[i] >= x (n when none). */
function lowerBound(xs, x, n) {
  let lo = 0, hi = n;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (xs[mid] < x) lo = mid + 1; else hi = mid; }
  return lo;
}

/** A "lod" message's level (size > 1) or full-resolution segment (size 1), from its float32 buffers; `stat` set
 * when it holds that one statistic only (a zoomed window of the heatmap's statistic). */
export function decodeLod(msg, buffers, L, K) {
  const one = typeof msg.stat === "number", K1 = one ? 1 : K, P = L * K1, k = one ? msg.stat : undefined;
  const m = msg.rows.length, f32 = (i, n) => decodeTensor({ dtype: "float32", shape: [n] }, buffers[i]);
  if (msg.size === 1) return { seg: { r0: msg.start, n: m, K: K1, k, steps: msg.first, stats: f32(0, m * P), step: f32(1, m * 2) } };
  const nf = buffers[5] ? decodeTensor({ dtype: "uint8", shape: [m * L] }, buffers[5]) : null;
  const level = levelFrom({ P, K: K1, size: msg.size, r0: msg.start, first: msg.first, lastStep: msg.last_step, rows: msg.rows,
    min: f32(0, m * P), max: f32(1, m * P), mean: f32(2, m * P), last: f32(3, m * P), step: f32(4, m * 8), nonfinite: nf });
  level.k = k;
  return { level };
}
