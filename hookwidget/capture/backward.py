"""Seeing every backward pass: one process-wide stand-in for torch.autograd.backward and .grad.

`Tensor.backward` calls `torch.autograd.backward`, so replacing those two attributes sees
every backward pass of the code a trace runs. Several traces and watches may be active at once (threads,
nested traces): one stand-in serves them all, installed when the first starts and removed
when the last ends, whatever order they end in (_torch/patch.py). It calls torch's own function with exactly
the arguments it got, every calling convention included (keywords, a generator of tensors).

Not a backward pass of the user's code: torch.autograd.grad called while torch.compile traces the joint graph
(AOTAutograd, on the first compiled call), on fake tensors; such a call is passed on unheard.
"""

from __future__ import annotations

import inspect
import threading

import torch

from hookwidget._torch.autograd import in_transform
from hookwidget._torch.patch import Patch


def listen(listener) -> None:
    """Route the backward passes of `listener.thread` to it (`listener.on_backward(roots, kind, create_graph)`
    and `.on_backward_end()`) until `unlisten(listener)`."""
    _PATCH.listen(listener)


def unlisten(listener) -> None:
    _PATCH.unlisten(listener)


_CREATE_GRAPH_AT = {"backward": 3, "grad": 4}  # position of create_graph in torch's signature


def _stand_in(name: str, original, listening):
    signature = inspect.signature(original)
    first = next(iter(signature.parameters))  # "tensors" or "outputs"
    at = _CREATE_GRAPH_AT[name]
    if list(signature.parameters).index("create_graph") != at:  # another torch: always bind
        at = -1

    def stand_in(*args, **kwargs):
        me = threading.get_ident()
        listeners = [ls for ls in listening() if ls.thread == me]
        if not listeners or in_transform() or _is_compiling():
            return original(*args, **kwargs)
        roots = args[0] if args else None
        if at >= 0 and isinstance(roots, torch.Tensor) and first not in kwargs:
            # The common call (Tensor.backward: all positional, a single root): no binding needed.
            tensors = [roots]
            create_graph = bool(args[at] if len(args) > at else kwargs.get("create_graph", False))
        else:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # torch's own error for a wrong call
            roots = bound.arguments[first]
            if not isinstance(roots, torch.Tensor) and not isinstance(roots, (list, tuple)):
                roots = bound.arguments[first] = tuple(roots)  # a generator is consumed once: pass torch the tuple
            tensors = [roots] if isinstance(roots, torch.Tensor) else [r for r in roots if isinstance(r, torch.Tensor)]
            create_graph = bool(bound.arguments.get("create_graph", False))
            args, kwargs = bound.args, bound.kwargs
        for ls in listeners:
            ls.on_backward(tensors, name, create_graph)
        try:
            return original(*args, **kwargs)
        finally:
            for ls in listeners:
                ls.on_backward_end()

    stand_in.__wrapped__ = original
    stand_in.__name__ = name
    stand_in.__doc__ = original.__doc__
    return stand_in


_is_compiling = torch.compiler.is_compiling
_PATCH = Patch(torch.autograd, ("backward", "grad"), _stand_in)
