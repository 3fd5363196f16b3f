"""Statistics and norms: tensor summaries (what remains of a tensor when its values are not kept) and the
2-norm (`l2`, `l2_batch`: on device, batched, overflow-safe), which the watch and the graph's norms use.

Statistics are reduced on the tensor's own device inside hooks and moved to the host
once, at the end of a trace, so a hook never forces a host-device synchronisation.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from hookwidget._torch import host_reads
from hookwidget._torch.norms import foreach_norm
from hookwidget._torch.tensors import sparse_values, version

_FIELDS = ("norm", "min", "max", "mean", "nan", "inf")


@dataclass(frozen=True)
class TensorSummary:
    """Shape, dtype and statistics of a tensor; NaN/Inf counts flag unhealthy values."""

    shape: tuple
    dtype: str
    norm: float
    min: float
    max: float
    mean: float
    nan: int
    inf: int

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0


def abs_max(lo: float, hi: float) -> float:
    """‖t‖∞ from t's min and max read on the host; NaN if either is (Python's max would drop it)."""
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


def max_abs(t: torch.Tensor) -> torch.Tensor:
    """‖t‖∞ as a 0-d tensor on t's device. On CPU max(|min|, |max|), exactly it (NaN propagates),
    at a tenth of the cost of the ∞-norm kernel there."""
    if t.numel() == 0:
        return torch.zeros((), dtype=t.dtype, device=t.device)
    if t.device.type != "cpu":  # one fused kernel there, where every launch counts
        return torch.linalg.vector_norm(t, float("inf"))
    lo, hi = torch.aminmax(_dense(t))
    return torch.maximum(lo.abs(), hi.abs())


def stats_on_device(t: torch.Tensor) -> torch.Tensor | tuple:
    """The statistics of `t` as one float tensor on t's device (no host sync), or as floats for a
    CPU tensor: norm, min, max, sum, NaN count, Inf count. Plain single-pass reductions: this runs
    in hooks, on every call."""
    t = t.detach()
    if t.numel() == 0:
        return (0.0,) * len(_FIELDS)
    f = _dense(t if t.dtype in (torch.float32, torch.float64) else t.float())
    lo, hi = torch.aminmax(f)
    if f.device.type == "cpu":
        # min and max are finite only when every entry is (aminmax propagates NaN): the NaN and Inf
        # counts, ten times the cost of the other statistics on CPU, are then 0. (Reading a CPU
        # tensor is no host-device sync; on GPU the counts stay on device.)
        mn, mx = lo.item(), hi.item()
        if math.isfinite(mn) and math.isfinite(mx):
            return torch.linalg.vector_norm(f).item(), mn, mx, f.sum().item(), 0.0, 0.0
    # stack promotes the int64 counts: eight kernels in all, each launch counting on GPU
    return torch.stack([torch.linalg.vector_norm(f), lo, hi, f.sum(), torch.isnan(f).sum(), torch.isinf(f).sum()])


BATCH_NUMEL = 4096  # tensors up to this size get their statistics reduced together, in batches
BATCH_TOTAL = 1 << 16  # elements held at most (256 KiB of float32) before the batch is reduced
BATCH_MIN = 4  # groups of fewer same-shaped tensors are reduced one by one


class Pending:
    """The statistics of one tensor of a batch: `value` is set when the batch is reduced (flush)."""

    __slots__ = ("value",)


class StatsBatch:
    """Statistics of many small tensors, reduced a group of same-shaped tensors at a time.

    For a tensor of a few hundred floats the reductions cost little, but each is a kernel call and a
    host read: batching them makes a few calls per group instead of eight per tensor. Tensors are held
    by reference until `flush`, at most BATCH_TOTAL elements; larger ones are reduced at once."""

    def __init__(self):
        self._groups: dict = {}  # (shape, dtype, device) -> ([tensors], [Pending])
        self._held = 0

    def stats(self, t: torch.Tensor, copy: bool = False):
        """stats_on_device(t), or a Pending filled in by the next flush. `copy`: t may change in place
        before then (a module's input, which an in-place module rewrites): hold a copy."""
        t = t.detach()
        n = t.numel()
        if n == 0 or n > BATCH_NUMEL or t.layout != torch.strided:
            return stats_on_device(t)
        if t.dtype not in (torch.float32, torch.float64):
            t = t.float()
        elif copy:
            t = t.clone()
        key = (t.shape, t.dtype, t.device)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = ([], [])
        slot = Pending()
        group[0].append(t)
        group[1].append(slot)
        self._held += n
        if self._held > BATCH_TOTAL:
            self.flush()
        return slot

    def flush(self) -> None:
        groups, self._groups, self._held = self._groups, {}, 0
        for ts, slots in groups.values():
            if len(ts) < BATCH_MIN:  # stacking and reducing by rows costs more than a few whole-tensor reductions
                for t, slot in zip(ts, slots):
                    slot.value = stats_on_device(t)
                continue
            x = torch.stack(ts).flatten(1)
            lo, hi = torch.aminmax(x, dim=1)
            cols = [torch.linalg.vector_norm(x, dim=1), lo, hi, x.sum(1)]
            if x.device.type == "cpu":  # as in stats_on_device: NaN/Inf counts only where min or max is not finite
                rows = torch.stack(cols, 1).tolist()
                if not all(math.isfinite(r[1]) and math.isfinite(r[2]) for r in rows):
                    bad = torch.stack([torch.isnan(x).sum(1), torch.isinf(x).sum(1)], 1).tolist()
                    rows = [(*r, *b) for r, b in zip(rows, bad)]
                else:
                    rows = [(*r, 0.0, 0.0) for r in rows]
                for slot, row in zip(slots, rows):
                    slot.value = tuple(row)
            else:  # on device, no host sync: one (k, 6) tensor, read in to_summaries
                m = torch.stack(cols + [torch.isnan(x).sum(1), torch.isinf(x).sum(1)], 1)
                for k, slot in enumerate(slots):
                    slot.value = m[k]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view of `t` when it is a permuted dense tensor (a weight gradient arrives as
    a transposed view): whole-tensor reductions on it are the same, and aminmax ten times faster."""
    if t.is_contiguous() or t.dim() < 2:
        return t
    p = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return p if p.is_contiguous() else t


def to_summaries(pending: list[tuple[tuple, torch.dtype, torch.Tensor | tuple]]) -> list[TensorSummary]:
    """Turn (shape, dtype, stats) triples into TensorSummary, moving all statistics at once."""
    if not pending:
        return []
    pending = list(pending)
    by_device: dict = {}
    values: list = [None] * len(pending)
    for i, (_, _, s) in enumerate(pending):
        if isinstance(s, Pending):  # reduced in a batch (StatsBatch.flush)
            s = s.value
            pending[i] = (*pending[i][:2], s)
        if isinstance(s, tuple):  # read on the host already
            values[i] = s
        else:
            by_device.setdefault(s.device, []).append(i)
    for idx in by_device.values():
        rows = torch.stack([pending[i][2].double() for i in idx]).cpu().tolist()
        for i, row in zip(idx, rows):
            values[i] = row
    out = []
    dtype_names: dict = {}  # str(dtype) is slow: once per dtype
    for (shape, dtype, _), row in zip(pending, values):
        norm, mn, mx, total, nan, inf = row
        numel = 1
        for n in shape:
            numel *= n
        name = dtype_names.get(dtype)
        if name is None:
            name = dtype_names[dtype] = str(dtype).replace("torch.", "")
        out.append(TensorSummary(tuple(shape), name, norm, mn, mx, total / max(numel, 1), int(nan), int(inf)))
    return out


def summaries(ts: list) -> list[TensorSummary]:
    """The TensorSummary of each tensor, their statistics reduced in batches and moved to the host at once."""
    batch = StatsBatch()
    pending = [(tuple(t.shape), t.dtype, batch.stats(t)) for t in ts]
    batch.flush()
    return to_summaries(pending)


# -- the 2-norm: on device, batched, overflow-safe --------------------------------------------------------
_LOW = (torch.float16, torch.bfloat16)  # accumulated in float32: a bfloat16 sum keeps 3 digits


def l2(t: torch.Tensor) -> torch.Tensor:
    """‖t‖₂ of one tensor as a 0-d tensor on its device, with no host sync (see l2_batch)."""
    if not t.is_floating_point():
        t = t.float()
    if _wide(t) and t.layout == torch.strided:  # _wide first: compiled autograd refuses to read .layout
        return foreach_norm([t], 2, dtype=torch.float64)[0]
    return _safe([t], [torch.linalg.vector_norm(t, dtype=torch.float32 if t.dtype in _LOW else None)])[0]


def _wide(t: torch.Tensor) -> bool:
    """Whether t's norm is accumulated in float64 from the start: off the CPU, outside torch.compile. The
    multi-tensor kernel accumulates in its output dtype (no float64 copy of t), so one kernel stands where a
    float32 norm and its overflow check (a second norm, isinf, where) took four: on a GPU, where a small step's
    time is kernel launches, that is most of what a norm costs."""
    return t.device.type != "cpu" and not torch.compiler.is_compiling()


def l2_batch(ts: list, batched: bool = True) -> list[torch.Tensor]:
    """‖t‖₂ of each tensor as 0-d tensors on their devices, with no host-device sync: one multi-tensor
    reduction per (device, dtype) group of strided tensors (`batched=False`: one reduction per tensor).
    On CPU float16 and bfloat16 accumulate in float32; an integer tensor is taken as float32. Tensors are taken
    as given: detach them (or hold no_grad) where autograd would record the reduction.
    Overflow-safe: where the sum of squares overflows its dtype (float32: ‖t‖ past ~1.8e19 though every
    entry is finite) the norm is taken again accumulating in float64, and returned in float64. On CPU only
    those, found by reading the norms (no sync there), so that where nothing overflowed the value is bitwise
    the plain reduction's; inside torch.compile for the whole group, kept by torch.where where the first
    overflowed. On other devices every norm accumulates in float64 from the start (_wide: one kernel, no
    copy, no sync), returned in float64."""
    if not ts:
        return []
    t0 = ts[0]
    dev, dtype = t0.device, t0.dtype
    if batched and dtype.is_floating_point and all(
            t.device == dev and t.dtype == dtype and t.layout == torch.strided for t in ts):  # the common case
        return _norms(ts)
    out: list = [None] * len(ts)
    groups: dict = {}
    for i, t in enumerate(ts):
        if not t.is_floating_point():
            t = t.float()
        key = (t.device, t.dtype) if batched and t.layout == torch.strided else i
        g = groups.setdefault(key, ([], []))
        g[0].append(i)
        g[1].append(t)
    for key, (idx, xs) in groups.items():
        for i, n in zip(idx, [l2(xs[0])] if isinstance(key, int) else _norms(xs)):
            out[i] = n
    return out


def _norms(xs: list) -> list:
    """The 2-norms of strided tensors of one device and dtype, in one multi-tensor reduction (see l2_batch)."""
    if _wide(xs[0]):
        return list(foreach_norm(xs, 2, dtype=torch.float64))
    return _safe(xs, list(foreach_norm(xs, 2, dtype=torch.float32 if xs[0].dtype in _LOW else None)))


def _safe(xs: list, ns: list) -> list:
    """The norms `ns` of `xs` with the overflowed ones (inf; NaN stays NaN) taken again in float64."""
    if ns[0].dtype == torch.float64:
        return ns
    if host_reads.free(ns[0].device) and not torch.compiler.is_compiling():
        bad = torch.isinf(torch.stack(ns)).tolist() if len(ns) > 16 else [math.isinf(n.item()) for n in ns]
        return [torch.linalg.vector_norm(x, dtype=torch.float64) if b else n for x, n, b in zip(xs, ns, bad)]
    if torch.compiler.is_compiling():  # the cast is fused there: no copy
        wide = [torch.linalg.vector_norm(x, dtype=torch.float64) for x in xs]
    else:  # the multi-tensor kernel accumulates in the output dtype: no float64 copy of x
        wide = list(foreach_norm(xs, 2, dtype=torch.float64))
    if len(ns) == 1:  # three kernels, not five
        return [torch.where(torch.isinf(ns[0]), wide[0], ns[0])]
    n = torch.stack(ns)
    return list(torch.where(torch.isinf(n), torch.stack(wide), n).unbind())


# -- 2-norms of many tensors at once (the graph's nodes, the payload, health) -------------------------------
_SMALL = 1 << 16  # on CPU, ‖t‖∞ of tensors up to this size from the multi-tensor kernel, of larger ones from aminmax


def fused_norms(tensors: dict, linf: bool = True) -> dict:
    """[‖t‖₂, ‖t‖∞] of many tensors with a few multi-tensor reductions, not two kernels each (without
    `linf`: [‖t‖₂, None]); the 2-norms are l2_batch's."""
    ts = [_dense_values(t) for t in tensors.values()]
    ts = [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in ts]
    if not ts:
        return {}
    norms = l2_batch(ts)
    if not linf:
        return {i: (a, None) for i, a in zip(tensors, norms)}
    cpu = all(t.device.type == "cpu" for t in ts)
    # the multi-tensor ∞-norm: not of empty tensors (no identity), and on CPU only of small ones (for
    # large ones the ∞-norm kernel is ~9x slower than aminmax there)
    fused = [k for k, t in enumerate(ts) if t.numel() and (not cpu or t.numel() <= _SMALL)]
    peaks = [None] * len(ts)
    if fused:
        for k, v in zip(fused, foreach_norm([ts[k] for k in fused], float("inf"))):
            peaks[k] = v
    if len(fused) < len(ts):
        for k, t in enumerate(ts):
            if peaks[k] is None:
                peaks[k] = max_abs(t)
    return {i: (a, b) for i, a, b in zip(tensors, norms, peaks)}


def _dense_values(t):
    """The values whose norms are t's: a sparse gradient's (Embedding(sparse=True)) after coalescing."""
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return sparse_values(t.coalesce())
    return t.to_dense()


def norms_to_floats(norms: dict) -> dict:
    if not norms:
        return {}
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
        return version(t)
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
        fresh = norms_to_floats({k: v for k, (v, _) in fused_norms({k: ts[k] for k in todo}, linf=False).items()})
        for k in todo:
            out[k] = fresh[k]
            remember_l2(ts[k], fresh[k])
    return out
