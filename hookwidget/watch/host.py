"""The watch's rows on their way to the host: recorded steps wait on device and move in one non-blocking transfer
(arrivals.py), `batch` steps at a time, at least every FLUSH_SECONDS while steps end (so that a slow run's live
view and log_dir keep up), or when read; they land when the transfer has arrived (a read waits for it). Each moved
row is judged by the detector (on its float64 figures), then kept in the storage's dtype by the watch's History
(history.py: a window in RAM, a summary, the disk) and told to the listeners."""

from __future__ import annotations

import time
from collections import deque

import torch

from hookwidget.capture.sample_shares import COLUMNS
from hookwidget.capture.stat_rows import F64, NAN, STAT_NAMES, S
from hookwidget.capture.step_stats import lr_column
from hookwidget.watch.amp import SKIPPED
from hookwidget.watch.arrivals import InFlight
from hookwidget.watch.micro import MicroRows

FLUSH_SECONDS = 0.5  # rows waiting on device move at the end of a step this long after the last move


class HostRows:
    """Recorded steps whose row is still on device (`pending`), moved to `history` (history.History). `amp()`
    gives the watch's ScaleTrack or None (it may appear mid-run); `per_sample`: whether steps carry per-sample
    maxima; `tell(event, *args)`: the watch's listeners (Watch.listen)."""

    def __init__(self, n_layers: int, detector, amp, per_sample: bool, tell, ranks=None, history=None):
        self.L, self.detector, self.amp, self.per_sample, self.tell = n_layers, detector, amp, per_sample, tell
        self.ranks = ranks  # a model spread over ranks: ranks.Ranks makes each row global before it is read
        self.pending: list = []  # recorded steps whose statistics are still on device
        self.history = history
        self._moving: deque = deque()  # (steps, their rows in flight to the host, what they hold): _launch
        self._recent: deque = deque(maxlen=2)  # (float64 rows, kept rows) of the latest moves: see changed()
        self.skipped: list = []  # steps whose optimizer step the GradScaler skipped (found inf/NaN)
        self.micro = MicroRows(history.log, history.dtype)  # each optimizer step of several passes: theirs
        self._due = time.monotonic() + FLUSH_SECONDS

    def add(self, step) -> None:
        if self.ranks is not None:
            self.ranks.launch(step)
        self.pending.append(step)

    def settle(self, step) -> None:
        """Make a pending step's row global (spread over ranks: ranks.Ranks) before it is judged; else nothing."""
        if self.ranks is not None:
            self.ranks.settle(step)

    def due(self, batch: int) -> bool:
        """Whether the waiting rows should move now: more than `batch` of them, or FLUSH_SECONDS since the last
        move (moving them never waits for the device: flush)."""
        return len(self.pending) > batch or bool(self.pending) and time.monotonic() >= self._due

    def changed(self) -> None:
        """A host row was written into (an optimizer step after the row was read: its update ratio, computed from
        the float64 row's weight norm as on the device): the kept rows of the latest moves follow it. The summary
        and the disk take the newest row one step late, so they see it so."""
        for rows, kept in self._recent:
            if kept is not rows:
                kept.copy_(rows)

    def holds(self, step: int) -> bool:
        """Whether `step`'s row is still on its way: on device, or in flight to the host."""
        return any(s.index == step for s in self.pending) or any(s.index == step for m in self._moving
                                                                 for s in m[0])

    def flush(self, upto: int | None = None, wait: bool = True) -> None:
        """Move the statistics of pending steps (those up to `upto`) to the host in one transfer. `wait`: land
        every row in flight now (a read); else only those that have arrived (the step's path: no sync)."""
        take = [s for s in self.pending if upto is None or s.index <= upto]
        if take:
            self._due = time.monotonic() + FLUSH_SECONDS
            self.pending = self.pending[len(take):]
            self._moving.append(self._launch(take))
        while self._moving and (wait or self._moving[0][1].arrived()):
            self._land(*self._moving.popleft())

    def _launch(self, take: list) -> tuple:
        """Start moving the rows of `take` (with their per-sample maxima, GradScaler scales, device learning rates
        and accumulated passes) in one non-blocking transfer: (take, the transfer, what it holds)."""
        for s in take if self.ranks is not None else ():
            self.ranks.settle(s)
        track = self.amp()
        scales = [track.pairs(take, take[0].row.device).flatten()] if track is not None else []
        ps = [torch.stack([s.ps for s in take]).flatten()] if self.per_sample else []
        lrs = _device_lrs(take)  # learning rates a scheduler keeps on device: in the same transfer
        dev = take[0].row.device
        grouped = [s for s in take if s.micro is not None]  # optimizer steps: their passes' rows come along
        micro = [t.to(dev).flatten() for s in grouped for t in s.micro]
        own = self.ranks.outgoing(take) if self.ranks is not None else []  # each rank's own rows, spread
        both = torch.cat([torch.stack([s.row for s in take]).flatten(),
                          torch.stack([s.step_row for s in take]).flatten(), *ps, *scales,
                          *([torch.stack([v.to(dev, F64) for v in lrs])] if lrs else []), *micro, *own])
        for s in take:
            s.ps = None
        return take, InFlight(both), (bool(scales), bool(ps), len(lrs), grouped, sum(t.numel() for t in own))

    def _land(self, take: list, moving: InFlight, holds: tuple) -> None:
        """The rows of `take` have arrived: judged, kept and told."""
        both = moving.wait()
        scales, ps, n_lrs, grouped, n_own = holds
        n, L = len(take), self.L
        own = both[both.numel() - n_own:] if n_own else None
        both = both[:both.numel() - n_own]
        if grouped:
            both = self._micro(grouped, both)
        if n_lrs:
            _read_lrs(take, both[-n_lrs:].tolist())
            both = both[:-n_lrs]
        skipped = both[-2 * n:].view(n, 2) if scales else None  # (scale, scale after) per step
        both = both[:-2 * n] if scales else both
        maxima = None  # this chunk's per-sample maxima and shares (n, COLUMNS)
        if ps:
            maxima = both[-COLUMNS * n:].view(n, COLUMNS)
            both = both[:-COLUMNS * n]
        rows, step_rows = both[:n * L * len(STAT_NAMES)].view(n, L, -1), both[n * L * len(STAT_NAMES):].view(n, 2)
        view = rows.numpy()  # the same memory: a row's small writes cost a fraction of torch indexing's
        for r, s in enumerate(take):
            if s.lr:
                view[r, :, S["lr"]] = lr_column(s.lr, L)
        if self.ranks is not None:
            self.ranks.moved(take, rows, step_rows, own)
        skips = [None] * n
        for r, s in enumerate(take):
            if skipped is not None and skipped[r, 1] < skipped[r, 0]:
                rows[r, :, S["update_ratio"]] = NAN  # a fused optimizer "steps" by zero: still no update
                self.skipped.append(s.index)
                skips[r] = SKIPPED.format(*skipped[r].tolist())
        kept = rows.to(self.history.dtype)  # what is kept (float32 unless the model is float64: watch.md)
        self._recent.append((rows, kept))
        for r, s in enumerate(take):
            s.host, s.row, s.step_row = (rows, r), None, None  # a late optimizer step writes its update ratio here
        indices = [s.index for s in take]
        self.history.append(kept, step_rows, indices, maxima)
        for r, s in enumerate(take):
            self.detector.check(s.index, rows[r], step_rows[r], s.order, s.a_order, s.has_loss, skipped=skips[r])
        self.tell("rows", kept, step_rows, indices, maxima)

    def _micro(self, grouped: list, both: torch.Tensor) -> torch.Tensor:
        """Keep the passes' rows of the optimizer steps `grouped` from the end of `both`; the rest of it."""
        K = len(STAT_NAMES)
        at = both.numel() - sum(s.micro[0].numel() + s.micro[1].numel() for s in grouped)
        tail, both = both[at:], both[:at]
        off = 0
        for s in grouped:
            P = s.micro[0].shape[0]
            rows = tail[off:off + P * self.L * K].view(P, self.L, K)
            off += P * self.L * K
            step_rows = tail[off:off + 2 * P].view(P, 2)
            kept = self.micro.add(s.index, list(s.passes), rows, step_rows)
            self.tell("micro", s.index, list(s.passes), kept, step_rows)
            off += 2 * P
            s.micro = None
        return both


def _device_lrs(take: list) -> list:
    """The learning rates of `take` that are device tensors, in order (steps, then layers)."""
    return [v for s in take for v in s.lr.values() if isinstance(v, torch.Tensor)]


def _read_lrs(take: list, values: list) -> None:
    """Put the host `values` of _device_lrs(take) back in place of their tensors."""
    it = iter(values)
    for s in take:
        s.lr = {li: next(it) if isinstance(v, torch.Tensor) else v for li, v in s.lr.items()}
