"""Facts about a finished trace that every analysis reads: which steps a query answers for, which parameters each
layer answers for and holds; the one cache per trace where such answers are kept (Facts); the typed refusal
(Refusal) of an analysis that has no answer.

Floor: analysis. Imports layers/ only.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from hookwidget._torch.modules import own_parameters
from hookwidget.layers import factors as fx
from hookwidget.layers import generic


def step_indices(trace, step: int | None) -> list[int]:
    """The steps a query answers for: the one asked for, or every backward pass when they
    accumulate into .grad (or there is only one); otherwise one line asking for step=."""
    steps = trace.steps
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or not -len(steps) <= step < len(steps):
            raise ValueError(f"step={step!r}: this trace has {len(steps)} step(s); pass step=0..{len(steps) - 1} "
                             "(t.steps lists them)")
        return [step % len(steps)]
    backward = [s.index for s in steps if s.kind == "backward"] or [s.index for s in steps]
    if len(backward) > 1 and not trace.accumulates:
        raise ValueError(f"this trace has {len(backward)} backward passes and .grad was reset between them (e.g. "
                         f"opt.zero_grad() every step): pass step=k for one of them (0..{len(steps) - 1}; "
                         "t.steps lists them)")
    return backward


def step_grad(trace, p, k: int) -> torch.Tensor | None:
    """What step k added to parameter p's .grad, or None (the step did not reach it, or kept a summary only)."""
    name = next((n for n, q in trace.params.items() if q is p), None)
    try:
        return trace.steps[k].grad(name)
    except (KeyError, ValueError):
        return None


def allclose_grad(got: torch.Tensor, want: torch.Tensor) -> bool:
    if want.is_sparse:
        want = want.to_dense()
    got = got.to(want.dtype).reshape(want.shape)
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-12))


class Facts(dict):
    """The one cache per trace, made with it (`trace.facts`): what analysis read of its record and of the modules
    when it ended, and answers worth keeping (the generic rule's rows per layer and step, batch sizes, coverage),
    by key. `lock`: taken where an answer must be decided once, whichever thread asks first (an explorer's
    message handler, the user's cell); re-entrant, as deciding may read other answers."""

    def __init__(self):
        super().__init__()
        self.lock = threading.RLock()


@dataclass(frozen=True)
class Refusal:
    """No answer, and why (one line): returned where callers go on without the answer and say why."""

    reason: str

    def __str__(self) -> str:
        return self.reason


def owned_params(trace, name: str) -> dict:
    """Parameter name -> trainable parameter the layer answers for: its own (an exact rule's), or with the
    generic rule also those of descendants no call of the trace reached (MultiheadAttention's out_proj, a
    weight-normed conv's parametrizations). A parametrization container answers for none: its module does."""
    return _layer_params(trace, name)[0]


def own_trainable(trace, name: str) -> list:
    """The layer's own parameters that require grad, answered for or not."""
    return _layer_params(trace, name)[1]


def _layer_params(trace, name: str) -> tuple:
    """(owned_params, own_trainable, the own ones it does not answer for) of the layer, read once per trace
    (when the run ends: coverage.settle): a model changed later does not change them."""
    cache = trace.facts
    key = ("params", name)
    found = cache.get(key)
    if found is None:
        module = trace.layers[name].module
        own = {n: p for n, p in own_parameters(module).items() if p is not None and p.requires_grad}
        if generic.is_parametrization(module):
            found = {}, list(own.values()), list(own.values())
        elif fx.is_generic(module):
            called = cache.get("called")
            if called is None:
                called = cache["called"] = {id(layer.module) for layer in trace.layers.values() if layer.calls}
            owned = generic.owned(module, called)
            ids = {id(p) for p in owned.values()}
            found = owned, list(own.values()), [p for p in own.values() if id(p) not in ids]
        else:
            found = own, list(own.values()), ()
        cache[key] = found
    return found


def param_holders(trace) -> dict:
    """id(parameter) -> names of the called layers that hold it (tied weights: several): those that answer for it,
    and any that only holds it (a parametrization container holds its module's parameters; answering_holders)."""
    cache = trace.facts
    out = cache.get("holders")
    if out is not None:
        return out
    out = cache["holders"] = defaultdict(list)
    for n, layer in trace.layers.items():
        calls = layer.calls
        if calls and (calls[0].step is not None or any(c.step is not None for c in calls)):
            owned, _, others = _layer_params(trace, n)
            for p in owned.values():
                out[id(p)].append(n)
            for p in others:  # its own, answered for or not
                out[id(p)].append(n)
    return out


def answering_holders(trace, p) -> list:
    """The layers among p's holders (param_holders) that answer for it."""
    return [h for h in param_holders(trace).get(id(p), ()) if any(q is p for q in owned_params(trace, h).values())]


def record_facts(trace) -> bool:
    """Read, once the trace ends, what the coverage decisions (left_out, the notes) would read from the live
    modules besides the registry's answers (which the record keeps): the parameters each layer answers for and
    holds. Returns whether those decisions now depend on nothing else that is live, so that they may be taken
    later: not where a generic-rule layer (its rule reruns the module) or a parameter several layers hold (its
    check rebuilds .grad through the layers' rules) is involved."""
    for layer in trace.layers.values():
        if fx.is_generic(layer.module):
            return False
    return all(len(hs) == 1 for hs in param_holders(trace).values())
