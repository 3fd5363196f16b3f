"""The watch's rows on their way to the host: recorded steps wait on device and move in one transfer, `batch`
steps at a time or when read; on the CPU, or with the flight recorder on (it reads each step's scalars anyway),
also at least every FLUSH_SECONDS while steps end, so that a slow run's live view and log_dir keep up. Each moved
row is judged by the detector and told to the listeners. Small chunks on the host are merged into blocks, so a
long run holds its rows and little else: layers × 13 + 2 float64 and one step index per recorded step."""

from __future__ import annotations

import time
from array import array

import torch

from hookwidget.capture.stat_rows import F64, NAN, STAT_NAMES, S
from hookwidget.capture.step_stats import lr_column
from hookwidget.watch.amp import SKIPPED

MERGE = 64  # small chunks on the host past which they are merged into one block
FLUSH_SECONDS = 0.5  # rows waiting on device move at the end of a step this long after the last move


class HostRows:
    """Recorded steps whose row is still on device (`pending`), and the rows on the host (`stats`, `step_stats`,
    `steps`, per-sample maxima). `amp()` gives the watch's ScaleTrack or None (it may appear mid-run);
    `per_sample`: whether steps carry per-sample maxima; `tell(event, *args)`: the watch's listeners (Watch.listen)."""

    def __init__(self, n_layers: int, detector, amp, per_sample: bool, tell, ranks=None):
        self.L, self.detector, self.amp, self.per_sample, self.tell = n_layers, detector, amp, per_sample, tell
        self.ranks = ranks  # a model spread over ranks: ranks.Ranks makes each row global before it is read
        self.pending: list = []  # recorded steps whose statistics are still on device
        self.chunks, self.step_chunks, self.recorded = [], [], array("q")  # recorded: the step index of each row
        self._blocks = 0  # leading chunks that are merged blocks already
        self.ps_chunks: list = []  # per_sample=True: (recorded steps, 2) on the host
        self.skipped: list = []  # steps whose optimizer step the GradScaler skipped (found inf/NaN)
        self.micro: dict = {}  # an optimizer step of several passes -> (their indices, (P, L, K) rows, (P, 2))
        self._cache = None
        self._due = time.monotonic() + FLUSH_SECONDS

    def add(self, step) -> None:
        if self.ranks is not None:
            self.ranks.launch(step)
        self.pending.append(step)

    def settle(self, step) -> None:
        """Make a pending step's row global (spread over ranks: ranks.Ranks) before it is judged; else nothing."""
        if self.ranks is not None:
            self.ranks.settle(step)

    def due(self, batch: int, timed: bool) -> bool:
        """Whether the waiting rows should move now: more than `batch` of them, or (`timed`: where moving them costs
        no sync of its own) FLUSH_SECONDS since the last move."""
        return len(self.pending) > batch or timed and bool(self.pending) and time.monotonic() >= self._due

    def changed(self) -> None:
        """A host row was written into (an optimizer step after the row was read)."""
        self._cache = None

    def flush(self, upto: int | None = None) -> None:
        """Move the statistics of pending steps (those up to `upto`) to the host in one transfer."""
        take = [s for s in self.pending if upto is None or s.index <= upto]
        if not take:
            return
        self._due = time.monotonic() + FLUSH_SECONDS
        self.pending = self.pending[len(take):]
        for s in take if self.ranks is not None else ():
            self.ranks.settle(s)
        n, L = len(take), self.L
        track = self.amp()
        scales = [track.pairs(take, take[0].row.device).flatten()] if track is not None else []
        ps = [torch.stack([s.ps for s in take]).flatten()] if self.per_sample else []
        lrs = _device_lrs(take)  # learning rates a scheduler keeps on device: in the same transfer
        dev = take[0].row.device
        grouped = [s for s in take if s.micro is not None]  # optimizer steps: their passes' rows come along
        micro = [t.to(dev).flatten() for s in grouped for t in s.micro]
        both = torch.cat([torch.stack([s.row for s in take]).flatten(),
                          torch.stack([s.step_row for s in take]).flatten(), *ps, *scales,
                          *([torch.stack([v.to(dev, F64) for v in lrs])] if lrs else []), *micro]).cpu()  # one transfer
        if micro:
            both = self._micro(grouped, both)
        if lrs:
            _read_lrs(take, both[-len(lrs):].tolist())
            both = both[:-len(lrs)]
        skipped = both[-2 * n:].view(n, 2) if scales else None  # (scale, scale after) per step
        both = both[:-2 * n] if scales else both
        if ps:
            self.ps_chunks.append(both[-2 * n:].view(n, 2))
            both = both[:-2 * n]
            for s in take:
                s.ps = None
        rows, step_rows = both[:n * L * len(STAT_NAMES)].view(n, L, -1), both[n * L * len(STAT_NAMES):].view(n, 2)
        view = rows.numpy()  # the same memory: a row's small writes cost a fraction of torch indexing's
        for r, s in enumerate(take):
            s.host, s.row, s.step_row = (rows, r), None, None
            if s.lr:
                view[r, :, S["lr"]] = lr_column(s.lr, L)
        if self.ranks is not None:
            self.ranks.moved(take, rows, step_rows)
        self.chunks.append(rows)
        self.step_chunks.append(step_rows)
        self.recorded.extend(s.index for s in take)
        self._cache = None
        if len(self.chunks) - self._blocks > MERGE:
            self._merge()
        for r, s in enumerate(take):
            skip = None
            if skipped is not None and skipped[r, 1] < skipped[r, 0]:
                rows[r, :, S["update_ratio"]] = NAN  # a fused optimizer "steps" by zero: still no update
                self.skipped.append(s.index)
                skip = SKIPPED.format(*skipped[r].tolist())
            self.detector.check(s.index, rows[r], step_rows[r], s.order, s.a_order, s.has_loss, skipped=skip)
        maxima = self.ps_chunks[-1] if self.per_sample else None  # this chunk's per-sample maxima (n, 2)
        self.tell("rows", rows, step_rows, [s.index for s in take], maxima)

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
            self.micro[s.index] = (list(s.passes), rows, tail[off:off + 2 * P].view(P, 2))
            off += 2 * P
            s.micro = None
        return both

    def _merge(self) -> None:
        """The chunks after the last block but the newest (its latest step's update ratio may still be written
        into it) concatenated into one block: each row is copied once more, at most."""
        at = self._blocks
        for chunks in (self.chunks, self.step_chunks, self.ps_chunks):
            if len(chunks) > at + 1:
                chunks[at:-1] = [torch.cat(chunks[at:-1])]
        self._blocks += 1

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(stats, step_stats) of every recorded step on the host; the pending ones moved first."""
        self.flush()
        return self.host_tables()

    def host_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(stats, step_stats) of the steps already on the host: nothing moved (no device sync)."""
        if self._cache is None:
            L, K = self.L, len(STAT_NAMES)
            stats = torch.cat(self.chunks) if self.chunks else torch.zeros(0, L, K, dtype=torch.float64)
            steps = torch.cat(self.step_chunks) if self.step_chunks else torch.zeros(0, 2, dtype=torch.float64)
            self._cache = (stats, steps)
        return self._cache

    def per_sample_table(self) -> torch.Tensor:
        self.flush()
        return torch.cat(self.ps_chunks) if self.ps_chunks else torch.zeros(0, 2, dtype=F64)


def _device_lrs(take: list) -> list:
    """The learning rates of `take` that are device tensors, in order (steps, then layers)."""
    return [v for s in take for v in s.lr.values() if isinstance(v, torch.Tensor)]


def _read_lrs(take: list, values: list) -> None:
    """Put the host `values` of _device_lrs(take) back in place of their tensors."""
    it = iter(values)
    for s in take:
        s.lr = {li: next(it) if isinstance(v, torch.Tensor) else v for li, v in s.lr.items()}
