"""A watch's statistics on disk as the run goes (every watch: `log_dir=d`, or a temporary folder), in files numpy
reads alone, each shard readable by row range without reading the rest (np.load(..., mmap_mode="r")).

    d/watch.json              {"format": "hookwidget-watch-log", "version": 2, "layers": [...], "stats": [...],
                              "step_stats": ["loss", "grad_norm"], "every", "per_sample", "per_sample_width",
                              "dtype", "closed",
                              "notes", "seen"}
    d/rows-<first>-<n>.npy    a structured array of n rows, the first being row <first> of the run (so the names
    ...                       are the shard index): step int64, stats (layers, stats) float32 (float64 where the
                              model holds float64 parameters: "dtype"), step_stats (2,) float64, per_sample
                              (per_sample_width,) float64 [max norm, its sample, the top samples' (index, share),
                              the top position and its share] where recorded (2 wide in logs from before shares).
                              Uncompressed: memory-mapped, a column or a row range is read alone.
    d/micro-<first>-<n>.npy   the backward passes of the optimizer steps that accumulated several (w.micro): n
                              passes, the first being pass <first> in the files' order: step int64, pass int64,
                              stats (layers, stats), step_stats (2,) float64; written with the rows' shards
    d/events.json             {"anomalies": [[step, where, reason], ...], "skipped": [...], "nonfinite": {...}}:
                              few; rewritten whole after a shard that brought new ones, and at close
    d/lod.npz                 at close: the watch's level-of-detail summary (watch/lod.py), so that hw.load draws
                              the whole run without reading it

The rows are the ones the watch moves to the host anyway (a listener, as TensorBoard's writer is): its thread
gathers them and writes a shard every `batch` rows or every SHARD_SECONDS, never a sync in the training loop.
The newest row handed over is held back until the next rows come (or close): an optimizer step may still write
its update ratio into it (a row read mid-step). Each file is written under a temporary name and renamed
(os.replace), so a reader, or a run killed mid-write (kill -9), sees whole files only: the log is readable up to
its last complete shard. Version 1 logs (compressed rows-NNNNNN.npz shards holding their anomalies) are still read,
eagerly.
"""

from __future__ import annotations

import bisect
import json
import os
import queue
import re
import time
from pathlib import Path

import numpy as np

from hookwidget.capture.sample_shares import COLUMNS
from hookwidget.views.tensorboard import TensorBoardLog

FORMAT, VERSION, META, EVENTS, LOD = "hookwidget-watch-log", 2, "watch.json", "events.json", "lod.npz"
SHARD = re.compile(r"rows-(\d+)-(\d+)\.npy")
SHARD_V1 = re.compile(r"rows-(\d+)\.npz")
SHARD_SECONDS = 10.0  # a shard at least this often while rows arrive, however few


def _replace(path: Path, write, durable: bool = True) -> None:
    """`write(file)` into a temporary name beside `path`, then rename it over `path`: whole or absent (`durable`:
    on the disk itself before the rename, so that a machine's crash leaves whole files too)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def row_dtype(L: int, K: int, dtype, per_sample: int) -> np.dtype:
    """One row of a shard: its step, its statistics, its step statistics (and per-sample maxima and shares:
    `per_sample` floats, 0 where not recorded)."""
    fields = [("step", "<i8"), ("stats", np.dtype(dtype).newbyteorder("<"), (L, K)), ("step_stats", "<f8", (2,))]
    return np.dtype(fields + ([("per_sample", "<f8", (per_sample,))] if per_sample else []))


def per_sample_width(meta: dict) -> int:
    """The floats of a log's per-sample column: 0 (not recorded), 2 (a log written before shares were) or more."""
    return int(meta.get("per_sample_width", 2)) if meta["per_sample"] else 0


class WatchLog(TensorBoardLog):
    """Appends a watch's rows to `log_dir` as .npy shards from TensorBoardLog's thread (the loop only queues the
    host tensors it was handed); close() writes the rest and marks the log closed. `index`: (first row, rows,
    path) of each shard written, appended by the thread once the shard is whole (the watch reads rows that left
    its RAM from there); `written`: the rows on disk."""

    LABEL = "log_dir"
    QUEUED = ("rows", "micro")

    def __init__(self, log_dir, watch, dtype, durable: bool = True):
        d = Path(log_dir)
        if (d / META).exists():
            raise ValueError(f"watch: log_dir={str(d)!r} already holds a watch log: give each run its own folder "
                             "(hw.load(log_dir) reads the one there)")
        d.mkdir(parents=True, exist_ok=True)
        self.watch, self.writer, self.log_dir = watch, self, str(d)
        self.durable = durable  # fsync each file (a log_dir= the user keeps; not a temporary folder)
        self._queue, self._thread, self.error = queue.SimpleQueue(), None, None
        self._ps, self.dtype = watch.tracks_per_sample, np.dtype(dtype)
        self._row = row_dtype(len(watch.layer_names), len(watch.stat_names), self.dtype, COLUMNS if self._ps else 0)
        self._held: list = []  # (stats, step_stats, steps, per-sample) handed over, not written yet
        self.index: list = []  # (first row, rows, path) of each whole shard
        self.written = 0
        self._held_micro: list = []  # (step, passes, (P, L, K) rows, (P, 2)) handed over, not written yet
        self.micro_index: list = []  # (last step, path) of each whole micro shard
        self.micro_written, self._passes_written = -1, 0  # the last step whose passes are on disk; passes there
        self.lod_source = None  # () -> the watch's summary as arrays, saved at close (the watch sets it)
        self._events = (0, 0)  # anomalies and skipped steps written so far
        self._due = time.monotonic() + SHARD_SECONDS
        empty = json.dumps({"anomalies": [], "skipped": [], "nonfinite": {}}).encode()
        _replace(d / EVENTS, lambda f: f.write(empty))
        self._meta(closed=False)

    def rows(self, stats, step_stats, steps, ps=None) -> None:
        """On the thread: hold the rows; a shard (of all but the newest row) once `batch` rows are held or
        SHARD_SECONDS passed."""
        self._held.append((stats, step_stats, steps, ps))
        if sum(len(h[2]) for h in self._held) > self.watch.batch or time.monotonic() >= self._due:
            self._shard(keep_last=True)

    def micro(self, step: int, passes: list, stats, step_stats) -> None:
        """On the thread: hold an optimizer step's passes (written with the next shard of rows)."""
        self._held_micro.append((step, passes, stats, step_stats))

    def _micro_shard(self) -> None:
        held, self._held_micro = self._held_micro, []
        if not held:
            return
        n = sum(len(h[1]) for h in held)
        out = np.empty(n, np.dtype([("step", "<i8"), ("pass", "<i8"), ("stats", self._row.fields["stats"][0]),
                                    ("step_stats", "<f8", (2,))]))
        out["step"] = [step for step, passes, _, _ in held for _ in passes]
        out["pass"] = [k for _, passes, _, _ in held for k in passes]
        out["stats"] = np.concatenate([np.asarray(h[2]) for h in held])
        out["step_stats"] = np.concatenate([np.asarray(h[3]) for h in held])
        path = Path(self.log_dir) / f"micro-{self._passes_written:09d}-{n}.npy"
        _replace(path, lambda f: np.save(f, out, allow_pickle=False), self.durable)
        self.micro_index.append((held[-1][0], str(path)))
        self._passes_written += n
        self.micro_written = held[-1][0]

    def read_micro(self, step: int) -> tuple:
        """(stats, step_stats) of the passes of optimizer step `step` from the micro shards (numpy)."""
        lasts = [last for last, _ in self.micro_index]
        i = bisect.bisect_left(lasts, step)
        m = np.load(self.micro_index[i][1], mmap_mode="r")
        at = m["step"] == step
        return m["stats"][at], m["step_stats"][at]

    def flush(self) -> None:
        """The thread's flush after each item: the shard is written when due (rows)."""

    def anomalies(self) -> None:
        """events.json holds them (_events)."""

    def close(self) -> None:
        """At the watch's close (the thread has stopped): the rows held, events.json, then watch.json marked
        closed."""
        try:
            if self.error is None and (self._held or self._held_micro):
                self._shard(keep_last=False)
            self._write_events(force=True)
            if self.error is None and self.lod_source is not None:  # the watch's summary (watch/history.py)
                arrays = self.lod_source()
                _replace(Path(self.log_dir) / LOD, lambda f: np.savez(f, **arrays))
            self._meta(closed=True)
        except Exception as e:  # noqa: BLE001 - reported in w.notes, as the thread's errors are
            self.error = self.error or e

    def _shard(self, keep_last: bool) -> None:
        self._micro_shard()
        held, self._held = self._held, []
        self._due = time.monotonic() + SHARD_SECONDS
        stats = np.concatenate([np.asarray(h[0]) for h in held])
        steps = np.asarray([k for h in held for k in h[2]], dtype=np.int64)
        n = len(steps) - (1 if keep_last else 0)
        if keep_last:  # the newest row waits for the next rows: its update ratio may still be written
            last = held[-1]
            r = len(last[2]) - 1
            self._held = [(last[0][r:], last[1][r:], last[2][r:], None if last[3] is None else last[3][r:])]
        if n <= 0:
            return
        out = np.empty(n, self._row)
        out["step"], out["stats"] = steps[:n], stats[:n]
        out["step_stats"] = np.concatenate([np.asarray(h[1]) for h in held])[:n]
        if self._ps:
            out["per_sample"] = np.concatenate([np.asarray(h[3]) for h in held])[:n]
        path = Path(self.log_dir) / f"rows-{self.written:09d}-{n}.npy"
        _replace(path, lambda f: np.save(f, out, allow_pickle=False), self.durable)
        self.index.append((self.written, n, str(path)))
        self.written += n
        self._write_events(force=False)

    def _write_events(self, force: bool) -> None:
        w = self.watch
        now = (len(w._detector.anomalies), len(w.skipped))
        if now == self._events and not force:
            return
        self._events = now
        events = {"anomalies": [[int(a[0]), str(a[1]), str(a[2])] for a in list(w._detector.anomalies)],
                  "skipped": [int(k) for k in list(w.skipped)],
                  "nonfinite": {str(k): int(v) for k, v in dict(w._detector.stretches).items()}}
        text = json.dumps(events).encode()
        _replace(Path(self.log_dir) / EVENTS, lambda f: f.write(text))

    def _meta(self, closed: bool) -> None:
        w = self.watch
        meta = {"format": FORMAT, "version": VERSION, "layers": list(w.layer_names), "stats": list(w.stat_names),
                "step_stats": list(w.step_stat_names), "every": w.every, "per_sample": self._ps,
                "per_sample_width": COLUMNS if self._ps else 0,
                "dtype": self.dtype.name, "closed": closed, "notes": [str(n) for n in w.notes],
                "seen": int(w.seen) if closed else None}
        text = json.dumps(meta, indent=1).encode()
        _replace(Path(self.log_dir) / META, lambda f: f.write(text))


class Shards:
    """The rows of a log's shards, read by row range (each shard memory-mapped when first touched): `index`
    holds (first row, rows, path) in row order (a live WatchLog's own list, or one listed from the folder)."""

    def __init__(self, index: list):
        self.index = index
        self._maps: dict = {}

    @property
    def n(self) -> int:
        return self.index[-1][0] + self.index[-1][1] if self.index else 0

    def _map(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is None:
            path = self.index[i][2]
            m = self._maps[i] = path if isinstance(path, np.ndarray) else np.load(path, mmap_mode="r")
        return m

    def parts(self, start: int, stop: int):
        """(shard rows, a, b) for the pieces of [start, stop), in order."""
        firsts = [s[0] for s in self.index]
        i = max(0, int(np.searchsorted(firsts, start, side="right")) - 1)
        while i < len(self.index) and self.index[i][0] < stop:
            first, n, _ = self.index[i]
            a, b = max(start, first) - first, min(stop, first + n) - first
            if b > a:
                yield self._map(i), a, b
            i += 1

    def read(self, field: str, start: int, stop: int, at=()) -> np.ndarray:
        """Field `field` of rows [start, stop) (`at`: an index into each row's field, e.g. (layer, stat))."""
        got = [np.array(m[field][(slice(a, b), *at)]) for m, a, b in self.parts(start, stop)]
        return np.concatenate(got) if got else None


def open_log(log_dir) -> tuple[dict, Shards, dict, list]:
    """(watch.json, the shards, events (anomalies, skipped, nonfinite, lod arrays or None), notes on what could not
    be read) of a log `WatchLog` wrote; one line where `log_dir` is not one. Version 2: nothing read but the
    names and the small files; version 1: every shard read now (compressed)."""
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
    if meta.get("version", 1) == 1:
        return _open_v1(d, meta)
    index, notes = [], []
    for first, n, path in sorted((int(m.group(1)), int(m.group(2)), p) for p in d.iterdir()
                                 if (m := SHARD.fullmatch(p.name))):
        if first != (index[-1][0] + index[-1][1] if index else 0):
            notes.append(f"{path.name} does not follow the shard before it: the rows from it on are left out")
            break
        index.append((first, n, str(path)))
    shards = _readable(Shards(index), meta, notes)
    try:
        events = json.loads((d / EVENTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        events = {"anomalies": [], "skipped": [], "nonfinite": {}}
    last = int(shards.read("step", shards.n - 1, shards.n)[0]) if shards.n else -1
    events = {"anomalies": [a for a in events["anomalies"] if a[0] <= last],
              "skipped": [k for k in events["skipped"] if k <= last],
              "nonfinite": {int(k): v for k, v in events["nonfinite"].items() if int(k) <= last}}
    events["lod"] = None
    if (d / LOD).exists():
        with np.load(d / LOD, allow_pickle=False) as z:
            lod = {k: z[k] for k in z.files}
        events["lod"] = lod if int(lod["end"]) == shards.n else None
    return meta, shards, events, notes


def _readable(shards: Shards, meta: dict, notes: list) -> Shards:
    """The shards up to the first that cannot be read (damaged, or of another shape), with a note. The first is
    opened; the others' sizes are checked against theirs (a header padded to 64 bytes, then n rows): hw.load
    stays lazy, one stat() a shard."""
    want = row_dtype(len(meta["layers"]), len(meta["stats"]), meta.get("dtype", "float64"), per_sample_width(meta))
    for i, (_, n, path) in enumerate(shards.index):
        try:
            if i == 0:
                m = np.load(path, mmap_mode="r")
                if m.dtype != want or m.shape != (n,):
                    raise ValueError(f"rows of {m.dtype} × {m.shape}")
            header = os.stat(path).st_size - n * want.itemsize
            if header < 64 or header % 64 or header > 4096:
                raise ValueError(f"{os.stat(path).st_size} bytes for {n} rows of {want.itemsize}")
        except Exception as e:  # noqa: BLE001 - the rows up to it stay readable
            notes.append(f"{Path(path).name} could not be read ({type(e).__name__}: {e}): the rows from it on are "
                         "left out")
            return Shards(shards.index[:i])
    return shards


def _open_v1(d: Path, meta: dict) -> tuple[dict, Shards, dict, list]:
    """A version 1 log (compressed .npz shards): read whole, as one in-memory shard."""
    L, K = len(meta["layers"]), len(meta["stats"])
    empty = {"steps": np.zeros(0, np.int64), "stats": np.zeros((0, L, K)), "step_stats": np.zeros((0, 2)),
             "per_sample": np.zeros((0, 2)), "anomaly_step": np.zeros(0, np.int64),
             "anomaly_where": np.zeros(0, np.str_), "anomaly_reason": np.zeros(0, np.str_),
             "skipped": np.zeros(0, np.int64)}
    parts, notes = {k: [v] for k, v in empty.items()}, []
    for _, path in sorted((int(m.group(1)), p) for p in d.iterdir() if (m := SHARD_V1.fullmatch(p.name))):
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
    rows = {k: np.concatenate(v) for k, v in parts.items()}
    n = len(rows["steps"])
    table = np.empty(n, row_dtype(L, K, np.float64, per_sample_width(meta)))
    table["step"], table["stats"], table["step_stats"] = rows["steps"], rows["stats"], rows["step_stats"]
    if meta["per_sample"]:
        table["per_sample"] = rows["per_sample"]
    events = {"anomalies": list(zip(rows["anomaly_step"].tolist(), rows["anomaly_where"].tolist(),
                                    rows["anomaly_reason"].tolist())),
              "skipped": rows["skipped"].tolist(), "nonfinite": {}, "lod": None}
    return {**meta, "dtype": "float64"}, Shards([(0, n, table)] if n else []), events, notes
