// The watch's layers as the explorer folds modules (explorer/collapse.js, reused: a run of alike numbered blocks
// h.0 … h.23 folds into one group, a long list is chunked by 50), so 1,000 layers read as a few dozen block rows
// that expand on a click. The module tree is the layers' dotted names (the watch sends no other); a block row
// shows the largest value over its layers.
import { buildHierarchy } from "../explorer/collapse.js";

export const ROW_LIMIT = 40; // rows in the first view: blocks expand while the rows stay within it

/** {groups, children: key -> [child keys], layersOf: key -> [layer indices], roots, keyOfLayer} of `layers`. */
export function layerTree(layers) {
  const prefixes = new Set();
  for (const name of layers) { const parts = name.split("."); for (let i = 1; i < parts.length; i++) prefixes.add(parts.slice(0, i).join(".")); }
  const modules = [], seen = new Set(), keyOfLayer = [];
  const add = (name, parent, cls = "") => { if (!seen.has(name)) { seen.add(name); modules.push({ name, cls, parent }); } };
  layers.forEach((name, l) => {
    const parts = name.split(".");
    let parent = null;
    for (let i = 1; i < parts.length; i++) { const pre = parts.slice(0, i).join("."); add(pre, parent); parent = pre; }
    // A layer that also has layers inside it (its own weight and children) is a leaf of its own under its module.
    const key = prefixes.has(name) ? `${name}\u0000own` : name;
    if (key !== name) add(name, parent);
    add(key, key === name ? parent : name, "layer");
    keyOfLayer[l] = key;
  });
  const groups = buildHierarchy(modules);
  const layersOf = new Map(), children = new Map();
  keyOfLayer.forEach((key, l) => { for (let k = key; k !== null && k !== undefined; k = groups.get(k).parent) { if (!layersOf.has(k)) layersOf.set(k, []); layersOf.get(k).push(l); } });
  for (const g of groups.values()) {
    if (!layersOf.has(g.key)) continue;
    if (!children.has(g.parent)) children.set(g.parent, []);
    children.get(g.parent).push(g.key);
  }
  for (const [key, list] of children) {
    list.sort((a, b) => layersOf.get(a)[0] - layersOf.get(b)[0]);
    const g = groups.get(key);
    const ends = (k, i) => groups.get(k).name ?? groups.get(k).label.split(" … ")[i]; // a chunk: "h.0 … h.49"
    if (g?.repeat) g.span = `${ends(list[0], 0)} … ${ends(list[list.length - 1], 1)}`; // "h.0 … h.23"
  }
  return { groups, children, layersOf, roots: children.get(null) || [], keyOfLayer };
}

/** The rows shown for the set of expanded keys: [{key, label, layers, leaf, depth, open}], in layer order; an
 * expanded block keeps its row (open: a click folds it again) above its members. */
export function visibleRows(tree, expanded) {
  const out = [];
  const walk = (key, depth) => {
    const kids = tree.children.get(key) || [];
    const g = tree.groups.get(key), layers = tree.layersOf.get(key);
    if (kids.length === 1) { walk(kids[0], depth); return; }
    const open = kids.length > 0 && expanded.has(key);
    out.push({ key, label: labelOf(g, layers.length), layers, leaf: !kids.length, depth, open });
    if (open) for (const c of kids) walk(c, depth + 1);
  };
  for (const r of tree.roots) walk(r, 0);
  return out;
}

function labelOf(g, n) {
  const name = g.name !== null && g.name !== undefined ? g.name.replace(/\u0000own$/, "") : g.label;
  if (g.cls === "layer") return name;
  return g.repeat ? `${g.span} (${g.members} blocks, ${n} layers)` : `${name} (${n} layers)`;
}

/** The keys to expand first: blocks open a depth at a time, outermost first, while all the rows stay within `limit`
 * (a level that would not fit stays folded whole, so no block reads differently from its siblings). */
export function initialExpanded(tree, limit = ROW_LIMIT) {
  const expanded = new Set();
  for (;;) {
    const rows = visibleRows(tree, expanded);
    const closed = rows.filter((r) => !r.leaf && !r.open);
    if (!closed.length) return expanded;
    const depth = Math.min(...closed.map((r) => r.depth));
    const level = closed.filter((r) => r.depth === depth);
    const more = level.reduce((n, r) => n + (tree.children.get(r.key) || []).length, 0);
    if (rows.length + more > limit) return expanded;
    for (const r of level) expanded.add(r.key);
  }
}
