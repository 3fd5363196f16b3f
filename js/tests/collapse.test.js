import { describe, expect, it } from "vitest";
import { CHUNK, buildHierarchy, countVisible, initialExpanded, visibleGraph } from "../explorer/collapse.js";
import { seedSummary } from "./fake_model.js";

/** A chain of n Linear-like modules under one root, 4 autograd nodes each. */
function chain(n) {
  const modules = [{ name: "Seq", cls: "Sequential", parent: null }];
  const graph = { id: [], name: [], role: [], module: [], param: [], shape: [], grad_norm: [], edges: [] };
  for (let i = 0; i < n; i++) {
    modules.push({ name: String(i), cls: "Linear", parent: "Seq" });
    for (const [nm, role] of [["AddmmBackward0", "op"], ["TBackward0", "op"], ["AccumulateGrad", "param"], ["AccumulateGrad", "param"]]) {
      const k = graph.id.length;
      graph.id.push(`${nm}#${k}`); graph.name.push(nm); graph.role.push(role); graph.module.push(String(i)); graph.param.push(""); graph.shape.push(null); graph.grad_norm.push(null);
      if (k % 4 !== 0) graph.edges.push(k - (k % 4), k);
    }
    if (i > 0) graph.edges.push(4 * (i - 1), 4 * i);
  }
  return { modules, graph };
}

describe("collapse to modules", () => {
  it("starts with one box per innermost module and ops outside modules shown as nodes", () => {
    const s = seedSummary();
    const groups = buildHierarchy(s.modules);
    const exp = initialExpanded(s.graph, groups);
    expect([...exp]).toEqual(["MLP"]);
    const vis = visibleGraph(s.graph, groups, exp);
    expect([...vis.items.keys()].sort()).toEqual(["m:fc1", "m:fc2", "n:0", "n:1", "n:4"].sort());
    // Edges follow gradient flow between boxes; none inside a box.
    expect(vis.edges).toContainEqual(["n:1", "m:fc2"]);
    expect(vis.edges).toContainEqual(["m:fc2", "n:4"]);
    expect(vis.edges).toContainEqual(["n:4", "m:fc1"]);
    expect(vis.edges.some(([u, v]) => u === v)).toBe(false);
    expect(vis.clusters).toEqual(["MLP"]);
  });

  it("folds only alike repeated blocks: ResNet's stages differ, their identical blocks fold", () => {
    const modules = [{ name: "", cls: "ResNet", parent: null }];
    const block = (name, parent, down) => {
      modules.push({ name, cls: "Bottleneck", parent });
      for (const c of ["conv1", "bn1", "conv2", "bn2", "conv3", "bn3"]) modules.push({ name: `${name}.${c}`, cls: c.startsWith("bn") ? "BatchNorm2d" : "Conv2d", parent: name });
      if (down) modules.push({ name: `${name}.downsample`, cls: "Sequential", parent: name });
    };
    [3, 4, 6, 3].forEach((n, i) => {
      modules.push({ name: `layer${i + 1}`, cls: "Sequential", parent: "" });
      for (let j = 0; j < n; j++) block(`layer${i + 1}.${j}`, `layer${i + 1}`, j === 0);
    });
    const groups = buildHierarchy(modules);
    const repeats = [...groups.values()].filter((g) => g.repeat).map((g) => `${g.label} · ${g.cls}`);
    // layer1 … layer4 are not alike (3, 4, 6, 3 blocks); block 0 of each has a downsample, the rest fold.
    expect(repeats).toEqual(["1 … 3 · Bottleneck × 3", "1 … 5 · Bottleneck × 5"]);
  });

  it("expanding a module shows its ops", () => {
    const s = seedSummary();
    const groups = buildHierarchy(s.modules);
    const vis = visibleGraph(s.graph, groups, new Set(["MLP", "fc1"]));
    expect(vis.items.has("m:fc1")).toBe(false);
    expect(vis.items.get("n:5").id).toBe("MmBackward0#1");
  });

  it("chunks a 10,000-module chain so no view needs thousands of boxes", () => {
    const { modules, graph } = chain(10000);
    expect(graph.id.length).toBe(40000);
    const groups = buildHierarchy(modules);
    const kids = new Map();
    for (const g of groups.values()) kids.set(g.parent, (kids.get(g.parent) || 0) + 1);
    expect(Math.max(...kids.values())).toBeLessThanOrEqual(CHUNK);
    const exp = initialExpanded(graph, groups);
    const n = countVisible(graph, groups, exp);
    expect(n).toBeGreaterThan(1);
    expect(n).toBeLessThanOrEqual(300);
  });
});
