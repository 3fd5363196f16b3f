"""TensorBoard event files for people who live there, through torch.utils.tensorboard (an optional extra).

Scalars, x = the step (backward pass) index: `{stat}/{layer}` for every layer statistic (one TensorBoard
section per statistic, a chart per layer), `step/loss` and `step/grad_norm`; NaN and Inf are written as
they are (TensorBoard shows them; nothing is dropped). The anomalies go in as text (`anomalies`).
"""

from __future__ import annotations

import queue
import threading

INSTALL = "pip install hookwidget[tensorboard]"


def _writer(log_dir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(f"TensorBoard is not installed: {INSTALL}") from None
    return SummaryWriter(log_dir=str(log_dir))


class TensorBoardLog:
    """Writes a watch's rows as they reach the host (a listener of the watch: no device sync of its own).
    Live, a thread writes them: add_scalar costs ~25 µs, 12 per layer per step, too much for the loop's
    own thread; close() waits for it, so the files are complete when the watch is closed."""

    LABEL = "tensorboard"  # names the sink in the note a failed write leaves (views/wandb.py reuses the thread)

    def __init__(self, log_dir, watch):
        self.watch, self.writer = watch, _writer(log_dir)
        self.log_dir = self.writer.log_dir
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        self.error = None  # the first exception the writing thread met (then it drops the rest)

    def rows(self, stats, step_stats, steps, ps=None) -> None:
        w, add = self.watch, self.writer.add_scalar
        for r, k in enumerate(steps):
            for li, layer in enumerate(w.layer_names):
                for si, stat in enumerate(w.stat_names):
                    add(f"{stat}/{layer}", stats[r, li, si].item(), k)
            for si, stat in enumerate(w.step_stat_names):
                add(f"step/{stat}", step_stats[r, si].item(), k)

    def anomalies(self) -> None:
        found = self.watch.found_anomalies
        if found:
            text = "\n".join(f"- step {a.step}, {a.where}: {a.reason}" + (f" ({a.samples.text})" if a.samples else "")
                              for a in found)
            self.writer.add_text("anomalies", text, found[-1].step)

    QUEUED = ("rows",)  # the events the thread writes (a method of each name)

    def __call__(self, event: str, *args) -> None:
        if event in self.QUEUED:
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="hookwidget-tensorboard", daemon=True)
                self._thread.start()
            self._queue.put((getattr(self, event), args))
        elif event == "closed":
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
            self.anomalies()
            self.writer.close()
            if self.error is not None:
                self.watch.notes.append(f"{self.LABEL}: writing to {self.log_dir} failed: {self.error!r}")

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is None:
                try:
                    write, args = item
                    write(*args)
                    self.writer.flush()
                except Exception as e:  # noqa: BLE001 - reported in w.notes at close
                    self.error = e


def write(watch, log_dir) -> str:
    """Everything the watch recorded so far, as one run in `log_dir`; returns the event files' folder."""
    log = TensorBoardLog(log_dir, watch)
    log.rows(watch.stats, watch.step_stats, watch.steps)
    log.anomalies()
    log.writer.close()
    return log.log_dir
