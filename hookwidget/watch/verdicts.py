"""The verdict on each completed step, for the flight recorder, without a device sync on the step's path: what
judges a step is sent to the host in a non-blocking transfer (arrivals.py) as the step completes, and read when
it has arrived, or waited for a step later (FlightRecorder.settle forces the older of two waiting steps)."""

from __future__ import annotations

from hookwidget.watch.arrivals import InFlight


class Verdicts:
    """`rows`: the watch's HostRows; `detector`: its Detector; `whole_rows()`: whether a verdict needs the whole
    row (a keep= predicate, a GradScaler's skipped steps) rather than the step's scalars; `flush(upto, wait)`: the
    watch's move of its rows to the host (Watch._flush)."""

    def __init__(self, rows, detector, whole_rows, flush):
        self.rows, self.detector, self.whole_rows, self.flush = rows, detector, whole_rows, flush

    def send(self, upto: int) -> None:
        """Send what judges the steps up to `upto` to the host, without waiting: their scalars (loss, global
        gradient norm) and one flag (a non-finite count in the row), in one small transfer a step; their rows stay
        on the device until the batch moves. Where a verdict needs the whole row, the rows are sent instead."""
        if self.whole_rows():
            self.flush(upto, wait=False)
            return
        for s in self.rows.pending:
            if s.index > upto or self.detector.judged(s.index):
                continue
            self.rows.settle(s)  # spread over ranks: judged on the global row, the same verdict on every rank
            self.detector.judge_later(s.index, InFlight(self.detector.scalars(s.row, s.step_row)), s.has_loss)

    def ready(self, step: int, force: bool) -> bool:
        """Whether the verdict on `step` is in (the flight recorder decides on it then); `force`: send and wait
        for what it needs."""
        if self.rows.holds(step) and not self.detector.judged(step):  # nothing sent to judge it yet
            if not force:
                return False
            self.send(upto=step)
        needs_row = self.detector.arrived(step, wait=force)
        if needs_row is None:
            return False
        if (needs_row or self.whole_rows()) and self.rows.holds(step):
            self.flush(step, wait=force)  # to locate a non-finite count, or for keep= and the scaler
            return not self.rows.holds(step)
        return True
