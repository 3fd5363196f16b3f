"""Tensor summaries: what remains of a tensor when its values are not kept.

Statistics are reduced on the tensor's own device inside hooks and moved to the host
once, at the end of a trace, so a hook never forces a host-device synchronisation.
"""

from __future__ import annotations

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


def norm_on_device(t: torch.Tensor) -> torch.Tensor:
    """‖t‖ as a 0-d tensor on t's device, accumulated in float64 where the device has it: a float32
    sum of squares overflows to inf past ~1.8e19 per entry, and health would then flag a finite gradient."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32 if t.device.type == "mps" else torch.float64)


def stats_on_device(t: torch.Tensor) -> torch.Tensor:
    """The six statistics of `t` as one float tensor on t's device (no host sync)."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros(len(_FIELDS), device=t.device, dtype=torch.float64)
    f = t.float() if not t.is_floating_point() or t.dtype in (torch.float16, torch.bfloat16) else t
    acc = torch.float32 if t.device.type == "mps" else torch.float64  # the norm must not overflow
    return torch.stack([
        norm_on_device(f).to(acc),
        f.amin().to(acc),
        f.amax().to(acc),
        f.mean(dtype=acc),
        torch.isnan(f).sum().to(acc),
        torch.isinf(f).sum().to(acc),
    ])


def to_summaries(pending: list[tuple[tuple, torch.dtype, torch.Tensor]]) -> list[TensorSummary]:
    """Turn (shape, dtype, stats) triples into TensorSummary, moving all statistics at once."""
    if not pending:
        return []
    by_device: dict = {}
    for i, (_, _, s) in enumerate(pending):
        by_device.setdefault(s.device, []).append(i)
    values: list = [None] * len(pending)
    for idx in by_device.values():
        rows = torch.stack([pending[i][2].double() for i in idx]).cpu().tolist()
        for i, row in zip(idx, rows):
            values[i] = row
    out = []
    for (shape, dtype, _), row in zip(pending, values):
        norm, mn, mx, mean, nan, inf = row
        out.append(TensorSummary(tuple(shape), str(dtype).replace("torch.", ""), norm, mn, mx, mean,
                                 int(nan), int(inf)))
    return out


def summarize(t: torch.Tensor) -> TensorSummary:
    """Summary of one tensor, computed now (one host sync)."""
    return to_summaries([(tuple(t.shape), t.dtype, stats_on_device(t))])[0]
