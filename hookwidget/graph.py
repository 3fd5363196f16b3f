"""The autograd graph of grad_fn nodes as a networkx.DiGraph.

The walk is iterative (a 40,000-node chain would overflow a recursive one) and
breadth-first from the backward roots, so the same code gives the same node ids:
`"<name>#<k>"`, the k-th node of that name met by the walk. `id(grad_fn)` is no id:
Python reuses it once a graph is freed.
"""

from __future__ import annotations

import bisect
import weakref
from collections import Counter

import networkx as nx

ROLES = ("root", "op", "param", "leaf", "input")
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
        self.seq = [n._sequence_nr() for n in self.nodes]
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
    norms = _norms_to_floats({**walk.grad_norm, **_fused_norms(pending)})
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


_SMALL = 1 << 16  # on CPU, ‖t‖∞ of tensors up to this size from the multi-tensor kernel, of larger ones from aminmax


def _fused_norms(tensors: dict, linf: bool = True) -> dict:
    """[‖t‖₂, ‖t‖∞] of many tensors with a few multi-tensor reductions, not two kernels each (without
    `linf`: [‖t‖₂, None])."""
    import torch

    ts = [_dense_values(t) for t in tensors.values()]
    ts = [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in ts]
    if not ts:
        return {}
    l2 = torch._foreach_norm(ts)
    if not linf:
        return {i: (a, None) for i, a in zip(tensors, l2)}
    cpu = all(t.device.type == "cpu" for t in ts)
    # the multi-tensor ∞-norm: not of empty tensors (no identity), and on CPU only of small ones (for
    # large ones the ∞-norm kernel is ~9x slower than aminmax there)
    fused = [k for k, t in enumerate(ts) if t.numel() and (not cpu or t.numel() <= _SMALL)]
    peaks = [None] * len(ts)
    if fused:
        for k, v in zip(fused, torch._foreach_norm([ts[k] for k in fused], float("inf"))):
            peaks[k] = v
    if len(fused) < len(ts):
        from .summary import max_abs

        for k, t in enumerate(ts):
            if peaks[k] is None:
                peaks[k] = max_abs(t)
    return {i: (a, b) for i, a, b in zip(tensors, l2, peaks)}


def _dense_values(t):
    """The values whose norms are t's: a sparse gradient's (Embedding(sparse=True)) after coalescing."""
    import torch

    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t.coalesce()._values()
    return t.to_dense()


def _norms_to_floats(norms: dict) -> dict:
    if not norms:
        return {}
    import torch

    by_device: dict = {}
    out = {}
    for k, v in norms.items():
        if isinstance(v, tuple) and isinstance(v[0], float):  # read on the host already
            out[k] = v
        else:
            by_device.setdefault((v[0] if isinstance(v, tuple) else v).device, []).append(k)
    for ks in by_device.values():
        rows = [torch.stack(norms[k]) if isinstance(norms[k], tuple) else norms[k] for k in ks]
        for k, v in zip(ks, torch.stack([r.double() for r in rows]).cpu().tolist()):
            out[k] = v
    return out


def _splice_out(g: nx.DiGraph, nodes: list) -> None:
    for n in nodes:
        preds, succs = list(g.predecessors(n)), list(g.successors(n))
        g.remove_node(n)
        g.add_edges_from((p, s) for p in preds for s in succs)


# -- 2-norms already reduced, by tensor ---------------------------------------------------------------
# The payload shows the norms of tensors that the graph's nodes carry too (a parameter's .grad, a layer's δ):
# each large tensor is read once. Keyed by id(), checked by a weak reference and the version counter, so a
# freed tensor's id reused by another, or a tensor changed in place, is reduced again.
_L2: dict = {}


def remember_l2(t, value: float) -> None:
    """Note ‖t‖₂ = value (a float read on the host); not for a tensor without a version counter (inference mode)."""
    key, version = id(t), _version(t)
    if version is None:
        return
    try:
        ref = weakref.ref(t, lambda _, key=key: _L2.pop(key, None))
    except TypeError:
        return
    _L2[key] = (ref, version, value)


def known_l2(t) -> float | None:
    """‖t‖₂ if it was reduced before and t has not changed since, else None."""
    hit = _L2.get(id(t))
    if hit is None or hit[0]() is not t or hit[1] != _version(t):
        return None
    return hit[2]


def _version(t) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor tracks no version
        return None


def l2_norm_map(tensors: dict) -> dict:
    """key -> ‖t‖₂ (a float; None where t is None), every tensor reduced in one pass (l2_norms)."""
    keys = [k for k, t in tensors.items() if t is not None]
    out = dict(zip(keys, l2_norms([tensors[k] for k in keys]))) if keys else {}
    return {k: out.get(k) for k in tensors}


def l2_norms(ts: list) -> list[float]:
    """‖t‖₂ of each tensor, as floats: known ones from memory, the rest with one multi-tensor reduction per
    device and one read back to the host (not a kernel and a host read per tensor)."""
    out = [known_l2(t) for t in ts]
    todo = [k for k, v in enumerate(out) if v is None]
    if todo:
        fresh = _norms_to_floats({k: v for k, (v, _) in _fused_norms({k: ts[k] for k in todo}, linf=False).items()})
        for k in todo:
            out[k] = fresh[k]
            remember_l2(ts[k], fresh[k])
    return out
