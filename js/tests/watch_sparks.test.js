import { describe, expect, it } from "vitest";
import { completeBins, summary } from "../watch/bins.js";
import { blockValue, infiniteRows, rowsOverColumns } from "../watch/sparks.js";
import { createStore } from "../watch/store.js";

// References: plain loops over the rows the test made (min/max/mean over finite values, NaN/±Inf codes), never the
// code under test.
const META = { layers: ["b.0.x", "b.0.y", "b.1.x", "b.1.y", "b.2.x", "head"], stats: ["grad_norm", "grad_nan", "grad_inf"], step_stats: ["loss", "grad_norm"], every: 1 };
const L = META.layers.length, K = META.stats.length, f32 = Math.fround;
const ROWS = [{ layers: [0, 1, 2, 3, 4, 5] }, { layers: [0, 1] }, { layers: [2, 3, 4] }, { layers: [5] }];

/** value(r, l, k) of the test's run: smooth, with NaN, an overflow (+Inf, counts 0) and a real +Inf (counts > 0). */
function value(r, l, k) {
  if (k === 1) return r === 31 && l === 3 ? 2 : 0; // grad_nan: layer 3 had NaN entries at row 31
  if (k === 2) return 0;
  if (r === 17 && l === 1) return NaN;
  if (r === 23 && l === 4) return Infinity; // an overflowed norm: its counts are 0
  if (r === 31 && l === 3) return Infinity; // a real one
  return f32(1 + r / 7 + l * 0.3 + ((r * 7 + l) % 5) * 0.01);
}

function streamed(n) {
  const st = createStore(META), s = new Float32Array(n * L * K), t = new Float32Array(n * 2);
  for (let r = 0; r < n; r++) for (let l = 0; l < L; l++) for (let k = 0; k < K; k++) s[(r * L + l) * K + k] = value(r, l, k);
  st.apply({ type: "rows", start: 0, count: n, dtype: "float32", steps: Array.from({ length: n }, (_, i) => i), a_start: 0, anomalies: [], kept: [], dropped: 0, total_steps: n, state: "open" },
    [new DataView(s.buffer), new DataView(t.buffer)]);
  return st;
}

function reference(layers, a, b, k) {
  let mn = Infinity, mx = -Infinity, sum = 0, w = 0, nf = 0;
  for (let r = a; r < b; r++) for (const l of layers) {
    const v = value(r, l, k);
    if (Number.isNaN(v)) nf |= 1; else if (v === Infinity) nf |= 2; else if (v === -Infinity) nf |= 4;
    else { mn = Math.min(mn, v); mx = Math.max(mx, v); sum += v; w++; }
  }
  return w ? { min: mn, max: mx, mean: sum / w, nf } : { min: NaN, max: NaN, mean: NaN, nf };
}

describe("rows of many layers", () => {
  it("sum each row's layers over full-resolution columns as plain loops over the rows do", () => {
    const st = streamed(40), cols = [[0, 10], [10, 24], [24, 40], [31, 32]];
    const got = rowsOverColumns(st, cols.map(([a, b]) => st.source(a, b, 0)), ROWS, 0);
    expect(cols.every(([a, b]) => st.source(a, b, 0).size === 1)).toBe(true);
    ROWS.forEach((row, i) => cols.forEach(([a, b], c) => {
      const want = reference(row.layers, a, b, 0), s = summary(got[i][c]);
      expect([s.min, s.max, s.nf]).toEqual([want.min, want.max, want.nf]);
      expect(s.mean).toBeCloseTo(want.mean, 12);
      expect(s.last).toBe(value(b - 1, row.layers.at(-1), 0)); // the last row of the row's last layer
    }));
  });

  it("sum each row's layers over bins (a longer run's overview) as plain loops over the bins' rows do", () => {
    const st = streamed(5000), o = st.overview;
    expect(o.size).toBeGreaterThan(1); // rows merged into bins: the source below is bins, not rows
    const cols = [[0, o.size * 3], [o.size * 3, o.size * 10], [o.size * 10, 5000]];
    const got = rowsOverColumns(st, cols.map(([a, b]) => st.source(a, b, 0, { level: o })), ROWS, 0);
    ROWS.forEach((row, i) => cols.forEach(([a, b], c) => {
      const want = reference(row.layers, a, b, 0), s = summary(got[i][c]);
      expect([s.min, s.max, s.nf]).toEqual([f32(want.min), f32(want.max), want.nf]);
      expect(s.mean).toBeCloseTo(want.mean, 4); // bins hold float32 means
    }));
  });

  it("flag the rows that held a real ±Inf, not an overflowed norm whose counts say its entries were finite", () => {
    const st = streamed(40);
    expect(infiniteRows(st, ROWS, 0, [1, 2])).toEqual([true, false, true, false]); // layer 3's real Inf; 4's overflow
    expect(infiniteRows(st, ROWS, 0, [])).toEqual([true, false, true, false]); // no counts: any Inf (layers 3, 4)
    expect(infiniteRows(st, [{ layers: [4] }], 0, [1, 2])).toEqual([false]);
    expect(infiniteRows(st, [{ layers: [4] }], 0, [])).toEqual([true]);
  });

  it("flag them the same while rows stream a few at a time, looking at each complete bin once", () => {
    const st = createStore(META), memo = { span: completeBins(), bad: null }, n = 3000;
    const s = new Float32Array(L * K), t = new Float32Array(2);
    let seen = 0;
    const span = memo.span;
    memo.span = (o, k) => { const r = span(o, k); seen += r.to - r.from; return r; };
    for (let r = 0; r < n; r++) {
      for (let l = 0; l < L; l++) for (let k = 0; k < K; k++) s[l * K + k] = value(r % 40 === 31 ? 31 : r % 40 === 23 ? 23 : 1, l, k);
      st.apply({ type: "rows", start: r, count: 1, dtype: "float32", steps: [r], a_start: 0, anomalies: [], kept: [], dropped: 0, total_steps: r + 1, state: "open" }, [new DataView(s.buffer.slice(0)), new DataView(t.buffer)]);
      if (r % 97 !== 0 && r !== 31 && r !== 32 && r !== n - 1) continue;
      // Plain reading of the rows so far: layer 3 has a real Inf from row 31 on (its NaN count is 2), layer 4 an overflow.
      const want = ROWS.map((row) => row.layers.includes(3) && r >= 31);
      expect(infiniteRows(st, ROWS, 0, [1, 2], memo)).toEqual(want);
    }
    expect(st.overview.size).toBeGreaterThan(1); // bins merged on the way (the memo started over then)
    expect(seen).toBeLessThan(3 * st.overview.m + 200); // complete bins looked at about once, not once a call
  });

  it("give a block's cell: +Inf, then -Inf, then NaN win, else the largest |value|", () => {
    expect(blockValue([1, -5, 3], [0, 1, 2])).toBe(-5);
    expect(blockValue([1, NaN, -Infinity], [0, 1, 2])).toBe(-Infinity);
    expect(blockValue([Infinity, NaN, -Infinity], [1, 0, 2])).toBe(Infinity);
    expect(blockValue([1, NaN, 2], [0, 1, 2])).toBeNaN();
    expect(blockValue([1, NaN, 2], [2])).toBe(2);
  });
});
