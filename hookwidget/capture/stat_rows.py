"""The watch's statistics (keep strategy "stats", step_stats.py): what each call reduces, and the step's
(layers, statistics) row put together from those reductions in a few kernels. All reduced on the parameters'
device as small float64 tensors: no host sync on GPU.

On CPU, reading a value is no host-device sync, so NaN/Inf counts (the costliest reductions there)
are computed only when a norm says a tensor is not finite.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch

from hookwidget._torch import host_reads
from hookwidget.stats import l2, l2_batch

# Per-layer statistics, in this order along the last axis of Watch.stats.
STAT_NAMES = ("delta_norm", "delta_max", "delta_nan", "delta_inf", "a_rms", "a_zero_frac", "a_nonfinite",
              "grad_norm", "weight_norm", "update_ratio", "grad_nan", "grad_inf", "lr")
STEP_STAT_NAMES = ("loss", "grad_norm")
S = {name: i for i, name in enumerate(STAT_NAMES)}
NAN = float("nan")
F64 = torch.float64
SCALED = [S["delta_norm"], S["delta_max"], S["grad_norm"]]  # what a GradScaler's scale multiplies


def _float(t: torch.Tensor) -> torch.Tensor:
    t = local(t)  # a DTensor input or δ (tensor parallelism): this rank's part, with no collective
    return t if t.is_floating_point() else t.float()


def reduce_delta(g: torch.Tensor) -> tuple:
    """What the δ hook keeps of one call's δ (while it is hot in cache): (‖g‖, min, max, [NaN, Inf] or None);
    the counts only where they may be non-zero (on CPU: a non-finite norm; elsewhere always: no sync)."""
    g = _float(g)
    if g.numel() == 0:
        z = torch.zeros((), dtype=F64, device=g.device)
        return z, z, z, None
    n = l2(g)
    lo, hi = torch.aminmax(g)
    counts = None
    if not host_reads.free(g.device) or not math.isfinite(n.item()):
        counts = torch.stack([torch.isnan(g).sum(dtype=F64), torch.isinf(g).sum(dtype=F64)])
    return n, lo, hi, counts


def reduce_input(a: torch.Tensor) -> tuple:
    """What the forward hook keeps of one call's input: (‖a‖, nonzero entries, entries, non-finite or None)."""
    a = _float(a)
    k = a.numel()
    if k == 0:
        z = torch.zeros((), dtype=F64, device=a.device)
        return z, z, 0, None
    n = l2(a)
    bad = None
    if not host_reads.free(a.device) or not math.isfinite(n.item()):  # ‖a‖ is finite where every entry is (stats.l2)
        bad = k - torch.isfinite(a).sum(dtype=F64)
    # a.bool().sum(), not torch.count_nonzero: that one branches per entry on CPU (~10x slower on fresh data)
    return n, a.bool().sum(), k, bad


def add_delta(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Statistics of two calls' δ together."""
    out = old + new
    out[1] = torch.maximum(old[1], new[1])
    return out


class Parts(NamedTuple):
    """What a row was summed from, kept for a distributed watch (watch/ranks.py) to sum shards over ranks:
    `present` the indices of the parameters with a .grad; `sq` (on device, float64) ‖grad‖² of each present one,
    then ‖W‖² of every parameter (local shards); `counts` (present, 2) [NaN, Inf] of each .grad, None where all
    are 0; `entries` (layers,) the input entries each layer's a statistics are over (at least 1)."""

    present: tuple
    sq: torch.Tensor
    counts: torch.Tensor | None
    entries: torch.Tensor


class Rows:
    """Turns what one step gathered into its (layers, stats) row, with cached index tensors."""

    def __init__(self, n_layers: int, params: list, pairs: list):
        self.L, self.params, self.pairs = n_layers, params, pairs  # pairs: (layer index, param index)
        self._cache: dict = {}
        self.parts = None  # the latest row's Parts (what a distributed watch sums over ranks: watch/ranks.py)
        # the latest row's sums before roots and quotients: (‖δ‖², Σa², zeros of a, entries of a), each (layers,)
        # (NaN: not reached); what an optimizer step's micro-batches add up exactly (opt_steps.py)
        self.sums = None

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
            t = _upload  # index tensors, not lists: a list index copies to the device (a sync on GPU)
            hit = self._cache[present] = (t(index, device=dev), t(has, device=dev), t(order, device=dev),
                                          t([li for li, _ in g_pairs], device=dev),
                                          t([j for _, j in g_pairs], dtype=torch.long, device=dev))
        return hit

    def row(self, delta: dict, a: dict, loss, dev) -> tuple[torch.Tensor, torch.Tensor]:
        L, params = self.L, self.params
        nan4 = torch.full((4,), NAN, dtype=F64, device=dev)
        d = torch.stack([delta[i].to(dev) if i in delta else nan4 for i in range(L)])
        dsq = d[:, 0].clone()
        d[:, 0].sqrt_()
        nan4 = torch.full((4,), NAN, dtype=F64, device=dev)
        a_sum = torch.stack([a[i].to(dev) if i in a else nan4 for i in range(L)])
        a_part = a_sum[:, :3] / a_sum[:, 3:].clamp(min=1)
        a_part[:, 0].sqrt_()
        a_part[:, 2] = a_sum[:, 2]  # a count, not a fraction
        present = tuple(i for i, p in enumerate(params) if p.grad is not None)
        grads = [_dense(params[i].grad) for i in present]
        index, has, order, g_layers, g_pos = self._grad_index(present, dev)
        norms = l2_batch(grads + [local(p) for p in params])
        sq = torch.stack([n.to(dev) for n in norms]).double().square_()
        gw = torch.zeros(2 * L, dtype=F64, device=dev).index_add_(0, index, sq[order]).sqrt_()
        gw.masked_fill_(~has, NAN)
        total = sq[:len(grads)].sum().sqrt() if grads else torch.full((), NAN, dtype=F64, device=dev)
        gc = torch.zeros(L, 2, dtype=F64, device=dev)
        counts = _grad_counts(grads, total, dev)
        if counts is not None:
            gc.index_add_(0, g_layers, counts[g_pos])
        upd = torch.full((L, 1), NAN, dtype=F64, device=dev)
        row = torch.cat([d, a_part, gw.view(2, L).T, upd, gc, upd], dim=1)
        self.parts = Parts(present, sq, counts, a_sum[:, 3])
        loss = loss.to(dev).double() if loss is not None else torch.full((), NAN, dtype=F64, device=dev)
        self.sums = (dsq, a_sum[:, 0], a_sum[:, 1], a_sum[:, 3])
        return row, torch.stack([loss, total])

    def _entry_index(self, key: tuple, dev):
        """Cached tensors for a step's layout. key = (layers of the δ entries, (layer, entries) of the a entries,
        params with a .grad). row_from stacks, in order: ‖·‖ of each δ, of each a, of each .grad present, of each
        parameter; min and max of each δ; the nonzero entries of each a; the loss. `src`/`dst` route them
        (squared, zeros = entries − nonzero) into L·5 sums [‖δ‖², Σa², zeros of a, ‖grad‖², ‖W‖²] and one
        global Σ‖grad‖² slot; `base` holds NaN where a layer has no entry (not reached: not measured)."""
        hit = self._cache.get(key)
        if hit is None or hit["dev"] != dev:
            d_layers, a_entries, present = key
            a_layers = [li for li, _ in a_entries]
            L, nd, na, ng, npar = self.L, len(d_layers), len(a_entries), len(present), len(self.params)
            pos = {pi: j for j, pi in enumerate(present)}
            g_pairs = [(li, pos[pi]) for li, pi in self.pairs if pi in pos]
            src, dst = [], []
            for j, li in enumerate(d_layers):
                src.append(j), dst.append(li * 5)
            for j, li in enumerate(a_layers):
                src.append(nd + j), dst.append(li * 5 + 1)
            for li, j in g_pairs:  # a shared parameter adds to each layer that holds it
                src.append(nd + na + j), dst.append(li * 5 + 3)
            for j in range(ng):  # the global norm: each parameter once
                src.append(nd + na + j), dst.append(L * 5)
            for li, pi in self.pairs:
                src.append(nd + na + ng + pi), dst.append(li * 5 + 4)
            zc = nd + na + ng + npar + 2 * nd
            for j, li in enumerate(a_layers):
                src.append(zc + j), dst.append(li * 5 + 2)
            base = torch.full((L, 5), NAN, dtype=F64)
            denom = torch.ones(L, 5, dtype=F64)
            entries = torch.zeros(L, dtype=F64)
            for li in d_layers:
                base[li, 0] = 0.0
            for li, k in a_entries:
                base[li, 1:3] = 0.0
                entries[li] += k
            for li, _ in g_pairs:
                base[li, 3] = 0.0
            base[:, 4] = 0.0
            denom[:, 1] = denom[:, 2] = entries.clamp(min=1)
            zero_d = torch.full((L, 2), NAN, dtype=F64)
            zero_d[list(d_layers)] = 0.0
            zero_a = torch.full((L, 1), NAN, dtype=F64)
            zero_a[a_layers] = 0.0
            t = _upload
            # columns of the matrix row_from concatenates: sqrt of the 5 sums (a_rms at 1), zero fraction,
            # max|δ|, δ NaN, δ Inf, a non-finite, .grad NaN, .grad Inf, NaN (update ratio and learning rate,
            # filled by the optimizer step)
            perm = [0, 6, 7, 8, 1, 5, 9, 3, 4, 12, 10, 11, 12]
            hit = self._cache[key] = {
                "dev": dev, "src": t(src, dtype=torch.long, device=dev), "dst": t(dst, dtype=torch.long, device=dev),
                "base": _upload(torch.cat([base.flatten(), torch.tensor([0.0 if ng else NAN], dtype=F64)]), device=dev),
                "denom": _upload(denom, device=dev), "perm": t(perm, dtype=torch.long, device=dev),
                "a_entries": t([float(k) for _, k in a_entries], dtype=F64, device=dev),
                "nan_l": torch.full((L,), NAN, dtype=F64, device=dev),
                "nan_col": torch.full((L, 1), NAN, dtype=F64, device=dev), "zero_d": _upload(zero_d, device=dev),
                "zero_a": _upload(zero_a, device=dev), "zero_g": torch.zeros(L, 2, dtype=F64, device=dev),
                "d_layers": t(list(d_layers), dtype=torch.long, device=dev),
                "a_layers": t(a_layers, dtype=torch.long, device=dev),
                "g_layers": t([li for li, _ in g_pairs], dtype=torch.long, device=dev),
                "g_pos": t([j for _, j in g_pairs], dtype=torch.long, device=dev)}  # a list index would sync
        return hit

    def row_from(self, ds: list, as_: list, loss, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's row from what its hooks reduced (see reduce_delta, reduce_input), put together once when
        backward ends in a few kernels. ds: (layer, ‖δ‖, min δ, max δ, [NaN, Inf] or None) per call backward
        reached; as_: (layer, ‖a‖, nonzero entries of a, entries, non-finite entries or None) per such call."""
        L, params = self.L, self.params
        present = tuple(i for i, p in enumerate(params) if p.grad is not None)
        key = (tuple(e[0] for e in ds), tuple((e[0], e[3]) for e in as_), present)
        ix = self._entry_index(key, dev)
        nd, na = len(ds), len(as_)
        with torch.no_grad():  # nothing here is recorded by autograd: no detach needed
            grads = [_dense(params[i].grad) for i in present]
            ws = params if sys.modules.get("torch.distributed.tensor") is None else _locals(params)
            norms = l2_batch(grads + list(ws))
            nN = nd + na + len(norms)
            vals = ([e[1] for e in ds] + [e[1] for e in as_] + norms + [x for e in ds for x in (e[2], e[3])]
                    + [e[2] for e in as_] + ([loss.reshape(())] if loss is not None else []))
            V = _stack(vals, dev).double()
            V[:nN].square_()
            if na:
                V[nN + 2 * nd:nN + 2 * nd + na].neg_().add_(ix["a_entries"])  # zeros = entries − nonzero
            flat = ix["base"].index_add(0, ix["dst"], V[ix["src"]])
            sums, total = flat[:L * 5].view(L, 5), flat[L * 5].sqrt()
            if nd:
                lohi = V[nN:nN + 2 * nd].abs().view(nd, 2).amax(1)
                dmax = ix["nan_l"].scatter_reduce(0, ix["d_layers"], lohi, "amax", include_self=False).view(L, 1)
            else:
                dmax = ix["nan_col"]
            d_counts, a_bad, g_counts = ix["zero_d"], ix["zero_a"], ix["zero_g"]
            if any(e[4] is not None for e in ds):
                c = torch.stack([e[4] if e[4] is not None else torch.zeros(2, dtype=F64, device=dev) for e in ds])
                d_counts = d_counts.index_add(0, ix["d_layers"], c.to(dev, F64))
            if any(e[4] is not None for e in as_):
                c = torch.stack([e[4] if e[4] is not None else torch.zeros((), dtype=F64, device=dev) for e in as_])
                a_bad = a_bad.index_add(0, ix["a_layers"], c.to(dev, F64).view(-1, 1))
            c = _grad_counts(grads, total, dev)
            if c is not None:
                g_counts = g_counts.index_add(0, ix["g_layers"], c.to(dev)[ix["g_pos"]])
            self.parts = Parts(present, V[nd + na:nN], c, ix["denom"][:, 1])
            self.sums = (sums[:, 0], sums[:, 1], sums[:, 2], ix["denom"][:, 1])  # views: no kernel
            scaled = sums / ix["denom"]  # Σa² and the zeros of a over the entries
            m = torch.cat([scaled.sqrt(), scaled[:, 2:3], dmax, d_counts, a_bad, g_counts, ix["nan_col"]], dim=1)
            row = m.index_select(1, ix["perm"])
            return row, torch.stack([V[-1] if loss is not None else ix["nan_l"][0], total])

    def update(self, key: tuple, deltas: list, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ‖ΔW‖² per layer from the ΔW of params `key` (param indices), and the mask of layers touched."""
        hit = self._cache.get(("u", key))
        if hit is None or hit[2].device != dev:
            pos = {pi: j for j, pi in enumerate(key)}
            pairs = [(li, pos[pi]) for li, pi in self.pairs if pi in pos]
            mask = [False] * self.L
            for li, _ in pairs:
                mask[li] = True
            same = [j for _, j in pairs] == list(range(len(key)))
            hit = self._cache[("u", key)] = (_upload([li for li, _ in pairs], device=dev),
                                             None if same else _upload([j for _, j in pairs], device=dev),
                                             _upload(mask, device=dev))
        layers, gather, mask = hit
        sq = _stack(deltas, dev).double().square_()
        if gather is not None:
            sq = sq[gather]
        return torch.zeros(self.L, dtype=F64, device=dev).index_add_(0, layers, sq), mask


    def grads(self, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """The .grad now: (layers, 3) [‖W.grad‖₂, NaN count, Inf count] (NaN: no .grad) and the global norm; read at
        an optimizer step that held several backward passes (opt_steps.py), where .grad is what that step used."""
        L, params = self.L, self.params
        present = tuple(i for i, p in enumerate(params) if p.grad is not None)
        if not present:
            return torch.full((L, 3), NAN, dtype=F64, device=dev), torch.full((), NAN, dtype=F64, device=dev)
        _, has, _, g_layers, g_pos = self._grad_index(present, dev)
        with torch.no_grad():
            grads = [_dense(params[i].grad) for i in present]
            sq = _stack(l2_batch(grads), dev).double().square_()
            norm = torch.zeros(L, dtype=F64, device=dev).index_add_(0, g_layers, sq[g_pos]).sqrt_()
            total = sq.sum().sqrt()
            counts = torch.zeros(L, 2, dtype=F64, device=dev)
            c = _grad_counts(grads, total, dev)
            if c is not None:
                counts.index_add_(0, g_layers, c.to(dev)[g_pos])
            out = torch.cat([norm.view(L, 1), counts], dim=1)
            return out.masked_fill_(~has[:L].view(L, 1), NAN), total


def _grad_counts(grads: list, total: torch.Tensor, dev) -> torch.Tensor | None:
    """(grads, 2) float64 [NaN, Inf] counts of each .grad; None where they are 0: on CPU only where the global
    norm `total` is not finite (reading it there is no sync), elsewhere always (no sync)."""
    if not grads or host_reads.free(dev) and math.isfinite(total.item()):
        return None
    return _stack([c for g in grads for c in (torch.isnan(g).sum(), torch.isinf(g).sum())], dev).view(-1, 2).double()


def _stack(ts: list, dev) -> torch.Tensor:
    """torch.stack of 0-d tensors onto `dev` (moved one by one only where they are elsewhere)."""
    try:
        return torch.stack(ts).to(dev)
    except RuntimeError:  # on several devices
        return torch.stack([t.to(dev) for t in ts])


def _locals(params: list) -> list:
    """The parameters detached (their local shards where they are DTensors)."""
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is None:
        return [p.detach() for p in params]
    return [local(p) for p in params]


def _dense(g: torch.Tensor) -> torch.Tensor:
    return g.coalesce().values() if g.is_sparse else local(g)


def local(t: torch.Tensor) -> torch.Tensor:
    """t detached; a DTensor's local shard (FSDP2's parameters and .grad): its norm on this rank
    needs no collective, where the DTensor's norm would all-reduce. (A DTensor exists only once its
    module was imported: importing it here would cost every user 0.4 s.)"""
    dt = sys.modules.get("torch.distributed.tensor")
    return t.detach().to_local() if dt is not None and isinstance(t, dt.DTensor) else t.detach()


def unscale(row: torch.Tensor, step_row: torch.Tensor, scale) -> None:
    """A step's row and [loss, global grad norm] divided by the GradScaler scale its backward ran at (None: none)."""
    if scale is not None:
        s = scale.to(row.device, F64)
        for c in SCALED:  # one column at a time: a list index would copy it to the device (a sync on GPU)
            row[:, c].div_(s)
        step_row.div_(s)


def _upload(data, dtype=None, device=None) -> torch.Tensor:
    """`data` (a list or a host tensor) as a tensor on `device`, with no host sync: a CUDA copy goes from pinned
    memory, asynchronously (torch.tensor(list, device="cuda") waits for the copy). Built once per step layout."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if host.dtype != (dtype or host.dtype):
        host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
