"""Per-sample norms of a parameter several layers or calls contribute to (a tied embedding and LM head, a
shared encoder): ‖Σ_i G_i‖² = Σ_i ‖G_i‖² + 2 Σ_{i<j} ⟨G_i, G_j⟩, each term in ghost form, so the vocab × d
gradient is not built per sample where that is cheaper (cost.shared_method chooses). The cross terms:
    outer · outer    ⟨Σ_t δ_t a_tᵀ, Σ_s ε_s c_sᵀ⟩ = Σ_{t,s} (δ_t·ε_s)(a_t·c_s)
    onehot · outer   an embedding's row idx_t gets δ_t: Σ_{t,s} ε_s[idx_t] (δ_t·c_s)   (a sample's rows are its tokens)
    onehot · onehot  Σ_{t,s} [idx_t = jdx_s] (δ_t·ε_s)
"""

from __future__ import annotations

import torch

from hookwidget.layers import cost
from hookwidget.layers.base import KINDS, batch_dot, sq_norms


def shared_norm_sq(fs: list, method: str | None = None) -> torch.Tensor:
    """(B,) squared per-sample norms of the sum of the contributions `fs` (factors of one parameter, same
    samples). method: 'ghost' or 'grad' to force one (tests), else the cheaper by cost.shared_method."""
    if (method or cost.shared_method(fs)) == "grad" or not cost.ghost_form(fs):
        return sq_norms(sum(KINDS[f.kind].per_sample(f).flatten(1) for f in fs))
    sq = sum(KINDS[f.kind].norm_sq(f) for f in fs)
    for i in range(len(fs)):
        for j in range(i):
            sq = sq + 2 * cross(fs[i], fs[j])
    return sq


def cross(f, g) -> torch.Tensor:
    """(B,) ⟨G_f, G_g⟩ per sample for two ghost-form contributions to one parameter."""
    if f.kind == "outer" and g.kind == "outer":
        return batch_dot(torch.bmm(f.D, g.D.transpose(1, 2)), torch.bmm(f.X, g.X.transpose(1, 2)))
    if f.kind == "onehot" and g.kind == "onehot":
        same = (f.X.unsqueeze(2) == g.X.unsqueeze(1)).to(f.D.dtype)
        return batch_dot(same, torch.bmm(f.D, g.D.transpose(1, 2)))
    e, h = (f, g) if f.kind == "onehot" else (g, f)
    # h's weight is (rows, width): its δ indexes rows, its input the width the embedding's δ has
    dots = torch.bmm(e.D, h.X.transpose(1, 2))  # (B, T_e, T_h): δ_t · c_s
    at_idx = torch.gather(h.D, 2, e.X.long().unsqueeze(1).expand(-1, h.D.shape[1], -1))  # (B, T_h, T_e): ε_s[idx_t]
    return batch_dot(dots, at_idx.transpose(1, 2))
