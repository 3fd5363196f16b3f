import { beforeEach, describe, expect, it } from "vitest";
import { layerRows, logScale, scaleColour, scalePos } from "../explorer/overview.js";
import { mount, seedSummary } from "./fake_model.js";

const info = (norm) => ({ shape: [2, 4], dtype: "float32", kept: true, norm, nonfinite: 0 });

/** A deep fake model: a root, 12 blocks (no own params) each holding a Linear, plus a head; one block vanishing. */
function deepSummary() {
  const mods = [{ name: "net", cls: "Net", parent: null, params: 999, own_params: [], calls: 1, flags: [], grad_norm: null }];
  for (let i = 0; i < 12; i++) {
    mods.push({ name: `net.h.${i}`, cls: "Block", parent: "net", params: 20, own_params: [], calls: 1, flags: [], grad_norm: null });
    const vanishing = i === 5;
    mods.push({ name: `net.h.${i}.lin`, cls: "Linear", parent: `net.h.${i}`, params: 20, own_params: [`net.h.${i}.lin.weight`, `net.h.${i}.lin.bias`],
      calls: 1, flags: vanishing ? ["vanishing"] : [], grad_norm: vanishing ? 3e-9 : 0.1 * (i + 1),
      a: info(1 + i), delta: info(vanishing ? 1e-9 : 0.01 * (i + 1)) });
  }
  mods.push({ name: "net.head", cls: "Linear", parent: "net", params: 5, own_params: ["net.head.weight"], calls: 1, flags: ["nonfinite"],
    grad_norm: "nan", a: info(2), delta: null });
  mods.push({ name: '<img src=x onerror="window.__pwned=1">', cls: "<b>Evil</b>", parent: "net", params: 1, own_params: ["w"], calls: 1, flags: [],
    grad_norm: 0.5, a: { ...info(130), dtype: "int64" }, delta: info(1) });
  return { ...seedSummary(), modules: mods };
}


const rowNames = (el) => [...el.querySelectorAll("[data-testid=overview] tr[data-layer-row]")].map((r) => r.getAttribute("data-layer-row"));
const rgb = (c) => c.match(/\d+/g).map(Number);

beforeEach(() => { document.body.replaceChildren(); });

describe("layer overview", () => {
  it("has one row per layer with parameters of its own, open by default for a deep model", () => {
    const { el } = mount(deepSummary());
    const names = rowNames(el);
    expect(names.length).toBe(14);
    expect(names.slice(0, 3)).toEqual(["net.h.0.lin", "net.h.1.lin", "net.h.2.lin"]);
    expect(names).not.toContain("net");
    expect(names).not.toContain("net.h.0");
    expect(el.querySelector("[data-testid=overview]").hidden).toBe(false);
    expect(el.querySelector(".hw-tree").hidden).toBe(true);
    expect(el.querySelector('[data-tab="layers"]').textContent).toBe("layers (14)");
    // Numbers via format.js; a non-finite norm and the health flags are shown as such.
    const head = el.querySelector('tr[data-layer-row="net.head"]');
    expect(head.querySelector('[data-col="grad"]').textContent).toBe("nan");
    expect(head.querySelector('[data-col="grad"]').classList.contains("nonfinite")).toBe(true);
    expect(head.querySelector('[data-col="delta"]').textContent).toBe("–");
    expect(el.querySelector('tr[data-layer-row="net.h.5.lin"] [data-col="flags"]').textContent).toBe("vanishing");
    expect(el.querySelector('tr[data-layer-row="net.h.5.lin"] [data-col="grad"]').textContent).toBe("3e-9");
    // Token ids (an Embedding's input) are not put on the norm scale.
    const ids = [...el.querySelectorAll("tr[data-layer-row]")].at(-1).querySelector('[data-col="a"]');
    expect(ids.textContent).toBe("ids");
    expect(ids.hasAttribute("data-t")).toBe(false);
    // Names from user code stay text.
    expect(el.querySelector("[data-testid=overview] img")).toBeNull();
    expect(el.querySelector("[data-testid=overview] b")).toBeNull();
    expect(el.querySelector("[data-testid=overview]").textContent).toContain("<b>Evil</b>");
  });

  it("a small model opens on the tree; the tabs switch", () => {
    const old = seedSummary(); // as a kernel before own_params sent it
    for (const m of old.modules) delete m.own_params;
    const { el } = mount(old);
    expect(el.querySelector("[data-testid=overview]").hidden).toBe(true);
    expect(el.querySelector(".hw-tree").hidden).toBe(false);
    el.querySelector('[data-tab="layers"]').dispatchEvent(new Event("click"));
    expect(el.querySelector("[data-testid=overview]").hidden).toBe(false);
    expect(rowNames(el)).toEqual(["fc1", "fc2"]); // no own_params in this summary: leaves with parameters
  });

  it("sorts by ‖W.grad‖ when its header is clicked, largest first, then reversed", () => {
    const { el } = mount(deepSummary());
    el.querySelector('[data-layer-sort="grad"]').dispatchEvent(new Event("click"));
    let names = rowNames(el);
    expect(names[0]).toBe("net.head"); // nan first: a problem comes to the top
    expect(names.slice(1, 3)).toEqual(["net.h.11.lin", "net.h.10.lin"]);
    expect(names.at(-1)).toBe("net.h.5.lin");
    expect(el.querySelector('[data-layer-sort="grad"]').getAttribute("aria-sort")).toBe("descending");
    el.querySelector('[data-layer-sort="grad"]').dispatchEvent(new Event("click"));
    names = rowNames(el);
    expect(names[0]).toBe("net.h.5.lin");
    expect(el.querySelector('[data-layer-sort="grad"]').getAttribute("aria-sort")).toBe("ascending");
    el.querySelector('[data-layer-sort="index"]').dispatchEvent(new Event("click"));
    expect(rowNames(el)[0]).toBe("net.h.0.lin");
  });

  it("colours are on one log scale shared by the columns, monotone in the value", () => {
    const { el } = mount(deepSummary());
    const cells = [...el.querySelectorAll("[data-testid=overview] td[data-t]")];
    expect(cells.length).toBeGreaterThan(30);
    const pts = cells.map((c) => {
      const [r, , b] = rgb(c.style.background || c.style.backgroundColor);
      return { v: Number(c.textContent.replace(/,/g, "")), t: Number(c.getAttribute("data-t")), redness: r - b };
    }).sort((p, q) => p.v - q.v);
    for (let i = 1; i < pts.length; i++) {
      if (pts[i].v === pts[i - 1].v) continue;
      expect(pts[i].t).toBeGreaterThanOrEqual(pts[i - 1].t);
      expect(pts[i].redness).toBeGreaterThanOrEqual(pts[i - 1].redness);
    }
    // The vanishing layer sits at the blue end, across columns of the same scale.
    const lo = el.querySelector('tr[data-layer-row="net.h.5.lin"] [data-col="delta"]');
    expect(Number(lo.getAttribute("data-t"))).toBe(0);
    // The scale alone: strictly monotone over a wide range.
    const scale = logScale(layerRows(deepSummary()));
    const vals = [1e-9, 1e-6, 1e-3, 0.1, 1, 10, 12];
    const red = vals.map((v) => { const [r, , b] = rgb(scaleColour(scalePos(v, scale))); return r - b; });
    for (let i = 1; i < red.length; i++) expect(red[i]).toBeGreaterThan(red[i - 1]);
  });

  it("clicking a row selects that layer: the same selection the tree makes", () => {
    const { model, el } = mount(deepSummary());
    el.querySelector('tr[data-layer-row="net.h.7.lin"]').dispatchEvent(new Event("click"));
    expect(model.sent.at(-1)).toMatchObject({ type: "detail", target: "net.h.7.lin" });
    expect(el.querySelector('tr[data-layer-row="net.h.7.lin"]').classList.contains("selected")).toBe(true);
    expect(el.querySelector('[data-tree-module="net.h.7.lin"]').classList.contains("selected")).toBe(true);
    // Selecting in the tree marks the row; Enter on a row selects; Escape clears both.
    el.querySelector('[data-tree-module="net.head"]').dispatchEvent(new Event("click"));
    expect(el.querySelector('tr[data-layer-row="net.head"]').classList.contains("selected")).toBe(true);
    expect(el.querySelector('tr[data-layer-row="net.h.7.lin"]').classList.contains("selected")).toBe(false);
    el.querySelector('tr[data-layer-row="net.h.3.lin"]').dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", bubbles: true }));
    expect(model.sent.at(-1)).toMatchObject({ type: "detail", target: "net.h.3.lin" });
    expect(el.querySelector('[data-tree-module="net.h.3.lin"]').classList.contains("selected")).toBe(true);
    el.querySelector('tr[data-layer-row="net.h.3.lin"]').dispatchEvent(new KeyboardEvent("keydown", { key: "Escape", bubbles: true }));
    expect(el.querySelector("tr[data-layer-row].selected")).toBeNull();
  });
});
