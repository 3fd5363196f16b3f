"""hookwidget.capture.rows: proofs from the autograd graph, back to the model's input (the root), that a tensor's
rows hold the batch's samples sample-major.

Each case builds a tensor from a batch of B samples and asks the proof; where it says yes, the claim itself is
checked numerically: the Jacobian of the tensor with respect to the batch has no entry linking row r to any
sample but r // (n/B)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookwidget.capture import rows

B, P, N, C = 3, 4, 5, 6


def _mobilevit_unfold(x):
    """timm MobileViT's unfold: (B, C, H, W) -> (B·P, N, C), the P = 2×2 patch positions of a sample together."""
    b, c, h, w = x.shape
    t = x.reshape(b * c * (h // 2), 2, w // 2, 2).transpose(1, 2)
    return t.reshape(b, c, (h // 2) * (w // 2), 4).transpose(1, 3).reshape(b * 4, -1, c)


def _attention_block(h, qkv, proj, heads=2):
    """timm's Attention and a residual: reshape, permute, unbind, sdpa, transpose, reshape, Linear, add."""
    n, T, d = h.shape
    q, k, v = qkv(F.layer_norm(h, (d,))).reshape(n, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4).unbind(0)
    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, T, d)
    return h + proj(o)


def _samples_of_rows(y, x):
    """For each row of y, the set of samples of x its values depend on (from the Jacobian)."""
    J = torch.autograd.functional.jacobian(lambda inp: y(inp), x)  # (*y.shape, *x.shape)
    J = J.reshape(y(x).shape[0], -1, x.shape[0], x[0].numel()).abs().sum((1, 3))
    return [set(torch.nonzero(J[r]).flatten().tolist()) for r in range(J.shape[0])]


def _check(make, x, expect: bool):
    out = make(x)
    assert rows.sample_major(out.grad_fn, out.output_nr, x.shape[0], rows.of(x)) is expect
    if expect:  # the proof's claim, by the Jacobian: row r depends on sample r // (n/B) alone
        k = out.shape[0] // x.shape[0]
        for r, samples in enumerate(_samples_of_rows(make, x)):
            assert samples <= {r // k}, (r, samples)


def test_mobilevit_patches_through_attention_and_residuals_stay_sample_major():
    torch.manual_seed(0)
    qkv, proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
    x = torch.randn(B, C, 4, 4, requires_grad=True)

    def make(inp):
        h = _mobilevit_unfold(inp)
        h = _attention_block(h, qkv, proj)
        return h + F.gelu(proj(F.layer_norm(h, (C,))))

    _check(make, x, True)


@pytest.mark.parametrize("case", ["patch-major fold", "rows mixed by a matmul", "sum over rows", "dim 0 sliced",
                                  "softmax over rows", "rows transposed", "their sum added back"])
def test_rows_that_mix_or_reorder_samples_are_not_proven(case):
    torch.manual_seed(0)
    lin = nn.Linear(C, C)
    x = torch.randn(B, P, N, C, requires_grad=True)
    make = {
        "patch-major fold": lambda inp: lin(inp.transpose(0, 1).reshape(P * B, N, C)),
        "rows mixed by a matmul": lambda inp: (lambda h: h.transpose(0, 2) @ h.transpose(0, 2).transpose(1, 2))(
            inp.reshape(B * P, N, C)),
        "sum over rows": lambda inp: inp.reshape(B * P, N, C).sum(0, keepdim=True).expand(B * P, N, C) * 1,
        "dim 0 sliced": lambda inp: torch.cat([inp.reshape(B * P, N, C)[1:], inp.reshape(B * P, N, C)[:1]]),
        "softmax over rows": lambda inp: inp.reshape(B * P, N, C).softmax(0),
        "rows transposed": lambda inp: lin(inp.reshape(B * P, N, C).transpose(0, 1).reshape(B * P, N, C)),
        "their sum added back": lambda inp: (lambda h: h + h.sum(0))(inp.reshape(B * P, N, C)),
    }[case]
    out = make(x)
    if out.shape[0] % B == 0:
        assert rows.sample_major(out.grad_fn, out.output_nr, B, rows.of(x)) is False
    # and the Jacobian agrees that some row depends on more than its own sample, or on another sample
    k = out.shape[0] // B if out.shape[0] % B == 0 else 1
    assert any(not s <= {r // k} for r, s in enumerate(_samples_of_rows(make, x)))


def test_a_parameter_or_a_broadcast_constant_holds_no_samples():
    torch.manual_seed(0)
    pos = nn.Parameter(torch.randn(1, N, C))
    rows_like_a_batch = nn.Parameter(torch.randn(B * P, 1, C))  # a parameter is never samples, whatever its size
    table = torch.randn(N, C)
    x = torch.randn(B, P, N, C, requires_grad=True)
    _check(lambda inp: inp.reshape(B * P, N, C) + pos + table + rows_like_a_batch, x, True)


def test_the_samples_come_from_a_root_and_other_sizes_no_proof():
    x = torch.randn(B, C, requires_grad=True)
    y = x * 2
    assert rows.sample_major(y.grad_fn, 0, B, rows.of(x))
    assert not rows.sample_major(y.grad_fn, 0, B + 1, rows.of(x))  # 3 rows are not a multiple of 4 samples
    other = torch.randn(B, C, requires_grad=True)  # B rows, but not the model's input: a size match proves nothing
    assert not rows.sample_major((other * 2).grad_fn, 0, B, rows.of(x))
    assert not rows.sample_major(y.grad_fn, 0, B, rows.of(x, 1))  # x's samples declared in its dim 1


def test_a_norm_over_the_samples_dimension_mixes_them():
    """Layer norm over (rows, C) of a (N, B·P, C) tensor, the samples in dim 1: their rows are mixed."""
    torch.manual_seed(0)
    x = torch.randn(B, P, N, C, requires_grad=True)

    def make(inp):
        h = inp.reshape(B * P, N, C).transpose(0, 1)  # (N, B·P, C)
        return F.layer_norm(h, (B * P, C)).transpose(0, 1)  # back to (B·P, N, C)

    out = make(x)
    assert rows.sample_major(out.grad_fn, out.output_nr, B, rows.of(x)) is False
    assert any(not s <= {r // P} for r, s in enumerate(_samples_of_rows(make, x)))
    _check(lambda inp: F.layer_norm(inp.reshape(B * P, N, C), (N, C)), x, True)  # over each row's own dims
