"""The hooks a user can toggle: each kind is one registered entry (parameters, doc, where it attaches).

Where they attach:
- `grad_*` and `callable` on a layer change the gradient flowing into the layer's output (a
  hook on the output tensor), so the layer's own W.grad and everything upstream change too.
  On a graph node id they change the gradient arriving at that node (a node pre-hook), like a
  tensor hook on the tensor the node produced (seed 002's `y.register_hook`).
- `out_*` and `out_callable` replace a layer's output in a forward hook (`out_*`: its first tensor,
  in a copy of the output's own type, so code that reads `out.logits` or `out["a"]` still works). That changes the
  gradient too (seed 001 is right; seed 000 says it does not, and is wrong): backward runs
  through the new output, so every gradient upstream of it follows the replaced values.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class InterventionError(RuntimeError):
    """An intervention's function raised or returned what autograd cannot take; the message names the intervention.

    It is raised in the run the intervention is on (`t.rerun()`), when the forward or backward pass calls it, not
    by `t.add_hook`: what a function returns is known only then. The run's state is put back as for any rerun, and
    the intervention stays on (`t.interventions`) until `t.remove_hook` takes it off.

    Raised where:

    - `callable` gives a gradient of another shape, dtype or device than the one it replaces;
    - `out_callable` returns something other than a tensor where the layer returned a tensor;
    - an `out_*` kind finds no tensor in the layer's output, or cannot rebuild the output's type around it;
    - the intervention's function raises (that exception is chained as the cause).

    Example:

    ```python
    t.add_hook("fc2", "callable", fn=lambda g: g[:1])   # the first sample's gradient only: another shape
    try:
        t.rerun()
    except hw.InterventionError as e:
        print(e)
    t.remove_hook("fc2", "callable")
    ```
    """


@dataclass(frozen=True)
class Kind:
    name: str
    attach: str  # "grad" (gradient into the target) or "out" (the layer's output, forward)
    params: dict  # parameter name -> (type, default); default None means required
    doc: str
    fn: Callable = field(repr=False)
    python_only: bool = False  # a user's callable: never settable from the front-end
    open_ends: dict = field(default_factory=dict)  # parameter -> the infinity that means "no bound" there
    example: str = ""  # valid parameters, for error messages


KINDS: dict[str, Kind] = {}


def register(name: str, attach: str, params: dict, doc: str, python_only: bool = False, open_ends=None,
             example: str = ""):
    def deco(fn):
        KINDS[name] = Kind(name, attach, params, doc, fn, python_only, open_ends or {}, example)
        return fn

    return deco


@register("grad_scale", "grad", {"factor": (float, None)}, "multiply the gradient by factor", example="factor=0.5")
def _grad_scale(g, factor):
    return g * factor


@register("grad_clamp", "grad", {"min": (float, None), "max": (float, None)},
          "clamp every gradient entry into [min, max]", open_ends={"min": -math.inf, "max": math.inf},
          example="min=-1.0, max=1.0")
def _grad_clamp(g, min, max):
    return g.clamp(min, max)


@register("grad_zero", "grad", {}, "replace the gradient by zeros (blocks everything upstream)")
def _grad_zero(g):
    return torch.zeros_like(g)


@register("grad_clip_norm", "grad", {"max_norm": (float, None)},
          "rescale the gradient so its norm is at most max_norm", example="max_norm=1.0")
def _grad_clip_norm(g, max_norm):
    # ‖g‖ = ‖g / m‖·m with m = max |g|: a float32 sum of squares would overflow for huge gradients.
    m = torch.linalg.vector_norm(g.float(), float("inf")).clamp_min(1e-30)
    norm = torch.linalg.vector_norm(g.float() / m) * m
    return g * (max_norm / (norm + 1e-6)).clamp(max=1.0).to(g.dtype)


@register("out_scale", "out", {"factor": (float, None)}, "multiply the layer's output by factor (forward)",
          example="factor=0.5")
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
        return self._checked_grad(grad, self._call(grad))

    def on_node_grads(self, grad_outputs):
        """Pre-hook on the target node: change the gradient with respect to its first output."""
        if not grad_outputs or grad_outputs[0] is None:
            return None
        new = self._checked_grad(grad_outputs[0], self._call(grad_outputs[0]))
        return None if new is None else (new, *grad_outputs[1:])

    def on_output(self, module, inputs, output):
        """Forward hook: the layer's new output, of the output's own type (its first tensor changed)."""
        if self.kind.name == "out_callable":
            new = self._call(output, module=module, inputs=inputs)
            if isinstance(output, torch.Tensor) and new is not None and not isinstance(new, torch.Tensor):
                raise InterventionError(f"intervention {self}{_fn_name(self.params)} returned a "
                                        f"{type(new).__name__} where the layer returned a tensor: return a tensor, "
                                        "or None to keep the output")
            return new
        return self._with_first_tensor(output)

    def _with_first_tensor(self, output):
        """A copy of a tensor / tuple / list / namedtuple / dict / dataclass output (a Hugging Face
        ModelOutput is both of the last two) with its first tensor replaced by the kind's result."""
        if isinstance(output, torch.Tensor):
            return self._call(output)
        try:
            if dataclasses.is_dataclass(output) and not isinstance(output, type):
                name = _first(f.name for f in dataclasses.fields(output) if isinstance(getattr(output, f.name),
                                                                                    torch.Tensor))
                if name is not None:
                    return dataclasses.replace(output, **{name: self._call(getattr(output, name))})
            if isinstance(output, (tuple, list)):
                i = _first(i for i, v in enumerate(output) if isinstance(v, torch.Tensor))
                if i is not None:
                    items = [*output[:i], self._call(output[i]), *output[i + 1:]]
                    return type(output)._make(items) if hasattr(type(output), "_make") else type(output)(items)
            if isinstance(output, dict):
                key = _first(k for k, v in output.items() if isinstance(v, torch.Tensor))
                if key is not None:
                    new = copy.copy(output)
                    new[key] = self._call(output[key])
                    return new
        except InterventionError:
            raise
        except Exception as e:
            raise InterventionError(f"intervention {self} could not rebuild the layer's {type(output).__name__} output "
                                    f"({type(e).__name__}: {_first_line(e)}); use out_callable to build it yourself"
                                    ) from e
        raise InterventionError(f"intervention {self} found no tensor in the layer's {type(output).__name__} output: "
                                f"{self.kind.name} changes the first tensor of a tensor, tuple, list, namedtuple, "
                                "dict or dataclass output; use out_callable for others")

    def _checked_grad(self, grad, new):
        """The new gradient, or one line naming the intervention where autograd could not take it."""
        problem = _grad_problem(grad, new)
        if problem:
            raise InterventionError(f"intervention {self}{_fn_name(self.params)} {problem}: return a tensor of the "
                                    "same shape, dtype and device, or None")
        return new

    def _call(self, value, **extra):
        try:
            return self.kind.fn(value, **self.params, **extra)
        except Exception as e:
            raise InterventionError(f"intervention {self} raised {type(e).__name__}: {e}") from e


def _grad_problem(grad, new) -> str | None:
    """What autograd would reject in a hook's result (None keeps the gradient)."""
    if new is None:
        return None
    if not isinstance(new, torch.Tensor):
        return f"returned a {type(new).__name__}; the gradient is a tensor of shape {tuple(grad.shape)}"
    if new.shape != grad.shape:
        return f"returned shape {tuple(new.shape)}; the gradient has shape {tuple(grad.shape)}"
    if new.dtype != grad.dtype:
        return f"returned dtype {new.dtype}; the gradient has dtype {grad.dtype}"
    if new.device != grad.device:
        return f"returned a tensor on {new.device}; the gradient is on {grad.device}"
    return None


def _first_line(e: Exception) -> str:
    return next(iter(str(e).strip().splitlines()), "")


def _first(items):
    return next(iter(items), None)


def _fn_name(params: dict) -> str:
    fn = params.get("fn")
    return "" if fn is None else f" (fn={getattr(fn, '__name__', type(fn).__name__)})"


def make(target: str, kind: str, params: dict, *, from_frontend: bool = False) -> Intervention:
    """Check a kind name and its parameters; one clear line when they are wrong."""
    spec = KINDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise ValueError(f"unknown intervention kind {kind!r}; choose one of: {', '.join(KINDS)}")
    if from_frontend and spec.python_only:
        raise ValueError(f"{kind!r} takes a Python function: set it from Python with t.add_hook(...)")
    unknown = set(params) - set(spec.params)
    if unknown:
        names = ", ".join(_one_line(u)[:30] or repr(u) for u in sorted(unknown)[:5])
        raise ValueError(f"{kind} takes {_signature(spec)}; got unknown parameter(s) {names}")
    checked: dict[str, Any] = {}
    for name, (typ, default) in spec.params.items():
        if name not in params:
            if default is None:
                raise ValueError(f"{kind} needs {name}: call it as {kind}({_signature(spec)})")
            checked[name] = default
            continue
        value = params[name]
        if typ is float:
            value = _number(spec, name, value)
        elif typ is Callable and not callable(value):
            raise ValueError(f"{kind}: {name} must be a function, got {type(value).__name__}")
        checked[name] = value
    if spec.name == "grad_clamp" and checked["min"] > checked["max"]:
        raise ValueError(f"grad_clamp: min={checked['min']} is above max={checked['max']}; e.g. {_example(spec)}")
    if spec.name == "grad_clip_norm" and checked["max_norm"] <= 0:
        raise ValueError(f"grad_clip_norm: max_norm must be > 0, got {checked['max_norm']}; e.g. {_example(spec)}")
    return Intervention(target, spec, checked)


def _signature(spec: Kind) -> str:
    return ", ".join(f"{n}: {t.__name__ if hasattr(t, '__name__') else t}" for n, (t, _) in spec.params.items())


def _number(spec: Kind, name: str, value) -> float:
    """A float parameter: finite, or the one infinity that means "no bound" there (grad_clamp's min=-inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        got = _one_line(repr(value))  # cut short: a module's repr spans many lines
        raise ValueError(f"{spec.name}: {name} must be a number, got {got[:60]}; e.g. {_example(spec)}")
    try:
        number = float(value)
    except OverflowError:
        # str() of an integer past 4300 digits is refused: its digits are counted from its bits then
        digits = len(str(value)) if value.bit_length() < 14_000 else f"about {int(value.bit_length() * 0.30103) + 1}"
        raise ValueError(f"{spec.name}: {name} is an integer of {digits} digits, too large for a float; "
                         f"e.g. {_example(spec)}") from None
    if math.isfinite(number) or number == spec.open_ends.get(name):
        return number
    raise ValueError(f"{spec.name}: {name}={number} means nothing here, it must be a finite number"
                     + (f" or {spec.open_ends[name]} for no bound" if name in spec.open_ends else "")
                     + f"; e.g. {_example(spec)}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _example(spec: Kind) -> str:
    return f"{spec.name}({spec.example})"
