"""What a watch answers about its rows, shared by the live Watch and a loaded SavedWatch: the whole run
(stats, step_stats, steps, series), rows by range, the level-of-detail bins, the anomalies with their leads, and
the views and files made from them (the widget, to_html, to_tensorboard, to_wandb, save).

Each class gives `n_rows`; `_table(start, stop)`, the rows [start, stop) as numpy (steps, stats, step_stats),
from wherever they are held; `_column(start, stop, at, field)`, one column of them; `_level()`, the in-RAM
lod.Level or None; `_settle()`, what a read of the whole run does first (the live watch moves its pending rows);
`_found()`, the anomalies found so far."""

from __future__ import annotations

import bisect

import numpy as np
import torch

from hookwidget.capture.sample_shares import COLUMNS, TOP
from hookwidget.options import check_path
from hookwidget.watch import leads, lod
from hookwidget.watch.carriers import carried
from hookwidget.watch.ranks import MODES

READ_BYTES = 128 << 20  # w.lod reads rows up to this many bytes for bins finer than the in-RAM summary's


class Reads:
    """The read side of a watch (see the module)."""

    def _range(self, start: int, stop: int | None, what: str) -> tuple[int, int]:
        if not isinstance(start, int) or not (stop is None or isinstance(stop, int)):
            raise TypeError(f"{what}: start and stop are row indices (ints), as in w.steps[start:stop]")
        start, stop = slice(start, stop).indices(self.n_rows)[:2]
        return start, max(start, stop)

    # -- the whole run ----------------------------------------------------------------------------------------
    @property
    def stats(self) -> torch.Tensor:
        """(recorded steps, layers, statistics) on the host, names in stat_names, layer_names: float32 (float64
        where the model holds float64 parameters; docs/guide/watch.md says why). The whole run, read into memory
        (from disk for the rows that left RAM): for long runs read w.rows(start, stop), w.series or w.lod."""
        self._settle()
        return torch.from_numpy(self._table(0, self.n_rows)[1])

    @property
    def step_stats(self) -> torch.Tensor:
        """(recorded steps, 2) float64: the loss and the global gradient norm (step_stat_names)."""
        self._settle()
        return torch.from_numpy(self._column(0, self.n_rows, (), "step_stats").reshape(-1, 2))

    @property
    def steps(self) -> list:
        """The step (backward pass) index of each row of stats."""
        self._settle()
        return self._steps()

    @property
    def loss(self) -> torch.Tensor:
        """(recorded steps,) float64: the loss of each recorded step, the scalar backward started from
        (`w.series("loss")`)."""
        return self.series("loss")

    @property
    def grad_norm(self) -> torch.Tensor:
        """(recorded steps,) float64: the global gradient norm of each recorded step (`w.series("grad_norm")`)."""
        return self.series("grad_norm")

    def series(self, layer: str, stat: str | None = None, scope: str = "global") -> torch.Tensor:
        """One statistic of one layer over the recorded steps, or one of the per-step ones.

        Args:

        - `layer`: a name of `w.layer_names`; or `"loss"` / `"grad_norm"` (the per-step ones, `w.step_stat_names`)
          with no `stat`.
        - `stat`: a name of `w.stat_names`.
        - `scope`: `"global"` (default); `"local"`: as this rank held it (a model spread over ranks: see
          `w.scope`).

        Returns:

        A tensor of shape (recorded steps,): float64 for the per-step ones, the storage's dtype (`w.stats`') for a
        layer's; read alone (one column, not every layer's rows).

        Raises:

        - `KeyError`: no such layer or statistic (the message lists the valid ones).
        - `ValueError`: a bad `scope`.

        Example:

        ```python
        w.series("fc1", "grad_norm"), w.series("loss")
        ```
        """
        if scope not in MODES:
            raise ValueError(f"series(scope={scope!r}): 'global' (over ranks) or 'local' (this rank's)")
        if stat is None:
            if layer in ("per_sample_max", "per_sample_argmax"):
                return self.per_sample[:, 0 if layer == "per_sample_max" else 1]
            if layer not in self.step_stat_names:
                raise KeyError(f"series({layer!r}): give a layer and a statistic, or one of {self.step_stat_names}")
            at, field = (self.step_stat_names.index(layer),), "step_stats"
        else:
            if layer not in self.layer_names:
                close = [n for n in self.layer_names if layer.lower() in n.lower()][:5] or self.layer_names[:8]
                raise KeyError(f"no layer {layer!r} watched (layers with parameters); e.g. {', '.join(close)}")
            if stat not in self.stat_names:
                raise KeyError(f"no statistic {stat!r}; choose one of {', '.join(self.stat_names)}")
            at, field = (self.layer_names.index(layer), self.stat_names.index(stat)), "stats"
        if scope == "local":
            return self._local()[0 if field == "stats" else 1][(slice(None), *at)]
        self._settle()
        return torch.from_numpy(self._column(0, self.n_rows, at, field))

    # -- by range ---------------------------------------------------------------------------------------------
    def rows(self, start: int = 0, stop: int | None = None) -> tuple:
        """The recorded rows [start, stop) at full resolution (row indices, as `w.steps[start:stop]`; negative from
        the end), from RAM or from disk, whichever holds them; on a live watch the rows on the host (no transfer).

        Returns:

        (steps, stats, step_stats): a LongTensor (n,) of step indices, (n, layers, statistics) in `w.stats`' dtype
        and (n, 2) float64.

        Example:

        ```python
        steps, stats, step_stats = w.rows(-100)   # the latest 100 rows
        ```
        """
        start, stop = self._range(start, stop, "w.rows(start, stop)")
        steps, stats, step_stats = self._table(start, stop)
        return torch.from_numpy(np.asarray(steps, np.int64)), torch.from_numpy(stats), torch.from_numpy(step_stats)

    def lod(self, bins: int, start: int = 0, stop: int | None = None) -> lod.Bins:
        """The rows [start, stop) summarised in at most `bins` bins of one power-of-two size, aligned to multiples
        of it (watch/lod.py says what a bin holds). The finest size that fits, read from the rows; but where those
        rows weigh more than READ_BYTES and the in-RAM summary is coarser, its size (fewer bins than asked: drawn
        from RAM, with at most two of its bins' rows read at the edges).

        Raises:

        - `ValueError`: `bins` < 1.
        """
        if not isinstance(bins, int) or bins < 1:
            raise ValueError(f"w.lod(bins={bins!r}): bins is how many bins at most, an int >= 1")
        start, stop = self._range(start, stop, "w.lod(bins, start, stop)")
        size, level = lod.size_for(bins, start, stop), self._level()
        L, K = len(self.layer_names), len(self.stat_names)
        if level is not None and size < level.size and (stop - start) * L * K * 4 > READ_BYTES:
            size = level.size
        if level is None or size < level.size:
            return self._reduced(start, stop, size)
        lo = min(stop, -(-start // level.size) * level.size)
        hi = max(lo, min(stop, level.done) // level.size * level.size)
        mid = level.bins.take(slice(lo // level.size, hi // level.size))
        parts = [self._reduced(start, lo, level.size), mid, self._reduced(hi, stop, level.size)]
        return lod.merge(lod.concat(parts, L, K, level.size), size)

    def _reduced(self, start: int, stop: int, size: int) -> lod.Bins:
        """Rows [start, stop) read and reduced in bins of `size`, READ_BYTES of rows at a time."""
        L, K = len(self.layer_names), len(self.stat_names)
        step = max(size, READ_BYTES // (L * K * 8) // size * size)
        parts, at = [], start
        while at < stop:
            end = min(stop, (at // step + 1) * step)
            parts.append(lod.reduce(*self._table(at, end), at, size))
            at = end
        return lod.concat(parts, L, K, size)

    # -- which samples carried each step (per_sample=True) ------------------------------------------------------
    def _per_sample_columns(self) -> np.ndarray:
        """(recorded steps, width) float64: each step's per-sample column (capture/sample_shares.py)."""
        if not self.tracks_per_sample:
            raise KeyError("per-sample norms and shares are off: hw.watch(model, per_sample=True) records them")
        self._settle()
        got = self._column(0, self.n_rows, (), "per_sample")
        return got.reshape(len(got), -1) if got.size else np.zeros((0, COLUMNS))

    @property
    def sample_shares(self) -> torch.Tensor:
        """per_sample=True: (recorded steps, 3, 2) float64, each step's three samples with the largest shares
        s_b = ⟨G_b, G⟩ / ‖G‖² of its gradient G, largest first, as [index in the batch, share]; NaN where not
        known (an optimizer step of several backward passes; a batch of fewer samples). Over the layers with an
        exact per-sample rule (w.notes names any left out); the shares of all samples sum to 1."""
        got = self._per_sample_columns()
        if got.shape[1] < COLUMNS:
            raise KeyError("this watch was recorded before shares were: its per-sample column holds the norms only")
        return torch.from_numpy(got[:, 2:2 + 2 * TOP].reshape(-1, TOP, 2).copy())

    @property
    def top_positions(self) -> torch.Tensor:
        """per_sample=True: (recorded steps, 2) float64, of each step's first sample in w.sample_shares the
        position (token) with the largest share and that share of the step, [position, share]; NaN where no
        watched layer is applied per position, or where the shares are not known."""
        got = self._per_sample_columns()
        if got.shape[1] < COLUMNS:
            raise KeyError("this watch was recorded before shares were: its per-sample column holds the norms only")
        return torch.from_numpy(got[:, 2 + 2 * TOP:COLUMNS].copy())

    # -- anomalies --------------------------------------------------------------------------------------------
    @property
    def anomalies(self) -> list:
        """Anomaly(step, where, reason, lead) entries, in step order (see `hw.watch` for the rules); `lead`: where
        the cause shows first (a `Lead`), or None."""
        self._settle()
        return self._with_leads(self._found())

    @property
    def found_anomalies(self) -> list:
        """The anomalies found so far among the rows already on the host (w.anomalies moves the rest first), with
        their leads from those rows (no transfer: the live view and the exports read this)."""
        return self._with_leads(self._found())

    def _with_leads(self, anomalies: list) -> list:
        """Each anomaly with its lead (watch/leads.py), worked out from the rows before it (the WINDOW + LOOKBACK
        rows that the rule reads), once its row is final (not the newest: its update ratio may still come), and
        the samples that carried its step (carriers.py; per_sample=True)."""
        cache = self.__dict__.setdefault("_leads", {})
        steps, n, out = self._step_index(), self.n_rows, []
        for a in anomalies:
            if a.step not in cache:
                r = bisect.bisect_left(steps, a.step)
                found = None
                if r < n and steps[r] == a.step:
                    lo = max(0, r - leads.LOOKBACK - leads.WINDOW)
                    got, stats, step_stats = self._table(lo, r + 1)
                    rows = leads.Rows(stats, step_stats, got.tolist(), self.layer_names, self.stat_names,
                                      self.step_stat_names)
                    found = leads.lead_of(rows, r - lo)
                if r < n and steps[r] == a.step and self.tracks_per_sample:  # which samples carried it
                    found = (found, carried(self._column(r, r + 1, (), "per_sample").reshape(-1)))
                else:
                    found = (found, None)
                if r >= n - 1 and not self.closed:
                    out.append(type(a)(*a, *found))
                    continue
                cache[a.step] = found
            out.append(type(a)(*a, *cache[a.step]))
        return out

    def _row_of(self, step: int) -> int | None:
        """The row of recorded step `step` (bisection: the steps increase), or None where it was not recorded."""
        steps = self._step_index()
        r = bisect.bisect_left(steps, step)
        return r if r < len(steps) and steps[r] == step else None

    def _step_index(self):
        """The step of each row, as a sequence bisect searches (a row's step read when asked: a long loaded log's
        step column is not read whole to find a few anomalies' rows)."""
        return _StepColumn(self)

    # -- views and files ------------------------------------------------------------------------------------
    def widget(self):
        """The live explorer of this watch (one per watch): heatmap, sparklines, loss; it grows while the loop runs."""
        from hookwidget.views.watch_widget import widget_of

        return widget_of(self)

    def _repr_mimebundle_(self, include=None, exclude=None):
        """In a Jupyter kernel the live explorer, elsewhere the plain-text repr."""
        from hookwidget.views.watch_widget import mimebundle

        return mimebundle(self, include, exclude)

    def to_html(self, path, budget: int | None = None):
        """Write the explorer of this watch (statistics, anomalies, kept Traces) as one standalone page.

        Args:

        - `path`: the HTML file to write.
        - `budget`: the page's size in bytes at most (default 16 MiB): a long run's page holds an overview of every
          step in bins and full-resolution rows around anomalies, kept steps and the last steps, as many as fit;
          the page says which.

        Returns:

        The path written (`pathlib.Path`).

        Raises:

        - `ValueError`: `budget` is not an int of at least 1 MiB (2**20).
        """
        from hookwidget.views.watch_export import BUDGET, to_html

        return to_html(self, path, BUDGET if budget is None else budget)

    def to_tensorboard(self, log_dir) -> str:
        """Write what was recorded so far as TensorBoard scalars (`{stat}/{layer}`, `step/loss`,
        `step/grad_norm`; x = step) and the anomalies as text.

        Args:

        - `log_dir`: the TensorBoard log directory.

        Returns:

        The run's folder. Needs: pip install hookwidget[tensorboard].
        """
        from hookwidget.views.tensorboard import write

        return write(self, log_dir)

    def to_wandb(self, run=None):
        """Log what was recorded so far to a W&B run: the same keys as to_tensorboard against x =
        `hookwidget_step`, the anomalies as a table.

        On an open watch the later rows follow from a background thread until close().

        Args:

        - `run`: a W&B run; None (default): the active one, else a new one.

        Returns:

        The run. Needs: pip install hookwidget[wandb].
        """
        from hookwidget.views.wandb import write

        return write(self, run)

    def save(self, path) -> None:
        """Write this watch to `path` as data (statistics, steps, names, anomalies, notes, the kept Traces; no
        code), for `hw.load(path)`: a read-only watch that answers the same queries and shows the same view. The
        file holds the whole run (read from disk where the rows left RAM); the log_dir, where one was given, holds
        it already.

        Args:

        - `path`: the file to write (a str or os.PathLike).

        Raises:

        - `TypeError`: `path` is not a path.

        Example:

        ```python
        w.save("run.pt")
        hw.load("run.pt").series("loss")
        ```
        """
        from hookwidget.record import saved

        check_path(path, "w.save(path)", "w.save('run.pt')")
        ps = torch.from_numpy(self._per_sample_columns()) if self.tracks_per_sample else None
        tree = {"layers": list(self.layer_names), "stat_names": list(self.stat_names),  # the whole run, read
                "step_stat_names": list(self.step_stat_names), "every": self.every, "stats": self.stats,
                "step_stats": self.step_stats, "steps": torch.tensor(self.steps, dtype=torch.int64),
                "per_sample": ps, "anomalies": [tuple(a[:3]) for a in self.anomalies],
                "notes": [str(n) for n in self.notes], "skipped": list(self.skipped), "seen": int(self.seen),
                "nonfinite": {int(k): int(v) for k, v in self.nonfinite.items()},
                "dropped": self.dropped_traces,
                "traces": None if self._flight is None else [(k, self.trace(k).to_data()) for k in self.kept]}
        saved.write(path, "watch", tree)  # a loaded watch saves the same way (watch/saved.py's SavedWatch)


class _StepColumn:
    """w's step column read one row at a time (len and [i], what bisect needs)."""

    def __init__(self, reads):
        self.reads, self.n = reads, reads.n_rows

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        i = i + self.n if i < 0 else i
        if not 0 <= i < self.n:
            raise IndexError(i)
        return int(self.reads._column(i, i + 1, (), "step")[0])
