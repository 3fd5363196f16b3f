"""What the hooks of one trace share, and context managers that undo one change each, so one ExitStack can own
every module hook of a trace."""

from __future__ import annotations

import threading

from torch import nn


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


def module_list(modules):
    """A tracer's `modules=` as a list of modules (None: every module, through global hooks)."""
    if modules is None:
        return None
    if isinstance(modules, nn.Module):
        return [modules]
    out = list(modules)
    bad = [type(m).__name__ for m in out if not isinstance(m, nn.Module)]
    if bad or not out:
        raise TypeError(f"modules= takes an nn.Module or a list of them; got {', '.join(bad) or 'an empty list'}")
    return out


def every_module(roots: list) -> list:
    """The modules of `roots` and of all their submodules, each once, in order."""
    seen, out = set(), []
    for root in roots:
        for m in root.modules():
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out
