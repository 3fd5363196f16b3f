"""A watch read back from disk: `w.save(path)` / `hw.load(path)`, and `hw.load(d)` of a log folder.

`w.save` writes the watch as data through record/saved.py (kind "watch"): the statistics, the step statistics,
the steps, the names, the anomalies, the notes and the kept Traces, each nested as its Trace.to_data() (the Traces
of one model share its stand-ins and tensors in the file). A log folder holds the statistics, anomalies and notes
(views/watch_log.py), not Traces. Either comes back as a SavedWatch: read-only, it answers what a closed watch
answers (reads.py: stats, step_stats, steps, series, rows, lod, anomalies, to_html, the widget, to_tensorboard,
to_wandb, save; notes, kept, trace(k)), and says in one line that what needs the live model is not here. A log
folder is read lazily: hw.load reads watch.json, the shard names, events.json and lod.npz; rows come from the
memory-mapped shards when asked.
"""

from __future__ import annotations

import numpy as np
import torch

from hookwidget.trace import Trace
from hookwidget.watch.detect import Anomaly
from hookwidget.watch.history import level_from
from hookwidget.watch.lod import Level
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


class _InMemory:
    """The rows of a `w.save` file, as the log's Shards read them (one shard: a structured array)."""

    def __init__(self, stats: torch.Tensor, step_stats: torch.Tensor, steps, per_sample):
        self.fields = {"step": np.asarray(steps, np.int64), "stats": stats.numpy(),
                       "step_stats": step_stats.numpy(), "per_sample": None if per_sample is None else
                       per_sample.numpy()}
        self.n = len(self.fields["step"])

    def read(self, field: str, start: int, stop: int, at=()) -> np.ndarray:
        return np.array(self.fields[field][(slice(start, stop), *at)])


class SavedWatch(Reads):
    """A watch as data, read-only: made by hw.load of a `w.save` file or of a log folder. `rows`: the log's
    watch_log.Shards, or the rows of a file in memory."""

    active, closed = False, True

    def __init__(self, source, meta: dict, rows, anomalies: list, notes: list, skipped: list, traces: dict | None,
                 dropped: int = 0, seen: int | None = None, nonfinite: dict | None = None, level=None):
        self.source = str(source)
        self.layer_names, self.stat_names = list(meta["layers"]), tuple(meta["stat_names"])
        self.step_stat_names, self.every = tuple(meta["step_stat_names"]), int(meta["every"])
        self._rows, self.notes, self.skipped = rows, list(notes), [int(k) for k in skipped]
        self.tracks_per_sample = bool(meta["per_sample"])
        self._dtype = np.dtype(meta.get("dtype", "float64"))
        self._detector = _Found([Anomaly(int(k), str(where), str(why)) for k, where, why in anomalies],
                                {int(k): int(v) for k, v in (nonfinite or {}).items()})
        self._flight = None if traces is None else _Kept(traces, dropped)
        self.flight_recorder = traces is not None
        self.seen = rows.n if seen is None else int(seen)  # backward passes the watch saw
        self._summary, self._step_list = level, None

    @classmethod
    def from_data(cls, tree: dict, source) -> SavedWatch:
        """The watch of a `w.save` file's tree (`hw.load` reads it)."""
        traces = None if tree["traces"] is None else {k: Trace.from_data(t, source) for k, t in tree["traces"]}
        meta = {k: tree[k] for k in ("layers", "stat_names", "step_stat_names", "every")}
        meta.update(per_sample=tree["per_sample"] is not None, dtype=str(tree["stats"].numpy().dtype))
        rows = _InMemory(tree["stats"], tree["step_stats"], tree["steps"], tree["per_sample"])
        return cls(source, meta, rows, tree["anomalies"], tree["notes"], tree["skipped"], traces, tree["dropped"],
                   tree["seen"], tree.get("nonfinite"))

    @classmethod
    def from_log(cls, log_dir) -> SavedWatch:
        """The watch of a log folder, up to its last complete shard; its notes say where it ended."""
        from hookwidget.views import watch_log

        meta, shards, events, unread = watch_log.open_log(log_dir)
        notes = [*meta["notes"], *unread]
        if not meta["closed"]:
            last = int(shards.read("step", shards.n - 1, shards.n)[0]) if shards.n else None
            notes.append(f"the log in {log_dir} was not closed (the run was killed, or is still going): "
                         f"{shards.n} recorded steps, up to step {last}, as of its last complete shard")
        names = {"layers": meta["layers"], "stat_names": meta["stats"], "step_stat_names": meta["step_stats"],
                 "every": meta["every"], "per_sample": meta["per_sample"], "dtype": meta.get("dtype", "float64")}
        L, K = len(meta["layers"]), len(meta["stats"])
        level = level_from(events["lod"], L, K) if events["lod"] is not None else None
        return cls(log_dir, names, shards, events["anomalies"], notes, events["skipped"], None, seen=meta["seen"],
                   nonfinite=events["nonfinite"], level=level)

    # -- the rows, for reads.py ---------------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        return self._rows.n

    def _settle(self) -> None:
        """Nothing to move: the rows are all here."""

    def _table(self, start: int, stop: int) -> tuple:
        if stop <= start:
            return (np.zeros(0, np.int64), np.zeros((0, len(self.layer_names), len(self.stat_names)), self._dtype),
                    np.zeros((0, 2)))
        return (self._rows.read("step", start, stop), self._rows.read("stats", start, stop),
                self._rows.read("step_stats", start, stop))

    def _column(self, start: int, stop: int, at: tuple, field: str) -> np.ndarray:
        got = self._rows.read(field, start, stop, at) if stop > start else None
        return got if got is not None else np.zeros(0)

    def _steps(self) -> list:
        if self._step_list is None:
            self._step_list = self._column(0, self.n_rows, (), "step").tolist()
        return self._step_list

    def _level(self) -> Level:
        """The summary: the log's lod.npz, else made from the rows when first asked (one read of the run)."""
        if self._summary is None:
            L, K = len(self.layer_names), len(self.stat_names)
            self._summary = level = Level(L, K, 1024)
            step = max(1, (64 << 20) // (L * K * 8))
            for at in range(0, self.n_rows, step):
                level.add(*self._table(at, min(self.n_rows, at + step)))
        return self._summary

    def _found(self) -> list:
        return list(self._detector.anomalies)

    def _local(self) -> tuple:
        """As the watch held them: a loaded watch keeps the global figures only."""
        return self.stats, self.step_stats

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
        if not self.tracks_per_sample:
            raise KeyError("per-sample norms were off in this watch: hw.watch(model, per_sample=True) records them")
        return torch.from_numpy(self._column(0, self.n_rows, (slice(0, 2),), "per_sample").reshape(-1, 2))

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
                f"{self.n_rows} recorded, {len(self._detector.anomalies)} anomalies{traces}")
