"""nn.Embedding: row idx_t of W.grad gets δ_t (padding_idx rows get nothing).

With scale_grad_by_freq, backward divides δ_t by how often idx_t occurs in the whole call's input, so samples
share a statistic (as BatchNorm on batch statistics does): a row is the sample's *contribution* to .grad
(its δ_t over the batch's counts; the rows still sum to .grad exactly), not the gradient of its loss alone."""

from __future__ import annotations

import torch
from torch import nn

from hookwidget.layers.base import Factor
from hookwidget.layers.registry import register


def _refuse(m: nn.Embedding) -> str | None:
    if m.sparse:
        return "Embedding(sparse=True): .grad is a sparse tensor"
    return None


def _per_sample(m: nn.Embedding, state=None) -> str:
    return "contribution" if m.scale_grad_by_freq else "exact"


@register(nn.Embedding, refuse=_refuse, params=("weight",), tokens=True, per_sample=_per_sample)
def embedding(m: nn.Embedding, idx, delta, state=None):
    B = idx.shape[0]
    idx, D = idx.reshape(B, -1), delta.reshape(B, -1, delta.shape[-1])
    if m.padding_idx is not None:
        D = D * (idx != m.padding_idx).unsqueeze(-1).to(D.dtype)
    if m.scale_grad_by_freq:
        counts = torch.bincount(idx.reshape(-1), minlength=m.num_embeddings)
        D = D / counts[idx].unsqueeze(-1).to(D.dtype)
        return [Factor("weight", "onehot", D, idx, tuple(m.weight.shape), rows=m.num_embeddings,
                       per_sample="contribution")]
    return [Factor("weight", "onehot", D, idx, tuple(m.weight.shape), rows=m.num_embeddings)]
