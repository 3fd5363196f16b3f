"""The (a, δ) factors: per layer type, how activations and output gradients make W.grad.

Each supported layer type is one registered rule that turns a call's (a, δ) into
per-parameter *token factors*: per sample b, the parameter's gradient is a sum over
tokens t of a small product of δ_bt with something built from a_bt. From those,
generic code gives the summed gradient (W.grad), per-sample gradients, and per-sample
gradient norms without materialising them where the Gram ("ghost") form is cheaper:
‖Σ_t δ_t a_tᵀ‖² = Σ_{t,t'} (a_t·a_t')(δ_t·δ_t') (Li et al. 2022).

Per-sample gradients are each sample's contribution to .grad (they sum to W.grad). With a
mean-reduced loss each carries the 1/B factor: pass loss_reduction="mean" to undo it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

RULES: dict[type, Callable] = {}


@dataclass
class Factor:
    """Token factors of one parameter. kind: outer (D, A), onehot (D, index), diag (D, X), sum (D)."""

    param: str
    kind: str
    D: torch.Tensor  # (B, T, o)
    X: torch.Tensor | None  # (B, T, i) for outer/diag, (B, T) indices for onehot
    shape: tuple
    rows: int = 0  # onehot: number of embeddings


def register(*types: type):
    """Decorator: `fn(module, a, delta) -> list[Factor]` becomes the rule for these layer types."""

    def deco(fn):
        for t in types:
            RULES[t] = fn
        return fn

    return deco


def rule_for(module: nn.Module):
    for cls in type(module).__mro__:
        if cls in RULES:
            return RULES[cls]
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why (a, δ) cannot rebuild this module's gradients, or None when it can."""
    if rule_for(module) is None:
        return f"no factor rule for {type(module).__name__}"
    if isinstance(module, nn.modules.conv._ConvNd):
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            return "convolution with groups, non-zero padding_mode or string padding"
    if isinstance(module, nn.Embedding) and (module.scale_grad_by_freq or module.sparse):
        return "Embedding with scale_grad_by_freq or sparse gradients"
    return None


# -- rules -------------------------------------------------------------------------------------
@register(nn.Linear)
def _linear(m: nn.Linear, a, delta):
    B = a.shape[0]
    A, D = a.reshape(B, -1, a.shape[-1]), delta.reshape(B, -1, delta.shape[-1])
    out = [Factor("weight", "outer", D, A, tuple(m.weight.shape))]
    if m.bias is not None:
        out.append(Factor("bias", "sum", D, None, tuple(m.bias.shape)))
    return out


@register(nn.Conv1d, nn.Conv2d)
def _conv(m, a, delta):
    B = a.shape[0]
    if isinstance(m, nn.Conv1d):
        a, delta = a.unsqueeze(-2), delta.unsqueeze(-2)
        k, d, p, s = (1, *m.kernel_size), (1, *m.dilation), (0, *m.padding), (1, *m.stride)
    else:
        k, d, p, s = m.kernel_size, m.dilation, m.padding, m.stride
    A = F.unfold(a, k, dilation=d, padding=p, stride=s).transpose(1, 2)  # (B, L, Cin*k)
    D = delta.reshape(B, delta.shape[1], -1).transpose(1, 2)  # (B, L, Cout)
    out = [Factor("weight", "outer", D, A, tuple(m.weight.shape))]
    if m.bias is not None:
        out.append(Factor("bias", "sum", D, None, tuple(m.bias.shape)))
    return out


@register(nn.Embedding)
def _embedding(m: nn.Embedding, idx, delta):
    B = idx.shape[0]
    idx, D = idx.reshape(B, -1), delta.reshape(B, -1, delta.shape[-1])
    if m.padding_idx is not None:
        D = D * (idx != m.padding_idx).unsqueeze(-1).to(D.dtype)
    return [Factor("weight", "onehot", D, idx, tuple(m.weight.shape), rows=m.num_embeddings)]


@register(nn.LayerNorm)
def _layer_norm(m: nn.LayerNorm, a, delta):
    if not m.elementwise_affine:
        return []
    dims = tuple(range(-len(m.normalized_shape), 0))
    mean = a.mean(dims, keepdim=True)
    var = a.var(dims, unbiased=False, keepdim=True)
    xhat = (a - mean) * torch.rsqrt(var + m.eps)
    B, n = a.shape[0], m.weight.numel()
    X, D = xhat.reshape(B, -1, n), delta.reshape(B, -1, n)
    out = [Factor("weight", "diag", D, X, tuple(m.weight.shape))]
    if m.bias is not None:
        out.append(Factor("bias", "sum", D, None, tuple(m.bias.shape)))
    return out


# -- generic mathematics -----------------------------------------------------------------------
def factors(module: nn.Module, calls: list) -> list[Factor]:
    """Token factors of every parameter of `module`, all calls concatenated along tokens."""
    reason = unsupported_reason(module)
    if reason:
        raise ValueError(f"{type(module).__name__} is not supported: {reason}")
    rule = rule_for(module)
    per_call = [rule(module, c.a, c.delta) for c in calls]
    merged = []
    for parts in zip(*per_call):
        f = parts[0]
        if len(parts) > 1:
            D = torch.cat([p.D for p in parts], 1)
            X = None if f.X is None else torch.cat([p.X for p in parts], 1)
            f = Factor(f.param, f.kind, D, X, f.shape, f.rows)
        merged.append(_in_param_dtype(f, getattr(module, f.param).dtype))
    return [f for f in merged if getattr(module, f.param).requires_grad]


def _in_param_dtype(f: Factor, dtype: torch.dtype) -> Factor:
    """Under autocast a and δ differ in dtype (float32 input, bfloat16 output gradient);
    .grad has the parameter's dtype, so the factors are brought to it."""
    if f.D.dtype != dtype and f.D.is_floating_point() and dtype.is_floating_point:
        f.D = f.D.to(dtype)
    if f.X is not None and f.X.is_floating_point() and f.X.dtype != dtype and dtype.is_floating_point:
        f.X = f.X.to(dtype)
    return f


def summed_grad(f: Factor) -> torch.Tensor:
    """The parameter's .grad rebuilt from its factors."""
    if f.kind == "outer":
        g = torch.einsum("bto,bti->oi", f.D, f.X)
    elif f.kind == "onehot":
        g = torch.zeros(f.rows, f.D.shape[-1], dtype=f.D.dtype, device=f.D.device)
        g.index_add_(0, f.X.reshape(-1), f.D.reshape(-1, f.D.shape[-1]))
    elif f.kind == "diag":
        g = (f.D * f.X).sum((0, 1))
    else:
        g = f.D.sum((0, 1))
    return g.reshape(f.shape)


def per_sample_grad(f: Factor) -> torch.Tensor:
    """(B, *shape): each sample's contribution to the parameter's .grad."""
    B = f.D.shape[0]
    if f.kind == "outer":
        g = torch.einsum("bto,bti->boi", f.D, f.X)
    elif f.kind == "onehot":
        g = torch.zeros(B, f.rows, f.D.shape[-1], dtype=f.D.dtype, device=f.D.device)
        g.scatter_add_(1, f.X.unsqueeze(-1).expand_as(f.D), f.D)
    elif f.kind == "diag":
        g = (f.D * f.X).sum(1)
    else:
        g = f.D.sum(1)
    return g.reshape(B, *f.shape)


def per_sample_norm_sq(f: Factor) -> torch.Tensor:
    """(B,) squared norms of per-sample gradients, by the cheaper exact method."""
    T = f.D.shape[1]
    if f.kind == "outer" and T * T < f.D.shape[-1] * f.X.shape[-1]:
        return (torch.bmm(f.X, f.X.transpose(1, 2)) * torch.bmm(f.D, f.D.transpose(1, 2))).sum((1, 2))
    if f.kind == "onehot" and T * T < f.rows * f.D.shape[-1]:
        same = (f.X.unsqueeze(2) == f.X.unsqueeze(1)).to(f.D.dtype)
        return (same * torch.bmm(f.D, f.D.transpose(1, 2))).sum((1, 2))
    return per_sample_grad(f).flatten(1).pow(2).sum(1)


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


def outer_as_kron(delta: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """vec(δ aᵀ), flattened column by column, is the Kronecker product a ⊗ δ (seed 003)."""
    return torch.outer(delta, a).T.reshape(-1)
