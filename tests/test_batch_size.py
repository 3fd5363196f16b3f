"""The batch size per-sample rows follow is the model's input's, not the most common leading dimension:
a model that folds samples into rows (MobileViT's patches, OPT's (B·T, d)) has more layers at B·k than at
B. Rows that hold the samples sample-major (as the graph proves: tests/test_rows.py) are unfolded exactly;
other layers at B·k are named in a note. References are
per-sample autograd: each sample run alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookwidget as hw


class Folding(nn.Module):
    """conv on (B, C, H, W); patches folded into rows by a reshape: l1 sees (B·4, 4, 8), each sample's 4 rows
    together; l2 sees l1's activation through torch.relu (a function, no module), rows kept as the graph shows.
    patch_major=True folds them the other way round ((4·B, 4, 8), the samples interleaved): not unfolded."""

    def __init__(self, patch_major=False):
        super().__init__()
        self.conv, self.l1, self.l2 = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 8), nn.Linear(8, 8)
        self.patch_major = patch_major

    def forward(self, x):
        h = self.conv(x)
        B = h.shape[0]
        h = h.permute(0, 2, 3, 1).reshape(B, 4, 4, 8)
        h = h.transpose(0, 1).reshape(4 * B, 4, 8) if self.patch_major else h.reshape(B * 4, 4, 8)
        out = self.l2(torch.relu(self.l1(h)))
        return (out.reshape(4, B, -1).transpose(0, 1) if self.patch_major else out).reshape(B, -1).sum(1)


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
    assert not t.per_sample_left_out  # capture="norms" unfolds the rows of a token layer as they stream
    torch.testing.assert_close(norms, _reference(m, x, ("conv", "l1", "l2")), rtol=1e-5, atol=1e-6)


def test_rows_folded_with_the_samples_interleaved_are_not_unfolded():
    torch.manual_seed(0)
    m, x = Folding(patch_major=True), torch.randn(3, 3, 4, 4)
    t = hw.trace(lambda: m(x).pow(2).sum().backward(), m)
    left = t.per_sample_left_out
    assert {"l1.weight", "l1.bias", "l2.weight", "l2.bias"} == set(left)
    assert "holds none of the 3 samples" in left["l1.weight"]
    torch.testing.assert_close(t.per_sample_grad_norms(), _reference(m, x, ("conv",)), rtol=1e-5, atol=1e-6)


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
    streamed = hw.trace(lambda: m(x).backward(), m, capture="norms")  # OPT's MLP, as capture="norms" streams it
    assert not streamed.per_sample_left_out
    torch.testing.assert_close(streamed.per_sample_grad_norms(), _reference_sum(m, x, ("inp", "ln", "fc")),
                               rtol=1e-5, atol=1e-6)


def test_rows_stay_folded_through_an_activation_module_and_a_function():
    """nn.ReLU keeps rows (a row-keeping module); torch.relu between two layers too (the graph shows it)."""

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
    assert not t.per_sample_left_out
    batch_grads = {name: getattr(model, name).weight.grad.clone() for name in ("fc", "out")}
    for name in ("fc", "out"):
        layer = getattr(model, name)
        torch.testing.assert_close(t.per_sample_grads(name, "weight").sum(0), batch_grads[name], rtol=1e-5, atol=1e-6)
        ref = []
        for i in range(3):
            model.zero_grad()
            model(x[i:i + 1]).backward()
            ref.append(layer.weight.grad.clone())
        torch.testing.assert_close(t.per_sample_grads(name, "weight"), torch.stack(ref), rtol=1e-5, atol=1e-6)


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


class LinearNorm(nn.Module):
    """LeViT's LinearNorm: a Linear, then BatchNorm1d over the tokens folded into rows, (B·T, C)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.lin(x)
        h = self.bn(h.flatten(0, 1)).reshape_as(h)
        return self.head(h).sum()


@pytest.mark.parametrize("train", [False, True])
def test_a_norm_over_folded_tokens_groups_its_rows_per_sample(train):
    """BatchNorm1d's factors are token sums: its rows (B·T tokens) are grouped per sample. In eval mode a row is
    each sample's own gradient (autograd, the sample alone); in train mode the statistics span the batch, and a
    row is the sample's contribution (autograd through the batch's own graph, the output's gradient kept for
    that sample alone)."""
    torch.manual_seed(0)
    m, x = LinearNorm(), torch.randn(3, 4, 5)
    m.bn.running_mean.normal_()
    m.train(train)
    t = hw.trace(lambda: m(x).backward(), m)
    assert "bn.weight" not in t.per_sample_left_out and "bn.bias" not in t.per_sample_left_out
    got = {n: t.per_sample_grads("bn", n) for n in ("weight", "bias")}
    torch.testing.assert_close(got["weight"].sum(0), m.bn.weight.grad, rtol=1e-5, atol=1e-6)
    ref = {n: [] for n in got}
    for i in range(3):
        if train:  # the sample's contribution: the batch's graph, with only sample i's output gradient
            h = m.lin(x)
            out = m.head(m.bn(h.flatten(0, 1)).reshape_as(h))
            mask = torch.zeros(3, 1, 1)
            mask[i] = 1
            gs = torch.autograd.grad((out * mask).sum(), [m.bn.weight, m.bn.bias])
        else:
            gs = torch.autograd.grad(m(x[i:i + 1]), [m.bn.weight, m.bn.bias])
        for n, g in zip(("weight", "bias"), gs):
            ref[n].append(g)
    for n in got:
        torch.testing.assert_close(got[n], torch.stack(ref[n]), rtol=1e-5, atol=1e-6)


def test_streamed_norms_unfold_and_group_folded_rows():
    """capture="norms" on LeViT's LinearNorm in eval mode: the head's rows unfolded, BatchNorm1d's grouped per
    sample, as capture="full" does: nothing left out, and the norms each sample's own gradient has (the sample run
    alone through autograd)."""
    torch.manual_seed(0)
    m, x = LinearNorm().eval(), torch.randn(3, 4, 5)
    m.bn.running_mean.normal_()
    t = hw.trace(lambda: m(x).backward(), m, capture="norms")
    assert not t.per_sample_left_out
    torch.testing.assert_close(t.per_sample_grad_norms(), _reference_sum(m, x, ("lin", "bn", "head")), rtol=1e-5,
                               atol=1e-6)
