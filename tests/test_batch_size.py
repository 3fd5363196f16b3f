"""The batch size per-sample rows follow is the model's input's, not the most common leading dimension:
a model that folds samples into rows (MobileViT's patches, OPT's (B·T, d)) has more layers at B·k than at
B. Rows folded by a view are unfolded exactly; other layers at B·k are named in a note. References are
per-sample autograd: each sample run alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookwidget as hw


class Folding(nn.Module):
    """conv on (B, C, H, W); patches folded into rows by a reshape (a view): l1 sees (B·4, 4, 8); l2 sees
    l1's activation, whose rows are samples only because ReLU keeps rows (nothing tells hookwidget so)."""

    def __init__(self):
        super().__init__()
        self.conv, self.l1, self.l2 = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.conv(x)
        B = h.shape[0]
        h = h.permute(0, 2, 3, 1).reshape(B * 4, 4, 8)
        return self.l2(torch.relu(self.l1(h))).reshape(B, -1).sum(1)


def _reference(model, x, prefixes):
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad()
        model(x[i:i + 1]).pow(2).sum().backward()
        rows.append(sum(p.grad.pow(2).sum() for n, p in model.named_parameters() if n.startswith(prefixes)).sqrt())
    return torch.stack(rows)


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_rows_follow_the_models_batch(capture):
    torch.manual_seed(0)
    m, x = Folding(), torch.randn(3, 3, 4, 4)
    t = hw.trace(lambda: m(x).pow(2).sum().backward(), m, capture=capture)
    norms = t.per_sample_grad_norms()
    assert norms.shape == (3,)
    left = t.per_sample_left_out
    assert {"conv.weight", "conv.bias"}.isdisjoint(left)
    assert {"l2.weight", "l2.bias"} <= set(left)
    assert "not the batch size" in left["l2.weight"]
    covered = ("conv", "l1") if capture == "full" else ("conv",)  # capture="norms" streams rows as they come
    if capture == "norms":
        assert {"l1.weight", "l1.bias"} <= set(left)
    torch.testing.assert_close(norms, _reference(m, x, covered), rtol=1e-5, atol=1e-6)


class FlattenedTokens(nn.Module):
    """OPT's decoder: (B, T, d) reshaped to (B·T, d), then LayerNorm and Linear over rows."""

    def __init__(self):
        super().__init__()
        self.inp, self.ln, self.fc = nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.ln(self.inp(x).reshape(-1, 8))).sum()


def test_rows_folded_by_a_view_are_unfolded_exactly():
    torch.manual_seed(0)
    m, x = FlattenedTokens(), torch.randn(3, 4, 5)
    t = hw.trace(lambda: m(x).backward(), m)
    assert not t.per_sample_left_out  # ln's input is a view; fc's is the output of ln, which keeps rows
    for name in ("ln", "fc"):
        g = t.per_sample_grads(name, "weight")
        assert g.shape == (3, *getattr(m, name).weight.shape)
        torch.testing.assert_close(g.sum(0), getattr(m, name).weight.grad, rtol=1e-5, atol=1e-6)  # autograd's
    torch.testing.assert_close(t.per_sample_grad_norms(), _reference_sum(m, x, ("inp", "ln", "fc")), rtol=1e-5,
                               atol=1e-6)


def test_rows_stay_folded_through_an_activation_module_not_a_function():
    """nn.ReLU keeps rows (known elementwise); torch.relu between two layers is not seen, so the last
    layer's rows are not taken for samples."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.act, self.fc, self.out = nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            h = self.fc(self.act(self.inp(x).reshape(-1, 8)))
            return self.out(torch.relu(h)).sum()

    torch.manual_seed(0)
    model, x = Model(), torch.randn(3, 4, 5)
    t = hw.trace(lambda: model(x).backward(), model)
    assert {"out.weight", "out.bias"} == set(t.per_sample_left_out)
    torch.testing.assert_close(t.per_sample_grads("fc", "weight").sum(0), model.fc.weight.grad, rtol=1e-5, atol=1e-6)
    ref = []
    for i in range(3):
        model.zero_grad()
        model(x[i:i + 1]).backward()
        ref.append(model.fc.weight.grad.clone())
    torch.testing.assert_close(t.per_sample_grads("fc", "weight"), torch.stack(ref), rtol=1e-5, atol=1e-6)


def _reference_sum(model, x, prefixes):
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad()
        model(x[i:i + 1]).backward()
        rows.append(sum(p.grad.pow(2).sum() for n, p in model.named_parameters() if n.startswith(prefixes)).sqrt())
    return torch.stack(rows)


def test_a_table_called_on_positions_still_is_not_a_batch():
    """Leading dimension T = 4 of a table of positions, batch B = 8 (a multiple of T): the table is not
    taken for the batch, the rows are B."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(10, 6), nn.Embedding(4, 6), nn.Linear(6, 1)

        def forward(self, ids):
            h = self.tok(ids) * self.pos(torch.arange(4)).sigmoid()  # multiplied: no per-sample δ for the table
            return self.head(h).pow(2).sum()

    torch.manual_seed(0)
    model, ids = Model(), torch.randint(0, 10, (8, 4))
    t = hw.trace(lambda: model(ids).backward(), model)
    assert t.per_sample_grad_norms().shape == (8,)
    assert "pos.weight" in t.per_sample_left_out
