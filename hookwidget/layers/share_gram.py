"""The Gram form of each position's part ⟨G_{b,t}, G⟩ of a step's gradient, where it is cheaper than the product
with G (layers/shares.py): no G at all, only products between the step's N tokens.

Why: with G = Σ_{t'} G_{t'} over every token t' of the step (every sample, every contribution to the parameter),
⟨G_t, G⟩ = Σ_{t'} ⟨G_t, G_{t'}⟩, and for one-token gradients that are outer products each ⟨G_t, G_{t'}⟩ is a product
of two dot products. Each contribution is written as L_t R_tᵀ, the (rows × width) weight's gradient of token t:
    outer    L_t = δ_t (rows = d_out),   R_t = a_t (width = d_in)        a Linear, a tied LM head
    onehot   L_t = e_{idx_t} (one-hot),  R_t = δ_t (width = d)           an embedding: row idx_t gets δ_t
so ⟨G_t, G_{t'}⟩ = (L_t·L_{t'})(R_t·R_{t'}), where L_t·L_{t'} is δ_t·δ_{t'} (outer, outer), δ_t[idx_{t'}] (outer,
onehot) or [idx_t = idx_{t'}] (onehot, onehot). GPT-2's tied head and token embedding share a 50257 × 768 weight:
its product with G costs N·50257·768 multiply-adds; the Gram form about N²·50257/2.

The N × N matrix P[t, t'] = ⟨G_t, G_{t'}⟩ is symmetric and only its row sums are wanted: each block on or above
the diagonal is computed once and gives its row sums to its rows and its column sums to its columns (the blocks
below are their transposes), about half the multiply-adds of the whole products, one block × block in memory.
Rounding: each entry of P is a dot product in the factors' dtype (the usual bound, |error| ≤ γ_w Σ |terms| for
w = rows or width); the blocks' sums are added in float64 (float32 on MPS).
"""

from __future__ import annotations

import torch

from hookwidget.layers import cost

# tokens a side of one block: GPT-2's 4 × 128 tokens make 2 × 2 blocks, 3 computed (1 thread: 1.6 s of CPU to open
# the panel against 1.8 s for the whole products; blocks of 128, 10 of 16 computed, save little more and make over
# three times the calls, each a wait for both threads on a loaded 2-core machine)
BLOCK = 256


def applies(fs: list) -> bool:
    """Whether the Gram form exists for one parameter's contributions: each a plain outer factor with its input at
    hand (a convolution's would be unfolded) or an embedding's one-hot one, all of one (rows, width) weight."""
    dims = {_dims(f) for f in fs}
    return bool(fs) and None not in dims and len(dims) == 1


def cheaper(fs: list, block: int | None = None) -> bool:
    """Whether the Gram form costs less than the product with G, in multiply-adds: per pair of tokens the left
    product (rows wide between two outer tokens, a lookup otherwise), the right (width wide) and a pass over
    their product (cost.MEMORY), over the blocks computed; against one product of G per token (rows × width for
    an outer token, a row of G for a one-hot one)."""
    if not applies(fs):
        return False
    rows, width = _dims(fs[0])
    block = block or BLOCK
    n = {"outer": 0, "onehot": 0}
    for f in fs:
        n[f.kind] += _tokens(f)
    half = {kind: _half(m, block) for kind, m in n.items()}
    gram = half["outer"] * (rows + width + cost.MEMORY) + (half["onehot"] + n["outer"] * n["onehot"]) * (
        1 + width + cost.MEMORY)
    product = n["outer"] * rows * width + n["onehot"] * width
    return gram < product


def position_dots(fs: list, block: int | None = None) -> list[torch.Tensor]:
    """Per factor of `fs` (applies(fs): one parameter's contributions, any steps), (B, T) ⟨G_{b,t}, G⟩ with G the
    sum of all their tokens' gradients, by Σ_{t'} (L_t·L_{t'})(R_t·R_{t'}) over the blocks on and above the
    diagonal (`block` tokens a side, default BLOCK)."""
    block = block or BLOCK
    outer = [f for f in fs if f.kind == "outer"]
    onehot = [f for f in fs if f.kind == "onehot"]
    D = _flat([f.D for f in outer])  # outer: L = δ (n_o, rows), R = a (n_o, width)
    A = _flat([f.X for f in outer])
    E = _flat([f.D for f in onehot])  # onehot: R = δ (n_e, width), L one-hot at idx (n_e,)
    idx = torch.cat([f.X.reshape(-1) for f in onehot]).long() if onehot else None
    some = fs[0].D
    acc = some.dtype if some.device.type == "mps" else torch.float64
    row_o = some.new_zeros(0 if D is None else D.shape[0], dtype=acc)
    row_e = some.new_zeros(0 if E is None else E.shape[0], dtype=acc)
    if D is not None:
        _symmetric(row_o, lambda i, j: torch.matmul(D[i], D[j].T).mul_(torch.matmul(A[i], A[j].T)), block)
    if E is not None:
        _symmetric(row_e, lambda i, j: torch.matmul(E[i], E[j].T).mul_(idx[i, None] == idx[None, j]), block)
    if D is not None and E is not None:
        for i in _blocks(D.shape[0], block):
            for j in _blocks(E.shape[0], block):
                P = D[i].index_select(1, idx[j]).mul_(torch.matmul(A[i], E[j].T))  # δ_t[idx_t'] (a_t·δ_t')
                row_o[i] += P.sum(1)
                row_e[j] += P.sum(0)
    out, seen = [], {"outer": 0, "onehot": 0}
    for f in fs:  # back to each factor's (B, T), in the order given
        rows = row_o if f.kind == "outer" else row_e
        m = _tokens(f)
        out.append(rows[seen[f.kind]:seen[f.kind] + m].reshape(f.D.shape[0], f.D.shape[1]))
        seen[f.kind] += m
    return out


def _symmetric(rows: torch.Tensor, block_of, block: int) -> None:
    """rows += the row sums of the symmetric matrix whose block (i, j) is block_of(i, j), from the blocks on and
    above the diagonal."""
    n = rows.shape[0]
    for i in _blocks(n, block):
        for j in _blocks(n, block, start=i.start):
            P = block_of(i, j)
            rows[i] += P.sum(1)
            if j.start > i.start:
                rows[j] += P.sum(0)


def _blocks(n: int, block: int, start: int = 0) -> list[slice]:
    return [slice(s, min(s + block, n)) for s in range(start, n, block)]


def _half(n: int, block: int) -> float:
    """The pairs of n tokens in the blocks on and above the diagonal."""
    k = max(1, -(-n // block))
    return n * n * (k + 1) / (2 * k)


def _flat(ts: list) -> torch.Tensor | None:
    """The tokens of `ts` as rows, a view where there is one (a tied head's δ is 100 MB: not copied)."""
    if len(ts) == 1:
        return ts[0].reshape(-1, ts[0].shape[-1])
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in ts]) if ts else None


def _tokens(f) -> int:
    return f.D.shape[0] * f.D.shape[1]


def _dims(f) -> tuple[int, int] | None:
    """(rows, width) of the weight a Gram-form factor writes, or None where it has no Gram form."""
    if f.D.dim() != 3:
        return None
    if f.kind == "outer" and f.conv is None and f._X is not None and f._X.dim() == 3:
        return f.D.shape[-1], f.X.shape[-1]
    if f.kind == "onehot" and f._X is not None and f._X.dim() == 2 and not f._X.is_floating_point() and f.rows:
        return f.rows, f.D.shape[-1]
    return None
