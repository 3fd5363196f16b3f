"""One fit as a trainer sees it: the watch opened for it, and its backward passes grouped into optimizer steps.

The watch counts backward passes (its steps); a trainer counts optimizer steps, each holding its micro-batches
(gradient accumulation: `gradient_accumulation_steps` backward passes, then one optimizer step). The callbacks
tell `Fit` when the trainer's step counter moves; Fit notes which backward passes that step held, and picks
the row the loggers get for it: the step's last recorded backward pass, where .grad is the accumulated
gradient the optimizer used and update_ratio is that optimizer step's. With every=N the watch records every N-th
backward pass, not every N-th optimizer step: a step whose last micro-batch was not recorded gets its last recorded
one (whose .grad holds the micro-batches so far), and a step with none recorded logs nothing.
"""

from __future__ import annotations

import bisect
import inspect

from hookwidget.watch import STAT_NAMES
from hookwidget.watch import watch as open_watch

PREFIX = "hookwidget"  # the loggers' keys: hookwidget/{stat}/{layer}
LOG_STATS = ("grad_norm", "update_ratio")


class Fit:
    """`watch_kwargs` go to hw.watch; `log_stats`: the statistics forwarded to the trainer's loggers (each for
    every watched layer; () forwards none)."""

    def __init__(self, watch_kwargs: dict, log_stats):
        self.watch_kwargs, self.log_stats = dict(watch_kwargs), tuple(log_stats)
        inspect.signature(open_watch).bind(None, **self.watch_kwargs)  # a misspelt argument fails now, not mid-fit
        unknown = [s for s in self.log_stats if s not in STAT_NAMES]
        if unknown:
            raise ValueError(f"log_stats: no statistic {', '.join(unknown)}; choose from {', '.join(STAT_NAMES)}")
        self.watch = None
        self.micro_batches: dict = {}  # trainer step -> the backward passes (watch steps) it held
        self._first = 0  # the first backward pass of the optimizer step being accumulated
        self._step = 0  # the trainer's step counter when last seen

    def open(self, model, step: int) -> None:
        """A new watch for a new fit, whose trainer step counter starts at `step` (resumed fits: not 0); the
        previous watch, if a fit left it open, is closed first."""
        self.close()
        self.watch, self.micro_batches, self._first, self._step = open_watch(model, **self.watch_kwargs), {}, 0, step

    def close(self) -> None:
        """Remove every hook of the watch; idempotent, and safe before open()."""
        if self.watch is not None:
            self.watch.close()

    @property
    def active(self) -> bool:
        return self.watch is not None and self.watch.active

    def stepped(self, step: int) -> bool:
        """The trainer's optimizer step counter reads `step`; if it moved, the backward passes since it last
        moved are that step's. Returns whether it moved."""
        if not self.active or step == self._step:
            return False
        n = self.watch.seen
        self.micro_batches[step], self._first, self._step = list(range(self._first, n)), n, step
        return True

    def optimizer_steps(self) -> list:
        """For each row of watch.stats (watch.steps), the trainer step whose micro-batch it was; None for backward
        passes after the last optimizer step (an accumulation the fit ended before stepping)."""
        of = {b: s for s, bs in self.micro_batches.items() for b in bs}
        return [of.get(k) for k in self.watch.steps] if self.watch is not None else []

    def row_of(self, step: int):
        """The row of watch.stats the loggers get for trainer step `step`: its last recorded micro-batch; None if
        none of its micro-batches was recorded (every=N)."""
        mine = self.micro_batches.get(step)
        if not mine:
            return None
        steps = self.watch.steps  # ascending
        r = bisect.bisect_right(steps, mine[-1]) - 1
        return r if r >= 0 and steps[r] >= mine[0] else None

    def metrics(self, step: int) -> dict:
        """{f"hookwidget/{stat}/{layer}": value} of trainer step `step` (moves pending rows to the host: call it
        at the trainer's logging cadence, not every step)."""
        if self.watch is None or not self.log_stats:
            return {}
        r = self.row_of(step)
        if r is None:
            return {}
        w = self.watch
        table = w.stats[r].tolist()
        return {f"{PREFIX}/{stat}/{layer}": table[li][w.stat_names.index(stat)]
                for stat in self.log_stats for li, layer in enumerate(w.layer_names)}


class Watching:
    """What both callbacks hand the user (they hold a Fit as `_fit`)."""

    _fit: Fit

    @property
    def watch(self):
        """The Watch of the current (or latest) fit; None before the first."""
        return self._fit.watch

    @property
    def micro_batches(self) -> dict:
        """Optimizer step (the trainer's step counter after it) -> the backward passes (watch steps) it held."""
        return self._fit.micro_batches

    def optimizer_steps(self) -> list:
        """The optimizer step of each row of watch.stats (None: after the last optimizer step)."""
        return self._fit.optimizer_steps()

    def close(self) -> None:
        """Remove the watch's hooks now (the fit does it itself when it ends, or raises)."""
        self._fit.close()
