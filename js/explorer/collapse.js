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

/** Visible items and edges: {items: Map(key -> item), edges: [[ku, kv]], clusters: [group keys expanded and shown]} */
export function visibleGraph(graph, groups, expanded) {
  const n = graph.id.length;
  const cache = new Map();
  const keys = new Array(n);
  const items = new Map();
  for (let i = 0; i < n; i++) {
    const k = (keys[i] = keyOf(groups, graph, expanded, i, cache));
    let item = items.get(k);
    if (!item) {
      if (k.startsWith("m:")) {
        const g = groups.get(k.slice(2));
        item = { key: k, kind: "module", group: g.key, module: g.name, label: g.label, cls: g.cls, chunk: g.chunk, nodes: [], roles: new Set() };
      } else {
        item = { key: k, kind: "node", index: i, id: graph.id[i], label: graph.name[i], role: graph.role[i], module: graph.module[i], nodes: [], roles: new Set() };
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
  return { items, edges, clusters: [...clusters], keys };
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
