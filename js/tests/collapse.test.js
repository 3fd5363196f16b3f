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

/** Issue 25's CNN, as its grad_fn graph: a pool called after conv1 and after conv2 (nodes in gradient flow order). */
function reusedPool() {
  const modules = ["conv1:Conv2d", "bn1:BatchNorm2d", "pool:MaxPool2d", "conv2:Conv2d", "bn2:BatchNorm2d", "fc:Linear"]
    .map((x) => ({ name: x.split(":")[0], cls: x.split(":")[1], parent: "CNN" }));
  modules.unshift({ name: "CNN", cls: "CNN", parent: null });
  const nodes = [["NllLossBackward0", ""], ["AddmmBackward0", "fc"], ["MaxPool2DWithIndicesBackward0", "pool"], ["ReluBackward0", "CNN"],
    ["NativeBatchNormBackward0", "bn2"], ["ConvolutionBackward0", "conv2"], ["MaxPool2DWithIndicesBackward0", "pool"], ["ReluBackward0", "CNN"],
    ["NativeBatchNormBackward0", "bn1"], ["ConvolutionBackward0", "conv1"]];
  const graph = { id: nodes.map(([n], i) => `${n}#${i}`), name: nodes.map(([n]) => n), role: nodes.map((_, i) => (i ? "op" : "root")),
    module: nodes.map(([, m]) => m), param: nodes.map(() => ""), shape: nodes.map(() => null), grad_norm: nodes.map(() => null), edges: [] };
  for (let i = 0; i + 1 < nodes.length; i++) graph.edges.push(i, i + 1);
  return { modules, graph };
}

/** Kahn's algorithm on the drawn edges: true when they have no cycle. */
function acyclic(items, edges) {
  const indeg = new Map([...items.keys()].map((k) => [k, 0]));
  for (const [, v] of edges) indeg.set(v, indeg.get(v) + 1);
  const queue = [...indeg].filter(([, d]) => d === 0).map(([k]) => k);
  let seen = 0;
  while (queue.length) {
    const u = queue.pop();
    seen++;
    for (const [a, b] of edges) if (a === u) { indeg.set(b, indeg.get(b) - 1); if (!indeg.get(b)) queue.push(b); }
  }
  return seen === items.size;
}

describe("modules called several times", () => {
  it("a pool used after conv1 and after conv2 is one box per call, with no edge back up into it", () => {
    const { modules, graph } = reusedPool();
    const groups = buildHierarchy(modules);
    const vis = visibleGraph(graph, groups, new Set(["CNN"]));
    const pools = [...vis.items.values()].filter((it) => it.module === "pool");
    expect(pools.map((p) => [p.part, p.parts, p.nodes]).sort()).toEqual([[1, 2, [6]], [2, 2, [2]]]);
    expect(acyclic(vis.items, vis.edges)).toBe(true);
    const key = (m, part) => [...vis.items.values()].find((it) => it.module === m && (part === undefined || it.part === part)).key;
    expect(vis.edges).toContainEqual([key("conv2"), key("pool", 1)]);
    expect(vis.edges).toContainEqual([key("pool", 2), "n:3"]);
    expect(vis.edges.some(([u, v]) => u === key("conv2") && v === key("pool", 2))).toBe(false);
  });

  it("expanded, each call has its own frame: conv2 is inside none of the pool's", () => {
    const { modules, graph } = reusedPool();
    const groups = buildHierarchy(modules);
    const vis = visibleGraph(graph, groups, new Set(["CNN", "pool"]));
    const poolFrames = [...vis.frames.values()].filter((f) => f.group === "pool");
    expect(poolFrames.map((f) => f.part).sort()).toEqual([1, 2]);
    expect(poolFrames.every((f) => f.parent === "CNN")).toBe(true);
    const inFrame = (f) => [...vis.items.values()].filter((it) => it.frame === f.key).map((it) => it.id ?? it.module);
    expect(poolFrames.map(inFrame).sort()).toEqual([["MaxPool2DWithIndicesBackward0#2"], ["MaxPool2DWithIndicesBackward0#6"]]);
    expect(vis.items.get("m:conv2").frame).toBe("CNN");
    expect(acyclic(vis.items, vis.edges)).toBe(true);
  });

  it("a module called twice in parallel (a shared encoder) stays one box: no path re-enters it", () => {
    const { modules, graph } = seedSummaryLike();
    const vis = visibleGraph(graph, buildHierarchy(modules), new Set(["Net"]));
    expect([...vis.items.values()].filter((it) => it.module === "enc").length).toBe(1);
    expect(acyclic(vis.items, vis.edges)).toBe(true);
  });
});

/** loss -> add -> enc(x1) and enc(x2): two calls side by side. */
function seedSummaryLike() {
  const modules = [{ name: "Net", cls: "Net", parent: null }, { name: "enc", cls: "Linear", parent: "Net" }];
  const graph = { id: ["Sum#0", "Add#0", "Mm#0", "Mm#1"], name: ["Sum", "Add", "Mm", "Mm"], role: ["root", "op", "op", "op"],
    module: ["", "Net", "enc", "enc"], param: ["", "", "", ""], shape: [null, null, null, null], grad_norm: [null, null, null, null], edges: [0, 1, 1, 2, 1, 3] };
  return { modules, graph };
}
