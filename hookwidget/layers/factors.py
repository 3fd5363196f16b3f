"""The (a, δ) factors: per layer type, how activations and output gradients make W.grad.

Each supported layer type is one registered spec (hookwidget/layers/) whose rule turns a call's
(a, δ) into per-parameter *token factors*: per sample b, the parameter's gradient is a sum over
tokens t of a small product of δ_bt with something built from a_bt. From those, generic code gives
the summed gradient (W.grad), per-sample gradients, and per-sample gradient norms without
materialising them where the Gram ("ghost") form is cheaper:
‖Σ_t δ_t a_tᵀ‖² = Σ_{t,t'} (a_t·a_t')(δ_t·δ_t') (Li et al. 2022).

A rule is applied only where it is exact: a subclass that overrides the layer's forward gets none
(exact_reason(module) says why) and falls back to the generic torch.func rule (layers/generic.py, kind
"dense"), which analysis/per_sample.py checks against the step's gradient before it is used.

Per-sample gradients are each sample's contribution to .grad (they sum to W.grad). With a
mean-reduced loss each carries the 1/B factor: pass loss_reduction="mean" to undo it. Where samples
share statistics (BatchNorm on batch statistics) a row is that sample's contribution and not the
gradient of its own loss alone: per_sample_meaning(module) and Factor.per_sample say "contribution".
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

# The package's surface (hookwidget.layers.__all__: specs, kinds, registry look-ups) is this module's too, so that
# callers reach all of it as `fx.name`; the list itself lives once, in layers/__init__.py.
from hookwidget.layers import *  # noqa: F403
from hookwidget.layers import KINDS, ConvCalls, Factor, cost, shared, spec_for, unsupported_reason
from hookwidget.layers.base import sq_norms
from hookwidget.layers.linear import linear, linear_norm_sq


def rule_for(module: nn.Module):
    """The rule that is exact for this module, or None (see unsupported_reason)."""
    spec = spec_for(module)
    return None if spec is None or spec.generic else spec.rule


# -- generic mathematics -----------------------------------------------------------------------
def factors(module: nn.Module, calls: list) -> list[Factor]:
    """Token factors of every parameter of `module`, all calls concatenated along tokens. A call may
    carry `state` (forward_state(module) at its forward); without it the module's state now is used.
    The common case, one call of an nn.Linear whose a, δ and weight share a dtype, goes straight to its rule: there
    is nothing to merge or cast (streamed per-sample norms ask this for every Linear call of every step)."""
    if len(calls) == 1 and type(module) is nn.Linear:
        a, delta = calls[0].a, calls[0].delta
        if a is not None and delta is not None and a.is_floating_point() and a.dtype == delta.dtype \
                == module.weight.dtype:
            return [f for f in linear(module, a, delta) if getattr(module, f.param).requires_grad]
    spec = spec_for(module)
    if spec is None:
        raise ValueError(f"{type(module).__name__} is not supported: {unsupported_reason(module)}")
    per_call = [spec.rule(module, c.a, c.delta, state=getattr(c, "state", None)) for c in calls]
    merged = [_in_param_dtype(f, getattr(module, f.param).dtype) for f in merge_calls(per_call)]
    return [f for f in merged if getattr(module, f.param).requires_grad]


def merge_calls(per_call: list) -> list[Factor]:
    """Each parameter's factors of several calls (lists in the same parameter order) as one: tokens side by side."""
    merged = []
    for parts in zip(*per_call):
        f = parts[0]
        if len(parts) > 1:
            D = torch.cat([p.D for p in parts], 1)
            X = None if f._X is None else torch.cat([p._X for p in parts], 1)
            conv = None if f.conv is None else ConvCalls([p.conv for p in parts])
            per_sample = "contribution" if any(p.per_sample == "contribution" for p in parts) else f.per_sample
            if f.back is not None and not all(f.back.same(p.back) for p in parts[1:]):
                raise ValueError(f"{f.param}: a weight-standardised convolution called with different weights: "
                                 "its calls' gradients cannot be merged")
            f = Factor(f.param, f.kind, D, X, f.shape, f.rows, conv=conv, per_sample=per_sample, back=f.back)
        merged.append(f)
    return merged


def unfolded(call, B: int):
    """A token layer's call as its B samples saw it where they were folded sample-major into its rows ((B, T, d)
    viewed as (B·T, d)): a copy with a and δ (n, ...) as (B, n/B, ...); None where its rows are not B equal groups."""
    a, d = call.a, call.delta
    if a is None or d is None or not a.dim() or a.shape[0] % B or d.shape[:1] != a.shape[:1]:
        return None
    out = copy.copy(call)
    out.a, out.delta = a.reshape(B, -1, *a.shape[1:]), d.reshape(B, -1, *d.shape[1:])
    return out


def grouped_rows(fs: list[Factor], B: int) -> list[Factor]:
    """Factors of rows that are samples folded sample-major, as factors of the B samples: a token sum over each
    sample's n/B rows (D (n, T, o) -> (B, n/B·T, o), X alike). ValueError for a factor that is not a token sum."""
    out = []
    for f in fs:
        if f.kind not in ("outer", "onehot", "diag", "sum") or f.conv is not None or f.D.shape[0] % B:
            raise ValueError(f"{f.param}: rows folded from the batch cannot be grouped for a {f.kind} factor")
        X = f.X
        out.append(Factor(f.param, f.kind, f.D.reshape(B, -1, *f.D.shape[2:]),
                          None if X is None else X.reshape(B, -1, *X.shape[2:]), f.shape, f.rows,
                          per_sample=f.per_sample))
    return out


def _in_param_dtype(f: Factor, dtype: torch.dtype) -> Factor:
    """Under autocast a and δ differ in dtype (float32 input, bfloat16 output gradient);
    .grad has the parameter's dtype, so the factors are brought to it."""
    if not dtype.is_floating_point:
        return f
    if f.D.dtype != dtype and f.D.is_floating_point():
        f.D = f.D.to(dtype)
    if f._X is not None and f._X.is_floating_point() and f._X.dtype != dtype:
        f.X = f._X.to(dtype)
    if f.conv is not None:
        f.conv.to(dtype)
    return f


def summed_grad(f: Factor) -> torch.Tensor:
    """The parameter's .grad rebuilt from its factors."""
    return KINDS[f.kind].summed(f).reshape(f.shape)


def per_sample_grad(f: Factor) -> torch.Tensor:
    """(B, *shape): each sample's contribution to the parameter's .grad."""
    return KINDS[f.kind].per_sample(f).reshape(f.D.shape[0], *f.shape)


def per_sample_norm_sq(f: Factor, x_gram: Callable | None = None, method: str | None = None) -> torch.Tensor:
    """(B,) squared norms of per-sample gradients, by the cheaper exact method (layers/cost.py chooses from the
    shapes; method 'ghost' or 'grad' forces one). `x_gram(X)` may supply X Xᵀ (layers reading the same input,
    like q, k and v, share it)."""
    norm = KINDS[f.kind].norm_sq
    if norm is not None and (method or cost.method(f)) == "ghost":
        return norm(f, x_gram)
    return sq_norms(per_sample_grad(f))


def shared_norm_sq(fs: list[Factor], method: str | None = None) -> torch.Tensor:
    """(B,) squared per-sample norms of one parameter from several contributions (tied weights, a layer called
    twice in separate passes over the same samples): their ghost norms and cross terms, or their summed
    per-sample gradient, whichever layers/cost.py finds cheaper (see layers/shared.py)."""
    if len(fs) == 1 and not isinstance(fs[0], shared.HeadPart):
        return per_sample_norm_sq(fs[0], method=method)
    return shared.shared_norm_sq(fs, method)


def per_sample_norm_sq_with_bias(w: Factor, b: Factor, x_gram: Callable | None = None) -> torch.Tensor | None:
    """(B,) squared per-sample norms of a weight and its bias together, or None where the Gram
    form does not apply (Linear's norm shortcut, see layers/linear.py)."""
    return linear_norm_sq([w, b], x_gram)


def layer_norm_sq(module: nn.Module, fs: list[Factor], x_gram: Callable | None = None) -> torch.Tensor:
    """(B,) squared per-sample norms over the given factors of one layer: the spec's shortcut where it
    has one, the cheapest exact form per factor otherwise."""
    spec = spec_for(module)
    both = spec.norm_sq(fs, x_gram) if spec is not None and spec.norm_sq is not None else None
    if both is not None:
        return both
    return sum(per_sample_norm_sq(f, x_gram if f.kind == "outer" else None) for f in fs)


def storage(module: nn.Module, tokens: int) -> dict:
    """Seed 003's storage figures: floats in W.grad vs the factors that determine it."""
    w = module.weight
    d_out, d_in = w.shape[0], w[0].numel()
    return {
        "weight_shape": tuple(w.shape),
        "weight_grad_floats": w.numel(),
        "factor_floats_per_token": d_in + d_out,
        "tokens": tokens,
        "factor_floats": (d_in + d_out) * tokens,
        "per_token_grad_floats": w.numel() * tokens,
    }
