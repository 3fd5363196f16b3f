"""The checks of a Trace method's arguments: a wrong one raises one line, naming the fix, from the method the user
called (not from the analysis/ or session.py frames that found it)."""

from __future__ import annotations

import functools
import math
import numbers

import torch

from hookwidget.analysis import facts
from hookwidget.options import shown, suggest

ARGUMENT_ERRORS = (ValueError, KeyError, TypeError)  # what a wrong argument of a Trace method raises: one line


def boundary(method):
    """A wrong argument raises from the method the user called, whatever checked it: the traceback is their line
    and this one, not the 5-7 frames of analysis/ and session.py that found it (the message names the fix)."""

    @functools.wraps(method)
    def entry(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except ARGUMENT_ERRORS as e:
            raise e.with_traceback(None) from None

    return entry


def check_step(t, step):
    """step=: None or the index of one of t.steps (negative from the end), else one line."""
    n = len(t.steps)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not -n <= step < n):
        raise ValueError(f"step={shown(step, 30)}: this trace has {n} step(s); pass step=0..{n - 1} or None "
                         "(t.steps lists them)")
    return step


def parameterised(t, name: str) -> None:
    """A layer asked for a parameter's gradient has parameters (a ReLU has none: that, not a missing factor rule, is
    why there is no gradient); else one line naming layers that have some."""
    module = t.layer(name).module
    if next(module.parameters(), None) is None:
        some = [n for n in t.layers if n != name and facts.owned_params(t, n)]
        raise ValueError(f"layer {name!r} ({t.layer(name).type}) has no parameters, so no gradient to rebuild; "
                         f"{suggest(name, some, 'layers with some')}")


def trainable(t, name: str) -> None:
    """A layer asked for per-sample gradients holds a parameter that requires grad; else one line naming some."""
    parameterised(t, name)
    if not facts.owned_params(t, name):
        some = [n for n in t.layers if n != name and facts.owned_params(t, n)]
        raise ValueError(f"layer {name!r} has no trainable parameters (requires_grad=False, e.g. a frozen or LoRA "
                         f"base layer): no per-sample gradients; {suggest(name, some, 'layers with some')}")


def with_weight(t, name: str):
    """The module of a layer that has a weight matrix (storage compares one with its factors); else one line naming
    layers with one."""
    module = t.layer(name).module
    if not _has_weight(module):
        some = [n for n, layer in t.layers.items() if _has_weight(layer.module)]
        raise ValueError(f"layer {name!r} ({t.layer(name).type}) has no weight matrix to compare its factors "
                         f"with; {suggest(name, some, 'layers with one')}")
    return module


def positive(value) -> bool:
    """A finite number > 0 (not a bool; an integer past float's range is not one)."""
    try:
        return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < float(value) < math.inf
    except OverflowError:
        return False


def reduction_scale(loss_reduction: str, batch: int) -> float:
    """What loss_reduction= multiplies the contributions by: 1 for 'sum', the batch for 'mean'; else one line."""
    if loss_reduction not in ("sum", "mean"):
        raise ValueError(f"loss_reduction={shown(loss_reduction)}: use 'sum' or 'mean' (the reduction of your loss)")
    return float(batch) if loss_reduction == "mean" else 1.0


def _has_weight(module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() >= 1
