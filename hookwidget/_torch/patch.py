"""One way to stand in for a torch function process-wide while someone listens: `Patch`.

hookwidget sees every backward pass by replacing `torch.autograd.backward` and `.grad` (capture/backward.py),
and every `GradScaler.scale` call (watch/amp.py). Several tracers and watches may listen at once (threads,
nested traces, a watch around a trace): one stand-in per attribute serves them all. It is installed when the
first listener arrives and torch's own function is put back when the last one leaves, whatever order they
leave in. If someone else replaced the attribute after us (another library's patch, wrapping ours or not),
theirs is left in place: restoring ours would silently undo it.
"""

from __future__ import annotations

import threading


class Patch:
    """Stand-ins for attributes `names` of `owner` (a module or a class) while `listeners` is not empty.

    `make(name, original, listeners)` builds the stand-in for one attribute: on each call it asks
    `listeners()` for the listeners now (a tuple, replaced whole on each change: no lock needed), tells them,
    and calls `original` with exactly what it got. `listeners()` is empty for a stand-in no longer installed
    as ours (left under someone else's patch, which may still call it): it then only passes the call on, so
    no listener hears a call twice. A stand-in is made once per (name, original) and reused (building one may
    be slow: inspect.signature)."""

    def __init__(self, owner, names: tuple, make):
        self.owner, self.names, self._make = owner, tuple(names), make
        self.listeners: tuple = ()  # a listener added twice counts twice (refcounted)
        self._lock = threading.Lock()
        self._originals: dict = {}  # name -> the function replaced, while installed
        self._stand_ins: dict = {}  # (name, original) -> its stand-in
        self._ours: dict = {}  # id(stand-in) -> (stand-in, the original it calls)

    def listen(self, listener) -> None:
        """Add `listener`; the first one installs the stand-ins."""
        with self._lock:
            if not self.listeners:
                self._install()
            self.listeners = (*self.listeners, listener)

    def unlisten(self, listener) -> None:
        """Remove `listener` (once; nothing if it is not there); the last one restores what was there."""
        with self._lock:
            at = next((i for i, ls in enumerate(self.listeners) if ls is listener), None)  # by identity
            if at is None:
                return
            self.listeners = self.listeners[:at] + self.listeners[at + 1:]
            if not self.listeners:
                self._restore()

    def installed(self, name: str) -> bool:
        """Whether the attribute `name` holds our stand-in now."""
        return id(getattr(self.owner, name)) in self._ours

    def _install(self) -> None:
        for name in self.names:
            original = getattr(self.owner, name)
            while id(original) in self._ours:  # ours, left in place under someone's patch that was removed since
                original = self._ours[id(original)][1]
            stand_in = self._stand_ins.get((name, original))
            if stand_in is None:
                stand_in = self._make(name, original, self._listeners_of(name, original))
                self._stand_ins[(name, original)] = stand_in
                self._ours[id(stand_in)] = (stand_in, original)
            self._originals[name] = original
            setattr(self.owner, name, stand_in)

    def _listeners_of(self, name: str, original):
        def listeners() -> tuple:
            return self.listeners if self._originals.get(name) is original else ()

        return listeners

    def _restore(self) -> None:
        for name, original in self._originals.items():
            if self._stand_ins.get((name, original)) is self.owner.__dict__.get(name):
                setattr(self.owner, name, original)  # else someone patched it after us: theirs stays
        self._originals.clear()
