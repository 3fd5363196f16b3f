// The grad_fn graph view: module boxes (collapsed) and op nodes, laid out by dagre, drawn in SVG,
// with zoom, pan, fit, search and a toggle between gradient-flow and forward direction.
// Pan and zoom by d3-zoom; the default view keeps labels readable (≥ 11 px) rather than fitting a tall graph.
import dagre from "@dagrejs/dagre";
import { select as d3select } from "d3-selection";
import { zoom as d3zoom, zoomIdentity } from "d3-zoom";
import { buildHierarchy, initialExpanded, search, visibleGraph } from "./collapse.js";
import { cssEscape, h, s } from "../shared/dom.js";
import { fmt, fmtShape } from "../shared/format.js";

let instances = 0;
const MAX_BOXES = 800;
const LABEL_PX = 12; // font size of box and node labels (styles.js); the default view keeps them ≥ 11 px on screen
const MIN_READABLE = 11; // dagre needs seconds past ~500 boxes in a deep chain and overflows its stack near 2,000
const K_READABLE = MIN_READABLE / LABEL_PX + 0.005; // the smallest scale any view goes to by itself ("fit" included)
const SCROLL_MARGIN = 12;

export function createGraphView({ onSelect, onStatus }) {
  const uid = `hw${++instances}`;
  const state = { summary: null, groups: null, expanded: new Set(), forward: false, selected: null,
    changed: { nodes: new Set(), modules: new Set() }, calls: new Map(), matches: [], matchAt: -1, view: { k: 1, x: 0, y: 0 }, bounds: null, layoutMs: 0 };

  const searchBox = h("input", { type: "search", placeholder: "search name…", class: "hw-search", "data-testid": "search",
    onkeydown: (e) => { if (e.key === "Enter") runSearch(searchBox.value, true); },
    oninput: () => runSearch(searchBox.value, false) });
  const dirButton = h("button", { type: "button", "data-testid": "direction", onclick: () => { state.forward = !state.forward; draw(); } });
  const toolbar = h("div", { class: "hw-toolbar" },
    searchBox,
    h("button", { type: "button", "data-testid": "fit", onclick: () => fit(), text: "fit" }),
    h("button", { type: "button", "data-testid": "zoom-in", onclick: () => zoomBy(1.25), text: "+" }),
    h("button", { type: "button", "data-testid": "zoom-out", onclick: () => zoomBy(0.8), text: "−" }),
    dirButton);
  const viewport = s("g", { class: "hw-viewport" });
  const svg = s("svg", { class: "hw-svg", "data-testid": "graph" },
    s("defs", {}, s("marker", { id: `${uid}-arrow`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
      s("path", { d: "M0,0 L10,5 L0,10 z", class: "hw-arrowhead" }))),
    viewport);
  const info = h("span", { class: "hw-dim hw-graph-info" });
  // The legend sits below the graph, where it can wrap: in the toolbar a narrow graph (three panes) cut it short.
  const el = h("div", { class: "hw-graph" }, toolbar, svg, h("div", { class: "hw-graph-foot" }, legend(), info));
  // An explicit extent: d3-zoom's default reads the SVG's width attribute, which fails for a relative
  // width before layout (JupyterLab renders into a detached node first). The wheel scrolls (a notebook's
  // gesture: at the graph's end the page scrolls on); ctrl/⌘ + wheel or a pinch zooms; drag pans.
  const zoomer = d3zoom().scaleExtent([0.02, 4]).extent(() => [[0, 0], size()])
    .filter((e) => (e.type === "wheel" ? e.ctrlKey || e.metaKey : e.button === 0 || e.type.startsWith("touch")) && !e.target.closest?.(".hw-expand"))
    .on("zoom", (e) => { const t = e.transform; state.view = { k: t.k, x: t.x, y: t.y }; viewport.setAttribute("transform", t.toString()); });
  d3select(svg).call(zoomer).on("dblclick.zoom", null);
  svg.addEventListener("wheel", (e) => {
    if (e.ctrlKey || e.metaKey) return;
    const before = { ...state.view };
    const unit = e.deltaMode === 1 ? 16 : e.deltaMode === 2 ? size()[1] : 1;
    const [dx, dy] = e.shiftKey && !e.deltaX ? [e.deltaY * unit, 0] : [e.deltaX * unit, e.deltaY * unit];
    scrollBy(dx, dy);
    if (before.x !== state.view.x || before.y !== state.view.y) e.preventDefault(); // at the end: the page scrolls
  }, { passive: false });

  /** Pan by (dx, dy) screen pixels, kept so that the graph never leaves the pane (SCROLL_MARGIN beyond its ends). */
  function scrollBy(dx, dy) {
    const { k, x, y } = state.view;
    const [nx, ny] = clampView(k, x - dx, y - dy);
    if (nx !== x || ny !== y) setView(k, nx, ny);
  }

  /** The translation nearest (x, y) that keeps the laid-out graph in the pane: centred where it fits, else its
   * ends no further in than SCROLL_MARGIN. */
  function clampView(k, x, y) {
    const [w, hgt] = size();
    const b = state.bounds || { width: 100, height: 100 };
    const axis = (t, extent, room) => (extent * k + 2 * SCROLL_MARGIN <= room ? Math.min(Math.max(t, SCROLL_MARGIN), room - extent * k - SCROLL_MARGIN)
      : Math.min(SCROLL_MARGIN, Math.max(t, room - extent * k - SCROLL_MARGIN)));
    return [axis(x, b.width, w), axis(y, b.height, hgt)];
  }

  function setSummary(summary, { keepView = false } = {}) {
    const first = !state.summary;
    state.summary = summary;
    state.groups = buildHierarchy(summary.modules);
    state.calls = new Map(summary.modules.map((m) => [m.name, m.calls]));
    if (first) state.expanded = initialExpanded(summary.graph, state.groups);
    else state.expanded = new Set([...state.expanded].filter((k) => state.groups.has(k)));
    draw();
    if (first || !keepView) defaultView();
  }

  function toggle(groupKey) {
    const next = new Set(state.expanded);
    if (next.has(groupKey)) for (const k of [...next]) { if (isWithin(k, groupKey)) next.delete(k); }
    else next.add(groupKey);
    const count = visibleGraph(state.summary.graph, state.groups, next).items.size;
    if (count > MAX_BOXES) { onStatus?.("error", `expanding would draw ${count} boxes (limit ${MAX_BOXES}): expand a smaller group`); return; }
    const opening = !state.expanded.has(groupKey);
    state.expanded = next;
    draw();
    if (opening) showGroup(groupKey);
  }

  /** Bring an expanded group's frame into view: whole if it fits at a readable scale, else from its top. */
  function showGroup(key) {
    const r = [...viewport.querySelectorAll(".hw-cluster")].find((c) => c.getAttribute("data-cluster") === key);
    if (!r) return;
    const bx = +r.getAttribute("x"), by = +r.getAttribute("y"), bw = +r.getAttribute("width"), bh = +r.getAttribute("height");
    const [w, hgt] = size();
    const k = Math.max(MIN_READABLE / LABEL_PX, Math.min(state.view.k, (0.95 * w) / bw, (0.95 * hgt) / bh));
    const x = w / 2 - (bx + bw / 2) * k;
    const y = bh * k <= hgt ? hgt / 2 - (by + bh / 2) * k : 8 - by * k;
    setView(k, x, y);
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
    const loose = looseInputs(vis);
    state.items = vis.items;
    const g = new dagre.graphlib.Graph({ multigraph: false, compound: true });
    g.setGraph({ rankdir: state.forward ? "BT" : "TB", nodesep: 18, ranksep: 36, marginx: 10, marginy: 10 });
    g.setDefaultEdgeLabel(() => ({}));
    // Frames are dagre clusters: a frame encloses its members and nothing else (a module never drawn inside one
    // it is not part of).
    for (const f of vis.frames.values()) g.setNode(f.key, {});
    for (const f of vis.frames.values()) if (f.parent !== null) g.setParent(f.key, f.parent);
    for (const item of vis.items.values()) {
      if (loose.hidden.has(item.key)) continue;
      const sub = item.kind === "module" ? boxSub(item) : "";
      const [w, hgt] = item.kind === "module"
        ? [Math.max(100, 7.4 * Math.min(40, Math.max(item.label.length, 0.95 * Math.min(44, sub.length))) + 34), 42]
        : [Math.max(60, 7 * Math.min(28, (item.role === "param" ? summary.graph.param[item.index] || item.label : item.label).length) + 16), 24];
      g.setNode(item.key, { width: w, height: hgt });
      if (item.frame) g.setParent(item.key, item.frame);
    }
    for (const [u, v] of vis.edges) if (!loose.hidden.has(v)) g.setEdge(u, v);
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
    const lines = [];
    for (const e of g.edges()) {
      const pts = g.edge(e).points;
      lines.push(pts);
      const d = "M" + pts.map((p) => `${p.x.toFixed(1)},${p.y.toFixed(1)}`).join(" L");
      edgeLayer.append(s("path", { d, class: "hw-edge", "data-from": e.v, "data-to": e.w, [state.forward ? "marker-start" : "marker-end"]: `url(#${uid}-arrow)` }));
    }
    const boxes = new Map();
    for (const item of vis.items.values()) {
      if (loose.hidden.has(item.key)) continue;
      const n = g.node(item.key);
      boxes.set(item.key, n);
      nodeLayer.append(item.kind === "module" ? moduleBox(item, n) : opNode(item, n, loose.at.get(item.key)));
    }
    drawFrames(clusterLayer, vis, g, lines);
    const gl = g.graph();
    state.bounds = { width: gl.width || 100, height: gl.height || 100 };
    info.textContent = `${summary.graph.id.length} autograd nodes · ${vis.items.size} shown · layout ${state.layoutMs.toFixed(0)} ms · wheel scrolls, ctrl + wheel zooms`;
    dirButton.textContent = state.forward ? "forward ↑" : "gradient ↓";
    dirButton.title = state.forward ? "edges point the forward way (input → loss): click for gradient flow" : "edges follow gradient flow (loss → inputs): click for the forward direction";
    applyMarks();
    applyView();
  }

  function moduleBox(item, n) {
    const x = n.x - n.width / 2, y = n.y - n.height / 2;
    const hasParams = item.roles.has("param");
    const attrs = { class: "hw-box" + (item.chunk ? " hw-chunk" : ""), transform: `translate(${x},${y})`, "data-key": item.key };
    if (item.chunk) attrs["data-group"] = item.group; else attrs["data-module"] = item.module;
    if (item.part) attrs["data-part"] = item.part;
    const sub = boxSub(item);
    const el = s("g", attrs,
      s("title", { text: `${item.chunk ? "group" : "module"} ${item.label}\n${sub}\nclick: details · double-click or +: expand` }),
      s("rect", { width: n.width, height: n.height, rx: 6, class: "hw-box-rect" }),
      hasParams ? s("rect", { width: 5, height: n.height, rx: 2, class: "hw-box-param" }) : null,
      s("text", { x: 10, y: 17, class: "hw-box-label", text: clip(item.label, 40) }),
      s("text", { x: 10, y: 33, class: "hw-box-sub", text: clip(sub, 44) }),
      s("g", { class: "hw-expand", "data-expand": item.group, transform: `translate(${n.width - 18},4)`,
        onclick: (e) => { e.stopPropagation(); toggle(item.group); } },
        s("rect", { width: 14, height: 14, rx: 3 }), s("text", { x: 7, y: 11, text: "+" })));
    el.addEventListener("click", () => (item.chunk ? toggle(item.group) : onSelect({ kind: "module", target: item.module })));
    el.addEventListener("dblclick", () => toggle(item.group));
    return el;
  }

  function opNode(item, n, inputs = []) {
    const i = item.index, G = state.summary.graph;
    const el = s("g", { class: `hw-node role-${item.role}`, "data-node-id": item.id, "data-key": item.key, transform: `translate(${n.x - n.width / 2},${n.y - n.height / 2})` },
      s("title", { text: `${item.id}\nrole: ${G.role[i]}${G.module[i] ? `\nmodule: ${G.module[i]}` : ""}${G.param[i] ? `\nparameter: ${G.param[i]}` : ""}\nshape: ${fmtShape(G.shape[i])}\n|grad|: ${fmt(G.grad_norm[i])}` }),
      s("rect", { width: n.width, height: n.height, rx: item.role === "input" || item.role === "param" || item.role === "leaf" ? 2 : 12, class: "hw-node-rect" }),
      s("text", { x: n.width / 2, y: 16.5, class: "hw-node-label", text: clip(G.param[i] || item.label, 28) }));
    el.addEventListener("click", () => onSelect({ kind: "node", target: item.id }));
    // Tensors without grad that enter here (a loss's target y, a mask): grey marks on the node's side, not boxes
    // beside the loss that read like the model's input; a click shows one as any node.
    inputs.forEach((id, k) => {
      const mark = s("g", { class: "hw-loose-input", "data-node-id": id, transform: `translate(${n.width + 3 + 11 * k},${n.height / 2 - 5})` },
        s("title", { text: `${id}: a tensor without grad enters ${item.id} here (a target, a mask, a constant): its gradient is not kept` }),
        s("rect", { width: 9, height: 10, rx: 2 }));
      mark.addEventListener("click", (e) => { e.stopPropagation(); onSelect({ kind: "node", target: id }); });
      el.append(mark);
    });
    return el;
  }

  /** A box's second line: class, which call (a module called several times: one box per call), op count. */
  function boxSub(item) {
    if (item.chunk) return item.cls;
    const calls = state.calls.get(item.module) || 1;
    const which = item.part ? ` · call ${item.part}/${item.parts}` : calls > 1 ? ` · ×${calls} calls` : "";
    return `${item.cls}${which} · ${item.nodes.length} op${item.nodes.length === 1 ? "" : "s"}`;
  }

  /** Expanded groups' frames where dagre laid them out (one per call of a module called several times), outer first. */
  function drawFrames(layer, vis, g, lines) {
    const depth = (f) => { let d = 0; for (let p = f.parent; p !== null; p = vis.frames.get(p).parent) d++; return d; };
    for (const f of [...vis.frames.values()].sort((p, q) => depth(p) - depth(q))) {
      const grp = state.groups.get(f.group), n = g.node(f.key);
      if (!n || !Number.isFinite(n.width)) continue;
      const b = { x0: n.x - n.width / 2, y0: n.y - n.height / 2, x1: n.x + n.width / 2, y1: n.y + n.height / 2 };
      const label = `${grp.label}${grp.chunk || grp.cls === grp.label ? "" : ` · ${grp.cls}`}${f.part ? ` · call ${f.part}/${f.parts}` : ""}`;
      const width = Math.min(b.x1 - b.x0, 7 * Math.min(40, label.length) + 34);
      const x = tabX(b, width, crossings(lines, b.y0, b.y0 + TAB_H));
      const attrs = { class: "hw-cluster-tab", transform: `translate(${x},${b.y0})` };
      if (grp.chunk) attrs["data-group"] = grp.key; else attrs["data-module"] = grp.name;
      const tab = s("g", attrs,
        s("title", { text: `${grp.label} (${grp.cls})${f.part ? `, call ${f.part} of ${f.parts}` : ""} — click: details · −: collapse` }),
        s("rect", { width, height: TAB_H, rx: 3 }),
        s("text", { x: 20, y: 12, text: clip(label, 40) }),
        s("g", { class: "hw-expand", "data-collapse": grp.key, transform: "translate(2,1)", onclick: (e) => { e.stopPropagation(); toggle(grp.key); } },
          s("rect", { width: 14, height: 14, rx: 3 }), s("text", { x: 7, y: 11, text: "−" })));
      tab.addEventListener("click", () => (grp.chunk ? toggle(grp.key) : onSelect({ kind: "module", target: grp.name })));
      layer.append(s("rect", { class: "hw-cluster", "data-cluster": grp.key, "data-frame": f.key, x: b.x0, y: b.y0, width: b.x1 - b.x0, height: b.y1 - b.y0, rx: 8 }), tab);
    }
  }

  /** A box is changed when one of its ops is; one call of a module called several times only then. */
  function boxChanged(key, mod) {
    const item = key ? state.items?.get(key) : null;
    if (item?.part) return item.nodes.some((i) => state.changed.nodes.has(state.summary.graph.id[i]));
    return state.changed.modules.has(mod);
  }

  function applyMarks() {
    for (const el of viewport.querySelectorAll("[data-node-id], [data-module]")) {
      const id = el.getAttribute("data-node-id"), mod = el.getAttribute("data-module");
      const sel = state.selected && ((state.selected.kind === "node" && id === state.selected.target) || (state.selected.kind === "module" && mod === state.selected.target));
      el.classList.toggle("selected", Boolean(sel));
      el.classList.toggle("changed", id !== null ? state.changed.nodes.has(id) : boxChanged(el.getAttribute("data-key"), mod));
    }
    const m = new Set(state.matches);
    for (const el of viewport.querySelectorAll("[data-node-id], [data-module]")) {
      el.classList.toggle("match", m.has(el.getAttribute("data-node-id") ?? `m:${el.getAttribute("data-module")}`));
    }
  }

  function runSearch(q, jump) {
    const r = search(state.summary.graph, state.summary.modules, q);
    const G = state.summary.graph;
    state.matches = [...r.modules.map((m) => `m:${m}`), ...r.nodes.map((i) => G.id[i])]; // a module's box before its ops
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

  const size = () => [svg.clientWidth || 800, svg.clientHeight || 500];
  let known = null; // the pane's size the view was last placed for
  const setView = (k, x, y) => { known = size(); d3select(svg).call(zoomer.transform, zoomIdentity.translate(x, y).scale(k)); };
  // A pane opening or closing beside the graph (or the output resizing) keeps what was at the centre there.
  function followResize() {
    const now = size();
    if (!known || !state.bounds || (now[0] === known[0] && now[1] === known[1])) { known = now; return; }
    const { k, x, y } = state.view;
    setView(k, ...clampView(k, x + (now[0] - known[0]) / 2, y));
  }
  if (globalThis.ResizeObserver) new ResizeObserver(followResize).observe(svg);

  /** Bring an element of the graph fully into view (at a readable scale): no move if it already is, else
   * centred on it; one larger than the pane shows from its top-left corner. */
  function centerOn(el, minK = 0) {
    const m = /translate\(([-\d.e]+),([-\d.e]+)\)/.exec(el.getAttribute("transform") || "");
    if (!m) return;
    const r = el.querySelector("rect");
    const bx = +m[1], by = +m[2], bw = +(r?.getAttribute("width") || 80), bh = +(r?.getAttribute("height") || 24);
    followResize(); // a pane that just opened beside the graph: first keep the centre, then look
    const [w, hgt] = size();
    const k = Math.max(state.view.k, minK);
    const inside = k === state.view.k && bx * k + state.view.x >= 4 && by * k + state.view.y >= 4
      && (bx + bw) * k + state.view.x <= w - 4 && (by + bh) * k + state.view.y <= hgt - 4;
    if (inside) return;
    const x = bw * k <= w - 16 ? w / 2 - (bx + bw / 2) * k : 8 - bx * k;
    const y = bh * k <= hgt - 16 ? hgt / 2 - (by + bh / 2) * k : 8 - by * k;
    setView(k, x, y);
  }

  /** The whole graph if it fits at a readable scale; else the readable scale, from where gradient flow starts
   * (the loss), the rest a scroll away: "fit" never shrinks labels below MIN_READABLE px. */
  function fit() {
    const [w, hgt] = size();
    const b = state.bounds || { width: 100, height: 100 };
    const kFit = Math.min(1.25, Math.min(w / b.width, hgt / b.height) * 0.95);
    if (kFit >= K_READABLE) { setView(kFit, (w - b.width * kFit) / 2, Math.max(4, (hgt - b.height * kFit) / 2)); return; }
    const k = Math.min(1, Math.max(K_READABLE, Math.min(w / b.width, 1) * 0.98));
    const x = b.width * k <= w ? (w - b.width * k) / 2 : w / 2 - (rootX() ?? b.width / 2) * k;
    const y = state.forward ? hgt - b.height * k - SCROLL_MARGIN : SCROLL_MARGIN;
    const [cx, cy] = clampView(k, x, y);
    setView(k, cx, cy);
  }

  /** The first view: fit (whole graph, or readable from the top). */
  function defaultView() { fit(); }

  /** x of the first root-like box (where gradient flow starts), to open the view there. */
  function rootX() {
    const el = viewport.querySelector(".hw-node.role-root, .hw-nodes > g");
    const m = el && /translate\(([-\d.e]+),/.exec(el.getAttribute("transform") || "");
    const r = el?.querySelector("rect");
    return m ? +m[1] + +(r?.getAttribute("width") || 0) / 2 : null;
  }

  function zoomBy(f) {
    d3select(svg).call(zoomer.scaleBy, f);
  }

  function applyView() {
    const v = state.view;
    viewport.setAttribute("transform", `translate(${v.x},${v.y}) scale(${v.k})`);
  }

  /** Pan (and zoom in if it is too small to read) to the box or node of a selection. */
  function focus(sel) {
    if (!sel) return;
    const q = sel.kind === "node" ? `[data-node-id="${cssEscape(sel.target)}"]` : `.hw-nodes [data-module="${cssEscape(sel.target)}"], .hw-cluster-tab[data-module="${cssEscape(sel.target)}"]`;
    const el = viewport.querySelector(q);
    if (el) centerOn(el, MIN_READABLE / LABEL_PX);
  }

  return {
    el, toolbar, setSummary, fit, defaultView, focus, toggle,
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

const TAB_H = 16; // a frame's title tab, on its top edge

/** Inputs without grad that enter an op outside every module (a loss's target y, a mask): {hidden: their item
 * keys, at: consumer key -> their node ids}. Drawn as marks on that op, not as boxes beside the loss. */
export function looseInputs(vis) {
  const hidden = new Set(), at = new Map(), into = new Map();
  for (const [u, v] of vis.edges) into.set(v, into.has(v) ? null : u); // null: entered from two places
  for (const item of vis.items.values()) {
    if (item.kind !== "node" || item.role !== "input") continue;
    const consumer = vis.items.get(into.get(item.key));
    if (!consumer || consumer.kind !== "node" || consumer.module || consumer.frame) continue;
    hidden.add(item.key);
    at.set(consumer.key, [...(at.get(consumer.key) || []), item.id]);
  }
  return { hidden, at };
}

/** Where edges cross the horizontal band y0..y1 (x of each segment that passes through it, at the band's middle). */
export function crossings(lines, y0, y1) {
  const xs = [], mid = (y0 + y1) / 2;
  for (const pts of lines) {
    for (let i = 1; i < pts.length; i++) {
      const p = pts[i - 1], q = pts[i];
      if (Math.max(p.y, q.y) < y0 || Math.min(p.y, q.y) > y1) continue;
      const t = q.y === p.y ? 0.5 : Math.min(1, Math.max(0, (mid - p.y) / (q.y - p.y)));
      xs.push(p.x + t * (q.x - p.x));
    }
  }
  return xs.sort((a, c) => a - c);
}

/** A frame's title tab goes where no edge crosses it: at the frame's left corner, else right of a crossing edge
 * inside the frame, else left of the leftmost one (hanging off the frame's corner), so no edge runs through its text. */
export function tabX(b, width, xs, gap = 6) {
  const free = (x) => xs.every((c) => c < x - gap || c > x + width + gap);
  const candidates = [b.x0, ...xs.map((c) => c + gap + 1).filter((x) => x + width <= b.x1), ...xs.map((c) => c - gap - 1 - width)];
  return candidates.find(free) ?? b.x0;
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
