"""The memory budget of one trace, and the summaries kept where it has no room.

Every tensor a trace keeps beyond the user's own (a, δ, the generic rule's inputs, gradients at nodes, .grad
copies) is counted here against `budget_mb`. Past it, a tensor is kept as a summary instead (shape, norm,
min/max/mean, NaN/Inf), reduced in batches (stats.StatsBatch) and turned into summaries when the trace ends.
One object, handed to the keep strategy and to the generic rule's capture, so none of them reaches into the tracer.
"""

from __future__ import annotations

import torch

from hookwidget.capture.tensors import _NO_LAZY, _copy, lazy_clone
from hookwidget.record.notes import Note
from hookwidget.stats import StatsBatch, stats_on_device, to_summaries


class Budget:
    """Bytes kept so far against the limit; what went over it; the summaries still to be made."""

    def __init__(self, budget_mb: float):
        self.limit = budget_mb * 2**20  # float("inf"): no limit
        self.kept = 0
        self.dropped = 0  # activations or gradients kept as summaries only
        self.dropped_grads = 0  # .grad copies of earlier steps made summaries
        self.trimmed = 0  # steps whose .grad copies are summaries already
        self.pending: list = []  # (call, attr, shape, dtype, stats)
        self.stats = StatsBatch()  # statistics of small tensors, reduced in batches (stats.py)

    def fits_bytes(self, size: int) -> bool:
        """Count `size` bytes as kept where the budget has room; else count a drop and say no."""
        if self.kept + size > self.limit:
            self.dropped += 1
            return False
        self.kept += size
        return True

    def fits(self, t: torch.Tensor) -> bool:
        return self.fits_bytes(t.numel() * t.element_size())

    def summarize(self, call, attr: str, t: torch.Tensor) -> None:
        """call.<attr> becomes t's summary when the trace ends. Its statistics are taken now, from a copy: a hook
        that runs after this one may change t in place."""
        self.pending.append((call, attr, tuple(t.shape), t.dtype, self.stats.stats(t, copy=True)))

    def finish(self) -> None:
        """Every pending summary made, with one host transfer."""
        self.stats.flush()
        pending, self.pending = self.pending, []
        for (call, attr, *_), s in zip(pending, to_summaries([p[2:] for p in pending])):
            setattr(call, attr, s)

    # -- .grad copies ------------------------------------------------------------------------------------
    def keep_grad(self, g: torch.Tensor) -> torch.Tensor:
        """A copy of a .grad: the record must not change when the user's code changes .grad later.
        It counts against the budget; older steps' copies give way first (see trim_grad_copies)."""
        self.kept += g.numel() * g.element_size()
        return _copy(g)

    def copy_grads(self, grads: list) -> list:
        """keep_grad of many .grads."""
        for g in grads:
            self.kept += g.numel() * g.element_size()
        if lazy_clone is None or _NO_LAZY:
            return [_copy(g) for g in grads]
        with torch.no_grad():
            try:
                return [lazy_clone(g) for g in grads]
            except Exception:  # a layout without plain storage (sparse): copies, one by one
                return [_copy(g) for g in grads]

    def trim_grad_copies(self, steps: list) -> None:
        """Over budget: the .grad copies of older steps become summaries, oldest first. The latest
        step's copies stay: they are what the trace reports as .grad."""
        while self.kept > self.limit and self.trimmed < len(steps) - 1:
            step = steps[self.trimmed]
            self.trimmed += 1
            kept = [(d, leaf, g) for d in (step.before, step.after) for leaf, g in d.items()
                    if isinstance(g, torch.Tensor)]
            summaries = to_summaries([(tuple(g.shape), g.dtype, stats_on_device(g)) for _, _, g in kept])
            for (d, leaf, g), summary in zip(kept, summaries):  # one host transfer per step
                d[leaf] = summary
                self.kept -= g.numel() * g.element_size()
                self.dropped_grads += 1

    def note(self) -> Note | None:
        """What went over the budget, for the trace's notes; None where nothing did."""
        if not (self.dropped or self.dropped_grads):
            return None
        return Note("budget_reached", {"budget_mb": self.limit / 2**20, "dropped": self.dropped,
                                       "dropped_grads": self.dropped_grads})
