"""Statistics reduced on the parameters' device as small float64 tensors: no host sync on GPU.

On CPU, reading a value is no host-device sync, so NaN/Inf counts (the costliest reductions there)
are computed only when a norm says a tensor is not finite.
"""

from __future__ import annotations

import math
import sys

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


def norm(t: torch.Tensor) -> torch.Tensor:
    """‖t‖₂, accumulated in float32 at least (a bfloat16 norm keeps 3 digits: autocast's δ and a are bf16)."""
    low = t.dtype in (torch.float16, torch.bfloat16)
    return torch.linalg.vector_norm(t, dtype=torch.float32 if low else None)


def delta_stats(g: torch.Tensor) -> torch.Tensor:
    """[‖g‖², max|g|, NaN count, Inf count] (float64, on g's device)."""
    g = _float(g)
    if g.numel() == 0:
        return torch.zeros(4, dtype=F64, device=g.device)
    n = norm(g)
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
    n2 = norm(a)
    count = torch.full((), float(n), dtype=F64, device=a.device)  # a fill, not a host-to-device copy
    if a.device.type == "cpu" and math.isfinite(n2.item()):
        bad = torch.zeros((), dtype=F64)
    else:  # ‖a‖ also overflows for finite entries past ~1e19: count
        bad = count - torch.isfinite(a).sum(dtype=F64)
    return torch.stack([n2.double().square(), count - torch.count_nonzero(a), bad, count])


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
        norms = torch._foreach_norm(grads + [local(p) for p in params])
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

    def _entry_index(self, key: tuple, dev):
        """Cached index tensors for a step's layout: which layer each δ and a entry belongs to, which
        params have a .grad. key = (layers of the δ entries, layers of the a entries, params with a .grad)."""
        hit = self._cache.get(key)
        if hit is None or hit["dev"] != dev:
            d_layers, a_layers, present = key
            L, nd, na, ng = self.L, len(d_layers), len(a_layers), len(present)
            pos = {pi: j for j, pi in enumerate(present)}
            g_pairs = [(li, pos[pi]) for li, pi in self.pairs if pi in pos]
            # one index_add_ into (L, 6) sums: [‖δ‖², Σa², zeros of a, entries of a, ‖grad‖², ‖W‖²]
            src = (list(range(nd)) + [nd + j for j in range(na)] + [nd + na + j for j in range(na)]
                   + [nd + 2 * na + j for j in range(na)] + [nd + 3 * na + j for _, j in g_pairs]
                   + [nd + 3 * na + ng + pi for _, pi in self.pairs])
            dst = ([li * 6 for li in d_layers] + [li * 6 + 1 for li in a_layers] + [li * 6 + 2 for li in a_layers]
                   + [li * 6 + 3 for li in a_layers] + [li * 6 + 4 for li, _ in g_pairs]
                   + [li * 6 + 5 for li, _ in self.pairs])
            missing = torch.ones(L, 6, dtype=torch.bool)
            for li in d_layers:
                missing[li, 0] = False
            for li in a_layers:
                missing[li, 1:4] = False
            for li, _ in g_pairs:
                missing[li, 4] = False
            missing[:, 5] = False
            t = torch.tensor
            hit = self._cache[key] = {
                "dev": dev, "src": t(src, dtype=torch.long, device=dev), "dst": t(dst, dtype=torch.long, device=dev),
                "missing": missing.to(dev), "d_layers": t(list(d_layers), dtype=torch.long, device=dev),
                "d_missing": missing[:, 0].to(dev), "g_layers": t([li for li, _ in g_pairs], dtype=torch.long,
                                                                   device=dev),
                "g_pos": [j for _, j in g_pairs], "a_layers": t(list(a_layers), dtype=torch.long, device=dev)}
        return hit

    def row_from(self, ds: list, as_: list, loss, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's row from the tensors themselves, reduced once at the end of backward with few kernels.
        ds: (layer, δ) per call backward reached; as_: (layer, a) per such call with an input."""
        L, params = self.L, self.params
        dg = [_float(g) for _, g in ds]
        ag = [_float(a) for _, a in as_]
        present = tuple(i for i, p in enumerate(params) if p.grad is not None)
        grads = [_dense(params[i].grad) for i in present]
        ws = [local(p) for p in params]
        key = (tuple(li for li, _ in ds), tuple(li for li, _ in as_), present)
        ix = self._entry_index(key, dev)
        nd, na, ng = len(dg), len(ag), len(grads)
        with torch.no_grad():
            norms = _norms(dg + ag + grads + ws)
            mm = [x for g in dg for x in (torch.aminmax(g) if g.numel() else (_ZERO, _ZERO))]
            zeros = [torch.count_nonzero(a) for a in ag]
            sq = torch.stack([n.to(dev) for n in norms]).double().square_()
            parts = [sq[:nd + na]]
            if na:
                entries = torch.tensor([float(a.numel()) for a in ag], dtype=F64, device=dev)
                parts += [entries - torch.stack(zeros).to(dev, F64), entries]
            parts.append(sq[nd + na:])
            vals = torch.cat(parts) if len(parts) > 1 else parts[0]
            sums = torch.zeros(L * 6, dtype=F64, device=dev).index_add_(0, ix["dst"], vals[ix["src"]]).view(L, 6)
            sums.masked_fill_(ix["missing"], NAN)
            row = torch.empty(L, len(STAT_NAMES), dtype=F64, device=dev)
            row[:, S["delta_norm"]] = sums[:, 0].sqrt()
            if nd:
                lohi = torch.stack([m.to(dev) for m in mm]).double().abs_().view(nd, 2).amax(1)
                dmax = torch.zeros(L, dtype=F64, device=dev).scatter_reduce_(0, ix["d_layers"], lohi, "amax",
                                                                             include_self=False)
                row[:, S["delta_max"]] = dmax.masked_fill_(ix["d_missing"], NAN)
            else:
                row[:, S["delta_max"]] = NAN
            count = sums[:, 3].clamp(min=1)
            row[:, S["a_rms"]] = (sums[:, 1] / count).sqrt_()
            row[:, S["a_zero_frac"]] = sums[:, 2] / count
            row[:, S["grad_norm"]] = sums[:, 4].sqrt()
            row[:, S["weight_norm"]] = sums[:, 5].sqrt()
            row[:, S["update_ratio"]] = NAN
            total = sq[nd + na:nd + na + ng].sum().sqrt() if ng else torch.full((), NAN, dtype=F64, device=dev)
            # NaN/Inf counts: on CPU only where a norm is not finite (reading it there is no device sync)
            counted = dev.type != "cpu" or not bool(torch.isfinite(sq[:nd + na + ng]).all())
            if counted:
                self._counts(row, ds, dg, as_, ag, grads, ix, dev)
            else:
                row[:, S["delta_nan"]] = row[:, S["delta_inf"]] = row[:, S["a_nonfinite"]] = 0.0
                row[:, S["grad_nan"]] = row[:, S["grad_inf"]] = 0.0
            for c in ("delta_nan", "delta_inf"):
                row[:, S[c]].masked_fill_(ix["missing"][:, 0], NAN)
            row[:, S["a_nonfinite"]].masked_fill_(ix["missing"][:, 1], NAN)
            loss = loss.to(dev).double().reshape(()) if loss is not None else torch.full((), NAN, dtype=F64,
                                                                                         device=dev)
            return row, torch.stack([loss, total])

    @staticmethod
    def _counts(row, ds, dg, as_, ag, grads, ix, dev) -> None:
        L = row.shape[0]
        z = torch.zeros(L, dtype=F64, device=dev)
        if dg:
            c = torch.stack([torch.stack([torch.isnan(g).sum(), torch.isinf(g).sum()]) for g in dg]).to(dev, F64)
            row[:, S["delta_nan"]] = z.clone().index_add_(0, ix["d_layers"], c[:, 0])
            row[:, S["delta_inf"]] = z.clone().index_add_(0, ix["d_layers"], c[:, 1])
        else:
            row[:, S["delta_nan"]] = row[:, S["delta_inf"]] = 0.0
        if ag:
            bad = torch.stack([(a.numel() - torch.isfinite(a).sum()) for a in ag]).to(dev, F64)
            row[:, S["a_nonfinite"]] = z.clone().index_add_(0, ix["a_layers"], bad)
        else:
            row[:, S["a_nonfinite"]] = 0.0
        if grads:
            c = torch.stack([torch.stack([torch.isnan(g).sum(), torch.isinf(g).sum()]) for g in grads]).double()
            c = c.to(dev)[ix["g_pos"]]
            row[:, S["grad_nan"]] = z.clone().index_add_(0, ix["g_layers"], c[:, 0])
            row[:, S["grad_inf"]] = z.clone().index_add_(0, ix["g_layers"], c[:, 1])
        else:
            row[:, S["grad_nan"]] = row[:, S["grad_inf"]] = 0.0

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


_ZERO = torch.zeros(())
_FOREACH = (torch.float32, torch.float64)


def _norms(ts: list) -> list:
    """‖t‖₂ of each tensor (low precision accumulated in float32, as norm() does): one _foreach_norm
    call where the dtypes and devices allow it."""
    if not ts:
        return []
    dev = ts[0].device
    if all(t.dtype in _FOREACH and t.device == dev and t.layout == torch.strided for t in ts):
        return list(torch._foreach_norm(ts))
    return [norm(t) if t.numel() else torch.zeros((), dtype=F64, device=t.device) for t in ts]


def _dense(g: torch.Tensor) -> torch.Tensor:
    return g.coalesce().values() if g.is_sparse else local(g)


def local(t: torch.Tensor) -> torch.Tensor:
    """t detached; a DTensor's local shard (FSDP2's parameters and .grad): its norm on this rank
    needs no collective, where the DTensor's norm would all-reduce. (A DTensor exists only once its
    module was imported: importing it here would cost every user 0.4 s.)"""
    dt = sys.modules.get("torch.distributed.tensor")
    return t.detach().to_local() if dt is not None and isinstance(t, dt.DTensor) else t.detach()
