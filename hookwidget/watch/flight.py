"""The flight recorder: one recording per step, of which only the anomalous steps' (and those the user's keep=
predicate asks for) and the latest step's Traces are kept.

A recording costs what the running step already holds: references to a and δ (copy-on-write clones where the
code may write them later), no gradient norms at graph nodes, and no Trace record assembled. When a step is
judged (as the next step's forward begins, its optimizer steps done; else when the next backward ends), a kept
step's record is assembled from those references; a dropped step's are let go, so while the model runs at most one
step's detail (within `budget_mb`) is alive besides the kept Traces: the running step's."""

from __future__ import annotations

from hookwidget.capture import backward as autograd_calls


class FlightRecorder:
    """Recording k runs from the end of backward k-1 (or the opening of the watch) to the end of
    backward k. When step k+1's forward begins (or, if no hook saw it, its backward ends), step k is kept (its
    Trace assembled) or dropped."""

    def __init__(self, tracer, model, budget_mb: float, max_kept: int):
        from hookwidget.session import Deferred, Session

        self.tracer, self.max_kept = tracer, max_kept  # the watch's own tracer (keep strategy "stats")
        self.session = Session(None, model, {"capture": "full", "budget_mb": budget_mb, "node_grads": False},
                               kept_by="hw.watch")
        self._recorder = None  # the recording's one Tracer, its hooks on from open() to close(), cut every step
        self._new = lambda: Deferred(self.session)
        self._rec = None  # the open recording (session.Deferred)
        self.latest = None  # (step, Deferred) of the latest completed step, not judged yet
        self.kept: dict = {}
        self._ranks: dict = {}  # kept step -> its Detector.rank (the latest, kept at the end, has none)
        self.dropped = 0  # anomalous steps whose Trace was not kept or was given up (max_kept reached)

    def open(self) -> None:
        recorder = self.session.tracer()
        recorder.__enter__()
        self._recorder = recorder
        self._rec = self._new()
        # The watch listens after the recording's tracer: that must end its step before the watch closes it.
        autograd_calls.unlisten(self.tracer)
        autograd_calls.listen(self.tracer)

    def close(self):
        """End the open recording and take the recorder's hooks off; its Deferred, or None if no backward ran."""
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return None
        recorder.__exit__(None, None, None)  # the watch's own hooks are not listed as the user's: hookwidget's
        return self._ended(recorder.records, recorder)

    def _ended(self, records, recorder):
        later, self._rec = self._rec, None
        later.ended(records, recorder)
        return later if later.steps else None

    def step_ended(self, step: int, rank) -> None:
        """Backward of `step` ended: cut its recording off (what the recorder holds of it, settled: unassembled and
        uncopied), start the next, decide on the step before."""
        later = self._ended(self._recorder.cut(), self._recorder)
        self._rec = self._new()
        self.judge(rank)
        self.latest = (step, later) if later is not None else None

    def judge(self, rank) -> None:
        """Keep or let go the latest completed step (judged from its scalars by `rank`: Watch._judge,
        Detector.rank)."""
        if self.latest is not None:
            latest, self.latest = self.latest, None
            self.decide(*latest, rank)

    def finish(self, rank) -> None:
        self.close()
        if self.latest is not None:
            self.decide(*self.latest, rank, latest=True)
            self.latest = None

    def decide(self, step: int, later, rank, latest: bool = False) -> None:
        """Keep step `step`'s Trace (assembled now, from what its recording holds) or let the recording go. First
        come, first kept, up to max_kept; then the first step of a higher rank than some kept one (the first
        non-finite value, after spikes) takes the place of the latest of the lowest ranked: warnings do not crowd
        out the step that went wrong, and the first warning, which the anomalies' lead points from, stays."""
        if latest:
            self.kept[step] = later.assemble()
            return
        r = rank(step)
        if r is None:
            return
        if len(self.kept) >= self.max_kept:  # the latest joins them at the end, beyond max_kept
            self.dropped += 1
            if r in self._ranks.values():  # one of its rank is kept: the first of them
                return
            lowest = min(self._ranks.items(), key=lambda kr: (kr[1], -kr[0]), default=None)
            if lowest is None or lowest[1] >= r:
                return
            del self.kept[lowest[0]], self._ranks[lowest[0]]
        self.kept[step] = later.assemble()
        self._ranks[step] = r

    def rekey(self, old: list, new: int) -> None:
        """Steps `old` are now part of step `new` (the first optimizer step that accumulated them): their
        recording, the latest, is the new step's (a Trace is of the step's last backward pass)."""
        if self.latest is not None and self.latest[0] in old:
            self.latest = (new, self.latest[1])
        for k in old:
            if k in self.kept:
                self.kept[new] = self.kept.pop(k)
                if k in self._ranks:
                    self._ranks[new] = self._ranks.pop(k)

    def steps(self) -> list:
        return sorted(set(self.kept) | ({self.latest[0]} if self.latest is not None else set()))

    def trace(self, k: int):
        if self.latest is not None and self.latest[0] == k:
            return self.latest[1].assemble()  # asked before it is judged: assembled now (once)
        if k not in self.kept:
            raise KeyError(f"step {k} was not kept; kept steps: {self.steps()} (the latest and "
                           "anomalous ones; keep=lambda step, stats: step == 0 keeps the first)")
        return self.kept[k]
