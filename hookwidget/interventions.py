"""The hooks a user can toggle: each kind is one registered entry (parameters, doc, where it attaches).

Where they attach:
- `grad_*` and `callable` on a layer change the gradient flowing into the layer's output (a
  hook on the output tensor), so the layer's own W.grad and everything upstream change too.
  On a graph node id they change the gradient arriving at that node (a node pre-hook), like a
  tensor hook on the tensor the node produced (seed 002's `y.register_hook`).
- `out_*` and `out_callable` replace a layer's output in a forward hook. That changes the
  gradient too (seed 001 is right; seed 000 says it does not, and is wrong): backward runs
  through the new output, so every gradient upstream of it follows the replaced values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class InterventionError(RuntimeError):
    """An intervention's own function raised; the message names the intervention."""


@dataclass(frozen=True)
class Kind:
    name: str
    attach: str  # "grad" (gradient into the target) or "out" (the layer's output, forward)
    params: dict  # parameter name -> (type, default); default None means required
    doc: str
    fn: Callable = field(repr=False)
    python_only: bool = False  # a user's callable: never settable from the front-end


KINDS: dict[str, Kind] = {}


def register(name: str, attach: str, params: dict, doc: str, python_only: bool = False):
    def deco(fn):
        KINDS[name] = Kind(name, attach, params, doc, fn, python_only)
        return fn

    return deco


@register("grad_scale", "grad", {"factor": (float, None)}, "multiply the gradient by factor")
def _grad_scale(g, factor):
    return g * factor


@register("grad_clamp", "grad", {"min": (float, None), "max": (float, None)},
          "clamp every gradient entry into [min, max]")
def _grad_clamp(g, min, max):
    return g.clamp(min, max)


@register("grad_zero", "grad", {}, "replace the gradient by zeros (blocks everything upstream)")
def _grad_zero(g):
    return torch.zeros_like(g)


@register("grad_clip_norm", "grad", {"max_norm": (float, None)},
          "rescale the gradient so its norm is at most max_norm")
def _grad_clip_norm(g, max_norm):
    # ‖g‖ = ‖g / m‖·m with m = max |g|: a float32 sum of squares would overflow for huge gradients.
    m = torch.linalg.vector_norm(g.float(), float("inf")).clamp_min(1e-30)
    norm = torch.linalg.vector_norm(g.float() / m) * m
    return g * (max_norm / (norm + 1e-6)).clamp(max=1.0).to(g.dtype)


@register("out_scale", "out", {"factor": (float, None)}, "multiply the layer's output by factor (forward)")
def _out_scale(out, factor):
    return out * factor


@register("out_zero", "out", {}, "replace the layer's output by zeros (forward)")
def _out_zero(out):
    return torch.zeros_like(out)


@register("callable", "grad", {"fn": (Callable, None)},
          "your fn(grad) -> new grad or None, on the gradient into the target", python_only=True)
def _callable(g, fn):
    return fn(g)


@register("out_callable", "out", {"fn": (Callable, None)},
          "your fn(module, inputs, output) -> new output or None, as a forward hook", python_only=True)
def _out_callable(out, fn, module=None, inputs=None):
    return fn(module, inputs, out)


@dataclass
class Intervention:
    """One kind with checked parameters, on one target (layer name or graph node id)."""

    target: str
    kind: Kind
    params: dict
    anchor: Any = field(default=None, repr=False)  # the module or graph node id it attaches to

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items() if k != "fn")
        return f"{self.kind.name}({args}) on {self.target!r}"

    def on_grad(self, grad):
        """Tensor hook on the target layer's output."""
        return self._call(grad)

    def on_node_grads(self, grad_outputs):
        """Pre-hook on the target node: change the gradient with respect to its first output."""
        if not grad_outputs or grad_outputs[0] is None:
            return None
        new = self._call(grad_outputs[0])
        return None if new is None else (new, *grad_outputs[1:])

    def on_output(self, module, inputs, output):
        """Forward hook: the layer's new output (a tensor output, or the first tensor of a tuple)."""
        first = output if isinstance(output, torch.Tensor) else output[0]
        if self.kind.name == "out_callable":
            return self._call(output, module=module, inputs=inputs)
        new = self._call(first)
        return new if isinstance(output, torch.Tensor) else type(output)((new, *output[1:]))

    def _call(self, value, **extra):
        try:
            return self.kind.fn(value, **self.params, **extra)
        except Exception as e:
            raise InterventionError(f"intervention {self} raised {type(e).__name__}: {e}") from e


def make(target: str, kind: str, params: dict, *, from_frontend: bool = False) -> Intervention:
    """Check a kind name and its parameters; one clear line when they are wrong."""
    spec = KINDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise ValueError(f"unknown intervention kind {kind!r}; choose one of: {', '.join(KINDS)}")
    if from_frontend and spec.python_only:
        raise ValueError(f"{kind!r} takes a Python function: set it from Python with t.add_hook(...)")
    unknown = set(params) - set(spec.params)
    if unknown:
        raise ValueError(f"{kind} takes {_signature(spec)}; got unknown parameter(s) {', '.join(sorted(unknown))}")
    checked: dict[str, Any] = {}
    for name, (typ, default) in spec.params.items():
        if name not in params:
            if default is None:
                raise ValueError(f"{kind} needs {name}: call it as {kind}({_signature(spec)})")
            checked[name] = default
            continue
        value = params[name]
        if typ is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{kind}: {name} must be a number, got {value!r}")
            value = float(value)
        elif typ is Callable and not callable(value):
            raise ValueError(f"{kind}: {name} must be a function, got {type(value).__name__}")
        checked[name] = value
    if spec.name == "grad_clamp" and checked["min"] > checked["max"]:
        raise ValueError(f"grad_clamp: min={checked['min']} is above max={checked['max']}")
    if spec.name == "grad_clip_norm" and checked["max_norm"] <= 0:
        raise ValueError(f"grad_clip_norm: max_norm must be > 0, got {checked['max_norm']}")
    return Intervention(target, spec, checked)


def _signature(spec: Kind) -> str:
    return ", ".join(f"{n}: {t.__name__ if hasattr(t, '__name__') else t}" for n, (t, _) in spec.params.items())
