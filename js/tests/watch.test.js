import { beforeEach, describe, expect, it } from "vitest";
import { liveOf } from "../watch/index.js";
import { renderPage, storeFromData } from "../watch/standalone.js";
import { createStore } from "../watch/store.js";
import { bins, chooseScale, colourOf, INF_RGB, NAN_RGB, position, ZERO_RGB } from "../watch/scale.js";
import { columnOf, createWatchView, rowHeight } from "../watch/view.js";
import { fakeModel, rows, WATCH_META } from "./fake_model.js";

const EVIL = WATCH_META.layers[1];
const META = WATCH_META;

describe("store", () => {
  it("folds rows in order, reports a gap (dropping what follows it), fills it from a sync reply", () => {
    const st = createStore(META);
    expect(st.apply(...rows(0, 2))).toBe(false);
    expect(st.value(1, 2, 1)).toBe(1021);
    expect(st.stepValue(1, 0)).toBe(0.5);
    expect(st.apply(...rows(5, 3))).toBe(true); // rows 2..4 missing: the kernel resends from row 2 on a sync
    expect([st.n, st.have]).toEqual([2, 2]);
    expect(Number.isNaN(st.value(3, 0, 0))).toBe(true);
    expect(st.received(3)).toBe(false);
    expect(st.apply(...rows(2, 6))).toBe(false);
    expect([st.n, st.have]).toEqual([8, 8]);
    expect(st.value(7, 1, 0)).toBe(7010);
    expect([0, 1, 2].map(st.stepOf)).toEqual([0, 2, 4]);
    expect(st.rowOf(14)).toBe(7);
  });

  it("appends anomalies from a_start, and asks for the ones it missed", () => {
    const st = createStore(META);
    st.apply(...rows(0, 1, { anomalies: [[0, "loss", "spike"]] }));
    st.apply(...rows(1, 1, { a_start: 1, anomalies: [[2, "fc1", "non-finite δ"]] }));
    expect(st.anomalies).toEqual([[0, "loss", "spike"], [2, "fc1", "non-finite δ"]]);
    expect(st.apply(...rows(2, 1, { a_start: 5, anomalies: [[4, "loss", "x"]] }))).toBe(true);
    expect(st.anomalyMap().get(2)).toEqual([["fc1", "non-finite δ"]]);
  });
});

describe("scale", () => {
  it("goes log where values span decades, linear otherwise", () => {
    expect(chooseScale([1e-6, 1e-3, 1, NaN, Infinity]).log).toBe(true);
    expect(chooseScale([1, 2, 50]).log).toBe(false);
    expect(chooseScale([-1, 1e6]).log).toBe(false); // negative values: no log
    expect(chooseScale([NaN]).empty).toBe(true);
  });

  it("colours NaN, ±Inf and log-scale zeros apart from the map", () => {
    const s = chooseScale([1e-4, 1]);
    expect(colourOf(NaN, s)).toEqual(NAN_RGB);
    expect(colourOf(Infinity, s)).toEqual(INF_RGB);
    expect(colourOf(0, s)).toEqual(ZERO_RGB);
    expect(position(1e-2, s)).toBeCloseTo(0.5);
    expect(colourOf(1e-4, s)).not.toEqual(colourOf(1, s));
  });

  it("bins rows into columns", () => {
    expect(bins(3, 10)).toEqual([[0, 1], [1, 2], [2, 3]]);
    const b = bins(10, 4);
    expect(b.length).toBe(4);
    expect(b[0][0]).toBe(0);
    expect(b[3][1]).toBe(10);
    for (let r = 0; r < 10; r++) { const c = columnOf(r, 10, 4); expect(b[c][0] <= r && r < b[c][1]).toBe(true); }
    expect(rowHeight(3)).toBe(18);
    expect(rowHeight(1000)).toBe(3);
  });
});

describe("view", () => {
  let el;
  beforeEach(() => { document.body.innerHTML = ""; el = document.createElement("div"); document.body.append(el); });

  it("shows the count of non-finite steps after a stretch's onset, as Python counted them", () => {
    const store = createStore(META);
    const view = createWatchView({ store, el, openTrace: async () => ({ ok: true }) });
    store.apply(...rows(0, 2, { anomalies: [[2, EVIL, "non-finite from here on"]], nonfinite: [[2, 0]] }));
    view.redraw();
    expect(el.querySelector('[data-testid="watch-nonfinite-after"]')).toBeNull();
    store.apply(...rows(2, 3, { a_start: 1, anomalies: [], nonfinite: [[2, 3]] }));
    view.redraw();
    expect(store.nonfinite.get(2)).toBe(3);
    expect(el.querySelector('li[data-step="2"] [data-testid="watch-nonfinite-after"]').textContent).toBe(" · then 3 more non-finite steps");
  });

  it("shows layer names as text, the counts, latest values and kept steps; grows with new rows", () => {
    const store = createStore(META);
    const opened = [];
    const view = createWatchView({ store, el, openTrace: async (step) => { opened.push(step); return { ok: true }; } });
    store.apply(...rows(0, 2, { kept: [0, 2], anomalies: [[2, EVIL, "non-finite δ (first in backward order)"]] }));
    view.redraw();
    const labels = [...el.querySelectorAll(".hw-w-label")].map((n) => n.textContent);
    expect(labels).toEqual(["fc1", EVIL, "fc2"]);
    expect(el.querySelector("img")).toBeNull();
    expect(el.querySelector('[data-testid="watch-heatmap"]').dataset.steps).toBe("2");
    expect(el.querySelector('[data-testid="watch-summary"]').textContent).toBe("3 layers · 2 steps recorded (of 4) · 1 anomaly");
    expect([...el.querySelectorAll(".hw-w-value")].slice(0, 3).map((n) => n.textContent)).toEqual(["1,000", "1,010", "1,020"]);
    const kept = [...el.querySelectorAll("[data-kept-step]")];
    expect(kept.map((b) => b.dataset.keptStep)).toEqual(["0", "2"]);
    expect(kept[1].textContent).toContain(EVIL);
    expect(kept[1].className).toContain("anomalous");
    kept[1].click();
    expect(opened).toEqual([2]);
    // A click on the heatmap column of a kept step opens it too (the first column: step 0).
    el.querySelector('[data-testid="watch-heatmap"]').dispatchEvent(new MouseEvent("click", { clientX: 3, clientY: 3, bubbles: true }));
    expect(opened).toEqual([2, 0]);
    expect(el.querySelector('[data-testid="watch-loss-range"]').textContent).toBe("0.5 … 1");
    store.apply(...rows(2, 3));
    view.redraw();
    expect(el.querySelector('[data-testid="watch-heatmap"]').dataset.steps).toBe("5");
    el.querySelector('[data-testid="watch-stat"]').value = "delta_norm";
    el.querySelector('[data-testid="watch-stat"]').dispatchEvent(new Event("change"));
    expect(el.querySelector(".hw-w-value").textContent).toBe("4,001");
    expect(globalThis.__pwned).toBeUndefined();
  });
});

describe("many layers", () => {
  it("folds repeated blocks into rows that expand on a click; many rows write every k-th name, hide the sparklines", () => {
    const meta = { ...META, layers: Array.from({ length: 70 }, (_, i) => `h.${i}`) };
    const el = document.createElement("div");
    const store = createStore(meta);
    const view = createWatchView({ store, el, openTrace: async () => ({ ok: true }) });
    let labels = [...el.querySelectorAll(".hw-w-label")];
    expect(labels.map((n) => n.textContent)).toEqual(["▾ h.0 … h.69 (70 blocks, 70 layers)", "▸ h.0 … h.49 (50 layers)", "▸ h.50 … h.69 (20 layers)"]);
    expect(labels.map((n) => n.dataset.layers)).toEqual(["70", "50", "20"]);
    labels[1].click(); // expand the first 50
    labels = [...el.querySelectorAll(".hw-w-label")];
    expect(labels.length).toBe(53);
    expect(view.rows.slice(2, 4).map((r) => r.layers)).toEqual([[0], [1]]);
    expect(labels.filter((n) => n.textContent).length).toBeLessThan(30); // every k-th name: each readable
    expect(labels.slice(2).every((n) => n.title.startsWith("h."))).toBe(true);
    const grid = el.querySelector(".hw-w-grid");
    expect(grid.className).toContain("no-spark");
    expect(grid.children.length % 4).toBe(0); // every row keeps its four cells: the grid places by order
    labels[1].click(); // fold it again
    expect(el.querySelectorAll(".hw-w-label").length).toBe(3);
  });
});

describe("live model", () => {
  it("keeps rows that arrive before a view, asks once for missed ones, opens a kept step on request", async () => {
    const model = fakeModel({ meta: META, state: "open", trace_model: "", trace_step: -1 });
    const { store } = liveOf(model);
    expect(model.sent).toEqual([expect.objectContaining({ type: "sync", have: 0 })]);
    model.emit("msg:custom", ...rows(3, 2)); // a push before the sync reply: stored, no second sync
    expect(model.sent.length).toBe(1);
    model.emit("msg:custom", ...rows(0, 5)); // the sync reply
    expect([store.n, store.have]).toEqual([5, 5]);
    model.emit("msg:custom", ...rows(7, 1)); // a new gap: one more sync
    expect(model.sent.at(-1)).toEqual(expect.objectContaining({ type: "sync", have: 5 }));
    expect(liveOf(model).store).toBe(store); // one store per model
  });
});

describe("standalone page data", () => {
  it("decodes the inlined overview (bfloat16) and full-resolution segments (float32)", () => {
    const [msg, bufs] = rows(0, 3, { kept: [0, 4], anomalies: [[4, "loss", "spike"]] });
    const P = META.layers.length * META.stats.length;
    const b64 = (a) => btoa(String.fromCharCode(...new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));
    const f64 = (dv) => new Float64Array(dv.buffer.slice(dv.byteOffset, dv.byteOffset + dv.byteLength));
    const stats = Float32Array.from(f64(bufs[0])), step = Float32Array.from(f64(bufs[1]));
    // One bin of the 3 rows: min, max, mean as bfloat16 (the upper half of a float32: 2011 reads 2008).
    const col = (f) => { const o = new Float32Array(P); for (let p = 0; p < P; p++) o[p] = f([0, 1, 2].map((r) => stats[r * P + p])); return o; };
    const bf16 = (a) => new Uint16Array(new Uint32Array(a.buffer).map((u) => u >>> 16));
    const sum = (v) => v.reduce((x, y) => x + y, 0);
    const overview = { size: 4, first: [0], last_step: [4], rows: [3], min: b64(bf16(col((v) => Math.min(...v)))), max: b64(bf16(col((v) => Math.max(...v)))),
      mean: b64(bf16(col((v) => sum(v) / 3))), step: b64(new Float32Array([1 / 3, 1, 11 / 18, 1 / 3, 0, 2, 1, 2])) };
    const data = { meta: META, n_rows: 3, overview, segments: [{ start: 2, steps: [4], stats: b64(stats.subarray(2 * P)), step_stats: b64(step.subarray(4)) }],
      held: "this page holds …", anomalies: msg.anomalies, kept: msg.kept, dropped: 0, state: "closed", traces: {} };
    const store = storeFromData(data);
    expect(store.value(2, 1, 1)).toBe(2011); // the segment: exact
    expect(Number.isNaN(store.value(1, 1, 1))).toBe(true); // row 1 is held in the bin only
    expect(store.overview.max[1 * 2 + 1]).toBe(2008); // bfloat16 of 2011: 8 significant bits
    expect(store.state).toBe("closed");
    expect([store.stepOf(0), store.stepOf(2), store.rowOf(4)]).toEqual([0, 4, 2]);
    const el = document.createElement("div");
    renderPage(data, el, "");
    expect(el.querySelector('[data-testid="watch-heatmap"]').dataset.steps).toBe("3");
    expect(el.querySelector('[data-testid="watch-held"]').textContent).toBe("this page holds …");
    expect(el.querySelector('[data-testid="watch-marks"]').dataset.anomalies).toBe("1");
  });
});
