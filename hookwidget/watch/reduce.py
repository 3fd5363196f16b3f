"""Statistics reduced on the parameters' device as small float64 tensors: no host sync on GPU.

On CPU, reading a value is no host-device sync, so NaN/Inf counts (the costliest reductions there)
are computed only when a norm says a tensor is not finite.
"""

from __future__ import annotations

import math

import torch

# Per-layer statistics, in this order along the last axis of Watch.stats.
STAT_NAMES = ("delta_norm", "delta_max", "delta_nan", "delta_inf", "a_rms", "a_zero_frac", "a_nonfinite",
              "grad_norm", "weight_norm", "update_ratio", "grad_nan", "grad_inf")
STEP_STAT_NAMES = ("loss", "grad_norm")
S = {name: i for i, name in enumerate(STAT_NAMES)}
NAN = float("nan")
F64 = torch.float64


def _counts(t: torch.Tensor, norm: torch.Tensor) -> list:
    """[NaN count, Inf count] of t as float64 0-d tensors."""
    if t.device.type == "cpu" and math.isfinite(norm.item()):
        z = torch.zeros((), dtype=F64)
        return [z, z]
    return [torch.isnan(t).sum(dtype=F64), torch.isinf(t).sum(dtype=F64)]


def _max_abs(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        return torch.linalg.vector_norm(t, float("inf"))
    lo, hi = torch.aminmax(t)
    return torch.maximum(lo.abs(), hi.abs())  # NaN propagates


def _float(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t if t.is_floating_point() else t.float()


def delta_stats(g: torch.Tensor) -> torch.Tensor:
    """[‖g‖², max|g|, NaN count, Inf count] (float64, on g's device)."""
    g = _float(g)
    if g.numel() == 0:
        return torch.zeros(4, dtype=F64, device=g.device)
    n = torch.linalg.vector_norm(g)
    return torch.stack([n.double().square(), _max_abs(g).double(), *_counts(g, n)])


def add_delta(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Statistics of two calls' δ together."""
    out = old + new
    out[1] = torch.maximum(old[1], new[1])
    return out


def input_stats(a: torch.Tensor) -> torch.Tensor:
    """[Σa², number of zero entries, number of NaN/Inf entries, number of entries] (float64, on a's device)."""
    a = _float(a)
    n = a.numel()
    if n == 0:
        return torch.zeros(4, dtype=F64, device=a.device)
    norm = torch.linalg.vector_norm(a)
    count = torch.full((), float(n), dtype=F64, device=a.device)  # a fill, not a host-to-device copy
    if a.device.type == "cpu" and math.isfinite(norm.item()):
        bad = torch.zeros((), dtype=F64)
    else:  # ‖a‖ also overflows for finite entries past ~1e19: count
        bad = count - torch.isfinite(a).sum(dtype=F64)
    return torch.stack([norm.double().square(), count - torch.count_nonzero(a), bad, count])


class Rows:
    """Turns what one step gathered into its (layers, stats) row, with cached index tensors."""

    def __init__(self, n_layers: int, params: list, pairs: list):
        self.L, self.params, self.pairs = n_layers, params, pairs  # pairs: (layer index, param index)
        self._cache: dict = {}

    def _grad_index(self, present: tuple, dev):
        """For the params with a .grad: (index into 2L of each [grad norm.., weight norm..], mask of layers
        with a grad, pair -> position of its param among the present ones)."""
        hit = self._cache.get(present)
        if hit is None or hit[0].device != dev:
            pos = {pi: j for j, pi in enumerate(present)}
            n = len(present)
            g_pairs = [(li, pos[pi]) for li, pi in self.pairs if pi in pos]
            order = [j for _, j in g_pairs] + [n + pi for _, pi in self.pairs]
            index = [li for li, _ in g_pairs] + [self.L + li for li, _ in self.pairs]
            has = [False] * self.L + [True] * self.L
            for li, _ in g_pairs:
                has[li] = True
            t = torch.tensor
            hit = self._cache[present] = (t(index, device=dev), t(has, device=dev), t(order, device=dev),
                                          t([li for li, _ in g_pairs], device=dev), [j for _, j in g_pairs])
        return hit

    def row(self, delta: dict, a: dict, loss, dev) -> tuple[torch.Tensor, torch.Tensor]:
        L, params = self.L, self.params
        nan4 = torch.full((4,), NAN, dtype=F64, device=dev)
        d = torch.stack([delta[i].to(dev) if i in delta else nan4 for i in range(L)])
        d[:, 0].sqrt_()
        nan4 = torch.full((4,), NAN, dtype=F64, device=dev)
        a_sum = torch.stack([a[i].to(dev) if i in a else nan4 for i in range(L)])
        a_part = a_sum[:, :3] / a_sum[:, 3:].clamp(min=1)
        a_part[:, 0].sqrt_()
        a_part[:, 2] = a_sum[:, 2]  # a count, not a fraction
        present = tuple(i for i, p in enumerate(params) if p.grad is not None)
        grads = [_dense(params[i].grad) for i in present]
        index, has, order, g_layers, g_pos = self._grad_index(present, dev)
        norms = torch._foreach_norm(grads + [p.detach() for p in params])
        sq = torch.stack([n.to(dev) for n in norms]).double().square_()
        gw = torch.zeros(2 * L, dtype=F64, device=dev).index_add_(0, index, sq[order]).sqrt_()
        gw.masked_fill_(~has, NAN)
        total = sq[:len(grads)].sum().sqrt() if grads else torch.full((), NAN, dtype=F64, device=dev)
        gc = torch.zeros(L, 2, dtype=F64, device=dev)
        if grads and (dev.type != "cpu" or not math.isfinite(total.item())):
            counts = torch.stack([torch.stack([torch.isnan(g).sum(), torch.isinf(g).sum()]) for g in grads]).double()
            gc.index_add_(0, g_layers, counts[g_pos])
        upd = torch.full((L, 1), NAN, dtype=F64, device=dev)
        row = torch.cat([d, a_part, gw.view(2, L).T, upd, gc], dim=1)
        loss = loss.to(dev).double() if loss is not None else torch.full((), NAN, dtype=F64, device=dev)
        return row, torch.stack([loss, total])

    def update(self, key: tuple, deltas: list, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ‖ΔW‖² per layer from the ΔW of params `key` (param indices), and the mask of layers touched."""
        hit = self._cache.get(("u", key))
        if hit is None or hit[0].device != dev:
            pos = {pi: j for j, pi in enumerate(key)}
            pairs = [(li, pos[pi]) for li, pi in self.pairs if pi in pos]
            mask = [False] * self.L
            for li, _ in pairs:
                mask[li] = True
            hit = self._cache[("u", key)] = (torch.tensor([li for li, _ in pairs], device=dev),
                                             torch.tensor([j for _, j in pairs], device=dev),
                                             torch.tensor(mask, device=dev))
        layers, gather, mask = hit
        sq = torch.stack([n.to(dev) for n in deltas]).double().square_()[gather]
        return torch.zeros(self.L, dtype=F64, device=dev).index_add_(0, layers, sq), mask


def _dense(g: torch.Tensor) -> torch.Tensor:
    return g.coalesce().values() if g.is_sparse else g.detach()
