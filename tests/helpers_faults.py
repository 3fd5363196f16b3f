"""Shared checks for the fault matrix: hook registries, and "the same cell with and without hookwidget".

References come from plain PyTorch: a run of the same cell without hookwidget, autograd's .grad,
torch.func. Nothing here asks hookwidget what the right answer is.
"""

from __future__ import annotations

import copy
import gc
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.modules.module as module_mod
from torch import nn

import hookwidget as hw

MODULE_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)
GLOBAL_HOOK_DICTS = tuple(sorted(n for n in vars(module_mod) if n.startswith("_global_") and
                                 isinstance(getattr(module_mod, n), dict)))
ORIGINAL_BACKWARD, ORIGINAL_GRAD = torch.autograd.backward, torch.autograd.grad


def _dict_state(d) -> tuple:
    return tuple((k, id(v)) for k, v in d.items())


def _node_hooks(node) -> tuple:
    """Hooks on an autograd node: its hook dicts are visible to the garbage collector."""
    return tuple(_dict_state(d) for d in gc.get_referents(node) if isinstance(d, OrderedDict) and d)


class Registries:
    """Snapshots of every hook registry that touches `objects` (modules, tensors, in any nesting).

    Holds the parameters' AccumulateGrad nodes alive, so that later graphs reuse the very nodes
    whose hooks are compared (autograd caches a leaf's accumulator only while it is alive)."""

    def __init__(self, *objects):
        self.modules, self.tensors = [], []
        _collect(objects, self.modules, self.tensors)
        for m in self.modules:
            self.tensors += [p for p in m.parameters() if all(p is not t for t in self.tensors)]
        self.accumulators = [t.view_as(t).grad_fn.next_functions[0][0] for t in self.tensors
                             if t.requires_grad and t.is_leaf]

    def take(self) -> dict:
        return {
            "global": {n: _dict_state(getattr(module_mod, n)) for n in GLOBAL_HOOK_DICTS},
            "modules": [{n: _dict_state(getattr(m, n)) for n in MODULE_HOOK_DICTS if hasattr(m, n)}
                        for m in self.modules],
            "tensors": [(_dict_state(t._backward_hooks or {}),
                         _dict_state(getattr(t, "_post_accumulate_grad_hooks", None) or {})) for t in self.tensors],
            "accumulators": [_node_hooks(n) for n in self.accumulators],
            "autograd": (torch.autograd.backward is ORIGINAL_BACKWARD, torch.autograd.grad is ORIGINAL_GRAD),
        }


def _collect(obj, modules, tensors, seen=None):
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        modules += [m for m in obj.modules() if all(m is not k for k in modules)]
    elif isinstance(obj, torch.Tensor):
        tensors.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, modules, tensors, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, modules, tensors, seen)


@dataclass
class Outcome:
    """What a cell left behind: its result, its exception, every .grad, buffers, the RNG."""

    result: Any
    exc: BaseException | None
    grads: dict
    state: dict
    rng: torch.Tensor
    trace: hw.Trace | None = None
    objects: dict = field(default_factory=dict)


def run_cell(build: Callable[[], dict], cell: Callable[..., Any], *, traced: bool, seed: int = 0,
             **trace_options) -> Outcome:
    """Build the user's objects from `seed`, then run `cell(**objects)` plainly or under hw.trace.

    With `traced`, asserts that every hook registry is as before, whatever the cell did."""
    torch.manual_seed(seed)
    objects = build()
    torch.manual_seed(seed + 1)
    if isinstance(trace_options.get("modules"), str):  # the name of one of the user's objects
        trace_options = {**trace_options, "modules": objects[trace_options["modules"]]}
    regs = Registries(objects)
    before = regs.take()
    result = exc = t = None
    try:
        if traced:
            out = []
            t = hw.trace(lambda: out.append(cell(**objects)), **trace_options)
            result = out[0]
        else:
            result = cell(**objects)
    except BaseException as e:  # KeyboardInterrupt too: the test compares it with the plain run
        exc = e
    after = regs.take()
    assert after == before, f"hook registries changed: {_difference(before, after)}"
    rng = torch.get_rng_state()
    grads, state = {}, {}
    for k, v in _named(objects):
        if isinstance(v, nn.Module):
            grads.update({f"{k}.{n}": p.grad for n, p in v.named_parameters()})
            state.update({f"{k}.{n}": b.detach().clone() for n, b in v.state_dict().items()})
        elif isinstance(v, torch.Tensor):
            grads[k] = v.grad if v.is_leaf and v.requires_grad else None
            state[k] = v.detach().clone()
    return Outcome(result, exc, grads, state, rng, t, objects)


def _named(objects: dict, prefix: str = ""):
    for k, v in objects.items():
        if isinstance(v, dict):
            yield from _named(v, f"{prefix}{k}.")
        elif isinstance(v, (nn.Module, torch.Tensor)):
            yield prefix + k, v


def _difference(before: dict, after: dict) -> str:
    out = []
    for key in before:
        if before[key] != after[key]:
            out.append(f"{key}: {before[key]!r} -> {after[key]!r}"[:400])
    return "; ".join(out)


def assert_same(plain: Outcome, traced: Outcome) -> None:
    """The traced run left exactly what the plain run left: exception type, result, grads,
    buffers and parameters, RNG state (bitwise)."""
    assert type(traced.exc) is type(plain.exc), f"plain raised {plain.exc!r}, traced raised {traced.exc!r}"
    if plain.exc is not None:
        assert str(traced.exc) == str(plain.exc)
    _assert_equal(plain.result, traced.result, "result")
    assert plain.grads.keys() == traced.grads.keys()
    for k, g in plain.grads.items():
        _assert_equal(g, traced.grads[k], f"{k}.grad")
    for k, v in plain.state.items():
        _assert_equal(v, traced.state[k], k)
    assert torch.equal(plain.rng, traced.rng), "RNG state differs"


def _assert_equal(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{what}: {a!r} vs {b!r}"
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what} differs: {a} vs {b}"
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{what}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_equal(a[k], b[k], f"{what}[{k!r}]")
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def observe(build, cell, seed: int = 0, **trace_options) -> Outcome:
    """Run the cell without and with hookwidget; assert both left the same; return the traced run."""
    plain = run_cell(build, cell, traced=False, seed=seed)
    traced = run_cell(build, cell, traced=True, seed=seed, **trace_options)
    assert_same(plain, traced)
    return traced


def deep_copy_state(module: nn.Module) -> dict:
    return copy.deepcopy(module.state_dict())
