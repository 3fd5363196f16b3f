"""Linear layers: nn.Linear (y = x Wᵀ + b) and transformers' Conv1D (y = x W + b, W of shape (in, out))."""

from __future__ import annotations

import torch
from torch import nn

from hookwidget.layers.base import Factor, batch_dot, gram_applies
from hookwidget.layers.registry import register


def linear_norm_sq(fs: list, x_gram=None) -> torch.Tensor | None:
    """Weight and bias together from one Gram product, or None where that form does not apply. A bias
    is a weight whose input is 1, so with G_a = X Xᵀ and G_δ = D Dᵀ:
    ‖ΣΣ δ_t a_tᵀ‖² + ‖Σ δ_t‖² = Σ_{t,t'} (a_t·a_t' + 1)(δ_t·δ_t'), one product for both."""
    w = next((f for f in fs if f.param == "weight"), None)
    b = next((f for f in fs if f.param == "bias"), None)
    if w is None or b is None or not (w.kind == "outer" and b.kind == "sum" and b.D is w.D and gram_applies(w)):
        return None
    X = w.X
    # X Xᵀ + 1 in one kernel (baddbmm adds the ones as it writes), the product with D Dᵀ summed in another
    gx = x_gram(X) + 1 if x_gram is not None else torch.baddbmm(X.new_ones(()), X, X.transpose(1, 2))
    return batch_dot(gx, torch.bmm(w.D, w.D.transpose(1, 2)))


@register(nn.Linear, norm_sq=linear_norm_sq, tokens=True)
def linear(m: nn.Linear, a, delta, state=None):
    return _token_factors(m, a, delta, transposed=False)


@register("transformers.pytorch_utils.Conv1D", tokens=True)
def hf_conv1d(m, a, delta, state=None):
    """GPT-2's Conv1D: W.grad = Σ_t a_t δ_tᵀ, shape (in, out): an outer factor with the roles of a and δ
    swapped (so no transformers import is needed)."""
    return _token_factors(m, a, delta, transposed=True)


def _token_factors(m, a, delta, transposed: bool) -> list:
    """A dense layer's factors over tokens (every dim between the batch and the features): W.grad = Σ_t δ_t a_tᵀ
    (an (out, in) weight; (in, out) where `transposed`), bias.grad = Σ_t δ_t."""
    B = a.shape[0]
    A, D = a.reshape(B, -1, a.shape[-1]), delta.reshape(B, -1, delta.shape[-1])
    out = [Factor("weight", "outer", *((A, D) if transposed else (D, A)), tuple(m.weight.shape))]
    if m.bias is not None:
        out.append(Factor("bias", "sum", D, None, tuple(m.bias.shape)))
    return out
