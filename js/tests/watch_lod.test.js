import { beforeEach, describe, expect, it } from "vitest";
import { accumulate, coarsen, completeBins, createLevel, foldRow, fromBfloat16, levelFrom, NAN, newAcc, POS_INF, shown, summarise } from "../watch/bins.js";
import { initialExpanded, layerTree, visibleRows } from "../watch/groups.js";
import { createStore, TAIL, tailRows } from "../watch/store.js";
import { createWatchView } from "../watch/view.js";

// References: plain loops over the rows (min/max/mean over the finite values), never the code under test.
function reference(values, a, b) {
  const fin = values.slice(a, b).filter(Number.isFinite);
  return fin.length ? { min: Math.min(...fin), max: Math.max(...fin), mean: fin.reduce((x, y) => x + y, 0) / fin.length } : { min: NaN, max: NaN, mean: NaN };
}
const f32 = (v) => Math.fround(v);
const rand = (seed) => () => { seed = (seed * 1103515245 + 12345) % 2 ** 31; return seed / 2 ** 31; };

describe("bins", () => {
  it("fold rows into power-of-two bins equal to plain loops, and keep them equal as pairs merge", () => {
    const r = rand(3), n = 1000, P = 3;
    const vals = Array.from({ length: n * P }, () => f32(r() * 10));
    vals[417 * P + 1] = f32(5000); // a spike
    vals[600 * P + 2] = NaN;
    vals[601 * P + 2] = Infinity;
    const level = createLevel(P);
    for (let i = 0; i < n; i++) foldRow(level, i, 10 * i, vals.slice(i * P, i * P + P), [f32(1 / (i + 1)), f32(i)], 64);
    expect(level.size).toBe(16); // 1000 rows in at most 64 bins of a power-of-two size
    expect(level.m).toBe(63);
    for (let i = 0; i < level.m; i++) {
      const a = i * 16, b = Math.min(n, a + 16);
      expect([level.first[i], level.lastStep[i], level.rows[i]]).toEqual([10 * a, 10 * (b - 1), b - a]);
      for (let p = 0; p < P; p++) {
        const want = reference(vals.filter((_, j) => j % P === p), a, b), got = summarise(level, i, i + 1, p);
        expect([got.min, got.max]).toEqual([want.min, want.max]);
        expect(got.mean).toBeCloseTo(want.mean, 4);
      }
    }
    // Rows 400..431 as one column: the spike is its max, never averaged away.
    const acc = accumulate(level, 25, 27, 1, newAcc());
    expect(shown(acc)).toBe(5000);
    // The NaN and the Inf of value 2 at rows 600 and 601 (bin 37): coded, and an Inf wins the cell.
    expect(summarise(level, 37, 38, 2).nf).toBe(NAN | POS_INF);
    expect(shown(accumulate(level, 37, 38, 2, newAcc()))).toBe(Infinity);
    expect(Number.isNaN(shown(accumulate(level, 37, 38, 1, newAcc())))).toBe(false);
    // The per-step statistics fold the same way.
    const s = summarise(level, 0, 1, 1, true);
    expect([s.min, s.max, s.mean]).toEqual([0, 15, 7.5]);
  });

  it("coarsen merges neighbouring bins exactly (a bin of 2s is the union of two of s)", () => {
    const level = createLevel(1, 1);
    const vals = [3, 1, 4, 1, 5, 9, 2];
    vals.forEach((v, i) => foldRow(level, i, i, [v], [v, v]));
    coarsen(level);
    expect([level.size, level.m, [...level.rows.slice(0, 4)]]).toEqual([2, 4, [2, 2, 2, 1]]);
    expect([0, 1, 2, 3].map((i) => summarise(level, i, i + 1, 0)).map((x) => [x.min, x.max, x.mean, x.last]))
      .toEqual([[1, 3, 2, 1], [1, 4, 2.5, 1], [5, 9, 7, 9], [2, 2, 2, 2]]);
  });

  it("reads bfloat16 as the upper half of a float32: range, NaN and ±Inf kept", () => {
    const x = new Float32Array([1.5, -2, 1e30, Infinity, -Infinity, NaN, 2 ** 18]); // 2 ** 18: over float16's 65,504
    const u16 = new Uint16Array(new Uint32Array(x.buffer).map((u) => u >>> 16));
    const back = fromBfloat16(u16);
    expect([back[0], back[1], back[3], back[4], back[6]]).toEqual([1.5, -2, Infinity, -Infinity, 2 ** 18]);
    expect(Number.isNaN(back[5])).toBe(true);
    expect(Math.abs(back[2] - 1e30) / 1e30).toBeLessThan(1 / 128);
  });
});

const META = { layers: ["a.0.x", "a.0.y", "a.1.x", "a.1.y", "a.2.x", "a.2.y", "head"], stats: ["grad_norm", "lr"], step_stats: ["loss", "grad_norm"], every: 1 };
const L = META.layers.length, K = META.stats.length;
/** Rows [start, start + count) as the kernel streams them (float32): value = r + l / 10 (+1000 at row 3000, layer 4). */
function rowsMsg(start, count, extra = {}) {
  const s = new Float32Array(count * L * K), t = new Float32Array(count * 2);
  for (let i = 0; i < count; i++) {
    const r = start + i;
    for (let l = 0; l < L; l++) for (let k = 0; k < K; k++) s[(i * L + l) * K + k] = r + l / 10 + (r === 3000 && l === 4 && k === 0 ? 1000 : 0);
    t[i * 2] = 1; t[i * 2 + 1] = r;
  }
  return [{ type: "rows", start, count, dtype: "float32", steps: Array.from({ length: count }, (_, i) => start + i), a_start: 0, anomalies: [], kept: [], dropped: 0, total_steps: start + count, state: "open", ...extra },
    [new DataView(s.buffer), new DataView(t.buffer)]];
}

describe("a figure of the whole run kept up while rows stream (completeBins)", () => {
  it("adds each complete bin once and the filling one afresh: the same as from every bin, across merges", () => {
    const P = 2, level = createLevel(P), span = completeBins(), r = rand(11);
    let done = -Infinity, added = 0, plain = -Infinity;
    for (let row = 0; row < 5000; row++) {
      const v = f32(r() * 100 + (row === 1234 ? 1e4 : 0)), stats = Float32Array.of(v, -v);
      foldRow(level, row, row, stats, Float32Array.of(0, 0), 64);
      plain = Math.max(plain, v); // plain reading: the largest value streamed so far
      if (row % 37) continue;
      const s = span(level, 0);
      if (s.reset) done = -Infinity;
      for (let i = s.from; i < s.to; i++) { done = Math.max(done, level.max[i * P]); added++; }
      expect(Math.max(done, level.max[(level.m - 1) * P])).toBe(plain);
    }
    expect(level.size).toBeGreaterThan(32); // bins merged many times on the way
    expect(added).toBeLessThan(64 * 8); // about once a bin per bin size, not m bins a call (135 calls)
  });
});

describe("the kernel's bins", () => {
  it("count a bin's rows as its finite values where its max is a number, none where it is NaN", () => {
    const rows = [4, 2, 3], P = 2, f = (xs) => Float32Array.from(xs);
    const max = f([1, NaN, 5, 6, NaN, NaN]), step = f([0, 0, NaN, NaN, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 3, 3, 3, 3, 0, 0, 0, 0]);
    const lv = levelFrom({ P, K: 1, size: 4, r0: 0, first: [0, 4, 8], lastStep: [3, 5, 10], rows, min: max, max, mean: max, last: null, step, nonfinite: null });
    expect(Array.from(lv.finite)).toEqual([4, 0, 2, 2, 0, 0]); // plain reading: rows[b] where max[b, p] is a number
    expect(Array.from(lv.sfinite)).toEqual([0, 0, 2, 2, 3, 3]); // the per-step max (the second of 4 pairs a bin) NaN in bin 0
  });
});

describe("the live store", () => {
  it("holds a bounded amount whatever the run's length: the overview's bins and the last TAIL to 2 × TAIL rows", () => {
    const st = createStore(META);
    for (let r = 0; r < 10_000; r += 500) st.apply(...rowsMsg(r, 500));
    expect(st.n).toBe(10_000);
    expect(st.overview.m).toBeLessThanOrEqual(2048);
    expect(st.overview.size).toBe(8);
    expect(st.received(10_000 - TAIL)).toBe(true);
    expect(st.received(10_000 - 2 * TAIL - 1)).toBe(false);
    expect(st.value(9999, 6, 0)).toBe(f32(9999.6));
    // The spike at row 3000 (layer 4) lives on in its bin's max, and the source for a column over it says bins.
    const src = st.source(2990, 3010, 0);
    expect(src.size).toBe(8);
    expect(shown(st.acc(src, 4, 0, newAcc()))).toBe(f32(3000.4 + 1000));
    expect(st.rowOf(3003)).toBe(3003);
    expect(st.stepOf(3003)).toBe(3003);
  });

  it("keeps the latest rows exact through the tail's compactions, in buffers that stop being reallocated", () => {
    const st = createStore(META), cap = 2 * tailRows(L * K), bufs = new Set();
    let r = 0;
    for (const count of [1, 7, 1, 300, 1, 1, 1000, 3, 1200, 1, 5, 2047, 2, 9]) {
      for (let i = 0; i < 40; i++, r += count) {
        st.apply(...rowsMsg(r, count));
        const seg = st.segmentOf(r + count - 1);
        expect(seg.n).toBeLessThanOrEqual(cap);
        expect(seg.n).toBeGreaterThanOrEqual(Math.min(r + count, tailRows(L * K)));
        if (seg.stats.length === cap * L * K) bufs.add(seg.stats);
        for (const q of [seg.r0, seg.r0 + (seg.n >> 1), r + count - 1]) // what rowsMsg sent for row q
          for (const l of [0, L - 1]) expect(st.value(q, l, 1)).toBe(f32(q + l / 10));
        expect(st.stepOf(r + count - 1)).toBe(r + count - 1);
      }
    }
    expect(bufs.size).toBe(1); // once grown to 2 × tailRows rows, the same buffer for every later message
  });

  it("holds fewer latest rows where a row is wide: 16 MiB of them, 32 at most", () => {
    expect(tailRows(1000 * 13) * 1000 * 13 * 4).toBeLessThanOrEqual(16 * 2 ** 20);
    expect((tailRows(1000 * 13) + 1) * 1000 * 13 * 4).toBeGreaterThan(16 * 2 ** 20);
    expect(tailRows(10)).toBe(TAIL);
  });

  it("takes a zoomed window's full-resolution rows (one statistic) and draws those columns from them", () => {
    const st = createStore(META);
    for (let r = 0; r < 10_000; r += 1000) st.apply(...rowsMsg(r, 1000));
    const n = 100, a = 2950, vals = new Float32Array(n * L), step = new Float32Array(n * 2);
    for (let i = 0; i < n; i++) for (let l = 0; l < L; l++) vals[i * L + l] = a + i + l / 10 + (a + i === 3000 && l === 4 ? 1000 : 0);
    st.applyLod({ type: "lod", role: "window", start: a, stop: a + n, bins: 800, stat: 0, size: 1, first: Array.from({ length: n }, (_, i) => a + i), last_step: [], rows: Array(n).fill(1), nonfinite: "none" },
      [new DataView(vals.buffer), new DataView(step.buffer)]);
    expect(st.source(a, a + n, 0).size).toBe(1);
    expect(st.source(a, a + n, 1).size).toBe(8); // the window holds grad_norm only
    expect(st.value(3000, 4, 0)).toBe(f32(4000.4));
    expect(Number.isNaN(st.value(3000, 4, 1))).toBe(true);
  });
});

describe("a heatmap column", () => {
  it("columnShown gives each layer's cell as shown() of its summary, from bins and from rows, NaN and ±Inf included", () => {
    const st = createStore(META);
    const [msg, bufs] = rowsMsg(0, 64);
    const s = new Float32Array(bufs[0].buffer);
    s[(10 * L + 2) * K] = NaN; s[(11 * L + 3) * K] = Infinity; s[(12 * L + 4) * K] = -Infinity; s[(13 * L + 4) * K] = NaN;
    st.apply(msg, bufs);
    for (const src of [st.source(8, 16, 0), { level: st.overview, range: [0, 64], size: 1 }]) {
      const out = st.columnShown(src, 0, new Float64Array(L));
      for (let l = 0; l < L; l++) expect(out[l]).toBe(shown(st.acc(src, l, 0, newAcc())));
    }
    const rows = st.columnShown(st.source(8, 16, 0), 0, new Float64Array(L));
    expect([rows[1], rows[2], rows[3], rows[4]]).toEqual([f32(15.1), NaN, Infinity, -Infinity]);
  });
});

describe("the view at scale", () => {
  let el;
  beforeEach(() => { document.body.innerHTML = ""; el = document.createElement("div"); document.body.append(el); });

  it("asks the kernel for a zoomed window coarser than its pixels, once, and marks anomalies and kept steps at every zoom", () => {
    const st = createStore(META);
    const asked = [];
    const view = createWatchView({ store: st, el, openTrace: async () => ({ ok: true }), requestWindow: (w) => asked.push(w) });
    for (let r = 0; r < 10_000; r += 1000) st.apply(...rowsMsg(r, 1000, { a_start: r ? 2 : 0, anomalies: r ? [] : [[3000, "a.2.x", "spike"], [7001, "loss", "spike"]], kept: [3000, 9999] }));
    view.redraw();
    const marks = el.querySelector('[data-testid="watch-marks"]');
    expect(marks.dataset.anomalies).toBe("2");
    expect(asked).toEqual([]); // all steps: the overview's bins are finer than the columns
    view.setView({ v0: 2950, v1: 3050 });
    expect(marks.dataset.anomalies).toBe("1"); // 7001 is out of the zoomed range
    expect(asked).toEqual([{ start: 2950, stop: 3050, bins: 100, stat: 0 }]);
    view.redraw();
    expect(asked.length).toBe(1);
    expect(el.querySelector('[data-testid="watch-resolution"]').textContent).toContain("bins of 8 rows");
    view.setView({ v0: 9900, v1: 10_000 }); // the latest steps: held at full resolution, nothing to ask
    expect(asked.length).toBe(1);
    expect(el.querySelector('[data-testid="watch-resolution"]').textContent).toBe("drawn at full resolution: a column a step");
    expect(view.shownValues(6).slice(0, 2).map((c) => [c.first, c.size, c.value])).toEqual([[9900, 1, f32(9900.6)], [9901, 1, f32(9901.6)]]);
  });

  it("shows a block row as the largest value over its layers", () => {
    const st = createStore(META);
    const view = createWatchView({ store: st, el, openTrace: async () => ({ ok: true }) });
    st.apply(...rowsMsg(0, 3));
    view.redraw();
    const block = view.rows.findIndex((r) => r.label.startsWith("a.0 … a.2"));
    expect(view.rows[block].layers).toEqual([0, 1, 2, 3, 4, 5]);
    expect([...el.querySelectorAll(".hw-w-value")][block].textContent).toBe("2.5"); // max over a.*.*: layer 5 (2 + 5 / 10) at row 2
  });
});

describe("groups", () => {
  it("fold numbered blocks as the explorer does, a chain of 1,000 layers into 50s, and open a level at a time", () => {
    const names = ["wte", ...Array.from({ length: 24 }, (_, b) => ["attn.q", "attn.k", "mlp.fc"].map((x) => `h.${b}.${x}`)).flat(), "head"];
    const tree = layerTree(names);
    const rows = visibleRows(tree, initialExpanded(tree));
    expect(rows.map((r) => r.label).slice(0, 3)).toEqual(["wte", "h.0 … h.23 (24 blocks, 72 layers)", "h.0 (3 layers)"]);
    expect(rows.length).toBe(27);
    expect(rows.every((r) => r.layers.length >= 1)).toBe(true);
    const chain = layerTree(Array.from({ length: 1000 }, (_, i) => `layers.${i}`));
    const top = visibleRows(chain, initialExpanded(chain));
    expect(top.length).toBe(21);
    expect(top[1].label).toBe("layers.0 … layers.49 (50 layers)");
    expect(new Set(top.slice(1).flatMap((r) => r.layers)).size).toBe(1000);
  });
});
