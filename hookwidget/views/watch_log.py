"""A watch's statistics on disk as the run goes (`hw.watch(model, log_dir=d)`), in files numpy reads alone.

    d/watch.json          {"format": "hookwidget-watch-log", "version": 1, "layers": [...], "stats": [...],
                          "step_stats": ["loss", "grad_norm"], "every", "per_sample", "closed", "notes", "seen"}
    d/rows-000000.npz     np.load(f) (compressed; no pickle): steps (n,) int64, stats (n, layers, stats) float64,
    d/rows-000001.npz     step_stats (n, 2) float64, per_sample (n, 2) [max norm, its sample] where recorded,
    ...                   anomaly_step / anomaly_where / anomaly_reason (m,): the anomalies found in these rows,
                          skipped (s,) int64: those of these steps whose optimizer step a GradScaler skipped

The rows are the ones the watch moves to the host anyway (a listener, as TensorBoard's writer is): its thread
gathers them and writes a shard every `batch` rows or every SHARD_SECONDS, never a sync in the training loop.
Each shard and watch.json are written under a temporary name and renamed (os.replace), so a reader, or a run
killed mid-write (kill -9), sees whole files only: the log is readable up to its last complete shard. watch.json
is written when the watch is made and again at close (closed: true, the notes, the steps seen).
"""

from __future__ import annotations

import json
import os
import queue
import re
import time
from pathlib import Path

import numpy as np

from hookwidget.views.tensorboard import TensorBoardLog

FORMAT, VERSION, META = "hookwidget-watch-log", 1, "watch.json"
SHARD = re.compile(r"rows-(\d+)\.npz")
SHARD_SECONDS = 10.0  # a shard at least this often while rows arrive, however few


def _replace(path: Path, write) -> None:
    """`write(file)` into a temporary name beside `path`, then rename it over `path`: whole or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class WatchLog(TensorBoardLog):
    """Appends a watch's rows to `log_dir` as numbered .npz shards from TensorBoardLog's thread (the loop
    only queues the host tensors it was handed); close() writes the rest and marks the log closed."""

    LABEL = "log_dir"

    def __init__(self, log_dir, watch):
        d = Path(log_dir)
        if (d / META).exists():
            raise ValueError(f"watch: log_dir={str(d)!r} already holds a watch log: give each run its own folder "
                             "(hw.load(log_dir) reads the one there)")
        d.mkdir(parents=True, exist_ok=True)
        self.watch, self.writer, self.log_dir = watch, self, str(d)
        self._queue, self._thread, self.error = queue.SimpleQueue(), None, None
        self._ps = watch.tracks_per_sample
        self._held: list = []  # (stats, step_stats, steps, per-sample) handed over, not written yet
        self._shards = self._anomalies = self._skipped = 0  # written so far
        self._due = time.monotonic() + SHARD_SECONDS
        self._meta(closed=False)

    def rows(self, stats, step_stats, steps, ps=None) -> None:
        """On the thread: hold the rows; a shard once `batch` rows are held or SHARD_SECONDS passed."""
        self._held.append((stats, step_stats, steps, ps))
        if sum(len(h[2]) for h in self._held) >= self.watch.batch or time.monotonic() >= self._due:
            self._shard()

    def flush(self) -> None:
        """The thread's flush after each item: the shard is written when due (rows)."""

    def anomalies(self) -> None:
        """Each shard holds the anomalies of its rows."""

    def close(self) -> None:
        """At the watch's close (the thread has stopped): the rows held, then watch.json marked closed."""
        try:
            if self.error is None and self._held:
                self._shard()
            self._meta(closed=True)
        except Exception as e:  # noqa: BLE001 - reported in w.notes, as the thread's errors are
            self.error = self.error or e

    def _shard(self) -> None:
        held, self._held = self._held, []
        self._due = time.monotonic() + SHARD_SECONDS
        steps = np.asarray([k for h in held for k in h[2]], dtype=np.int64)
        last = int(steps[-1])
        found = self._new("_anomalies", self.watch._detector.anomalies, lambda a: a.step <= last)
        skipped = self._new("_skipped", self.watch.skipped, lambda k: k <= last)
        arrays = {"steps": steps,
                  "stats": np.concatenate([h[0].numpy() for h in held]),
                  "step_stats": np.concatenate([h[1].numpy() for h in held]),
                  "anomaly_step": np.asarray([a.step for a in found], dtype=np.int64),
                  "anomaly_where": np.asarray([a.where for a in found], dtype=np.str_),
                  "anomaly_reason": np.asarray([a.reason for a in found], dtype=np.str_),
                  "skipped": np.asarray(skipped, dtype=np.int64)}
        if self._ps:
            arrays["per_sample"] = np.concatenate([h[3].numpy() for h in held])
        _replace(Path(self.log_dir) / f"rows-{self._shards:06d}.npz", lambda f: np.savez_compressed(f, **arrays))
        self._shards += 1

    def _new(self, counter: str, found: list, upto) -> list:
        """The entries of `found` (appended in step order by the loop's thread) not written yet, up to this
        shard's last step."""
        start = getattr(self, counter)
        new = list(found[start:])
        new = new[:next((i for i, x in enumerate(new) if not upto(x)), len(new))]
        setattr(self, counter, start + len(new))
        return new

    def _meta(self, closed: bool) -> None:
        w = self.watch
        meta = {"format": FORMAT, "version": VERSION, "layers": list(w.layer_names), "stats": list(w.stat_names),
                "step_stats": list(w.step_stat_names), "every": w.every, "per_sample": self._ps, "closed": closed,
                "notes": [str(n) for n in w.notes], "seen": int(w.seen) if closed else None}
        text = json.dumps(meta, indent=1).encode()
        _replace(Path(self.log_dir) / META, lambda f: f.write(text))


def read(log_dir) -> tuple[dict, dict, list]:
    """(watch.json, the shards' arrays concatenated, notes on what could not be read) of a log `WatchLog` wrote;
    one line where `log_dir` is not one."""
    d = Path(log_dir)
    try:
        meta = json.loads((d / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{d}: not a watch log ({META}: {type(e).__name__}); hw.watch(model, log_dir=d) writes "
                         "one, w.save(path) a file") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{d}: {META} is not a hookwidget watch log's")
    if meta.get("version", 0) > VERSION:
        raise ValueError(f"{d}: written by a newer hookwidget (log format {meta['version']}); upgrade hookwidget")
    L, K = len(meta["layers"]), len(meta["stats"])
    empty = {"steps": np.zeros(0, np.int64), "stats": np.zeros((0, L, K)), "step_stats": np.zeros((0, 2)),
             "per_sample": np.zeros((0, 2)), "anomaly_step": np.zeros(0, np.int64),
             "anomaly_where": np.zeros(0, np.str_), "anomaly_reason": np.zeros(0, np.str_),
             "skipped": np.zeros(0, np.int64)}
    parts, notes = {k: [v] for k, v in empty.items()}, []
    for _, path in sorted((int(m.group(1)), p) for p in d.iterdir() if (m := SHARD.fullmatch(p.name))):
        try:
            with np.load(path, allow_pickle=False) as z:
                shard = {k: z[k] for k in empty if k in z.files}
            if shard["stats"].shape[1:] != (L, K):
                raise ValueError(f"stats of shape {shard['stats'].shape}")
        except Exception as e:  # noqa: BLE001 - the rows up to it stay readable
            notes.append(f"{path.name} could not be read ({type(e).__name__}: {e}): the rows from it on are left out")
            break
        for k, v in shard.items():
            parts[k].append(v)
    return meta, {k: np.concatenate(v) for k, v in parts.items()}, notes
