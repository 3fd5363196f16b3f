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
        self._sq: dict = {}  # leading dimension -> (B,) sum of squared norms
        self._layers: dict = {}  # leading dimension -> modules counted in it
        self._shared: dict = {}  # parameter -> list of (module, Factor)
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
                self._shared.setdefault(p, []).append((module, f))
            else:
                self._add(module, fx.per_sample_norm_sq(f))
        for c in calls:
            c.a = c.delta = None

    def _add(self, module, sq: torch.Tensor) -> None:
        b = sq.shape[0]
        self._sq[b] = self._sq[b] + sq if b in self._sq else sq
        self._layers.setdefault(b, []).append(module)

    def result(self):
        """(B,) squared norms for the batch size most layers agree on, and the modules left out
        because their inputs had another leading dimension (their gradient is summed over the batch)."""
        for pairs in self._shared.values():
            if len({f.D.shape[0] for _, f in pairs}) == 1:
                self._add(pairs[0][0], sum(fx.per_sample_grad(f) for _, f in pairs).flatten(1).pow(2).sum(1))
        if not self._sq:
            return None, []
        batch = max(self._layers, key=lambda b: len(self._layers[b]))
        left_out = [m for b, ms in self._layers.items() if b != batch for m in ms]
        return self._sq[batch], left_out
