"""The autograd graph of grad_fn nodes as a networkx.DiGraph.

The walk is iterative (a 40,000-node chain would overflow a recursive one) and
breadth-first from the backward roots, so the same code gives the same node ids:
`"<name>#<k>"`, the k-th node of that name met by the walk. `id(grad_fn)` is no id:
Python reuses it once a graph is freed.
"""

from __future__ import annotations

import bisect
from collections import Counter

import networkx as nx

from hookwidget._torch.autograd import sequence_nrs
from hookwidget.stats import fused_norms, norms_to_floats, remember_l2

# Nodes that hooks add to the graph (full module backward hooks); hidden unless asked for.
HOOK_NODE_NAMES = ("BackwardHookFunctionBackward",)


def node_name(node) -> str:
    """`AddmmBackward0`, `AccumulateGrad` (without the C++ namespace)."""
    return node.name().rpartition("::")[2]


_NAMES: dict = {}  # node type -> node_name, where the type carries the name (asked once per node per walk)


def _cached_name(node) -> str:
    cls = type(node)
    name = _NAMES.get(cls)
    if name is None:
        name = node_name(node)
        if cls.__name__ == name:  # a type named as its nodes are (C++ nodes, autograd.Function backward types)
            _NAMES[cls] = name
    return name


class GraphWalk:
    """Grows as backward calls reveal roots; records nodes, edges and what hooks saw."""

    def __init__(self):
        self.nodes: list = []
        self._ids: list[str] = []  # see ids
        self.names: list[str] = []  # node_name of each node
        self.edges: list[tuple[int, int]] = []
        self.inputs: list[int] = []  # for each grad-less input slot: the node that consumed it
        self.roots: set[int] = set()
        self.grad_norm: dict = {}  # node index -> [‖g‖₂, ‖g‖∞]: a tensor or pair of 0-d tensors (on device until
        # built), or a pair of floats
        self.shape: dict = {}
        self.order: dict = {}  # node index -> position in backward execution
        self.pending_norms: dict = {}  # node index -> the tensor whose norms are that node's (reduced in build)
        self.same_norm: dict = {}  # node index -> a node that the same gradient (reshaped) arrives at
        self.variables: list = []  # once frozen: each node's leaf tensor (AccumulateGrad) or None
        self.seq: list = []  # once frozen: each node's autograd sequence number
        self._index: dict = {}
        self._names: Counter = Counter()  # name -> nodes of that name given an id so far

    @property
    def ids(self) -> list[str]:
        """Each node's id, `"<name>#<k>"`: made when first asked for (the graph is built, an intervention on a
        node looked up), not for every node of every backward pass."""
        ids, names = self._ids, self.names
        if len(ids) < len(names):
            counts = self._names
            for name in names[len(ids):]:
                k = counts[name]
                ids.append(f"{name}#{k}")
                counts[name] = k + 1
        return ids

    def extend(self, roots) -> list[int]:
        """Walk from `roots` (grad_fn nodes); return the indices of nodes not seen before."""
        new: list[int] = []
        index, nodes, edges, inputs = self._index, self.nodes, self.edges, self.inputs
        for r in roots:
            i = index.get(r)
            if i is None:
                i = self._add(r)
                new.append(i)
            self.roots.add(i)
        names, known = self.names, _NAMES
        k = 0
        while k < len(new):  # breadth-first: `new` is the queue
            i = new[k]
            k += 1
            for child, _ in nodes[i].next_functions:
                if child is None:
                    inputs.append(i)
                    continue
                j = index.get(child)
                if j is None:  # _add, inlined: a walk visits every node of every backward pass
                    j = index[child] = len(nodes)
                    names.append(known.get(type(child)) or _cached_name(child))
                    nodes.append(child)
                    new.append(j)
                edges.append((i, j))
        return new

    def freeze(self) -> None:
        """Keep what `build` needs and let the grad_fn objects go: they hold the graph's saved
        tensors, which a trace must not keep alive beyond the backward pass."""
        if self.nodes is None:
            return
        self.variables = [n.variable if name == "AccumulateGrad" else None for n, name in zip(self.nodes, self.names)]
        self.seq = sequence_nrs(self.nodes)
        self.nodes, self._index = None, {}

    def _add(self, node) -> int:
        i = self._index[node] = len(self.nodes)
        self.names.append(_cached_name(node))
        self.nodes.append(node)
        return i


def build(walk: GraphWalk, param_names: dict, calls: list, *, show_hook_nodes: bool = False) -> nx.DiGraph:
    """The DiGraph of the walk. `param_names` maps leaf tensors to qualified names;
    `calls` are (module name, seq_start, seq_end) of every recorded module call."""
    owner = _module_owner(walk, calls)
    g = nx.DiGraph()
    pending = walk.pending_norms
    norms = norms_to_floats({**walk.grad_norm, **fused_norms(pending)})
    for i, t in pending.items():  # the payload shows these tensors' norms too (a .grad, a δ): reduced once
        remember_l2(t, norms[i][0])
    for i, j in walk.same_norm.items():
        if i not in norms and j in norms:
            norms[i] = norms[j]
    walk.freeze()
    ids, roots, none = walk.ids, walk.roots, (None, None)
    rows = []
    for i, name in enumerate(walk.names):
        variable = walk.variables[i]
        if variable is not None:
            pname = param_names.get(variable, "")
            role = "param" if pname else "leaf"
            module = pname.rpartition(".")[0] if pname else ""
            shape = tuple(variable.shape)
        else:
            pname, role, module, shape = "", "root" if i in roots else "op", owner.get(i, ""), walk.shape.get(i)
        norm = norms.get(i, none)
        rows.append((ids[i], {"name": name, "role": role, "module": module, "param": pname, "shape": shape,
                              "grad_norm": norm[0], "grad_max": norm[1], "order": walk.order.get(i)}))
    g.add_nodes_from(rows)
    g.add_edges_from((ids[u], ids[v]) for u, v in walk.edges)
    for k, consumer in enumerate(walk.inputs):
        nid = f"input#{k}"
        g.add_node(nid, name="input", role="input", module=g.nodes[ids[consumer]]["module"], param="",
                   shape=None, grad_norm=None, grad_max=None, order=None)
        g.add_edge(ids[consumer], nid)
    if not show_hook_nodes:
        _splice_out(g, [n for n, d in g.nodes(data=True) if d["name"].startswith(HOOK_NODE_NAMES)])
    return g


def _module_owner(walk: GraphWalk, calls: list) -> dict:
    """Node index -> innermost module whose forward call created it (by autograd sequence number)."""
    if not calls:
        return {}
    # Sort intervals so that an enclosing call comes before the calls it contains.
    intervals = sorted(calls, key=lambda c: (c[1], -c[2]))
    starts = [c[1] for c in intervals]
    owner = {}
    for i, seq in enumerate(walk.seq):
        if walk.variables[i] is not None:
            continue
        k = bisect.bisect_right(starts, seq) - 1
        # Walk back to the innermost interval containing seq (the latest-starting that still contains it).
        while k >= 0:
            name, start, end = intervals[k]
            if start <= seq < end:
                owner[i] = name
                break
            k -= 1
    return owner


def _splice_out(g: nx.DiGraph, nodes: list) -> None:
    for n in nodes:
        preds, succs = list(g.predecessors(n)), list(g.successors(n))
        g.remove_node(n)
        g.add_edges_from((p, s) for p in preds for s in succs)
