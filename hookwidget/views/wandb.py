"""A watch's series and anomalies in a Weights & Biases run, for people who live there (wandb is an optional extra).

The keys are TensorBoard's (views/tensorboard.py): `{stat}/{layer}` for every layer statistic (one W&B section per
statistic, a chart per layer), `step/loss` and `step/grad_norm`, against their own x axis `hookwidget_step` (the
watch's step: a backward pass), declared with define_metric, so they never fight the run's own `_step` (a
Trainer's logger may be writing optimizer steps into the same run). NaN and Inf go in as they are. The
anomalies go in as a table (`hookwidget/anomalies`: step, where, reason, and with per_sample=True the samples
that carried the step) and their count in the summary.

On an open watch the export keeps going: the rows recorded later are logged from a background thread as they
reach the host (TensorBoardLog's thread: the training loop never waits for W&B), until the watch is closed.
"""

from __future__ import annotations

import queue

from hookwidget.views.tensorboard import TensorBoardLog

INSTALL = "pip install hookwidget[wandb]"
X = "hookwidget_step"  # the x axis of every series this module logs
ANOMALIES = "hookwidget/anomalies"


def _wandb():
    try:
        import wandb
    except ImportError:
        raise ImportError(f"wandb is not installed: {INSTALL}") from None
    return wandb


class _Run:
    """The face of a run that TensorBoardLog's thread writes through (flush, close). A run this module started
    (run=None and none active) is finished at close; a run the user gave stays theirs to finish."""

    def __init__(self, run, own: bool):
        self.run, self.own = run, own

    def flush(self) -> None:
        """run.log hands rows to W&B's own process; nothing to flush here."""

    def close(self) -> None:
        if self.own:
            self.run.finish()


class WandbLog(TensorBoardLog):
    """Logs a watch's rows to `run` (None: the active run, else a new one in project "hookwidget")."""

    LABEL = "wandb"

    def __init__(self, watch, run=None):
        wandb = _wandb()
        own = run is None and wandb.run is None
        run = (wandb.run or wandb.init(project="hookwidget")) if run is None else run
        self.watch, self.run, self.writer = watch, run, _Run(run, own)
        self.log_dir = f"W&B run {run.id}"
        self._queue, self._thread, self.error = queue.SimpleQueue(), None, None
        run.define_metric(X)
        for prefix in (*watch.stat_names, "step", "hookwidget"):
            run.define_metric(f"{prefix}/*", step_metric=X)

    def rows(self, stats, step_stats, steps, ps=None) -> None:
        w, stats, step_stats = self.watch, stats.tolist(), step_stats.tolist()
        for r, k in enumerate(steps):
            row = {X: k}
            for li, layer in enumerate(w.layer_names):
                row.update({f"{stat}/{layer}": stats[r][li][si] for si, stat in enumerate(w.stat_names)})
            row.update({f"step/{stat}": step_stats[r][si] for si, stat in enumerate(w.step_stat_names)})
            self.run.log(row)

    def anomalies(self) -> None:
        found = self.watch.found_anomalies
        self.run.summary["hookwidget/anomaly_count"] = len(found)
        if found:
            table = _wandb().Table(columns=["step", "where", "reason", "samples"],  # samples: per_sample=True's
                                   data=[[a.step, a.where, a.reason, a.samples.text if a.samples else ""]
                                         for a in found])
            self.run.log({ANOMALIES: table, X: found[-1].step})


def write(watch, run=None):
    """Everything the watch recorded so far into `run`; an open watch keeps streaming its later rows there
    until it is closed. Returns the run."""
    log = WandbLog(watch, run)
    rows = watch.stats, watch.step_stats, watch.steps
    if watch.active:
        log("rows", *rows)  # the recorded rows first, through the same thread as the later ones
        watch.listen(log)
    else:
        log.rows(*rows)
        log.anomalies()
        log.writer.close()
    return log.run
