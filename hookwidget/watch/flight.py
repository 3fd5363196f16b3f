"""The flight recorder: one recording per step, of which only the anomalous steps' (and those the user's keep=
predicate asks for) and the latest step's Traces are kept.

A recording costs what the running step already holds: references to a and δ (copy-on-write clones where the
code may write them later), no gradient norms at graph nodes, and no Trace record assembled. A step is decided on
once its verdict is in (its scalars on the host: as the next step's forward begins if they have arrived, else
when the next backward ends, waiting for them then): a kept step's record is assembled from those references; a
dropped step's are let go, so while the model runs at most two steps' detail (each within `budget_mb`) is alive
besides the kept Traces: the running step's, and the one before it while its values are on their way."""

from __future__ import annotations

from hookwidget.capture import backward as autograd_calls


class FlightRecorder:
    """Recording k runs from the end of backward k-1 (or the opening of the watch) to the end of
    backward k. Once the verdict on step k is in (settle), step k is kept (its Trace assembled) or dropped."""

    def __init__(self, tracer, model, budget_mb: float, max_kept: int):
        from hookwidget.session import Deferred, Session

        self.tracer, self.max_kept = tracer, max_kept  # the watch's own tracer (keep strategy "stats")
        self.session = Session(None, model, {"capture": "full", "budget_mb": budget_mb, "node_grads": False},
                               kept_by="hw.watch")
        self._recorder = None  # the recording's one Tracer, its hooks on from open() to close(), cut every step
        self._new = lambda: Deferred(self.session)
        self._rec = None  # the open recording (session.Deferred)
        self.waiting: list = []  # (step, Deferred) of the completed steps not decided on yet, oldest first (<= 2)
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

    def step_ended(self, step: int) -> None:
        """Backward of `step` ended: cut its recording off (what the recorder holds of it, settled: unassembled and
        uncopied) to wait for its verdict, and start the next."""
        later = self._ended(self._recorder.cut(), self._recorder)
        self._rec = self._new()
        if later is not None:
            self.waiting.append((step, later))

    def settle(self, verdict, rank) -> None:
        """Keep or let go the completed steps whose verdict is in, oldest first: `verdict(step, force)` says
        whether it is (force: wait for it, as for every step but the latest: at most one step waits), `rank` what
        it is worth (Detector.rank)."""
        while self.waiting:
            step, later = self.waiting[0]
            if not verdict(step, len(self.waiting) > 1):
                return
            self.waiting.pop(0)
            self.decide(step, later, rank)

    def finish(self, verdict, rank) -> None:
        """The watch closes: every waiting step decided on, the latest kept whatever its verdict."""
        self.close()
        if self.waiting:
            *older, latest = self.waiting
            self.waiting = older
            self.settle(lambda step, force: verdict(step, True), rank)
            self.decide(*latest, rank, latest=True)

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
        recordings waiting for a verdict are the new step's, the latest of them only (a Trace is of the step's
        last backward pass)."""
        waiting = [(new if k in old else k, later) for k, later in self.waiting]
        self.waiting = [w for i, w in enumerate(waiting) if all(k != w[0] for k, _ in waiting[i + 1:])]
        for k in old:
            if k in self.kept:
                self.kept[new] = self.kept.pop(k)
                if k in self._ranks:
                    self._ranks[new] = self._ranks.pop(k)

    def steps(self) -> list:
        return sorted(set(self.kept) | {k for k, _ in self.waiting})

    def trace(self, k: int):
        for step, later in self.waiting:
            if step == k:
                return later.assemble()  # asked before it is decided on: assembled now (once)
        if k not in self.kept:
            raise KeyError(f"step {k} was not kept; kept steps: {self.steps()} (the latest and "
                           "anomalous ones; keep=lambda step, stats: step == 0 keeps the first)")
        return self.kept[k]
