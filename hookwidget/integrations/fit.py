"""One fit as a trainer sees it: the watch opened for it, its rows the trainer's optimizer steps, and what the
trainer's loggers get.

A trainer always steps an optimizer (after `gradient_accumulation_steps` backward passes, or with backward inside
`optimizer.step(closure)`, as Lightning does): `Fit.open` tells the watch to count optimizer steps from the first
backward pass (Watch.count_optimizer_steps), so each row of watch.stats is one optimizer step (its micro-batches
added up, ‖W.grad‖ of the gradient the step used, the loss as the trainer reports it) and watch.steps[r] + 1 + the
trainer's step counter at the start is the trainer's step after it (global_step). Rows made from backward passes
no optimizer step followed (a fit that ended mid-accumulation) belong to no trainer step.

At the trainer's logging cadence the loggers get a handful of keys (LOG_KEYS): the global gradient norm, the
largest update ratio and its layer (an index into watch.layer_names: loggers take numbers), the anomalies so far,
the trainer step of the latest and of its lead (where its cause shows first), and with per_sample=True the sample
that carried its step most (its index in the batch); per-layer series only for the statistics asked for in
`log_stats`.
"""

from __future__ import annotations

import bisect
import inspect
import math

from hookwidget.watch import STAT_NAMES
from hookwidget.watch import watch as open_watch

PREFIX = "hookwidget"  # the loggers' keys: hookwidget/{key}, and hookwidget/{stat}/{layer} for log_stats
LOG_KEYS = ("grad_norm", "update_ratio_max", "update_ratio_max_layer", "anomalies", "anomaly_step", "anomaly_lead_step",
            "anomaly_sample")


class Fit:
    """`watch_kwargs` go to hw.watch; `log_stats`: the statistics forwarded per layer to the trainer's loggers
    (() forwards none: LOG_KEYS only)."""

    def __init__(self, watch_kwargs: dict, log_stats):
        self.watch_kwargs = dict(watch_kwargs)
        self.log_stats = (log_stats,) if isinstance(log_stats, str) else tuple(log_stats)
        inspect.signature(open_watch).bind(None, **self.watch_kwargs)  # a misspelt argument fails now, not mid-fit
        unknown = [s for s in self.log_stats if s not in STAT_NAMES]
        if unknown:
            raise ValueError(f"log_stats: no statistic {', '.join(unknown)}; choose from {', '.join(STAT_NAMES)}")
        self.watch = None
        self._start = 0  # the trainer's step counter when the fit began (resumed fits: not 0)
        self._step = 0  # the trainer's step counter when last seen

    def open(self, model, step: int) -> None:
        """A new watch for a new fit, whose trainer step counter starts at `step`; the previous watch, if a fit
        left it open, is closed first."""
        self.close()
        self.watch, self._start, self._step = open_watch(model, **self.watch_kwargs), step, step
        self.watch.count_optimizer_steps()

    def close(self) -> None:
        """Remove every hook of the watch; idempotent, and safe before open()."""
        if self.watch is not None:
            self.watch.close()

    @property
    def active(self) -> bool:
        return self.watch is not None and self.watch.active

    def stepped(self, step: int) -> bool:
        """The trainer's optimizer step counter reads `step`; returns whether it moved since last seen."""
        if not self.active or step == self._step:
            return False
        self._step = step
        return True

    def trainer_step(self, k: int):
        """The trainer's step counter after the watch's step k; None if the trainer never got there."""
        s = self._start + k + 1
        return s if s <= self._step else None

    @property
    def micro_batches(self) -> dict:
        if self.watch is None:
            return {}
        return {s: bs for k, bs in self.watch.micro_batches.items() if (s := self.trainer_step(k)) is not None}

    def optimizer_steps(self) -> list:
        """For each row of watch.stats (watch.steps), the trainer step it is; None where the fit ended before that
        optimizer step."""
        return [self.trainer_step(k) for k in self.watch.steps] if self.watch is not None else []

    def row_of(self, step: int):
        """The row of watch.stats of trainer step `step`; None if not recorded (every=N)."""
        steps, k = self.watch.steps, step - self._start - 1
        r = bisect.bisect_left(steps, k)
        return r if r < len(steps) and steps[r] == k else None

    def metrics(self, step: int) -> dict:
        """The loggers' keys for trainer step `step` (moves pending rows to the host: call it at the trainer's
        logging cadence, not every step): LOG_KEYS, and f"hookwidget/{stat}/{layer}" for the stats in log_stats."""
        if self.watch is None:
            return {}
        r = self.row_of(step)
        if r is None:
            return {}
        w = self.watch
        _, row, step_row = w.rows(r, r + 1)  # this row alone: w.stats would read the whole run
        out = {f"{PREFIX}/grad_norm": step_row[0, 1].item()}
        ratios = row[0, :, w.stat_names.index("update_ratio")].double().nan_to_num(-math.inf)
        top = int(ratios.argmax())
        out[f"{PREFIX}/update_ratio_max"] = ratios[top].item() if ratios[top] > -math.inf else math.nan
        out[f"{PREFIX}/update_ratio_max_layer"] = top if ratios[top] > -math.inf else math.nan
        anomalies = w.anomalies
        out[f"{PREFIX}/anomalies"] = len(anomalies)
        if anomalies:
            latest = self.trainer_step(anomalies[-1].step)
            out[f"{PREFIX}/anomaly_step"] = latest if latest is not None else math.nan
            lead = anomalies[-1].lead  # where its cause shows first (watch/leads.py); its text is in cb.watch.anomalies
            if lead is not None:
                at = self.trainer_step(lead.step)
                out[f"{PREFIX}/anomaly_lead_step"] = at if at is not None else math.nan
            carried = anomalies[-1].samples  # per_sample=True: the samples that carried its step (watch/carriers.py)
            if carried is not None:
                out[f"{PREFIX}/anomaly_sample"] = carried.samples[0][0]
        if self.log_stats:
            table = row[0].double().tolist()
            out.update({f"{PREFIX}/{stat}/{layer}": table[li][w.stat_names.index(stat)]
                        for stat in self.log_stats for li, layer in enumerate(w.layer_names)})
        return out


class Watching:
    """What both callbacks give you, and what they log.

    At the trainer's logging cadence its loggers get, at x = the trainer's step: `hookwidget/grad_norm` (the
    global ‖W.grad‖ of the gradient the optimizer step used), `hookwidget/update_ratio_max` and
    `hookwidget/update_ratio_max_layer` (an index into `cb.watch.layer_names`: loggers take numbers),
    `hookwidget/anomalies` (so far), `hookwidget/anomaly_step` (the latest one's) and
    `hookwidget/anomaly_lead_step` (where its cause shows first), `hookwidget/anomaly_sample` (with
    per_sample=True: the index in its batch of the sample that carried its step most; `cb.watch.anomalies[-1]
    .samples` has the rest); per layer, `hookwidget/{stat}/{layer}` only for
    the statistics in `log_stats`.
    """

    _fit: Fit

    def __init__(self, log_stats=(), **watch_kwargs):
        """Check the arguments now (a misspelt one fails here, not mid-fit); the watch opens when the fit starts.

        Args:

        - `log_stats`: statistics forwarded per layer to the loggers (default none), e.g.
          `log_stats=("grad_norm", "update_ratio")`.
        - `**watch_kwargs`: the arguments of `hw.watch` (every, spike, window, keep, flight_recorder, max_kept,
          per_sample, ...).

        Raises:

        - `TypeError`: an argument `hw.watch` does not take.
        - `ValueError`: a statistic in `log_stats` that the watch does not record.
        """
        super().__init__()
        self._fit = Fit(watch_kwargs, log_stats)

    @property
    def watch(self):
        """The Watch of the current (or latest) fit; None before the first."""
        return self._fit.watch

    @property
    def micro_batches(self) -> dict:
        """Optimizer step (the trainer's step counter after it) -> the backward passes it held (0, 1, ... over the
        fit; `cb.watch.micro(k)` gives their rows)."""
        return self._fit.micro_batches

    def optimizer_steps(self) -> list:
        """The trainer's optimizer step of each row of `cb.watch.stats` (None: passes after the last optimizer
        step, in a fit that ended mid-accumulation)."""
        return self._fit.optimizer_steps()

    def close(self) -> None:
        """Remove the watch's hooks now (the fit does it itself when it ends, or raises)."""
        self._fit.close()
