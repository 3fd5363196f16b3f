import { beforeEach, describe, expect, it } from "vitest";
import { liveOf } from "../watch/index.js";
import { renderPage, storeFromData } from "../watch/standalone.js";
import { createStore } from "../watch/store.js";
import { bins, chooseScale, colourOf, INF_RGB, NAN_RGB, pick, position, ZERO_RGB } from "../watch/scale.js";
import { columnOf, createWatchView, rowHeight } from "../watch/view.js";
import { fakeModel, rows, WATCH_META } from "./fake_model.js";

const EVIL = WATCH_META.layers[1];
const META = WATCH_META;

describe("store", () => {
  it("places rows by index, reports a gap, fills it from a sync reply", () => {
    const st = createStore(META);
    expect(st.apply(...rows(0, 2))).toBe(false);
    expect(st.value(1, 2, 1)).toBe(1021);
    expect(st.stepValue(1, 0)).toBe(0.5);
    expect(st.apply(...rows(5, 3))).toBe(true); // rows 2..4 missing
    expect([st.n, st.have]).toEqual([8, 2]);
    expect(Number.isNaN(st.value(3, 0, 0))).toBe(true);
    expect(st.received(3)).toBe(false);
    expect(st.apply(...rows(2, 6))).toBe(false);
    expect([st.n, st.have]).toEqual([8, 8]);
    expect(st.value(7, 1, 0)).toBe(7010);
    expect(st.steps.slice(0, 3)).toEqual([0, 2, 4]);
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

  it("bins rows into columns and picks the value a bin shows", () => {
    expect(bins(3, 10)).toEqual([[0, 1], [1, 2], [2, 3]]);
    const b = bins(10, 4);
    expect(b.length).toBe(4);
    expect(b[0][0]).toBe(0);
    expect(b[3][1]).toBe(10);
    for (let r = 0; r < 10; r++) { const c = columnOf(r, 10, 4); expect(b[c][0] <= r && r < b[c][1]).toBe(true); }
    const v = [1, -5, 2, NaN, Infinity];
    expect(pick((r) => v[r], 0, 3)).toBe(-5);
    expect(Number.isNaN(pick((r) => v[r], 0, 4))).toBe(true);
    expect(pick((r) => v[r], 0, 5)).toBe(Infinity);
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
  it("writes every k-th name at a readable size, keeps the grid's cells, hides the sparklines", () => {
    const meta = { ...META, layers: Array.from({ length: 70 }, (_, i) => `h.${i}`) };
    const el = document.createElement("div");
    createWatchView({ store: createStore(meta), el, openTrace: async () => ({ ok: true }) });
    const labels = [...el.querySelectorAll(".hw-w-label")];
    expect(labels.length).toBe(70);
    expect(labels.map((n) => n.textContent).filter(Boolean)).toEqual(["h.0", "h.3", "h.6"].concat(Array.from({ length: 21 }, (_, i) => `h.${3 * (i + 3)}`)));
    expect(labels.every((n) => n.title.startsWith("h."))).toBe(true);
    const grid = el.querySelector(".hw-w-grid");
    expect(grid.className).toContain("no-spark");
    expect(grid.children.length % 4).toBe(0); // every row keeps its four cells: the grid places by order
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
  it("decodes the inlined base64 rows", () => {
    const [msg, bufs] = rows(0, 3, { kept: [0, 4], anomalies: [[4, "loss", "spike"]] });
    const b64 = (dv) => btoa(String.fromCharCode(...new Uint8Array(dv.buffer, dv.byteOffset, dv.byteLength)));
    const data = { meta: META, steps: msg.steps, stats: b64(bufs[0]), step_stats: b64(bufs[1]), anomalies: msg.anomalies, kept: msg.kept, dropped: 0, state: "closed", traces: {} };
    const store = storeFromData(data);
    expect(store.value(2, 1, 1)).toBe(2011);
    expect(store.state).toBe("closed");
    const el = document.createElement("div");
    renderPage(data, el, "");
    expect(el.querySelector('[data-testid="watch-heatmap"]').dataset.steps).toBe("3");
  });
});
