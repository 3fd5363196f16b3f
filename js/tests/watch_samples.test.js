import { describe, expect, it } from "vitest";
import { createStore } from "../watch/store.js";
import { anomalyList } from "../watch/text.js";

const META = { layers: ["fc1"], stats: ["grad_norm"], step_stats: ["loss", "grad_norm"], every: 1 };

/** A store of 3 rows whose anomalies are [step, where, reason, lead, samples] as the kernel sends them
 * (hookwidget/views/anomalies.py; the samples' text is watch/carriers.py's). */
function storeWith(anomalies) {
  const st = createStore(META);
  const s = new Float64Array(3), t = new Float64Array(6);
  st.apply({ type: "rows", start: 0, count: 3, steps: [0, 1, 2], a_start: 0, anomalies, kept: [], dropped: 0, total_steps: 3, state: "closed" },
    [new DataView(s.buffer), new DataView(t.buffer)]);
  return st;
}

describe("anomaly list: the samples that carried the step", () => {
  it("shows the kernel's text once per step, as text", () => {
    const carried = { samples: [[4, 0.91], [0, 0.05]], position: 6, position_share: 0.32, text: "samples 4 (0.91), 0 (0.05) of the step's gradient; sample 4's position 6 (0.32) <b>x</b>" };
    const el = document.createElement("details");
    anomalyList(el, storeWith([[2, "loss", "spike", null, carried], [2, "grad_norm", "spike", null, carried], [1, "keep", "asked", null, null]]), () => {});
    const shown = el.querySelectorAll("[data-testid=watch-anomaly-samples]");
    expect(shown.length).toBe(1); // once for step 2's two anomalies; none where the kernel sent null
    expect(shown[0].textContent).toBe(` · ${carried.text}`);
    expect(shown[0].querySelector("b")).toBe(null); // markup in the text stays text
  });

  it("reads an older message of four elements (no samples)", () => {
    const el = document.createElement("details");
    anomalyList(el, storeWith([[2, "loss", "spike", null]]), () => {});
    expect(el.querySelectorAll("[data-testid=watch-anomaly-samples]").length).toBe(0);
    expect(el.textContent).toMatch(/step 2 · loss: spike/);
  });
});
