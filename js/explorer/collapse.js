// Collapsing the grad_fn graph to modules: which boxes and edges are visible for a set of
// expanded modules. Pure functions (no DOM), so they are unit-tested directly.
//
// The hierarchy is the module tree (parent links from the kernel). A module with more than
// CHUNK children gets synthetic chunk groups ("blocks [0…49]"), recursively, so that expanding
// the root of a 10,000-layer chain never asks the layout for 10,000 boxes at once.

export const CHUNK = 50;
export const DEFAULT_LIMIT = 40; // boxes in the first view: few enough to read at ≥ 11 px
export const MIN_REPEAT = 3; // a run of this many same-class siblings h.0, h.1, … folds into one group

const NUMBERED = /^(.*?)(\d+)$/;

/** Module hierarchy with chunk groups: {groups: Map(key -> {key, name, label, cls, parent, depth, leaf, chunk}), order}. */
export function buildHierarchy(modules) {
  const groups = new Map();
  const children = new Map([[null, []]]);
  for (const m of modules) {
    groups.set(m.name, { key: m.name, name: m.name, label: m.name || "(root)", cls: m.cls, parent: m.parent ?? null, chunk: false });
    children.set(m.name, []);
  }
  for (const m of modules) {
    const p = m.parent !== null && m.parent !== undefined && groups.has(m.parent) ? m.parent : null;
    groups.get(m.name).parent = p;
    children.get(p).push(m.name);
  }
  // What a module is made of (its children's local names and classes): blocks fold only when alike, so
  // ResNet's layer1 … layer4 (3, 4, 6 and 3 blocks) stay apart while GPT-2's h.0 … h.11 fold.
  const shape = new Map(modules.map((m) => [m.name, children.get(m.name).map((c) => `${localName(c, m.name)}:${groups.get(c).cls}`).join(",")]));
  for (const [parent, kids] of [...children.entries()]) {
    const folded = foldRepeats(groups, parent, kids, shape);
    for (const [p, list] of folded) chunkChildren(groups, p, list);
  }
  for (const g of groups.values()) {
    let d = 0;
    for (let p = g.parent; p !== null; p = groups.get(p).parent) d++;
    g.depth = d;
  }
  for (const g of groups.values()) g.leaf = true;
  for (const g of groups.values()) if (g.parent !== null) groups.get(g.parent).leaf = false;
  return groups;
}

const localName = (name, parent) => (parent && name.startsWith(parent + ".") ? name.slice(parent.length + 1) : name);

/** Runs of ≥ MIN_REPEAT siblings of one class and one make-up (`shape`), named prefix0, prefix1, … (a ModuleList
 * of blocks) become one folded group "h.0 … h.11" · "GPT2Block × 12". Returns [[parent, children]] lists left to chunk. */
function foldRepeats(groups, parent, kids, shape) {
  const out = [];
  const top = [];
  let i = 0;
  while (i < kids.length) {
    const first = groups.get(kids[i]);
    const m = NUMBERED.exec(first.name ?? "");
    let j = i + 1;
    if (m) {
      while (j < kids.length) {
        const g = groups.get(kids[j]);
        const mj = NUMBERED.exec(g.name ?? "");
        if (!mj || mj[1] !== m[1] || g.cls !== first.cls || shape.get(g.key) !== shape.get(first.key)
          || Number(mj[2]) !== Number(m[2]) + (j - i)) break;
        j++;
      }
    }
    if (m && j - i >= MIN_REPEAT) {
      const run = kids.slice(i, j);
      const last = groups.get(run[run.length - 1]);
      const pname = parent === null ? null : groups.get(parent)?.name ?? null;
      const key = `\u0000repeat:${parent ?? ""}:${first.key}:${run.length}`;
      const label = `${localName(first.name, pname)} … ${localName(last.name, pname)}`;
      groups.set(key, { key, name: null, label, cls: `${first.cls} × ${run.length}`, parent, chunk: true, repeat: true, members: run.length });
      for (const k of run) groups.get(k).parent = key;
      top.push(key);
      out.push([key, run]);
    } else {
      for (let k = i; k < j; k++) top.push(kids[k]);
    }
    i = j;
  }
  out.push([parent, top]);
  return out;
}

function chunkChildren(groups, parent, kids) {
  let level = kids;
  while (level.length > CHUNK) {
    const next = [];
    for (let i = 0; i < level.length; i += CHUNK) {
      const part = level.slice(i, i + CHUNK);
      const first = groups.get(part[0]), last = groups.get(part[part.length - 1]);
      const key = `\u0000chunk:${parent ?? ""}:${first.key}:${part.length}`;
      const label = `${first.label} … ${last.label}`;
      groups.set(key, { key, name: null, label, cls: `${part.length} groups`, parent, chunk: true });
      for (const k of part) groups.get(k).parent = key;
      next.push(key);
    }
    level = next;
  }
}

/** Ancestor chain of a group, outermost first (including the group itself). */
export function chain(groups, key) {
  const out = [];
  for (let k = key; k !== null && k !== undefined; k = groups.get(k).parent) out.unshift(k);
  return out;
}

/** The visible key of graph node i: the outermost collapsed group on its module's chain, or the node itself. */
export function keyOf(groups, graph, expanded, i, cache = new Map()) {
  const mod = graph.module[i];
  if (!mod || !groups.has(mod)) return `n:${i}`;
  let k = cache.get(mod);
  if (k === undefined) {
    k = null;
    for (const g of chain(groups, mod)) if (!expanded.has(g)) { k = `m:${g}`; break; }
    cache.set(mod, k);
  }
  return k ?? `n:${i}`;
}

/** Visible items and edges: {items: Map(key -> item), edges: [[ku, kv]], clusters: [group keys expanded and shown],
 * frames: Map(frame key -> {key, group, parent frame key or null, part, parts})}.
 *
 * A module called several times (a pool after conv1 and after conv2) holds ops that a path leaves and comes back
 * to: drawn as one box, that path would be an edge back up into it (a false cycle), and its frame, expanded, would
 * enclose what lies between its calls. So a group whose ops a path re-enters is split into parts, one per entry
 * (entries(): the most times a path from the loss has entered it), which for a module called in sequence is one
 * part per call: boxes and frames are drawn per part and the drawn graph stays acyclic. Items and frames of a
 * split group carry {part, parts} (part 1 = the first in forward order). */
export function visibleGraph(graph, groups, expanded) {
  const n = graph.id.length;
  const cache = new Map();
  const keys = new Array(n);
  const chains = new Map(); // module -> visible groups on its chain, outermost first (expanded ones, then the box)
  const chainOf = (i) => {
    const mod = graph.module[i];
    if (!mod || !groups.has(mod)) return [];
    let c = chains.get(mod);
    if (!c) {
      c = [];
      for (const g of chain(groups, mod)) { c.push(g); if (!expanded.has(g)) break; }
      chains.set(mod, c);
    }
    return c;
  };
  const members = new Map(); // visible group -> its nodes
  for (let i = 0; i < n; i++) {
    keys[i] = keyOf(groups, graph, expanded, i, cache);
    for (const g of chainOf(i)) { let m = members.get(g); if (!m) members.set(g, (m = [])); m.push(i); }
  }
  const split = new Map(); // group -> {parts, of(node) -> its part} (only groups a path re-enters)
  for (const [g, nodes] of members) { const e = entries(graph, nodes); if (e) split.set(g, e); }
  const frames = new Map();
  const items = new Map();
  for (let i = 0; i < n; i++) {
    const c = chainOf(i);
    let frame = null, suffix = "";
    const partAt = (g) => (split.has(g) ? split.get(g).of(i) : 0);
    for (const g of c) {
      if (!expanded.has(g)) break;
      const part = partAt(g);
      if (part) suffix += `@${part}`;
      const fk = g + suffix;
      if (!frames.has(fk)) frames.set(fk, { key: fk, group: g, parent: frame, part: part || null, parts: part ? split.get(g).parts : null });
      frame = fk;
    }
    let k = keys[i];
    const box = k.startsWith("m:") ? k.slice(2) : null;
    const part = box !== null ? partAt(box) : 0;
    if (k.startsWith("m:") && (suffix || part)) k = keys[i] = k + suffix + (part ? `@${part}` : "");
    let item = items.get(k);
    if (!item) {
      if (box !== null) {
        const g = groups.get(box);
        item = { key: k, kind: "module", group: g.key, module: g.name, label: g.label, cls: g.cls, chunk: g.chunk, nodes: [], roles: new Set(),
          frame, part: part || null, parts: part ? split.get(box).parts : null };
      } else {
        item = { key: k, kind: "node", index: i, id: graph.id[i], label: graph.name[i], role: graph.role[i], module: graph.module[i], nodes: [], roles: new Set(), frame };
      }
      items.set(k, item);
    }
    item.nodes.push(i);
    item.roles.add(graph.role[i]);
  }
  const seen = new Set();
  const edges = [];
  const E = graph.edges;
  for (let j = 0; j < E.length; j += 2) {
    const ku = keys[E[j]], kv = keys[E[j + 1]];
    if (ku === kv) continue;
    const e = ku + "\u0001" + kv;
    if (seen.has(e)) continue;
    seen.add(e);
    edges.push([ku, kv]);
  }
  const clusters = new Set();
  for (const item of items.values()) {
    const start = item.kind === "module" ? groups.get(item.group).parent : graph.module[item.index] && groups.has(graph.module[item.index]) ? graph.module[item.index] : null;
    for (let p = start; p !== null && p !== undefined; p = groups.get(p).parent) clusters.add(p);
  }
  return { items, edges, clusters: [...clusters], frames, keys };
}

const TOPO = new WeakMap();

/** Each node's position in a topological order of the graph (gradient flow: the loss first), and successor lists. */
function topology(graph) {
  let t = TOPO.get(graph);
  if (t) return t;
  const n = graph.id.length, E = graph.edges;
  const indeg = new Int32Array(n), start = new Int32Array(n + 1), succ = new Int32Array(E.length / 2);
  for (let j = 0; j < E.length; j += 2) { indeg[E[j + 1]]++; start[E[j] + 1]++; }
  for (let i = 0; i < n; i++) start[i + 1] += start[i];
  const fill = start.slice(0, n);
  for (let j = 0; j < E.length; j += 2) succ[fill[E[j]]++] = E[j + 1];
  const order = [], pos = new Int32Array(n);
  for (let i = 0; i < n; i++) if (!indeg[i]) order.push(i);
  for (let k = 0; k < order.length; k++) {
    const u = order[k];
    pos[u] = k;
    for (let s = start[u]; s < start[u + 1]; s++) if (--indeg[succ[s]] === 0) order.push(succ[s]);
  }
  for (let i = 0; i < n; i++) if (indeg[i] > 0) pos[i] = order.length; // a cycle (not an autograd graph): left out
  t = { order, pos, start, succ };
  TOPO.set(graph, t);
  return t;
}

/** For a node set a path leaves and re-enters: each node's part: {parts, of(node)}, from its entry count (the most times a path
 * from the loss has entered the set on reaching it); part 1 = the first call in forward order (the last entered).
 * null when no path re-enters (one box is acyclic). Walks only the topological span of the set. */
export function entries(graph, nodes) {
  if (nodes.length < 2) return null;
  const { order, pos, start, succ } = topology(graph);
  const inS = new Set(nodes);
  let lo = Infinity, hi = -1;
  for (const i of nodes) { if (pos[i] < lo) lo = pos[i]; if (pos[i] > hi) hi = pos[i]; }
  if (hi >= order.length) return null;
  const best = new Map();
  const e = new Map();
  let max = 0;
  for (let k = lo; k <= hi; k++) {
    const u = order[k], su = inS.has(u);
    const v = Math.max(best.get(u) ?? 0, su ? 1 : 0);
    if (su) { e.set(u, v); if (v > max) max = v; }
    for (let s = start[u]; s < start[u + 1]; s++) {
      const w = succ[s];
      if (pos[w] > hi) continue;
      const c = v + (inS.has(w) && !su ? 1 : 0);
      if (c > (best.get(w) ?? 0)) best.set(w, c);
    }
  }
  if (max < 2) return null;
  const part = new Map(nodes.map((i) => [i, max - e.get(i) + 1])); // gradient flow meets the last call first
  return { parts: max, of: (i) => part.get(i) };
}

/** Expanded set for the first view: non-leaf groups down to the deepest level that keeps at most `limit` boxes.
 * Folded repeats stay folded (their members are alike, one click away) unless the view would be nearly empty. */
export function initialExpanded(graph, groups, limit = DEFAULT_LIMIT) {
  const maxDepth = Math.max(0, ...[...groups.values()].map((g) => g.depth));
  const deepest = (openRepeats) => {
    let best = new Set();
    for (let d = 1; d <= maxDepth; d++) {
      const exp = new Set([...groups.values()].filter((g) => g.depth < d && !g.leaf && (openRepeats || (!g.repeat && !insideRepeat(groups, g)))).map((g) => g.key));
      if (countVisible(graph, groups, exp) > limit) break;
      best = exp;
    }
    return best;
  };
  const folded = deepest(false);
  return countVisible(graph, groups, folded) >= 8 ? folded : deepest(true);
}

function insideRepeat(groups, g) {
  for (let p = g.parent; p !== null && p !== undefined; p = groups.get(p).parent) if (groups.get(p).repeat) return true;
  return false;
}

export function countVisible(graph, groups, expanded) {
  const cache = new Map();
  const keys = new Set();
  for (let i = 0; i < graph.id.length; i++) keys.add(keyOf(groups, graph, expanded, i, cache));
  return keys.size;
}

/** Node indices whose name, module or id contains `query` (case-insensitive). */
export function search(graph, modules, query) {
  const q = query.trim().toLowerCase();
  if (!q) return { nodes: [], modules: [] };
  const nodes = [];
  for (let i = 0; i < graph.id.length; i++) {
    if (graph.id[i].toLowerCase().includes(q) || graph.param[i].toLowerCase().includes(q)) nodes.push(i);
  }
  return { nodes, modules: modules.filter((m) => m.name.toLowerCase().includes(q) || m.cls.toLowerCase().includes(q)).map((m) => m.name) };
}
