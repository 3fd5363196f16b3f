"""What the hooks of one trace share, and context managers that undo one change each, so one ExitStack can own
every module hook of a trace."""

from __future__ import annotations

import threading


class Hooks:
    """The state every hook of one trace reads, handed explicitly to the parts that register hooks (the tracer,
    the generic rule's capture, the node norms) instead of their reaching into the tracer:

    - `active`: hooks act only while the trace runs (a hook baked into a graph that outlives it can still fire);
    - `lock`: taken by the hooks that autograd may run on its own threads;
    - `tensor`: handles of tensor hooks on module outputs (many per step: a list, removed when the trace ends);
    - `node`: handles of node pre-hooks of the running step's graph, removed when the step ends;
    - `step`: the StepRecord of the backward pass running now, or None.

    The lists are emptied and refilled in place, never replaced: every holder sees the same ones."""

    __slots__ = ("active", "lock", "tensor", "node", "step")

    def __init__(self):
        self.active = False
        self.lock = threading.Lock()
        self.tensor: list = []
        self.node: list = []
        self.step = None

    def step_index(self, call) -> None:
        """call.step = the running step, where it has none yet (its δ arrives in this backward pass)."""
        if call.step is None and self.step is not None:
            call.step = self.step.index

    def guarded(self, fn):
        """fn as a hook that does nothing once the trace has ended (an intervention's own callable)."""

        def hook(*args):
            if not self.active:
                return None
            return fn(*args)

        return hook

    def remove_node_hooks(self) -> None:
        for h in self.node:
            h.remove()
        self.node.clear()


class Removing:
    """Context manager that removes a hook handle on exit."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self.handle

    def __exit__(self, *exc):
        self.handle.remove()
