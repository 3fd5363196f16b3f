"""The flight recorder: one full recording per step, of which only the first, the latest and the
anomalous steps' Traces are kept."""

from __future__ import annotations

from hookwidget.capture import backward as autograd_calls


class FlightRecorder:
    """Recording k runs from the end of backward k-1 (or the opening of the watch) to the end of
    backward k. When step k ends, the Trace of step k-1 is kept or dropped: so at most two Traces
    besides the kept ones are alive (the latest, and the one being recorded)."""

    def __init__(self, tracer, model, budget_mb: float, max_kept: int):
        from hookwidget.session import Session

        self.tracer, self.max_kept = tracer, max_kept  # the watch's own tracer (keep strategy "stats")
        self.session = Session(None, model, {"capture": "full", "budget_mb": budget_mb}, kept_by="hw.watch")
        self._rec = None  # the open recording's context manager and Trace
        self.latest = None  # (step, Trace) of the latest completed step, not decided yet
        self.kept: dict = {}
        self.dropped = 0  # anomalous steps whose Trace was not kept (max_kept reached)

    def open(self) -> None:
        cm = self.session.recording()
        self._rec = (cm, cm.__enter__())
        # The watch listens after the recording's tracer: that must end its step before the watch closes it.
        autograd_calls.unlisten(self.tracer)
        autograd_calls.listen(self.tracer)

    def close(self):
        """End the open recording; its Trace, or None if no backward ran in it."""
        rec, self._rec = self._rec, None
        if rec is None:
            return None
        cm, trace = rec
        cm.__exit__(None, None, None)  # the watch's own hooks are not listed as the user's: they are hookwidget's
        return trace if trace.steps else None

    def step_ended(self, step: int, flagged) -> None:
        """Backward of `step` ended: close its recording, open the next, decide on the step before."""
        trace = self.close()
        self.open()
        if self.latest is not None:
            self.decide(*self.latest, flagged)
        self.latest = (step, trace) if trace is not None else None

    def finish(self, flagged) -> None:
        self.close()
        if self.latest is not None:
            self.decide(*self.latest, flagged, latest=True)
            self.latest = None

    def decide(self, step: int, trace, flagged, latest: bool = False) -> None:
        if step == 0 or latest:
            self.kept[step] = trace
        elif flagged(step):
            if sum(1 for k in self.kept if k != 0) < self.max_kept:
                self.kept[step] = trace
            else:
                self.dropped += 1

    def steps(self) -> list:
        return sorted(set(self.kept) | ({self.latest[0]} if self.latest is not None else set()))

    def trace(self, k: int):
        if self.latest is not None and self.latest[0] == k:
            return self.latest[1]
        if k not in self.kept:
            raise KeyError(f"step {k} was not kept; kept steps: {self.steps()} (the first, the latest and "
                           "anomalous ones)")
        return self.kept[k]
