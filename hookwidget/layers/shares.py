"""Each sample's and each position's part of a step's gradient, per factor: ⟨G_b, G⟩ and ⟨G_{b,t}, G⟩.

Why: ‖G‖² = Σ_b ⟨G_b, G⟩ for G = Σ_b G_b, so s_b = ⟨G_b, G⟩ / ‖G‖² says exactly, and additively, how much of
the step each sample carried (negative where it pulled against it). A layer applied per position t has
G_b = Σ_t δ_t a_tᵀ, so a position's part is δ_tᵀ G a_t: the output the layer would give with G as its weight,
dotted with δ_t. That costs one product with G (the .grad the step recorded; about what W.grad costs), and no
per-sample gradient is built.
The Gram form Σ_{t'} (δ_t·δ_t')(a_t·a_t') over every token t' of the step needs no G but N² pairs for N tokens:
layers/share_gram.py, and it says when it is the cheaper (as layers/cost.py does for the norms).

Per kind (base.KINDS), with G shaped as the parameter:
    outer    rowwise((D G) · X)       a convolution: (conv(a; weight = G) · δ) summed over channels, per position
    onehot   rowwise(D · G[idx])      an embedding's row idx_t gets δ_t
    diag     (D ⊙ X) G                 a norm's weight, per position
    sum      D G                       a bias
    conv     as outer (grouped, transposed, 3-d convolutions: the convolution op takes them all)
    mapped, dense: no per-position form: ⟨per-sample gradient, G⟩ per sample only.
A parameter several layers share (a tied embedding and head) needs no cross terms: ⟨Σ_i G_b,i, G⟩ = Σ_i ⟨G_b,i, G⟩.
"""

from __future__ import annotations

import torch

from hookwidget.layers.base import KINDS, ConvCall, ConvCalls, Factor, batch_dot

POSITIONAL = ("outer", "onehot", "diag", "sum", "conv")


def position_dots(f: Factor, G: torch.Tensor) -> torch.Tensor | None:
    """(B, T) ⟨G_{b,t}, G⟩ of each sample b and position (token) t of factor f, G the parameter's whole gradient;
    None for a kind without a per-position form (sample_dots then)."""
    if f.kind not in POSITIONAL or (f.kind != "conv" and f.D.dim() != 3):
        return None
    if f.kind in ("outer", "conv") and f.conv is not None and f._X is None:
        return _conv_dots(f.conv, G.reshape(f.shape))
    D = f.D
    if f.kind == "outer":
        # δ_tᵀ G a_t, multiplied in the order with the narrower product (the same multiply-adds, N·o·i, either
        # way): the output this layer gives its inputs with weight G dotted with δ, (B, T, o) · ((B, T, i) Gᵀ),
        # or G's transpose applied to δ dotted with the input, ((B, T, o) G) · (B, T, i). An LM head of
        # 50257 × 768 writes 768 floats a token instead of 50257 (512 tokens, 2 CPU cores: 0.21 s against 0.37 s).
        G = G.reshape(D.shape[-1], -1)
        if G.shape[0] > G.shape[1]:
            return torch.linalg.vecdot(torch.matmul(D, G), f.X)
        return torch.linalg.vecdot(D, torch.matmul(f.X, G.T))
    if f.kind == "onehot":
        return torch.linalg.vecdot(D, G.reshape(f.rows, -1)[f.X.long()])
    if f.kind == "diag":
        return torch.matmul(D * f.X, G.reshape(-1))
    return torch.matmul(D, G.reshape(-1))  # sum


def sample_dots(f: Factor, G: torch.Tensor) -> torch.Tensor:
    """(B,) ⟨G_b, G⟩ of each sample of factor f: its positions' sum where it has them, else from its per-sample
    gradients (the generic rule's, a mapped convolution's)."""
    pos = position_dots(f, G)
    if pos is not None:
        return pos.sum(1)
    per_sample = KINDS[f.kind].per_sample(f)
    return batch_dot(per_sample, G.reshape(1, -1).expand(per_sample.shape[0], -1))


def _conv_dots(conv: ConvCall | ConvCalls, G: torch.Tensor) -> torch.Tensor:
    """(B, L) for a convolution: its output is linear in the weight, so ⟨G_{b,l}, G⟩ = Σ_o δ_{b,o,l} y_{b,o,l}
    with y the convolution of its input with weight G (every position l of every call, calls side by side)."""
    calls = conv.calls if isinstance(conv, ConvCalls) else [conv]
    out = []
    for c in calls:
        y = torch.ops.aten.convolution(c.a, G.to(c.a.dtype), None, list(c.stride), list(c.padding),
                                       list(c.dilation), c.transposed, c._output_padding(), c.groups)
        B, o = c.delta.shape[:2]
        out.append(torch.linalg.vecdot(c.delta.reshape(B, o, -1), y.reshape(B, o, -1), dim=1))
    return torch.cat(out, 1)


def position_sq_norms(f: Factor) -> torch.Tensor | None:
    """(B, T) ‖G_{b,t}‖² of factor f: each position's gradient is one outer product, ‖δ_t‖²·‖a_t‖² (a bias's
    ‖δ_t‖², an embedding row's ‖δ_t‖², a norm weight's ‖δ_t ⊙ x̂_t‖²); None where there is no such form (a
    grouped, transposed or 3-d convolution: its input patches are not unfolded; mapped and dense kinds)."""
    if f.kind not in ("outer", "onehot", "diag", "sum") or f.D.dim() != 3:
        return None
    d2 = f.D.square().sum(-1)
    if f.kind == "outer":
        return d2 * f.X.square().sum(-1)
    if f.kind == "diag":
        return (f.D * f.X).square().sum(-1)
    return d2
