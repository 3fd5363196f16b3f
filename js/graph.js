// The grad_fn graph view: module boxes (collapsed) and op nodes, laid out by dagre, drawn in SVG,
// with zoom, pan, fit, search and a toggle between gradient-flow and forward direction.
import dagre from "@dagrejs/dagre";
import { buildHierarchy, initialExpanded, search, visibleGraph } from "./collapse.js";
import { cssEscape, fmt, fmtShape, h, s } from "./dom.js";

let instances = 0;
const MAX_BOXES = 800; // dagre needs seconds past ~500 boxes in a deep chain and overflows its stack near 2,000

export function createGraphView({ onSelect, onStatus }) {
  const uid = `hw${++instances}`;
  const state = { summary: null, groups: null, expanded: new Set(), forward: false, selected: null,
    changed: { nodes: new Set(), modules: new Set() }, matches: [], matchAt: -1, view: { k: 1, x: 0, y: 0 }, bounds: null, layoutMs: 0 };

  const searchBox = h("input", { type: "search", placeholder: "search name…", class: "hw-search", "data-testid": "search",
    onkeydown: (e) => { if (e.key === "Enter") runSearch(searchBox.value, true); },
    oninput: () => runSearch(searchBox.value, false) });
  const dirButton = h("button", { type: "button", "data-testid": "direction", onclick: () => { state.forward = !state.forward; draw(); } });
  const toolbar = h("div", { class: "hw-toolbar" },
    searchBox,
    h("button", { type: "button", "data-testid": "fit", onclick: () => fit(), text: "fit" }),
    h("button", { type: "button", "data-testid": "zoom-in", onclick: () => zoomBy(1.25), text: "+" }),
    h("button", { type: "button", "data-testid": "zoom-out", onclick: () => zoomBy(0.8), text: "−" }),
    dirButton, legend());
  const viewport = s("g", { class: "hw-viewport" });
  const svg = s("svg", { class: "hw-svg", "data-testid": "graph" },
    s("defs", {}, s("marker", { id: `${uid}-arrow`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
      s("path", { d: "M0,0 L10,5 L0,10 z", class: "hw-arrowhead" }))),
    viewport);
  const info = h("div", { class: "hw-dim hw-graph-info" });
  const el = h("div", { class: "hw-graph" }, toolbar, svg, info);
  installPanZoom(svg, state, applyView);

  function setSummary(summary, { keepView = false } = {}) {
    const first = !state.summary;
    state.summary = summary;
    state.groups = buildHierarchy(summary.modules);
    if (first) state.expanded = initialExpanded(summary.graph, state.groups);
    else state.expanded = new Set([...state.expanded].filter((k) => state.groups.has(k)));
    draw();
    if (first || !keepView) fit();
  }

  function toggle(groupKey) {
    const next = new Set(state.expanded);
    if (next.has(groupKey)) for (const k of [...next]) { if (isWithin(k, groupKey)) next.delete(k); }
    else next.add(groupKey);
    const count = visibleGraph(state.summary.graph, state.groups, next).items.size;
    if (count > MAX_BOXES) { onStatus?.("error", `expanding would draw ${count} boxes (limit ${MAX_BOXES}): expand a smaller group`); return; }
    state.expanded = next;
    draw();
  }

  function isWithin(k, ancestor) {
    for (let p = k; p !== null && p !== undefined; p = state.groups.get(p)?.parent) if (p === ancestor) return true;
    return false;
  }

  function draw() {
    const { summary, groups } = state;
    if (!summary) return;
    const t0 = performance.now();
    const vis = visibleGraph(summary.graph, groups, state.expanded);
    const g = new dagre.graphlib.Graph({ multigraph: false });
    g.setGraph({ rankdir: state.forward ? "BT" : "TB", nodesep: 18, ranksep: 36, marginx: 10, marginy: 10 });
    g.setDefaultEdgeLabel(() => ({}));
    for (const item of vis.items.values()) {
      const [w, hgt] = item.kind === "module" ? [Math.max(90, 7 * Math.min(32, item.label.length) + 30), 40] : [Math.max(60, 6.5 * Math.min(28, item.label.length) + 16), 24];
      g.setNode(item.key, { width: w, height: hgt });
    }
    for (const [u, v] of vis.edges) g.setEdge(u, v);
    try {
      dagre.layout(g);
    } catch (e) {
      onStatus?.("error", `graph layout failed for ${vis.items.size} boxes (${e.message}): collapse some modules`);
      return;
    }
    state.layoutMs = performance.now() - t0;

    viewport.replaceChildren();
    const clusterLayer = s("g", { class: "hw-clusters" }), edgeLayer = s("g", { class: "hw-edges" }), nodeLayer = s("g", { class: "hw-nodes" });
    viewport.append(clusterLayer, edgeLayer, nodeLayer);
    for (const e of g.edges()) {
      const pts = g.edge(e).points;
      const d = "M" + pts.map((p) => `${p.x.toFixed(1)},${p.y.toFixed(1)}`).join(" L");
      edgeLayer.append(s("path", { d, class: "hw-edge", [state.forward ? "marker-start" : "marker-end"]: `url(#${uid}-arrow)` }));
    }
    const boxes = new Map();
    for (const item of vis.items.values()) {
      const n = g.node(item.key);
      boxes.set(item.key, n);
      nodeLayer.append(item.kind === "module" ? moduleBox(item, n) : opNode(item, n));
    }
    drawClusters(clusterLayer, vis, boxes);
    const gl = g.graph();
    state.bounds = { width: gl.width || 100, height: gl.height || 100 };
    info.textContent = `${summary.graph.id.length} autograd nodes · ${vis.items.size} shown · layout ${state.layoutMs.toFixed(0)} ms`;
    dirButton.textContent = state.forward ? "edges: forward ↑" : "edges: gradient flow ↓";
    applyMarks();
    applyView();
  }

  function moduleBox(item, n) {
    const x = n.x - n.width / 2, y = n.y - n.height / 2;
    const hasParams = item.roles.has("param");
    const attrs = { class: "hw-box" + (item.chunk ? " hw-chunk" : ""), transform: `translate(${x},${y})` };
    if (item.chunk) attrs["data-group"] = item.group; else attrs["data-module"] = item.module;
    const sub = item.chunk ? item.cls : `${item.cls} · ${item.nodes.length} op${item.nodes.length === 1 ? "" : "s"}`;
    const el = s("g", attrs,
      s("title", { text: `${item.chunk ? "group" : "module"} ${item.label}\n${sub}\nclick: details · double-click or +: expand` }),
      s("rect", { width: n.width, height: n.height, rx: 6, class: "hw-box-rect" }),
      hasParams ? s("rect", { width: 5, height: n.height, rx: 2, class: "hw-box-param" }) : null,
      s("text", { x: 10, y: 16, class: "hw-box-label", text: clip(item.label, 32) }),
      s("text", { x: 10, y: 31, class: "hw-box-sub", text: clip(sub, 36) }),
      s("g", { class: "hw-expand", "data-expand": item.group, transform: `translate(${n.width - 18},4)`,
        onclick: (e) => { e.stopPropagation(); toggle(item.group); } },
        s("rect", { width: 14, height: 14, rx: 3 }), s("text", { x: 7, y: 11, text: "+" })));
    el.addEventListener("click", () => (item.chunk ? toggle(item.group) : onSelect({ kind: "module", target: item.module })));
    el.addEventListener("dblclick", () => toggle(item.group));
    return el;
  }

  function opNode(item, n) {
    const i = item.index, G = state.summary.graph;
    const el = s("g", { class: `hw-node role-${item.role}`, "data-node-id": item.id, transform: `translate(${n.x - n.width / 2},${n.y - n.height / 2})` },
      s("title", { text: `${item.id}\nrole: ${G.role[i]}${G.module[i] ? `\nmodule: ${G.module[i]}` : ""}${G.param[i] ? `\nparameter: ${G.param[i]}` : ""}\nshape: ${fmtShape(G.shape[i])}\n|grad|: ${fmt(G.grad_norm[i])}` }),
      s("rect", { width: n.width, height: n.height, rx: item.role === "input" || item.role === "param" || item.role === "leaf" ? 2 : 12, class: "hw-node-rect" }),
      s("text", { x: n.width / 2, y: 16, class: "hw-node-label", text: clip(G.param[i] || item.label, 28) }));
    el.addEventListener("click", () => onSelect({ kind: "node", target: item.id }));
    return el;
  }

  function drawClusters(layer, vis, boxes) {
    const groups = state.groups;
    const bbox = new Map();
    const grow = (key, b) => {
      const c = bbox.get(key) || { x0: Infinity, y0: Infinity, x1: -Infinity, y1: -Infinity };
      c.x0 = Math.min(c.x0, b.x0); c.y0 = Math.min(c.y0, b.y0); c.x1 = Math.max(c.x1, b.x1); c.y1 = Math.max(c.y1, b.y1);
      bbox.set(key, c);
    };
    const byDepth = vis.clusters.map((k) => groups.get(k)).sort((a, b) => b.depth - a.depth);
    for (const item of vis.items.values()) {
      const parent = item.kind === "module" ? groups.get(item.group).parent : groups.has(item.module) ? item.module : null;
      if (parent === null || parent === undefined) continue;
      const n = boxes.get(item.key);
      grow(parent, { x0: n.x - n.width / 2, y0: n.y - n.height / 2, x1: n.x + n.width / 2, y1: n.y + n.height / 2 });
    }
    const out = [];
    for (const grp of byDepth) {
      const b = bbox.get(grp.key);
      if (!b) continue;
      const pad = { x0: b.x0 - 8, y0: b.y0 - 22, x1: b.x1 + 8, y1: b.y1 + 8 };
      if (grp.parent !== null && grp.parent !== undefined) grow(grp.parent, pad);
      out.push([grp, pad]);
    }
    for (const [grp, b] of out.reverse()) {
      const attrs = { class: "hw-cluster-tab", transform: `translate(${b.x0},${b.y0})` };
      if (grp.chunk) attrs["data-group"] = grp.key; else attrs["data-module"] = grp.name;
      const tab = s("g", attrs,
        s("title", { text: `${grp.label} (${grp.cls}) — click: details · −: collapse` }),
        s("rect", { width: Math.min(b.x1 - b.x0, 7 * Math.min(40, grp.label.length) + 34), height: 16, rx: 3 }),
        s("text", { x: 20, y: 12, text: clip(`${grp.label}${grp.chunk ? "" : ` · ${grp.cls}`}`, 40) }),
        s("g", { class: "hw-expand", "data-collapse": grp.key, transform: "translate(2,1)", onclick: (e) => { e.stopPropagation(); toggle(grp.key); } },
          s("rect", { width: 14, height: 14, rx: 3 }), s("text", { x: 7, y: 11, text: "−" })));
      tab.addEventListener("click", () => (grp.chunk ? toggle(grp.key) : onSelect({ kind: "module", target: grp.name })));
      layer.append(s("rect", { class: "hw-cluster", x: b.x0, y: b.y0, width: b.x1 - b.x0, height: b.y1 - b.y0, rx: 8 }), tab);
    }
  }

  function applyMarks() {
    for (const el of viewport.querySelectorAll("[data-node-id], [data-module]")) {
      const id = el.getAttribute("data-node-id"), mod = el.getAttribute("data-module");
      const sel = state.selected && ((state.selected.kind === "node" && id === state.selected.target) || (state.selected.kind === "module" && mod === state.selected.target));
      el.classList.toggle("selected", Boolean(sel));
      el.classList.toggle("changed", id !== null ? state.changed.nodes.has(id) : state.changed.modules.has(mod));
    }
    const m = new Set(state.matches);
    for (const el of viewport.querySelectorAll("[data-node-id], [data-module]")) {
      el.classList.toggle("match", m.has(el.getAttribute("data-node-id") ?? `m:${el.getAttribute("data-module")}`));
    }
  }

  function runSearch(q, jump) {
    const r = search(state.summary.graph, state.summary.modules, q);
    const G = state.summary.graph;
    state.matches = [...r.nodes.map((i) => G.id[i]), ...r.modules.map((m) => `m:${m}`)];
    applyMarks();
    info.textContent = q ? `${r.modules.length} module(s), ${r.nodes.length} node(s) match “${q}”` : info.textContent;
    if (jump && (r.modules.length || r.nodes.length)) {
      state.matchAt = (state.matchAt + 1) % state.matches.length;
      const key = state.matches[state.matchAt];
      reveal(key);
      const sel = key.startsWith("m:") ? `[data-module="${cssEscape(key.slice(2))}"]` : `[data-node-id="${cssEscape(key)}"]`;
      const el = viewport.querySelector(sel);
      if (el) centerOn(el);
    }
  }

  /** Expand the groups hiding a search match (a module, or the module of an op node). */
  function reveal(key) {
    const G = state.summary.graph;
    const mod = key.startsWith("m:") ? key.slice(2) : G.module[G.id.indexOf(key)];
    if (!mod || !state.groups.has(mod)) return;
    const next = new Set(state.expanded);
    for (let p = state.groups.get(mod).parent; p !== null && p !== undefined; p = state.groups.get(p).parent) next.add(p);
    if (!key.startsWith("m:")) next.add(mod);
    if (next.size === state.expanded.size) return;
    if (visibleGraph(G, state.groups, next).items.size > MAX_BOXES) return;
    state.expanded = next;
    draw();
  }

  function centerOn(el) {
    const m = /translate\(([-\d.e]+),([-\d.e]+)\)/.exec(el.getAttribute("transform") || "");
    if (!m) return;
    const w = svg.clientWidth || 800, hgt = svg.clientHeight || 500;
    state.view.x = w / 2 - (+m[1] + 40) * state.view.k;
    state.view.y = hgt / 2 - (+m[2] + 12) * state.view.k;
    applyView();
  }

  function fit() {
    const w = svg.clientWidth || 800, hgt = svg.clientHeight || 500;
    const b = state.bounds || { width: 100, height: 100 };
    const k = Math.min(1.25, Math.max(0.02, Math.min(w / b.width, hgt / b.height) * 0.95));
    state.view = { k, x: (w - b.width * k) / 2, y: Math.max(4, (hgt - b.height * k) / 2) };
    applyView();
  }

  function zoomBy(f) {
    const w = svg.clientWidth || 800, hgt = svg.clientHeight || 500;
    const v = state.view;
    v.x = w / 2 - (w / 2 - v.x) * f; v.y = hgt / 2 - (hgt / 2 - v.y) * f; v.k *= f;
    applyView();
  }

  function applyView() {
    const v = state.view;
    viewport.setAttribute("transform", `translate(${v.x},${v.y}) scale(${v.k})`);
  }

  return {
    el, setSummary, fit, toggle,
    select(sel) { state.selected = sel; applyMarks(); },
    setChanged(nodes, modules) { state.changed = { nodes: new Set(nodes), modules: new Set(modules) }; applyMarks(); },
    expandTo(moduleName) {
      // Make a module visible: expand every group above it.
      let changed = false;
      for (let p = state.groups.get(moduleName)?.parent; p !== null && p !== undefined; p = state.groups.get(p).parent) {
        if (!state.expanded.has(p)) { state.expanded.add(p); changed = true; }
      }
      if (changed) draw();
    },
    get state() { return state; },
  };
}

function installPanZoom(svg, state, apply) {
  let drag = null;
  svg.addEventListener("wheel", (e) => {
    e.preventDefault();
    const r = svg.getBoundingClientRect();
    const px = e.clientX - r.left, py = e.clientY - r.top, f = Math.exp(-e.deltaY * 0.0015);
    const v = state.view;
    v.x = px - (px - v.x) * f; v.y = py - (py - v.y) * f; v.k *= f;
    apply();
  }, { passive: false });
  svg.addEventListener("pointerdown", (e) => {
    if (e.target !== svg && !e.target.classList?.contains("hw-cluster")) return;
    drag = { x: e.clientX, y: e.clientY, vx: state.view.x, vy: state.view.y };
    svg.setPointerCapture?.(e.pointerId);
  });
  svg.addEventListener("pointermove", (e) => {
    if (!drag) return;
    state.view.x = drag.vx + e.clientX - drag.x; state.view.y = drag.vy + e.clientY - drag.y;
    apply();
  });
  const end = () => { drag = null; };
  svg.addEventListener("pointerup", end);
  svg.addEventListener("pointercancel", end);
}

function legend() {
  const item = (cls, label, title) => h("span", { class: "hw-legend-item", title }, h("span", { class: `hw-swatch ${cls}` }), label);
  return h("span", { class: "hw-legend", "data-testid": "legend" },
    item("role-input", "input (no grad)", "leaf tensor without requires_grad: gradient computed, then dropped"),
    item("role-param", "parameter", "leaf with requires_grad: .grad is stored here"),
    item("role-leaf", "other leaf", "leaf tensor that requires grad but is no parameter"),
    item("role-op", "op / root", "non-leaf: produced by an op, gradient passes through"),
    item("hw-swatch-box", "module", "a module's ops, collapsed: + expands"));
}

const clip = (t, n) => (t.length > n ? t.slice(0, n - 1) + "…" : t);
