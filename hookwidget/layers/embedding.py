"""nn.Embedding: row idx_t of W.grad gets δ_t (padding_idx rows get nothing)."""

from __future__ import annotations

from torch import nn

from .base import Factor
from .registry import register


def _refuse(m: nn.Embedding) -> str | None:
    if m.scale_grad_by_freq:
        return ("Embedding(scale_grad_by_freq=True): .grad divides each row by its count in the whole batch, "
                "which no sample's (a, δ) holds")
    if m.sparse:
        return "Embedding(sparse=True): .grad is a sparse tensor"
    return None


@register(nn.Embedding, refuse=_refuse, params=("weight",), tokens=True)
def embedding(m: nn.Embedding, idx, delta, state=None):
    B = idx.shape[0]
    idx, D = idx.reshape(B, -1), delta.reshape(B, -1, delta.shape[-1])
    if m.padding_idx is not None:
        D = D * (idx != m.padding_idx).unsqueeze(-1).to(D.dtype)
    return [Factor("weight", "onehot", D, idx, tuple(m.weight.shape), rows=m.num_embeddings)]
