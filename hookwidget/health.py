"""Gradient health: where a gradient turns NaN/Inf, vanishes or explodes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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
    bad = [(d["order"], n) for n, d in trace.graph.nodes(data=True)
           if d.get("grad_max") is not None and not math.isfinite(d["grad_max"])]
    out.nonfinite_nodes = [n for _, n in sorted(bad, key=lambda x: (x[0] is None, x[0] or 0))]
    out.first_nonfinite_node = out.nonfinite_nodes[0] if out.nonfinite_nodes else None
    for name, layer in trace.layers.items():
        params = [p for p in layer.module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        grads = [trace.param_grads.get(_param_name(trace, p)) for p in params]
        grads = [g for g in grads if g is not None]
        gn = _norm(grads) if grads else None
        wn = _norm([p.detach() for p in params])
        nonfinite = sum(int((~torch.isfinite(g)).sum()) for g in grads)
        c = layer.calls[0]
        if c.delta is not None:
            dn = float(torch.linalg.vector_norm(c.delta.double()))
            nonfinite += int((~torch.isfinite(c.delta)).sum())
        elif c.delta_summary is not None:
            dn = c.delta_summary.norm
            nonfinite += c.delta_summary.nan + c.delta_summary.inf
        else:
            dn = None
        finite = gn is not None and math.isfinite(gn)
        out.layers[name] = LayerHealth(name, gn, wn, dn, nonfinite,
                                       vanishing=finite and gn < vanishing * max(wn, 1e-12),
                                       exploding=finite and gn > exploding * max(wn, 1e-12))
    return out


def _param_name(trace, p) -> str | None:
    for n, q in trace.params.items():
        if q is p:
            return n
    return None


def _norm(ts) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in ts])))
