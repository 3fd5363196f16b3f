"""Per-sample gradient norms computed while backward runs, freeing the factors at once.

Used by capture="norms": a layer's norms are computed as soon as the δ of its last call
arrives, and its a and δ are dropped. A parameter shared by several layers (weight tying)
keeps its factors until the end, since its per-sample gradient is the sum over those layers.
"""

from __future__ import annotations

from collections import Counter

import torch

from . import factors as fx


class StreamingNorms:
    def __init__(self):
        self._sq: torch.Tensor | float = 0.0
        self._shared: dict = {}  # parameter -> list of Factor
        self._owners: Counter | None = None

    def wants(self, module) -> bool:
        return fx.unsupported_reason(module) is None and any(
            p.requires_grad for p in module.parameters(recurse=False))

    def on_delta(self, module, calls, modules) -> None:
        if any(c.delta is None or c.a is None for c in calls):
            return  # wait for the last call's δ
        if self._owners is None:
            self._owners = Counter(id(p) for m in modules for p in m.parameters(recurse=False))
        for f in fx.factors(module, calls):
            p = getattr(module, f.param)
            if self._owners[id(p)] > 1:
                self._shared.setdefault(p, []).append(f)
            else:
                self._sq = self._sq + fx.per_sample_norm_sq(f)
        for c in calls:
            c.a = c.delta = None

    def result(self) -> torch.Tensor | None:
        sq = self._sq
        for fs in self._shared.values():
            sq = sq + sum(fx.per_sample_grad(f) for f in fs).flatten(1).pow(2).sum(1)
        return sq if isinstance(sq, torch.Tensor) else None
