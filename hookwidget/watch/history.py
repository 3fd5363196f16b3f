"""Where a live watch's rows are kept once on the host, so that its memory does not grow with the run.

- The latest rows at full resolution in RAM: a window of WINDOW_BYTES (rows × layers × 13 statistics in the
  storage dtype), at least MIN_WINDOW and at most MAX_WINDOW rows; rows not yet on disk stay too (the writer's
  backlog).
- A level-of-detail summary of every row (lod.Level): at most a fixed number of bins (LOD_BYTES of them, between
  MIN_BINS and MAX_BINS) of one power-of-two size, merged pairwise as the run grows; rows are added one step late
  (the newest row's update ratio may still be written).
- Every row on disk (views/watch_log.py, the watch's log_dir or a temporary folder), from the writer's thread;
  rows that left the window are read back from there by range (memory-mapped shards).
- The step index of every row (8 bytes a row: w.steps, and the row of a step), the only part that grows.

Anomalies are the detector's (few, kept apart), never binned away."""

from __future__ import annotations

from array import array
from collections import deque

import numpy as np
import torch

from hookwidget.views.watch_log import Shards
from hookwidget.watch import lod

WINDOW_BYTES, MIN_WINDOW, MAX_WINDOW = 32 << 20, 64, 4096
LOD_BYTES, MIN_BINS, MAX_BINS = 64 << 20, 64, 1024
FOLD_ROWS = 64  # rows summarised (and the window trimmed) together
BIN_BYTES = 5 * 4 + 1  # per layer and statistic: min, max, mean, last, count (float32); + the non-finite flag


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


class History:
    """The rows of a watch (n, L, K) in `dtype`, their (n, 2) float64 step statistics, (n, 2) per-sample maxima
    where recorded: a window in RAM, a summary, the disk (`log`: a views/watch_log.WatchLog)."""

    def __init__(self, L: int, K: int, dtype: torch.dtype, per_sample: bool, log):
        self.L, self.K, self.dtype, self.per_sample, self.log = L, K, dtype, per_sample, log
        row = L * K * torch.tensor([], dtype=dtype).element_size()
        self.window = min(MAX_WINDOW, max(MIN_WINDOW, WINDOW_BYTES // row))
        cap = min(MAX_BINS, max(MIN_BINS, _pow2_floor(LOD_BYTES // (L * K * BIN_BYTES))))
        self.level = lod.Level(L, K, cap)
        self.chunks: deque = deque()  # (first row, stats, step_stats, per-sample or None) in RAM, oldest first
        self.steps = array("q")  # the step index of every row
        self.ram_start = 0  # rows before it are on disk only
        self.disk = Shards(log.index) if log is not None else None
        if log is not None:
            log.lod_source = self.lod_arrays

    @property
    def n(self) -> int:
        return len(self.steps)

    def append(self, stats: torch.Tensor, step_stats: torch.Tensor, steps: list, ps) -> None:
        """New rows (host tensors the watch keeps writing into until their optimizer step ran: the newest)."""
        self.chunks.append((self.n, stats, step_stats, ps))
        self.steps.extend(steps)
        if self.n - 1 - self.level.end >= FOLD_ROWS:  # summarised in blocks: a row at a time costs ~20 numpy calls
            self._fold(self.n - 1)
            self._evict()

    def summary(self) -> lod.Level:
        """The summary, with every row but the newest in it (a read: w.lod)."""
        self._fold(self.n - 1)
        return self.level

    def finish(self) -> None:
        """The run ended: the newest row is final too."""
        self._fold(self.n)
        self._evict()

    def _fold(self, upto: int) -> None:
        """Rows [level.end, upto) into the summary (they are in RAM: eviction waits for them)."""
        start = self.level.end
        if upto > start:
            steps, stats, step_stats = self.table(start, upto)
            self.level.add(steps, stats, step_stats)

    def _evict(self) -> None:
        """Drop the oldest chunks that are out of the window, summarised and on disk."""
        written = self.log.written if self.log is not None else 0
        upto = min(self.n - self.window, self.level.end, written)
        while self.chunks and self.chunks[0][0] + len(self.chunks[0][1]) <= upto:
            first, stats, _, _ = self.chunks.popleft()
            self.ram_start = first + len(stats)

    def _pieces(self, start: int, stop: int):
        """(chunk, a, b) of the RAM chunks over [max(start, ram_start), stop)."""
        for first, *parts in list(self.chunks):
            a, b = max(start, first) - first, min(stop, first + len(parts[0])) - first
            if b > a:
                yield parts, a, b

    def table(self, start: int, stop: int) -> tuple:
        """(steps, stats, step_stats) numpy of rows [start, stop): the disk's part, then RAM's."""
        cut = min(max(start, self.ram_start), stop)
        stats = [self.disk.read("stats", start, cut)] if cut > start else []
        step_stats = [self.disk.read("step_stats", start, cut)] if cut > start else []
        for (s, t, _), a, b in self._pieces(cut, stop):
            stats.append(s[a:b].numpy())
            step_stats.append(t[a:b].numpy())
        np_dtype = torch.empty(0, dtype=self.dtype).numpy().dtype
        return (np.asarray(self.steps[start:stop], np.int64),
                np.concatenate(stats) if stats else np.zeros((0, self.L, self.K), np_dtype),
                np.concatenate(step_stats) if step_stats else np.zeros((0, 2)))

    def column(self, start: int, stop: int, at: tuple, field: str = "stats") -> np.ndarray:
        """One column of rows [start, stop): field "stats" at (layer, stat), "step_stats" at (k,), "per_sample"."""
        cut = min(max(start, self.ram_start), stop)
        got = [self.disk.read(field, start, cut, at)] if cut > start else []
        which = {"stats": 0, "step_stats": 1, "per_sample": 2}[field]
        for parts, a, b in self._pieces(cut, stop):
            got.append(parts[which][(slice(a, b), *at)].numpy())
        return np.concatenate(got) if got else np.zeros(0)

    def lod_arrays(self) -> dict:
        """The summary as arrays (watch_log.LOD): saved at close, so that a loaded log draws without reading."""
        whole = lod.concat([self.level.bins, self.level.open], self.L, self.K, self.level.size)
        return {"end": np.int64(self.level.end), "size": np.int64(self.level.size), "cap": np.int64(self.level.cap),
                **{k: v for k, v in vars(whole).items() if k != "size"}}

    @property
    def nbytes(self) -> int:
        """What the history holds in RAM: the window's rows, the summary, the step indices."""
        ram = sum(t.nelement() * t.element_size() for c in self.chunks for t in c[1:] if t is not None)
        return ram + self.level.nbytes + self.steps.itemsize * len(self.steps)


def level_from(arrays: dict, L: int, K: int) -> lod.Level:
    """A Level back from lod_arrays() (a loaded log's)."""
    level = lod.Level(L, K, int(arrays["cap"]))
    size = int(arrays["size"])
    whole = lod.Bins(size, **{k: arrays[k] for k in vars(lod.empty(1, 1)) if k != "size"})
    full = whole.rows == size
    level.size, level.open, level.end = size, whole.take(~full), int(arrays["end"])
    level._write(whole.take(full), 0)
    return level
