import { beforeEach, describe, expect, it } from "vitest";
import { createDiffView, gradScale, impactOf, rankRows } from "../explorer/diffview.js";

beforeEach(() => { document.body.replaceChildren(); });

// The CNN of issue 25 under grad_scale(0.1) on conv2, as payload.diff sends it (rows in the kernel's order,
// shuffled here: the view ranks them itself).
const row = (name, before, after, extra = {}) => ({ name, before, after, rel_change: before ? Math.abs(after - before) / before : "new",
  cosine: 1, change: Math.abs(after - before), impact: null, noise: false, hooked: false, ...extra });
const CNN = {
  against: "baseline", hooks: ["conv2"], loss_before: 2.1, loss_after: 2.1, grad_scale: 7.86, layers: {}, changed_nodes: [], changed_modules: [],
  params: [
    row("conv1.bias", 2.48e-7, 2.2e-8, { rel_change: 0.973, cosine: null, noise: true }),
    row("fc.weight", 7.12, 7.12, { rel_change: 0, change: 0 }),
    row("bn1.bias", 0.0963, 0.00963),
    row("conv1.weight", 2.065, 0.2065),
    row("conv2.bias", 7.95e-8, 1.21e-8, { rel_change: 0.989, cosine: null, noise: true }),
    row("conv2.weight", 2.551, 0.2551, { hooked: true }),
  ],
};

describe("diff ranking", () => {
  it("ranks by impact: the real change first, float noise last", () => {
    const names = rankRows(CNN).map((p) => p.name);
    expect(names.slice(0, 3)).toEqual(["conv2.weight", "conv1.weight", "bn1.bias"]);
    expect(names.slice(-2).sort()).toEqual(["conv1.bias", "conv2.bias"]);
    expect(names.indexOf("fc.weight")).toBe(3); // no change: after every real change, before noise
  });

  it("impact is the change over the model's gradient scale, computed where an older kernel sent none", () => {
    expect(gradScale(CNN)).toBe(7.86);
    expect(impactOf({ rel_change: 0.5, before: 2, after: 1 }, 4)).toBe(0.25);
    expect(impactOf({ rel_change: "new", before: 0, after: 3 }, 6)).toBe(0.5);
    const old = { params: [{ name: "a", before: 3, after: 4, rel_change: 0.1 }, { name: "b", before: 4, after: 3, rel_change: 0.9 }] };
    expect(gradScale(old)).toBe(5);
    expect(rankRows(old).map((p) => p.name)).toEqual(["b", "a"]);
  });

  it("a gradient that appeared ranks first; a row without numbers last", () => {
    const d = { params: [{ name: "x", before: 1, after: 2, rel_change: 1 }, { name: "gone", before: null, after: 1, rel_change: null },
      { name: "new", before: 0, after: 0.001, rel_change: "new" }] };
    expect(rankRows(d).map((p) => p.name)).toEqual(["new", "x", "gone"]);
  });

  it("the table shows the ranking, marks noise, and hides a noise vector's cosine", () => {
    const view = createDiffView();
    document.body.append(view.el);
    view.render(CNN);
    const trs = [...view.el.querySelectorAll("tr[data-param]")];
    expect(trs[0].getAttribute("data-param")).toBe("conv2.weight");
    expect(trs[0].classList.contains("changed")).toBe(true);
    const noise = view.el.querySelector('[data-param="conv1.bias"]');
    expect(noise.classList.contains("changed")).toBe(false);
    expect(noise.querySelector('[data-testid="impact"]').textContent).toBe("noise");
    expect(noise.querySelector('[data-testid="cosine"]').textContent).toBe("–");
    expect(view.el.querySelector('[data-param="conv1.weight"] [data-testid="impact"]').textContent).toBe(String(Number((1.8585 / 7.86).toPrecision(3))));
    // A header click sorts by that column; back to impact restores the ranking (the same order as rankRows).
    view.el.querySelector('[data-sort="rel_change"]').dispatchEvent(new Event("click"));
    expect(view.el.querySelector("tr[data-param]").getAttribute("data-param")).toBe("conv2.bias");
    view.el.querySelector('[data-sort="impact"]').dispatchEvent(new Event("click"));
    expect(view.el.querySelector("tr[data-param]").getAttribute("data-param")).toBe("conv2.weight");
    expect(view.el.querySelector('[data-testid="weights-differ"]')).toBeNull(); // one model: nothing to say
  });

  it("says so when the two runs had different weights (two model instances), as text", () => {
    const view = createDiffView();
    view.render({ ...CNN, weights_differ: ["conv1.weight", "<b>x</b>", "fc.weight", "fc.bias"] });
    const line = view.el.querySelector('[data-testid="weights-differ"]');
    expect(line.textContent).toBe("weights differ: conv1.weight, <b>x</b>, fc.weight and 1 more held other values in the two runs "
      + "(two model instances, or the model changed between them), so their gradients differ for that reason too, not only by a hook");
    expect(line.querySelector("b")).toBeNull();
  });
});
