"""The Gram form of position shares (layers/share_gram.py) against per-token gradients built by plain float64
loops: ⟨G_t, G⟩ with G_t = δ_t a_tᵀ (a Linear's token) or δ_t in row idx_t (an embedding's), G their sum. Blocks
smaller than the tokens (ragged ones too) run the symmetric path: a block below the diagonal dropped, or the cross
term between a tied head and its embedding dropped, fails here."""

import pytest
import torch

from hookwidget.layers import share_gram
from hookwidget.layers.base import Factor

pytestmark = pytest.mark.usefixtures("float64_default")

ROWS, WIDTH = 11, 5


def outer(B, T):
    D, X = torch.randn(B, T, ROWS), torch.randn(B, T, WIDTH)
    return Factor("weight", "outer", D, X, (ROWS, WIDTH))


def onehot(B, T, idx=None):
    idx = torch.randint(0, ROWS, (B, T)) if idx is None else idx
    return Factor("weight", "onehot", torch.randn(B, T, WIDTH), idx, (ROWS, WIDTH), rows=ROWS)


def token_grads(f) -> list[torch.Tensor]:
    """Each token's (ROWS, WIDTH) gradient, by a loop over the tokens."""
    out = []
    for b in range(f.D.shape[0]):
        for t in range(f.D.shape[1]):
            if f.kind == "outer":
                out.append(torch.outer(f.D[b, t], f.X[b, t]))
            else:
                g = torch.zeros(ROWS, WIDTH)
                g[int(f.X[b, t])] += f.D[b, t]
                out.append(g)
    return out


def reference(fs: list) -> list[torch.Tensor]:
    per_factor = [token_grads(f) for f in fs]
    G = sum(g for gs in per_factor for g in gs)
    return [torch.stack([(g * G).sum() for g in gs]).reshape(f.D.shape[:2]) for f, gs in zip(fs, per_factor)]


@pytest.mark.parametrize("block", [1, 3, 4, 128])
def test_gram_dots_match_per_token_loops(block):
    torch.manual_seed(0)
    idx = torch.randint(0, ROWS, (2, 6))
    idx[0, 4] = idx[0, 1]  # a token twice in a sample
    idx[1, 0] = idx[0, 2]  # and in two samples
    cases = {"two outer calls (two steps of a layer)": [outer(2, 5), outer(3, 4)],
             "a tied head and its embedding": [outer(2, 6), onehot(2, 6, idx)],
             "an embedding alone, twice": [onehot(2, 6, idx), onehot(1, 3)],
             "head, embedding, head": [outer(2, 3), onehot(2, 6, idx), outer(1, 7)]}
    for what, fs in cases.items():
        got = share_gram.position_dots(fs, block)
        for g, want in zip(got, reference(fs)):
            assert g.shape == want.shape, what
            torch.testing.assert_close(g.to(want.dtype), want, rtol=1e-12, atol=1e-12, msg=what)


def test_the_form_applies_only_to_one_weights_outer_and_onehot_factors():
    assert share_gram.applies([outer(2, 3), onehot(2, 3)])
    other = Factor("weight", "outer", torch.randn(2, 3, WIDTH), torch.randn(2, 3, ROWS), (WIDTH, ROWS))
    assert not share_gram.applies([outer(2, 3), other])  # a transposed tie: not one weight's rows
    diag = Factor("weight", "diag", torch.randn(2, 3, WIDTH), torch.randn(2, 3, WIDTH), (WIDTH,))
    assert not share_gram.applies([diag]) and not share_gram.applies([])


def test_cheaper_counts_multiply_adds():
    # an embedding alone: its product with G is one row of G a token, never more than the token pairs
    assert not share_gram.cheaper([onehot(4, 128)])
    # a wide weight against few tokens (GPT-2's tied head on 4 x 128 tokens: 50257 x 768)
    head = Factor("weight", "outer", torch.empty(4, 128, 50257, device="meta"), torch.empty(4, 128, 768, device="meta"),
                  (50257, 768))
    emb = Factor("weight", "onehot", torch.empty(4, 128, 768, device="meta"),
                 torch.empty(4, 128, dtype=torch.long, device="meta"), (50257, 768), rows=50257)
    assert share_gram.cheaper([head, emb])
    # a narrow weight against many tokens: the product
    many = Factor("weight", "outer", torch.empty(64, 512, 64, device="meta"), torch.empty(64, 512, 64, device="meta"),
                  (64, 64))
    assert not share_gram.cheaper([many])
