"""The watch's rows summarised in bins of equal power-of-two row counts: what a view draws when a run has more
rows than the screen has pixels, and what the watch keeps in RAM of the rows that left its full-resolution window.

A bin of size s covers the rows [j·s, (j+1)·s) (row indices, as w.steps[...]: aligned to multiples of its size, so
that two neighbouring bins of size s merge into one of size 2s exactly); a range [start, stop) that does not begin
or end on a multiple of s has partial first and last bins (`rows` counts each bin's rows). Per bin, per layer and
statistic: min, max and mean over the finite values (NaN where the bin has none: NaN means "not measured" in the
watch), the value of the bin's last row as it is (NaN included), and `count`, the finite values (what merging two
means weighs them by). `nonfinite[bin, layer]`: the layer had a NaN or Inf entry there (one of its non-finite counts
above 0) or an infinite statistic; `step_nonfinite`: the loss or the global gradient norm was NaN or Inf. All
float32: a summary to draw from; the exact rows are w.rows(start, stop).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hookwidget.capture.stat_rows import S

_COUNTS = [S[c] for c in ("delta_nan", "delta_inf", "a_nonfinite", "grad_nan", "grad_inf")]
F32 = np.float32


@dataclass
class Bins:
    """Rows summarised per bin (see the module): `size` rows per bin; per bin `start` (its first row index),
    `first` / `last_step` (the step index of its first and last row), `rows` (its row count); (m, L, K) float32
    `min`, `max`, `mean`, `last`, `count`; (m, 2) float32 `step_min`, `step_max`, `step_mean`, `step_last`,
    `step_count`; `nonfinite` (m, L) and `step_nonfinite` (m,) bool."""

    size: int
    start: np.ndarray
    first: np.ndarray
    last_step: np.ndarray
    rows: np.ndarray
    min: np.ndarray
    max: np.ndarray
    mean: np.ndarray
    last: np.ndarray
    count: np.ndarray
    step_min: np.ndarray
    step_max: np.ndarray
    step_mean: np.ndarray
    step_last: np.ndarray
    step_count: np.ndarray
    nonfinite: np.ndarray
    step_nonfinite: np.ndarray

    def __len__(self) -> int:
        return len(self.start)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray))

    def take(self, keep) -> Bins:
        """The bins `keep` selects (a slice or a boolean mask)."""
        return Bins(self.size, **{k: v[keep] for k, v in vars(self).items() if k != "size"})


def size_for(bins: int, start: int, stop: int) -> int:
    """The smallest power of two s whose aligned bins cover [start, stop) in at most `bins` bins."""
    s = 1
    while stop > start and (stop - 1) // s - start // s + 1 > bins:
        s *= 2
    return s


def empty(L: int, K: int, size: int = 1) -> Bins:
    i64, f = np.zeros(0, np.int64), np.zeros((0, L, K), F32)
    g = np.zeros((0, 2), F32)
    return Bins(size, i64, i64, i64, i64, f, f, f, f, f, g, g, g, g, g, np.zeros((0, L), bool), np.zeros(0, bool))


def reduce(steps, stats, step_stats, start: int, size: int) -> Bins:
    """The rows `stats` (n, L, K), `step_stats` (n, 2), `steps` (n,), whose first is row index `start`, in bins of
    `size` aligned to multiples of it."""
    stats, step_stats = np.asarray(stats), np.asarray(step_stats)
    steps = np.asarray(steps, dtype=np.int64)
    n, L, K = stats.shape
    if n == 0:
        return empty(L, K, size)
    idx = start + np.arange(n)
    cuts = np.flatnonzero(np.diff(idx // size)) + 1
    heads = np.concatenate([[0], cuts])
    tails = np.concatenate([cuts, [n]]) - 1
    mn, mx, mean, count = _finite(stats, heads)
    smn, smx, smean, scount = _finite(step_stats, heads)
    with np.errstate(invalid="ignore"):
        bad = (stats[:, :, _COUNTS] > 0).any(axis=2) | np.isinf(stats).any(axis=2)
    return Bins(size, idx[heads], steps[heads], steps[tails], tails - heads + 1, mn, mx, mean,
                stats[tails].astype(F32), count, smn, smx, smean, step_stats[tails].astype(F32), scount,
                np.logical_or.reduceat(bad, heads, axis=0),
                np.logical_or.reduceat(~np.isfinite(step_stats).all(axis=1), heads))


def _finite(x: np.ndarray, heads: np.ndarray) -> tuple:
    """(min, max, mean, count) over the finite values of x's rows, per run of rows starting at `heads`."""
    ok = np.isfinite(x)
    count = np.add.reduceat(ok, heads, axis=0).astype(F32)
    mn = np.minimum.reduceat(np.where(ok, x, np.inf), heads, axis=0)
    mx = np.maximum.reduceat(np.where(ok, x, -np.inf), heads, axis=0)
    total = np.add.reduceat(np.where(ok, x, 0.0), heads, axis=0, dtype=np.float64)
    none = count == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(none, np.nan, total / np.maximum(count, 1))
    return (np.where(none, np.nan, mn).astype(F32), np.where(none, np.nan, mx).astype(F32), mean.astype(F32), count)


def concat(parts: list, L: int, K: int, size: int) -> Bins:
    """Bins of one size laid end to end (in row order)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return empty(L, K, size)
    return Bins(size, **{k: np.concatenate([getattr(p, k) for p in parts]) for k in vars(parts[0]) if k != "size"})


def merge(b: Bins, size: int) -> Bins:
    """Bins `b` merged into bins of `size` (a multiple of b.size), aligned to multiples of it: exact for min,
    max, last, the counts and the flags; the mean weighed by the finite counts (float32 rounding)."""
    if len(b) == 0:
        return Bins(size, **{k: v for k, v in vars(b).items() if k != "size"})
    cuts = np.flatnonzero(np.diff(b.start // size)) + 1
    heads = np.concatenate([[0], cuts])
    tails = np.concatenate([cuts, [len(b)]]) - 1

    def weighed(mean, count):
        total = np.add.reduceat(np.where(count > 0, mean.astype(np.float64) * count, 0.0), heads, axis=0)
        c = np.add.reduceat(count, heads, axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(c > 0, total / np.maximum(c, 1), np.nan).astype(F32), c

    mean, count = weighed(b.mean, b.count)
    smean, scount = weighed(b.step_mean, b.step_count)
    return Bins(size, b.start[heads], b.first[heads], b.last_step[tails], np.add.reduceat(b.rows, heads),
                np.fmin.reduceat(b.min, heads, axis=0), np.fmax.reduceat(b.max, heads, axis=0), mean, b.last[tails],
                count, np.fmin.reduceat(b.step_min, heads, axis=0), np.fmax.reduceat(b.step_max, heads, axis=0),
                smean, b.step_last[tails], scount, np.logical_or.reduceat(b.nonfinite, heads, axis=0),
                np.logical_or.reduceat(b.step_nonfinite, heads))


class Level:
    """The in-RAM summary of a watch's rows: complete bins of one size in `cap` preallocated slots (cap a power
    of two); when they would reach the cap, neighbours merge pairwise and the size doubles, so its memory is fixed
    whatever the run's length; `open` holds the rows of the bin being filled, summarised."""

    def __init__(self, L: int, K: int, cap: int):
        self.L, self.K, self.cap = L, K, cap
        self.size, self.m = 1, 0  # bin size; complete bins held
        self.open = empty(L, K, 1)  # at most one partial bin of self.size, summarised so far
        self.end = 0  # rows summarised (complete bins and the open one)
        self._slots = None  # field -> array with `cap` rows, made at the first complete bin

    @property
    def bins(self) -> Bins:
        """The complete bins (views of the slots)."""
        if self._slots is None:
            return empty(self.L, self.K, self.size)
        return Bins(self.size, **{k: v[:self.m] for k, v in self._slots.items()})

    @property
    def done(self) -> int:
        """Rows in complete bins: [0, done) is answered by self.bins."""
        return self.m * self.size

    def add(self, steps, stats, step_stats) -> None:
        """Rows `end`, `end` + 1, ... (in order) added to the summary."""
        if len(steps) == 0:
            return
        new = reduce(steps, stats, step_stats, self.end, self.size)
        self.end += len(steps)
        both = merge(concat([self.open, new], self.L, self.K, self.size), self.size)
        full = both.rows == self.size
        self.open = both.take(~full)
        self._put(both.take(full))

    def _put(self, done: Bins) -> None:
        if self.m + len(done) < self.cap:
            self._write(done, self.m)
            return
        whole, size = concat([self.bins, done, self.open], self.L, self.K, self.size), self.size
        while True:  # the cap reached: neighbours merged pairwise, as often as it takes
            size *= 2
            whole = merge(whole, size)
            full = whole.rows == size
            if int(full.sum()) < self.cap:
                break
        self.size, self.open = size, whole.take(~full)
        self._write(whole.take(full), 0)

    def _write(self, b: Bins, at: int) -> None:
        if self._slots is None:
            self._slots = {k: np.empty((self.cap, *v.shape[1:]), v.dtype) for k, v in vars(b).items() if k != "size"}
        for k, v in self._slots.items():
            v[at:at + len(b)] = getattr(b, k)
        self.m = at + len(b)

    @property
    def nbytes(self) -> int:
        slots = sum(v.nbytes for v in self._slots.values()) if self._slots is not None else 0
        return slots + self.open.nbytes
