"""A watch read back from disk: `w.save(path)` / `hw.load(path)`, and `hw.load(d)` of a `log_dir=d` log.

`w.save` writes the watch as data through record/saved.py (kind "watch"): the statistics, the step statistics,
the steps, the names, the anomalies, the notes and the kept Traces, each nested as its Trace.to_data() (the Traces
of one model share its stand-ins and tensors in the file). A log_dir holds the statistics, anomalies and notes
(views/watch_log.py), not Traces. Either comes back as a SavedWatch: read-only, it answers what a closed watch
answers (stats, step_stats, steps, series, anomalies, notes, kept, trace(k), to_html, the widget, to_tensorboard,
to_wandb: Watch's own methods, on the data), and says in one line that what needs the live model is not here.
"""

from __future__ import annotations

import numpy as np
import torch

from hookwidget.trace import Trace
from hookwidget.watch import leads
from hookwidget.watch.core import Watch
from hookwidget.watch.detect import Anomaly
from hookwidget.watch.reads import Reads


class _Found:
    """The anomalies, where the views read them on a live watch (its detector)."""

    def __init__(self, anomalies: list, stretches: dict):
        self.anomalies, self.stretches = anomalies, stretches


class _Kept:
    """The kept Traces by step, where the views read them on a live watch (its flight recorder)."""

    def __init__(self, traces: dict, dropped: int):
        self.traces, self.dropped = traces, dropped

    def steps(self) -> list:
        return sorted(self.traces)


class SavedWatch(Reads):
    """A watch as data, read-only: made by hw.load of a `w.save` file or of a `log_dir` folder."""

    active, closed = False, True

    def __init__(self, source, meta: dict, stats, step_stats, steps, per_sample, anomalies: list, notes: list,
                 skipped: list, traces: dict | None, dropped: int = 0, seen: int | None = None,
                 nonfinite: dict | None = None):
        self.source = str(source)
        self.layer_names, self.stat_names = list(meta["layers"]), tuple(meta["stat_names"])
        self.step_stat_names, self.every = tuple(meta["step_stat_names"]), int(meta["every"])
        self.stats, self.step_stats, self.steps = stats, step_stats, [int(k) for k in steps]
        self._per_sample, self.notes, self.skipped = per_sample, list(notes), [int(k) for k in skipped]
        self.tracks_per_sample = per_sample is not None
        self._detector = _Found([Anomaly(int(k), str(where), str(why)) for k, where, why in anomalies],
                                {int(k): int(v) for k, v in (nonfinite or {}).items()})
        self._flight = None if traces is None else _Kept(traces, dropped)
        self.flight_recorder = traces is not None
        self.seen = len(self.steps) if seen is None else int(seen)  # backward passes the watch saw

    @classmethod
    def from_data(cls, tree: dict, source) -> SavedWatch:
        """The watch of a `w.save` file's tree (`hw.load` reads it)."""
        traces = None if tree["traces"] is None else {k: Trace.from_data(t, source) for k, t in tree["traces"]}
        meta = {k: tree[k] for k in ("layers", "stat_names", "step_stat_names", "every")}
        return cls(source, meta, tree["stats"], tree["step_stats"], tree["steps"].tolist(), tree["per_sample"],
                   tree["anomalies"], tree["notes"], tree["skipped"], traces, tree["dropped"], tree["seen"],
                   tree.get("nonfinite"))

    @classmethod
    def from_log(cls, log_dir) -> SavedWatch:
        """The watch of a `log_dir` folder, up to its last complete shard; its notes say where it ended."""
        from hookwidget.views import watch_log

        meta, rows, unread = watch_log.read(log_dir)
        notes = [*meta["notes"], *unread]
        steps = rows["steps"].tolist()
        if not meta["closed"]:
            notes.append(f"the log in {log_dir} was not closed (the run was killed, or is still going): "
                         f"{len(steps)} recorded steps, up to step {steps[-1] if steps else None}, as of its last "
                         "complete shard")
        names = {"layers": meta["layers"], "stat_names": meta["stats"], "step_stat_names": meta["step_stats"],
                 "every": meta["every"]}
        anomalies = zip(rows["anomaly_step"].tolist(), rows["anomaly_where"].tolist(), rows["anomaly_reason"].tolist())
        return cls(log_dir, names, torch.from_numpy(rows["stats"]), torch.from_numpy(rows["step_stats"]), steps,
                   torch.from_numpy(rows["per_sample"]) if meta["per_sample"] else None, list(anomalies), notes,
                   rows["skipped"].tolist(), None, seen=meta["seen"])

    # -- what a watch answers, from the data (Watch's own methods) ------------------------------
    @property
    def n_rows(self) -> int:
        return len(self.steps)

    def _table(self, start: int, stop: int) -> tuple:
        return (np.asarray(self.steps[start:stop], np.int64), self.stats[start:stop].numpy(),
                self.step_stats[start:stop].numpy())

    series, loss, grad_norm = Watch.series, Watch.loss, Watch.grad_norm
    widget, _repr_mimebundle_, to_html = Watch.widget, Watch._repr_mimebundle_, Watch.to_html
    to_tensorboard, to_wandb = Watch.to_tensorboard, Watch.to_wandb
    save = Watch.save

    @property
    def anomalies(self) -> list:
        """As the live watch's: each with its lead, worked out from the saved rows the same way."""
        found = list(self._detector.anomalies)
        if not found:
            return found
        rows = leads.Rows(self.stats.numpy(), self.step_stats.numpy(), self.steps, self.layer_names,
                          self.stat_names, self.step_stat_names)
        return leads.with_leads(found, rows)

    found_anomalies = anomalies

    @property
    def nonfinite(self) -> dict:
        """Onset step of each non-finite stretch -> the non-finite steps counted after it (a log_dir keeps none)."""
        return dict(self._detector.stretches)

    found_nonfinite = nonfinite

    def listen(self, fn) -> None:
        """Never told: the rows are all here (the views listen to a live watch)."""

    def sync(self) -> None:
        """Nothing to move: the rows are all on the host."""

    @property
    def per_sample(self) -> torch.Tensor:
        if self._per_sample is None:
            raise KeyError("per-sample norms were off in this watch: hw.watch(model, per_sample=True) records them")
        return self._per_sample

    @property
    def kept(self) -> list:
        return self._flight.steps() if self._flight is not None else []

    @property
    def dropped_traces(self) -> int:
        return self._flight.dropped if self._flight is not None else 0

    def trace(self, k: int = -1):
        """The loaded Trace of kept step k (read-only: it answers every query but rerun and hooks); -1: the latest."""
        if self._flight is None:
            raise KeyError(f"this watch, loaded from {self.source}, holds no Traces (a log_dir holds statistics, "
                           "and the flight recorder may have been off): w.save(path) keeps a watch's Traces")
        kept = self.kept
        if k == -1 and kept:
            k = kept[-1]
        if k not in self._flight.traces:
            raise KeyError(f"step {k} was not kept; kept steps: {kept} (the latest and anomalous ones)")
        return self._flight.traces[k]

    # -- what needs the live model ------------------------------------------------------------
    def _refuse(self, what: str):
        raise RuntimeError(f"this watch was loaded from {self.source}: {what} needs the live model and its training "
                           "loop; hw.watch(model) records a new watch")

    @property
    def model(self):
        raise AttributeError(f"this watch was loaded from {self.source}: it holds statistics, not the model")

    def open(self):
        self._refuse("open()")

    def gather(self, dst: int = 0, group=None):
        self._refuse("gather() (it runs on every rank of the training job)")

    def close(self) -> None:
        """Nothing to close: a loaded watch holds no hooks."""

    def __repr__(self) -> str:
        traces = f", traces kept at steps {self.kept}" if self._flight is not None else ""
        return (f"Watch (loaded from {self.source}): {len(self.layer_names)} layers, {self.seen} steps, "
                f"{len(self.steps)} recorded, {len(self.anomalies)} anomalies{traces}")
