"""Gradient health: where a gradient turns NaN/Inf, vanishes or explodes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx
import torch

from hookwidget._torch.norms import foreach_norm
from hookwidget.stats import l2_norm_map


@dataclass(frozen=True)
class LayerHealth:
    name: str
    grad_norm: float | None  # norm of the layer's parameter gradients
    weight_norm: float | None
    delta_norm: float | None
    nonfinite: int  # NaN + Inf entries in δ and the parameter gradients
    vanishing: bool
    exploding: bool

    @property
    def flags(self) -> list[str]:
        return [f for f, on in (("nonfinite", self.nonfinite > 0), ("vanishing", self.vanishing),
                                ("exploding", self.exploding)) if on]


@dataclass
class Health:
    layers: dict = field(default_factory=dict)  # name -> LayerHealth
    nonfinite_nodes: list = field(default_factory=list)  # graph node ids, backward order
    first_nonfinite_node: str | None = None

    @property
    def flagged(self) -> dict:
        return {n: h.flags for n, h in self.layers.items() if h.flags}

    def __repr__(self) -> str:
        lines = [f"first non-finite gradient at: {self.first_nonfinite_node or 'none'}"]
        for n, flags in self.flagged.items():
            h = self.layers[n]
            lines.append(f"  {n}: {', '.join(flags)} (|grad| {h.grad_norm:.3g}, |W| {h.weight_norm:.3g})")
        return "\n".join(lines) if len(lines) > 1 else lines[0] + "\n  all layers healthy"


def health(trace, vanishing: float = 1e-7, exploding: float = 1e3) -> Health:
    """Flag a layer as vanishing when ‖grad‖ < vanishing·‖W‖, exploding when ‖grad‖ > exploding·‖W‖."""
    out = Health()
    # judged by the largest entry: the float32 norm of a huge but finite gradient overflows to inf
    g = trace.graph
    bad = {n for n, d in g.nodes(data=True) if d.get("grad_max") is not None and not math.isfinite(d["grad_max"])}
    if bad:  # edges point the way gradients flow: a node's gradient comes from the nodes before it
        when = {n: (d["order"] is None, d["order"] or 0) for n, d in g.nodes(data=True)}
        out.nonfinite_nodes = [n for n in nx.lexicographical_topological_sort(g, key=when.__getitem__) if n in bad]
    out.first_nonfinite_node = out.nonfinite_nodes[0] if out.nonfinite_nodes else None
    names = {id(p): n for n, p in trace.params.items()}
    rows = []  # (name, grads, params, delta or None, delta_summary or None)
    for name, layer in trace.layers.items():
        params = [p for p in layer.module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        grads = [g for g in (trace.param_grads.get(names.get(id(p))) for p in params) if g is not None]
        params = [p.detach() for p in params]
        c = layer.calls[0]
        rows.append((name, grads, params, c.delta, c.delta_summary if c.delta is None else None))
    # every tensor's norm in one batched pass (the graph build reduced the .grads and δ already: stats.l2_norms)
    flat = [t for _, grads, params, delta, _ in rows for t in (*grads, *params, *(() if delta is None else (delta,)))]
    known = l2_norm_map({id(t): t for t in flat})
    for name, grads, params, delta, summary in rows:
        gn, g_finite = _layer_norm(grads, known) if grads else (None, True)
        wn, _ = _layer_norm(params, known)
        nonfinite = 0 if g_finite else sum(_count_nonfinite(g) for g in grads)
        if delta is not None:
            dn, d_finite = _layer_norm([delta], known)
            nonfinite += 0 if d_finite else _count_nonfinite(delta)
        elif summary is not None:
            dn = summary.norm
            nonfinite += summary.nan + summary.inf
        else:
            dn = None
        usable = gn is not None and g_finite
        out.layers[name] = LayerHealth(name, gn, wn, dn, nonfinite,
                                       vanishing=usable and gn < vanishing * max(wn, 1e-12),
                                       exploding=usable and gn > exploding * max(wn, 1e-12))
    return out


def _layer_norm(ts, known: dict) -> tuple[float, bool]:
    """(‖ts‖₂ over all tensors, whether every entry is finite) from the batched norms; where one came out 0 or
    not finite (squares that underflow, a huge but finite entry, a NaN), _norm's careful path decides."""
    norms = [known[id(t)] for t in ts]
    if all(math.isfinite(v) and v > 0 for v in norms):
        return math.sqrt(sum(v * v for v in norms)), True
    return _norm(ts)


def _norm(ts) -> tuple[float, bool]:
    """(‖ts‖₂ over all tensors, whether every entry is finite), from fused reductions. A float32
    norm that came out inf (a huge but finite gradient) or 0 (squares that underflow) is computed
    again with each tensor scaled by its largest entry first."""
    ts = [t.detach() if t.dtype in (torch.float32, torch.float64) else t.detach().float() for t in ts]
    norms = torch.stack(foreach_norm(ts)).double()
    redo = [i for i, v in enumerate(norms.tolist()) if not (math.isfinite(v) and v > 0)]
    if redo:
        careful = [ts[i] for i in redo]
        maxima = torch.stack(foreach_norm(careful, float("inf"))).double()
        if not bool(torch.isfinite(maxima).all()):
            return float("nan"), False
        scaled = foreach_norm([t / m if m > 0 else t for t, m in zip(careful, maxima.tolist())])
        norms[redo] = torch.stack(scaled).double() * maxima
    return float(torch.linalg.vector_norm(norms)), True


def _count_nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())
