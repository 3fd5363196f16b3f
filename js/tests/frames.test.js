import { describe, expect, it } from "vitest";
import { crossings, looseInputs, tabX } from "../explorer/graph.js";
import { mount, seedSummary } from "./fake_model.js";

describe("a frame's title tab", () => {
  const frame = { x0: 428, x1: 641 };

  it("finds where edges cross the tab's band", () => {
    const lines = [[{ x: 450, y: 200 }, { x: 534, y: 250 }, { x: 534, y: 300 }], [{ x: 100, y: 0 }, { x: 100, y: 50 }]];
    expect(crossings(lines, 280, 296)).toEqual([534]);
    expect(crossings(lines, 210, 226).map((x) => Math.round(x))).toEqual([480]);
  });

  it("stays at the frame's corner where no edge crosses it", () => {
    expect(tabX(frame, 104, [])).toBe(428);
    expect(tabX(frame, 104, [300, 700])).toBe(428);
  });

  it("moves off an edge that would run through its text: right of it inside the frame, else left of it", () => {
    expect(tabX(frame, 80, [470])).toBe(477); // right of the edge, still inside the frame
    const x = tabX(frame, 104, [534]); // no room on the right: hangs left of the edge
    expect(x + 104).toBeLessThan(534 - 5);
  });
});

describe("inputs without grad", () => {
  const node = (key, role, module = "", frame = null) => [key, { key, kind: "node", id: key, role, module, frame }];

  it("that enter an op outside every module (a loss's target) become marks on it; a layer's input stays a box", () => {
    const vis = {
      items: new Map([node("loss", "root"), node("y", "input"), ["m:fc1", { key: "m:fc1", kind: "module" }], node("x", "input", "fc1", "fc1"), node("mask", "input")]),
      edges: [["loss", "y"], ["loss", "m:fc1"], ["m:fc1", "x"], ["loss", "mask"]],
    };
    const { hidden, at } = looseInputs(vis);
    expect([...hidden]).toEqual(["y", "mask"]);
    expect(at.get("loss")).toEqual(["y", "mask"]);
  });

  it("the explorer draws the target as a clickable grey mark on the loss, not a box beside it", () => {
    const summary = seedSummary();
    const G = summary.graph;
    G.id.push("input#1"); G.name.push("input"); G.role.push("input"); G.module.push(""); G.param.push(""); G.shape.push([5, 6, 2]); G.grad_norm.push(null);
    G.edges = [...G.edges, 0, G.id.length - 1]; // the root (the loss) takes y
    const { el, model } = mount(summary);
    expect(el.querySelector('.hw-nodes > [data-node-id="input#1"]')).toBeNull();
    const mark = el.querySelector('[data-node-id="MulBackward0#0"] .hw-loose-input[data-node-id="input#1"]');
    expect(mark.querySelector("title").textContent).toContain("a tensor without grad enters MulBackward0#0");
    mark.dispatchEvent(new Event("click"));
    expect(model.sent.at(-1)).toMatchObject({ type: "detail", target: "input#1" });
  });
});
