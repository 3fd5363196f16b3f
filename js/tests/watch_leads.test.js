import { describe, expect, it } from "vitest";
import { around, brush, clampView, pan, visible, zoom } from "../watch/axis.js";
import { leadsOf } from "../watch/leads.js";
import { lrText } from "../watch/lr.js";
import { overflowAt, stepOverflowAt } from "../watch/overflow.js";
import { createStore } from "../watch/store.js";
import { createWatchView } from "../watch/view.js";

const STATS = ["delta_norm", "delta_max", "delta_nan", "delta_inf", "a_rms", "a_zero_frac", "a_nonfinite", "grad_norm", "weight_norm", "update_ratio", "grad_nan", "grad_inf"];
const META = { layers: ["fc1", "fc2", "fc3"], stats: STATS, step_stats: ["loss", "grad_norm"], every: 1 };

/** A 300-step run whose learning rate is raised ×300 at step 200: the update ratio jumps there, gradients stay
 * normal; the loss spikes at 201 and the gradients blow up after (the first gradient norm overflows at 203).
 * `lr(r, l)`: the learning rate the watch recorded (statistic "lr"), or none recorded (an older page). */
function diverging(n = 300, lr = null) {
  const stats = lr ? [...STATS, "lr"] : STATS, meta = { ...META, stats };
  const L = 3, K = stats.length, s = new Float64Array(n * L * K), t = new Float64Array(n * 2);
  let seed = 1;
  const noise = () => { seed = (seed * 16807) % 2147483647; return 1 + 0.2 * (seed / 2147483647 - 0.5); };
  for (let r = 0; r < n; r++) {
    const blow = r > 200 ? 10 ** Math.min(40, 3 * (r - 200)) : 1;
    for (let l = 0; l < L; l++) {
      const at = (name, v) => { s[(r * L + l) * K + stats.indexOf(name)] = v; };
      for (const name of stats) at(name, 0);
      if (lr) at("lr", lr(r, l));
      at("delta_norm", 0.1 * noise() * blow); at("a_rms", 0.5 * noise()); at("weight_norm", 3 * noise());
      at("grad_norm", r === 203 && l === 0 ? Infinity : 0.2 * noise() * blow);
      at("update_ratio", 1e-3 * noise() * (r >= 200 ? 300 : 1) * (r === 0 ? NaN : 1));
    }
    t[2 * r] = r > 200 ? 2 * blow : 1 / (1 + r / 50);
    t[2 * r + 1] = r === 203 ? Infinity : 0.35 * noise() * blow;
  }
  // the leads as the kernel sends them (hookwidget/watch/leads.py works them out: tests/test_watch_leads.py)
  const lead = lr
    ? { step: 200, stat: "lr", layers: ["fc1", "fc2", "fc3"], ratio: 300, base: 0.001, value: 0.3, lr: true, text: "step 200: learning rate ×300 (0.001 → 0.3) in 3 layers (fc1, fc2, …), update ratio ‖ΔW‖/‖W‖ ×300" }
    : { step: 200, stat: "update_ratio", layers: ["fc1", "fc2", "fc3"], ratio: 300, base: 0.001, value: 0.3, lr: true, text: "step 200: update ratio ‖ΔW‖/‖W‖ ×300 in 3 layers (fc1, fc2, …), gradients in their window: the learning rate (or optimizer) changed" };
  const st = createStore(meta);
  st.apply({ type: "rows", start: 0, count: n, steps: [...Array(n).keys()], a_start: 0,
    anomalies: [[201, "loss", "spike (×20 its window)", lead], [202, "fc1", "‖W.grad‖₂ spike", lead], [203, "fc1", "non-finite", { ...lead, step: 203, stat: "grad_norm", ratio: "inf", text: "step 203: ‖W.grad‖₂ → Inf of fc1" }], [150, "keep", "asked", null]],
    kept: [201, 299], dropped: 0, total_steps: n, state: "closed" },
  [new DataView(s.buffer), new DataView(t.buffer)]);
  return st;
}

describe("leads", () => {
  it("shows the kernel's lead of each anomaly, mapped to its row; computes none of its own", () => {
    const st = diverging();
    const leads = leadsOf(st);
    expect([leads.get(201).step, leads.get(201).row, leads.get(201).stat, leads.get(201).lr]).toEqual([200, 200, "update_ratio", true]);
    expect(leads.get(201).text).toMatch(/^step 200: update ratio .*×300 in 3 layers.*learning rate/);
    expect(leads.get(202).step).toBe(200);
    expect(leads.get(203).ratio).toBe(Infinity); // "inf" from JSON
    expect(leads.get(150)).toBe(null);
    expect(leadsOf(st)).toBe(leads); // cached until the rows change
  });

  it("reads the recorded learning rate at each step; param groups read by value", () => {
    const st = diverging(300, (r) => (r >= 200 ? 0.3 : 1e-3));
    expect(leadsOf(st).get(201).stat).toBe("lr");
    expect(lrText(st, 199)).toBe("learning rate 0.001");
    expect(lrText(st, 200)).toBe("learning rate 0.3");
    const groups = diverging(300, (r, l) => (l === 2 ? 0.01 : 0.001) * (r === 190 ? NaN : 1) * (r >= 200 ? 300 : 1));
    expect(lrText(groups, 10)).toBe("learning rates 0.001 (fc1, fc2) · 0.01 (fc3)");
    expect(lrText(groups, 190)).toBe("learning rate: no optimizer step");
    expect(lrText(diverging(), 10)).toBe("(learning rate: not recorded by the watch)");
  });
});

describe("overflow", () => {
  it("tells an overflowed norm (entries finite) from an Inf entry", () => {
    const st = diverging();
    const k = STATS.indexOf("grad_norm");
    expect(overflowAt(st, 203, 0, k)).toBe(true);
    expect(overflowAt(st, 202, 0, k)).toBe(false);
    expect(stepOverflowAt(st, 203, 1)).toBe(true);
    expect(stepOverflowAt(st, 203, 0)).toBe(false);
  });
});

describe("axis zoom", () => {
  it("zooms around the pointer, brushes, pans and clamps", () => {
    expect(visible(null, 300)).toEqual([0, 300]);
    const z = zoom(null, 300, 0.5, 0.1);
    expect(z).toEqual({ v0: 135, v1: 165 });
    expect(zoom(z, 300, 0, 0.5)).toEqual({ v0: 135, v1: 150 }); // the left edge stays
    expect(zoom(z, 300, 0.5, 100)).toBe(null); // out past everything: all steps
    expect(brush(300, 210, 190)).toEqual({ v0: 190, v1: 211 });
    expect(brush(300, 5, 5, 3)).toEqual({ v0: 4, v1: 7 });
    expect(pan({ v0: 280, v1: 295 }, 300, 10)).toEqual({ v0: 285, v1: 300 });
    expect(clampView({ v0: -5, v1: 5 }, 300)).toEqual({ v0: 0, v1: 10 });
    expect(around(300, 200, 25)).toEqual({ v0: 188, v1: 213 });
    expect(zoom({ v0: 10, v1: 12 }, 300, 0.5, 0.5, 3)).toEqual({ v0: 10, v1: 13 }); // never under minSpan
  });

  it("makes one step a 24 px column to click: the lead's step selected, its values in the readout", () => {
    const st = diverging(), el = document.createElement("div");
    document.body.appendChild(el);
    const v = createWatchView({ store: st, el, openTrace: async () => ({ ok: true }) });
    expect(v.layout.colW).toBeLessThan(3); // 300 steps in ~600 px
    const first = el.querySelector("[data-testid=watch-first-lead]");
    expect(first.textContent).toMatch(/first at step 201 · lead: step 200: update ratio/);
    el.querySelector("li[data-step='201'] .hw-w-lead").click();
    expect(v.layout.colW).toBe(24);
    expect(el.querySelector("[data-testid=watch-stat]").value).toBe("update_ratio");
    expect(v.layout.v0 <= 200 && v.layout.v1 > 200).toBe(true);
    expect(el.querySelector("[data-testid=watch-readout]").textContent).toMatch(/^step 200 · .*update ratio/);
    expect(el.querySelector("[data-testid=watch-zoom-range]").textContent).toMatch(/^steps \d+–\d+$/);
    el.querySelector("[data-testid=watch-zoom-all]").click();
    expect(v.layout.n).toBe(300);
    const heat = el.querySelector("[data-testid=watch-heatmap]"), axis = el.querySelector("[data-testid=watch-axis]");
    heat.dispatchEvent(new WheelEvent("wheel", { deltaY: -100, clientX: 0, cancelable: true }));
    expect([v.layout.v0, v.layout.n]).toEqual([60, 180]); // zoomed in ×0.6 (happy-dom has no clientX on a wheel: the middle)
    el.querySelector("[data-testid=watch-zoom-all]").click();
    const colW = v.layout.colW, at = (r) => (r + 0.5) * colW;
    axis.dispatchEvent(new MouseEvent("mousedown", { clientX: at(195), bubbles: true }));
    axis.dispatchEvent(new MouseEvent("mouseup", { clientX: at(205), bubbles: true }));
    expect([v.layout.v0, v.layout.v1, v.layout.colW]).toEqual([195, 206, 24]); // a brushed range: steps to click
    v.select(203);
    expect(el.querySelector("[data-testid=watch-readout]").textContent).toMatch(/global ‖grad‖₂ overflow .*fc1 overflow/);
    v.destroy();
  });

  it("shows the step's learning rate in the readout and above a kept Trace; the direct lead first", async () => {
    const st = diverging(300, (r) => (r >= 200 ? 0.3 : 1e-3)), el = document.createElement("div");
    document.body.appendChild(el);
    const v = createWatchView({ store: st, el, openTrace: async () => ({ ok: true }) });
    expect(el.querySelector("[data-testid=watch-first-lead]").textContent).toMatch(/first at step 201 · lead: step 200: learning rate ×300/);
    el.querySelector("li[data-step='201'] .hw-w-lead").click();
    expect(el.querySelector("[data-testid=watch-stat]").value).toBe("lr");
    expect(el.querySelector("[data-testid=watch-readout]").textContent).toMatch(/^step 200 · loss \S+ · learning rate 0\.3 · .*update ratio/);
    await v.open(201);
    expect(el.textContent).toMatch(/step 201 · loss \S+ · learning rate 0\.3 · .*this anomaly's lead: step 200: learning rate ×300/);
    v.destroy();
  });
});
