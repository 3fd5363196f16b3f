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
from hookwidget.layers.base import KINDS, Factor, batch_dot, sq_norms


class HeadPart:
    """An LM head's contribution (kind outer, δ (B, T_h, V)) to the weight it shares with a token embedding, reduced
    as it arrives to what the ghost form needs of it: its own ghost norm, its input X (B, T_h, d) and its δ at the
    embedding's token ids idx (B, T_e), (B, T_h, T_e). The vocabulary-wide δ is let go then, not held until the
    embedding's δ arrives at the end of backward (GPT-2 small, batch 4 × 128 tokens: 103 MB)."""

    kind = "head_part"

    def __init__(self, f, idx: torch.Tensor):
        self.param, self.shape, self.idx, self.X = f.param, f.shape, idx, f.X
        self.batch = f.D.shape[0]
        self.sq = KINDS["outer"].norm_sq(f)
        self.at_idx = _at_ids(f.D, idx)

    @staticmethod
    def worth(f, idx: torch.Tensor, rows: int) -> bool:
        """Whether the ghost form is the cheaper for the head `f` and an embedding looking up `idx` (cost.py)."""
        d = f.X.shape[-1]
        lookup = Factor(f.param, "onehot", torch.empty((idx.shape[0], idx.shape[1], d), device="meta"), idx,
                        f.shape, rows=rows)
        return cost.ghost_form([f]) and cost.shared_method([f, lookup]) == "ghost"


def head_part(f, lookup, ids: torch.Tensor) -> HeadPart | None:
    """`f` reduced to a HeadPart where it is an LM head's contribution (kind outer, δ over the vocabulary) to the
    weight it shares with the token embedding `lookup`, whose one call this step read `ids` and has no δ yet, and
    the ghost form is the cheaper; else None (the callers find that call: capture/norms.py, sample_stats.py)."""
    if ids.is_floating_point() or ids.dim() == 0 or f.kind != "outer" or f.conv is not None or f.D.dim() != 3:
        return None
    idx = ids.reshape(ids.shape[0], -1)
    rows = lookup.num_embeddings
    if idx.shape[0] != f.D.shape[0] or f.D.shape[-1] != rows or not HeadPart.worth(f, idx, rows):
        return None
    return HeadPart(f, idx)


def batch_of(f) -> int:
    """The number of samples of a contribution (a Factor, or a HeadPart)."""
    return f.batch if isinstance(f, HeadPart) else f.D.shape[0]


def shared_norm_sq(fs: list, method: str | None = None) -> torch.Tensor:
    """(B,) squared per-sample norms of the sum of the contributions `fs` (factors of one parameter, same
    samples). method: 'ghost' or 'grad' to force one (tests), else the cheaper by cost.shared_method. A HeadPart
    pairs with the one embedding factor whose ids it was reduced at (else ValueError: the head's δ is gone), or
    stands alone where the embedding got no δ."""
    head = next((f for f in fs if isinstance(f, HeadPart)), None)
    if head is not None and len(fs) == 1:  # the embedding added nothing (no δ reached it)
        return head.sq
    if head is not None:
        e = next((f for f in fs if f is not head), None)
        if len(fs) != 2 or e.kind != "onehot" or not torch.equal(e.X, head.idx):
            raise ValueError("the tied head's δ was reduced at other token ids than its embedding's")
        return head.sq + KINDS["onehot"].norm_sq(e) + 2 * _lookup_cross(e, head.X, head.at_idx)
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
    return _lookup_cross(e, h.X, _at_ids(h.D, e.X))


def _at_ids(D: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B, T_h, T_e): a head's δ ε_s (B, T_h, rows) at the embedding's ids idx_t (B, T_e), ε_s[idx_t]."""
    return torch.gather(D, 2, idx.long().unsqueeze(1).expand(-1, D.shape[1], -1))


def _lookup_cross(e, X: torch.Tensor, at_idx: torch.Tensor) -> torch.Tensor:
    """(B,) ⟨G_e, G_h⟩ of an embedding's factor e and a head with input X and δ at e's ids at_idx (_at_ids):
    Σ_{t,s} ε_s[idx_t] (δ_t · c_s)."""
    dots = torch.bmm(e.D, X.transpose(1, 2))  # (B, T_e, T_h): δ_t · c_s
    return batch_dot(dots, at_idx.transpose(1, 2))
