"""The backward passes of each optimizer step that accumulated several (w.micro, w.micro_batches), kept so that a
watch's memory does not grow with the run: the latest MICRO_KEPT such steps' rows in RAM, every one on disk
(views/watch_log.py's micro shards, written by the log's thread), and the passes' indices of every step in three
integer arrays (20 bytes a step of several passes; a step of one pass costs nothing)."""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict

import numpy as np
import torch

MICRO_KEPT = 64  # optimizer steps whose passes' rows stay in RAM (160 KiB each for 168 layers × 4 passes)


class MicroRows:
    """`log`: the watch's views/watch_log.WatchLog (None: no disk, every step stays in RAM)."""

    def __init__(self, log, dtype: torch.dtype):
        self.log, self.dtype = log, dtype
        self.ram: OrderedDict = OrderedDict()  # step -> ((P, L, K) rows, (P, 2) step rows), oldest first
        self._steps, self._first, self._count = array("q"), array("q"), array("i")  # contiguous passes
        self._scattered: dict = {}  # step -> its passes, where they are not one run of indices

    def add(self, step: int, passes: list, rows: torch.Tensor, step_rows: torch.Tensor) -> torch.Tensor:
        """Step `step` held backward passes `passes` (in step order), whose rows are `rows` (float64); returns the
        rows as kept (the storage dtype), which the log writes."""
        if passes == list(range(passes[0], passes[0] + len(passes))):
            self._steps.append(step)
            self._first.append(passes[0])
            self._count.append(len(passes))
        else:
            self._scattered[step] = list(passes)
        kept = self.ram[step] = (rows.to(self.dtype), step_rows)
        written = self.log.micro_written if self.log is not None else -1
        while len(self.ram) > MICRO_KEPT and next(iter(self.ram)) <= written:  # on disk: read back from there
            self.ram.popitem(last=False)
        return kept[0]

    def passes(self, step: int) -> list | None:
        """The backward passes step `step` held, or None where it held one (its own index)."""
        if step in self._scattered:
            return self._scattered[step]
        i = bisect.bisect_left(self._steps, step)
        if i < len(self._steps) and self._steps[i] == step:
            return list(range(self._first[i], self._first[i] + self._count[i]))
        return None

    def rows(self, step: int) -> tuple | None:
        """(stats, step_stats) of the passes of step `step`: (P, L, K) and (P, 2) tensors; None where it held
        one pass."""
        if step in self.ram:
            return self.ram[step]
        if self.passes(step) is None:
            return None
        stats, step_stats = self.log.read_micro(step)
        return torch.from_numpy(np.array(stats)), torch.from_numpy(np.array(step_stats))

    @property
    def nbytes(self) -> int:
        ram = sum(t.nelement() * t.element_size() for pair in self.ram.values() for t in pair)
        return ram + sum(a.itemsize * len(a) for a in (self._steps, self._first, self._count))
