"""Tensor summaries: what remains of a tensor when its values are not kept.

Statistics are reduced on the tensor's own device inside hooks and moved to the host
once, at the end of a trace, so a hook never forces a host-device synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
