"""The live explorer of a Watch: a layers × steps heatmap, sparklines, loss and gradient norm, that grows
while the training loop runs.

The watch calls `_on_watch` each time rows reach the host (it never syncs the device for the widget);
new rows are sent at most every `interval` seconds, as binary float32 buffers, so a loop pays a
time.monotonic() check per step and one small message per interval. The widget holds only the rows not sent
yet, and the front-end a bounded view of the run (js/watch/store.js: an overview in bins, the latest rows, the
zoomed window). A view that missed rows (it rendered late, or the page was reloaded) asks with a `sync` message
and gets the run's overview (`w.lod`) and its latest rows; a zoom asks for its steps with a `window` message and
gets them at full resolution (`w.rows`) or in bins as fine as its pixels (`w.lod`), of the one statistic the
heatmap shows. Clicking a kept step
opens its Trace in the trace explorer (a HookWidget, drawn by the same front-end code). In marimo the widget
is a UI element (`mo.ui.anywidget(w.widget())`, or `w` as a cell's last expression); the rows stream there too.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import sys
import time
import weakref

import anywidget
import numpy as np
import torch
import traitlets

from hookwidget.views.anomalies import anomaly_entry
from hookwidget.views.widget import HookWidget, MessageError, _one_line, check_envelope, reply_id, request_keys

log = logging.getLogger("hookwidget")

ESM = pathlib.Path(__file__).resolve().parents[1] / "static" / "watch.js"  # built from js/watch/ by `npm run build`
NOT_BUILT = ('export default { render({ el }) { el.textContent = "hookwidget: the watch front-end is not built '
             '(hookwidget/static/watch.js is missing): run `npm run build` or `pip install -e .`"; } };')
SCHEMA = request_keys("watch")  # type -> the keys it must carry besides type and request_id
OVERVIEW_BINS, OVERVIEW_BYTES = 2048, 48 * 2**20  # a view's overview: bins and memory at most (js/watch/bins.js)
TAIL, TAIL_BYTES = 1024, 16 * 2**20  # latest rows a view holds at full resolution: at most, their memory (store.js)
WINDOW_BYTES = 8 * 2**20  # most bytes of a zoomed window's answer (one statistic of every layer)


class KeptTraceWidget(HookWidget):
    """The trace explorer on one kept step (it stays on that step: HookWidget does not follow the flight recorder's
    shared session). Hooks and reruns are refused in one line naming what to do instead."""

    def _do_add_hook(self, msg: dict) -> None:
        # The recordings' shared session would carry the hook into the watch's next steps: the user's training.
        raise ValueError("hooks and reruns on a step kept by hw.watch are not available here: trace that step "
                         "with hw.trace(step_fn) or %%hooktrace to try them")

    _do_remove_hook = _do_rerun = _do_add_hook


class WatchFreed(RuntimeError):
    """The watch this widget showed was garbage-collected (the widget holds it weakly)."""


class WatchWidget(anywidget.AnyWidget):
    """Heatmap + sparklines + loss of one Watch, fed while its loop runs; a kept step opens below it."""

    _esm = ESM if ESM.exists() else NOT_BUILT
    meta = traitlets.Dict().tag(sync=True)  # layer, statistic and per-step names
    state = traitlets.Unicode("open").tag(sync=True)  # "open" while the watch records, then "closed"
    trace_model = traitlets.Unicode("").tag(sync=True)  # model id of the HookWidget of the opened step
    trace_step = traitlets.Int(-1).tag(sync=True)
    interval = 0.5  # seconds between two pushes while the loop runs

    def __init__(self, watch, **kwargs):
        # meta goes with the model's first state: the front-end keys its store on it (watch.js).
        meta = {"layers": list(watch.layer_names), "stats": list(watch.stat_names),
                "step_stats": list(watch.step_stat_names), "every": watch.every}
        super().__init__(meta=meta, state="open" if watch.active else "closed", **kwargs)
        # Held weakly: a displayed widget lives as long as the kernel, and must not keep the watch's Traces.
        self._watch_ref = weakref.ref(watch)
        self._unsent: list = []  # (stats, step_stats, steps) on the host not pushed yet, in order
        # Rows recorded before the widget existed are not pushed: a view's first message is a sync, answered with the
        # run's overview and latest rows (_do_sync), a bounded answer where pushing them was the whole run in one
        # message (62 MB for 1,200 steps of 1,000 layers, and decoded twice with the sync's answer).
        self._rows = self._sent = int(watch.n_rows)
        self._anomalies_sent = 0
        self._last_push = time.monotonic()  # the first push after one interval: the front-end is listening by then
        self._trace = self._trace_widget = None  # the opened step's Trace and its HookWidget
        self.pushes = 0  # messages with rows sent (tests, and a cheap look at the throttle)
        self._cell = _marimo_cell()  # in marimo: the cell that made this widget, for the explorers it opens
        watch.listen(self._on_watch)
        self._ip = _kernel_shell()
        if self._ip is not None and watch.active:
            self._ip.events.register("post_run_cell", self._after_cell)
        self.on_msg(self._on_msg)

    @property
    def watch(self):
        w = self._watch_ref()
        if w is None:
            raise WatchFreed("this watch was freed: run the cell again")
        return w

    # -- from the watch (the training loop's thread; host data only) -----------------------------
    def _on_watch(self, event: str, *args) -> None:
        try:
            if event == "rows":
                self._add(*args)
                if time.monotonic() - self._last_push >= self.interval:
                    self._push()
            elif event == "closed":
                self.state = "closed"
                self._push()
                self._stop_listening_cells()
        except Exception as e:  # the loop must never fail because of the display
            log.warning("hookwidget: live watch update failed: %s", _one_line(e))

    def _add(self, stats, step_stats, steps, ps=None) -> None:
        chunk = (stats, step_stats, list(steps))
        self._unsent.append(chunk)
        self._rows += len(chunk[2])

    def _after_cell(self, *_args) -> None:
        """After a cell with the watch still open: the rows whose step is complete, then a push."""
        w = self._watch_ref()
        if w is None:
            self._stop_listening_cells()
            return
        try:
            w.sync()  # outside the loop: one transfer, as a read would
            if self._unsent:
                self._push()
        except Exception as e:  # never a traceback after the user's cell because of the display
            log.warning("hookwidget: live watch update failed: %s", _one_line(e))

    def _stop_listening_cells(self) -> None:
        if self._ip is not None:
            try:
                self._ip.events.unregister("post_run_cell", self._after_cell)
            except ValueError:
                pass

    def _push(self) -> None:
        """Send the rows not sent yet (and new anomalies, the kept steps): one message, two buffers."""
        self._last_push = time.monotonic()
        unsent, self._unsent = self._unsent, []
        start = self._sent
        self._sent = self._rows
        self._send_rows(start, unsent, self._anomalies_sent)

    def _send_rows(self, start: int, chunks: list, a_start: int) -> None:
        w = self._watch_ref()
        L, K = len(self.meta["layers"]), len(self.meta["stats"])
        if chunks:
            stats = torch.cat([torch.as_tensor(c[0]) for c in chunks]).to(torch.float32).contiguous()
            step_stats = torch.cat([torch.as_tensor(c[1]) for c in chunks]).to(torch.float32).contiguous()
        else:
            stats, step_stats = torch.zeros(0, L, K), torch.zeros(0, 2)
        anomalies = w.found_anomalies if w is not None else []
        self._anomalies_sent = len(anomalies)
        msg = {"type": "rows", "start": start, "count": int(stats.shape[0]), "dtype": "float32",
               "steps": [int(s) for c in chunks for s in c[2]],
               "a_start": a_start,
               "anomalies": [anomaly_entry(a) for a in anomalies[a_start:]],
               "nonfinite": [[int(k), int(v)] for k, v in (w.found_nonfinite if w is not None else {}).items()],
               "kept": _kept(w), "dropped": w.dropped_traces if w is not None else 0,
               "total_steps": int(getattr(w, "_n", 0)) if w is not None else None, "state": self.state}
        self.pushes += 1
        self.send(msg, [stats.numpy().tobytes(), step_stats.numpy().tobytes()])

    # -- from the front-end ----------------------------------------------------------------------
    def _on_msg(self, _widget, content, buffers) -> None:
        rid = reply_id(content)
        try:
            msg = validate(content)
            getattr(self, "_do_" + msg["type"])(msg)
        except MessageError as e:
            log.warning("hookwidget: rejected front-end message: %s", e)
            self._status(rid, "error", f"rejected message: {e}")
        except Exception as e:  # reported to the front-end, never swallowed
            self._status(rid, "error", _one_line(e))

    def _do_sync(self, msg: dict) -> None:
        """Every row recorded so far from `have` on, for a view that missed some: the latest TAIL at full resolution,
        and, when more are missing, the overview of rows [0, sent) first (w.lod), which the view folds new rows into."""
        self._unsent, self._sent, self._last_push = [], self._rows, time.monotonic()  # the answer carries them all
        have, sent = min(msg["have"], self._sent), self._sent
        start = max(have, sent - tail_rows(len(self.meta["layers"]) * len(self.meta["stats"])))
        if start > have:
            bins = overview_bins(len(self.meta["layers"]) * len(self.meta["stats"]))
            self._send_lod("overview", self.watch.lod(bins, 0, sent), 0, sent)
        steps, stats, step_stats = self.watch.rows(start, sent) if sent > start else ([], None, None)
        chunks = [(stats, step_stats, [int(k) for k in steps])] if sent > start else []
        self._send_rows(start, chunks, 0)

    def _do_window(self, msg: dict) -> None:
        """Rows [start, stop) of statistic `stat` for a zoomed view: at full resolution (w.rows) when they fit
        WINDOW_BYTES, else in at most `bins` bins (w.lod), as few as fit."""
        start, stop, k, L = msg["start"], min(msg["stop"], self._sent), msg["stat"], len(self.meta["layers"])
        if k >= len(self.meta["stats"]) or stop <= start or msg["bins"] < 1:
            raise ValueError(f"window: rows [{start}, {stop}) of statistic {k} are not in this watch "
                             f"({self._sent} rows sent, {len(self.meta['stats'])} statistics)")
        if (stop - start) * L * 4 <= WINDOW_BYTES:
            steps, stats, step_stats = self.watch.rows(start, stop)
            self.send({"type": "lod", "role": "window", "start": start, "stop": stop, "bins": msg["bins"], "stat": k,
                       "size": 1, "first": [int(s) for s in steps], "last_step": [], "rows": [1] * len(steps),
                       "nonfinite": "none"},
                      [stats[:, :, k].float().contiguous().numpy().tobytes(),
                       step_stats.float().contiguous().numpy().tobytes()])
            return
        bins = max(1, min(msg["bins"], WINDOW_BYTES // (16 * L)))
        self._send_lod("window", self.watch.lod(bins, start, stop), start, stop, k, msg["bins"])

    def _send_lod(self, role: str, b, start: int, stop: int, stat: int | None = None, asked: int = 0) -> None:
        """A "lod" message of bins `b` (watch/lod.py Bins): all statistics, or the one `stat`; float32 buffers."""
        pick = (lambda a: a) if stat is None else (lambda a: a[:, :, stat])
        f32 = lambda a: np.ascontiguousarray(pick(a), dtype=np.float32).tobytes()  # noqa: E731
        step = np.stack([b.step_min, b.step_max, b.step_mean, b.step_last], axis=1).astype(np.float32)
        r0 = (int(b.start[0]) // b.size) * b.size if len(b) else start  # the bins are aligned to their size
        msg = {"type": "lod", "role": role, "start": r0, "stop": stop, "bins": asked or len(b), "size": int(b.size),
               "first": b.first.tolist(), "last_step": b.last_step.tolist(), "rows": b.rows.tolist(),
               "nonfinite": "layer"}
        if stat is not None:
            msg["stat"] = stat
        self.send(msg, [f32(b.min), f32(b.max), f32(b.mean), f32(b.last), step.tobytes(),
                        np.ascontiguousarray(b.nonfinite, dtype=np.uint8).tobytes()])

    def _do_open(self, msg: dict) -> None:
        step = msg["step"]
        t = self.watch.trace(step)  # KeyError names the kept steps
        with _in_marimo_cell(self._cell):
            kept = KeptTraceWidget(t)
        old, self._trace_widget = self._trace_widget, kept
        self._trace = t  # the Trace on screen stays alive while it is shown, even once the recorder drops it
        self.trace_step, self.trace_model = step, self._trace_widget.model_id
        if old is not None:
            old.close()
        self._status(msg["request_id"], "done", f"step {step}: its kept Trace is open below")

    def _status(self, request_id, state: str, text: str) -> None:
        self.send({"type": "status", "request_id": request_id, "state": state, "text": text})

    def to_html(self, path, budget: int | None = None):
        from hookwidget.views.watch_export import BUDGET, to_html

        return to_html(self.watch, path, BUDGET if budget is None else budget)


def overview_bins(values_a_row: int) -> int:
    """Bins of the overview a view holds for rows of `values_a_row` values: as js/watch/bins.js maxBinsFor (the view
    goes on folding rows into the kernel's overview, so both must agree): 25 bytes a value a bin, OVERVIEW_BYTES."""
    return max(64, min(OVERVIEW_BINS, OVERVIEW_BYTES // (25 * max(values_a_row, 1))))


def tail_rows(values_a_row: int) -> int:
    """Latest rows a view holds at full resolution for rows of `values_a_row` values, as js/watch/store.js tailRows:
    TAIL, fewer where they pass TAIL_BYTES as float32 (322 rows for 1,000 layers × 13 statistics), 64 at least. A
    sync sends no more (a view that opens on a wide run decodes 16 MiB of rows, not 53)."""
    return max(64, min(TAIL, TAIL_BYTES // (4 * max(values_a_row, 1))))


def validate(content) -> dict:
    """The message if it follows the schema exactly, else MessageError naming what is wrong."""
    kind = check_envelope(content, SCHEMA)
    for key in SCHEMA[kind]:
        v = content[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise MessageError(f"{kind}: {key} must be a non-negative integer")
    return content


def _kept(w) -> list:
    flight = getattr(w, "_flight", None) if w is not None else None
    return [int(k) for k in flight.steps()] if flight is not None else []  # not w.kept: that would flush


def _kernel_shell():
    """The IPython shell when running in a Jupyter kernel (where widgets can show), else None."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    return ip if ip is not None and getattr(ip, "kernel", None) is not None else None


def _marimo_context():
    """marimo's runtime context when this runs in a marimo kernel, else None. It is marimo's own module, not its
    public API: read only when marimo is already loaded (never imported here), and any failure reads as None."""
    context = sys.modules.get("marimo._runtime.context")
    try:
        return context.safe_get_context() if context is not None else None
    except Exception:  # another marimo version: no context means the plain path
        return None


def _marimo_cell():
    """The marimo cell running now (None between cells, and outside marimo)."""
    ctx = _marimo_context()
    return getattr(ctx, "cell_id", None)


@contextlib.contextmanager
def _in_marimo_cell(cell_id):
    """Make a widget as part of marimo cell `cell_id`. marimo serves each new widget's code as a file owned by
    the running cell, and a front-end message (the click that opens a kept step) runs in no cell: there,
    making the step's explorer fails (an AssertionError in marimo's virtual files). The explorer then belongs
    to the cell that made the watch's widget and goes when that cell reruns. Elsewhere nothing changes."""
    ctx = _marimo_context()
    if cell_id is None or ctx is None or ctx.cell_id is not None or not hasattr(ctx, "with_cell_id"):
        yield
        return
    with ctx.with_cell_id(cell_id):
        yield


def widget_of(watch) -> WatchWidget:
    """The one widget of `watch` (made on first use; several displays are views of it)."""
    wid = watch.__dict__.get("_live_widget")
    if wid is None:
        wid = watch.__dict__["_live_widget"] = WatchWidget(watch)
    return wid


def _in_marimo_notebook() -> bool:
    """Whether a marimo notebook (edit or app view) runs this: widgets render there as in a Jupyter kernel."""
    mo = sys.modules.get("marimo")  # imported by the notebook itself when it runs in marimo
    try:
        return mo is not None and bool(mo.running_in_notebook())
    except Exception:
        return False


def mimebundle(watch, include=None, exclude=None) -> dict:
    """The live view where widgets render (a Jupyter kernel, a marimo notebook), else the plain-text repr."""
    text = repr(watch)
    if _kernel_shell() is None and not _in_marimo_notebook():
        return {"text/plain": text}
    out = widget_of(watch)._repr_mimebundle_(include=include, exclude=exclude)
    data, metadata = out if isinstance(out, tuple) else (out or {}, {})  # anywidget: (data, metadata)
    return {**data, "text/plain": text}, metadata
