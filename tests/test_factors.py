"""(a, δ) factors: W.grad, per-sample gradients and norms, against autograd and torch.func."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import hookwidget as hw


class Mixed(nn.Module):
    """Every supported layer type, with (B, T, ...) shaped data."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.conv1 = nn.Conv1d(8, 6, 3, padding=1, dilation=1)
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 5)
        self.conv2 = nn.Conv2d(1, 3, (2, 3), stride=(1, 2), padding=1, dilation=(1, 1))
        self.head = nn.Linear(3 * 6 * 3, 2, bias=False)

    def forward(self, idx):
        h = self.emb(idx)  # (B, T, 8)
        h = self.conv1(h.transpose(1, 2)).transpose(1, 2)  # (B, T, 6)
        h = torch.tanh(self.fc(self.norm(h)))  # (B, T, 5)
        h = self.conv2(h.unsqueeze(1))  # (B, 3, H, W)
        return self.head(h.flatten(1))


def loss_of(model, idx, y):
    return ((model(idx) - y) ** 2).sum()


@pytest.fixture
def mixed():
    torch.manual_seed(0)
    model = Mixed()
    idx = torch.randint(0, 11, (4, 5))
    idx[0, :2] = 0  # padding positions
    idx[1, 3] = idx[1, 1]  # an index used twice in one sample
    y = torch.randn(4, 2)

    def step():
        model.zero_grad()
        loss_of(model, idx, y).backward()

    return model, idx, y, step


def per_sample_reference(model, idx, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, i, t):
        return ((functional_call(model, p, (i.unsqueeze(0),)) - t.unsqueeze(0)) ** 2).sum()

    return vmap(grad(one), in_dims=(None, 0, 0))(params, idx, y)


LAYERS = ["emb", "conv1", "norm", "fc", "conv2", "head"]


def test_weight_and_bias_grads_rebuild_autograd(mixed):
    model, idx, y, step = mixed
    t = hw.trace(step)
    for name in LAYERS:
        m = model.get_submodule(name)
        assert torch.allclose(t.weight_grad(name), m.weight.grad, atol=1e-5), name
        if getattr(m, "bias", None) is not None:
            assert torch.allclose(t.bias_grad(name), m.bias.grad, atol=1e-5), name


def test_per_sample_grads_equal_torch_func(mixed):
    model, idx, y, step = mixed
    t = hw.trace(step)
    ref = per_sample_reference(model, idx, y)
    for name in LAYERS:
        assert torch.allclose(t.per_sample_grads(name), ref[f"{name}.weight"], atol=1e-5), name
    assert torch.allclose(t.per_sample_grads("fc", "bias"), ref["fc.bias"], atol=1e-5)


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_per_sample_norms_equal_torch_func(mixed, capture):
    model, idx, y, step = mixed
    t = hw.trace(step, capture=capture)
    ref = per_sample_reference(model, idx, y)
    ref_norm = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
    assert torch.allclose(t.per_sample_grad_norms(), ref_norm, rtol=1e-4)
    if capture == "full":
        fc = torch.cat([ref["fc.weight"].flatten(1), ref["fc.bias"].flatten(1)], 1).norm(dim=1)
        assert torch.allclose(t.per_sample_grad_norms("fc"), fc, rtol=1e-4)


def test_ghost_and_materialised_norms_agree():
    # T*T < d_in*d_out takes the Gram route, T*T >= d_in*d_out materialises: both exact.
    torch.manual_seed(0)
    for T, d in ((3, 16), (40, 2)):
        layer = nn.Linear(d, d)
        x = torch.randn(5, T, d)
        t = hw.trace(lambda layer=layer, x=x: layer(x).pow(2).sum().backward())
        params = {k: v.detach() for k, v in layer.named_parameters()}

        def one(p, xi, layer=layer):
            return functional_call(layer, p, (xi[None],)).pow(2).sum()

        ref = vmap(grad(one), in_dims=(None, 0))(params, x)
        ref = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
        assert torch.allclose(t.per_sample_grad_norms("Linear"), ref, rtol=1e-5), (T, d)


def test_mean_reduced_loss_is_undone_by_loss_reduction_mean(mixed):
    model, idx, y, step = mixed

    def mean_step():
        model.zero_grad()
        ((model(idx) - y) ** 2).sum(1).mean().backward()

    t = hw.trace(mean_step)
    ref = per_sample_reference(model, idx, y)["fc.weight"]  # each sample's own (sum) loss
    assert torch.allclose(t.per_sample_grads("fc") * 4, ref, atol=1e-5)
    assert torch.allclose(t.per_sample_grads("fc", loss_reduction="mean"), ref, atol=1e-5)
    assert torch.allclose(t.per_sample_grads("fc").sum(0), model.fc.weight.grad, atol=1e-6)


def test_tied_weights_count_once():
    torch.manual_seed(0)
    emb = nn.Embedding(7, 4)
    head = nn.Linear(4, 7, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    idx = torch.randint(0, 7, (3, 5))

    def loss(p, i):
        h = functional_call(model["emb"], {"weight": p}, (i.unsqueeze(0),))
        return functional_call(model["head"], {"weight": p}, (h,)).pow(2).sum()

    def step():
        emb.zero_grad()
        head(emb(idx)).pow(2).sum().backward()

    for capture in ("full", "norms"):
        t = hw.trace(step, capture=capture)
        ref = vmap(grad(loss), in_dims=(None, 0))(emb.weight.detach(), idx).flatten(1).norm(dim=1)
        assert torch.allclose(t.per_sample_grad_norms(), ref, rtol=1e-4), capture


def test_unsupported_layers_are_listed_not_skipped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.SyncBatchNorm(3), nn.Linear(3, 1)).eval()
    x = torch.randn(8, 4)
    t = hw.trace(lambda: model(x).sum().backward())
    assert any("1 (no factor rule for SyncBatchNorm: its statistics span every process" in n for n in t.notes)
    assert [(n.id, n.layers) for n in t.note_records] == [("no_factor_rule", ("1",)), ("params_left_out", ("1",))]
    assert not t.supports("1")
    with pytest.raises(ValueError, match="no factor rule for SyncBatchNorm: .*; supported types:"):
        t.weight_grad("1")
    assert any("1.weight (1: no factor rule for SyncBatchNorm" in n for n in t.notes)


def test_a_layer_without_an_exact_rule_gets_the_generic_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.PReLU(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    t = hw.trace(lambda: model(x).pow(2).sum().backward())
    assert t.supports("1") and "1" in t.factor_layers and not t.per_sample_left_out
    assert torch.allclose(t.weight_grad("1"), model[1].weight.grad, atol=1e-6)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = vmap(grad(lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()), in_dims=(None, 0))(params, x)
    assert torch.allclose(t.per_sample_grads("1"), ref["1.weight"], atol=1e-6)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    assert torch.allclose(t.per_sample_grad_norms(), norms, rtol=1e-4)


class WithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(9, 6)
        self.pos = nn.Embedding(4, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, idx):
        return self.out(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))


def _position_reference(model, idx):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, i):
        return functional_call(model, p, (i[None],)).pow(2).sum()

    return vmap(grad(one), in_dims=(None, 0))(params, idx)


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_positions_added_to_the_batch_get_each_samples_delta(capture):
    """pos(arange(T)) is (T, d), added to (B, T, d): each sample's δ is what arrives at that add (exact)."""
    torch.manual_seed(0)
    model, idx = WithPositions(), torch.randint(0, 9, (5, 4))
    t = hw.trace(lambda: model(idx).pow(2).sum().backward(), capture=capture)
    ref = _position_reference(model, idx)
    assert not t.per_sample_left_out
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    assert torch.allclose(t.per_sample_grad_norms(), norms, rtol=1e-4)
    if capture == "full":
        assert torch.allclose(t.per_sample_grads("pos"), ref["pos.weight"], atol=1e-5)
        assert torch.allclose(t.weight_grad("pos"), model.pos.weight.grad, atol=1e-5)


class ScaledByPositions(WithPositions):
    def forward(self, idx):
        return self.out(self.tok(idx) * self.pos(torch.arange(idx.shape[1])))


@pytest.mark.parametrize("model_type, capture", [(ScaledByPositions, "full"), (ScaledByPositions, "norms")])
def test_an_unbatched_embedding_is_left_out_and_said(model_type, capture):
    """Positions that are not added to the batch (multiplied): left out, by name."""
    torch.manual_seed(0)
    model, idx = model_type(), torch.randint(0, 9, (5, 4))
    t = hw.trace(lambda: model(idx).pow(2).sum().backward(), capture=capture)
    ref = _position_reference(model, idx)
    ref = torch.cat([g.flatten(1) for k, g in ref.items() if not k.startswith("pos.")], 1).norm(dim=1)
    assert torch.allclose(t.per_sample_grad_norms(), ref, rtol=1e-4)
    assert any("per-sample gradient norms leave out 1 parameters" in n
               and "pos.weight (pos: its input (4,) holds none of the 5 samples" in n for n in t.notes)
    if capture == "full":
        with pytest.raises(ValueError, match=r"'pos': its input \(4,\) holds none of the 5 samples .*batch_dim=N"):
            t.per_sample_grads("pos")
        assert torch.allclose(t.weight_grad("pos"), model.pos.weight.grad, atol=1e-5)  # .grad itself is fine


def test_summary_capture_says_how_to_get_per_sample_norms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    t = hw.trace(lambda: model(x).sum().backward(), model, capture="summary")
    assert not any("per-sample" in n for n in t.notes)  # no (a, δ) is what summaries are: not news
    assert set(t.per_sample_left_out) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    with pytest.raises(ValueError, match=r"capture='summary' keeps statistics, not \(a, δ\): trace with"):
        t.per_sample_grad_norms()


def _loop_norms(model, loss_of, idx, skip=()):
    out = []
    for b in range(idx.shape[0]):
        model.zero_grad()
        loss_of(idx[b:b + 1]).backward()
        out.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if n not in skip]).norm())
    return torch.stack(out)


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_a_weight_also_read_outside_its_layers_calls_is_left_out_with_a_note(capture):
    """A tied head written as F.linear(h, self.wte.weight) in the model's own forward: the embedding's exact rule
    covers only the lookup. Per-sample norms counted the lookup's part alone, silently (36.15 for 36.49); the
    weight is now checked against the .grad its step made, left out, and named (capture="norms" projects the
    factors along random directions as they stream, and checks them as the step ends)."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.fc = nn.Embedding(20, 8), nn.Linear(8, 8)

        def forward(self, i):
            return nn.functional.linear(torch.tanh(self.fc(self.wte(i))), self.wte.weight)

    model, idx = M(), torch.randint(0, 20, (3, 5))

    def loss_of(i):
        return nn.functional.cross_entropy(model(i).flatten(0, 1), i.flatten(), reduction="sum")

    t = hw.trace(lambda: loss_of(idx).backward(), capture=capture)  # norms: checked as the step ends
    assert "outside" in t.per_sample_left_out["wte.weight"] and "recorded calls" in t.per_sample_left_out["wte.weight"]
    assert torch.allclose(t.per_sample_grad_norms(), _loop_norms(model, loss_of, idx, skip={"wte.weight"}),
                          rtol=1e-5)


def test_a_tied_weight_whose_other_layer_is_excluded_is_left_out_with_a_note():
    """exclude= drops the embedding of a tied pair: the head's factors alone are not the weight's gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Tanh(), nn.Linear(8, 20, bias=False))
    model[2].weight = model[0].weight

    def loss_of(i):
        return nn.functional.cross_entropy(model(i).flatten(0, 1), i.flatten(), reduction="sum")

    idx = torch.randint(0, 20, (3, 5))
    t = hw.trace(lambda: loss_of(idx).backward(), exclude=["0"])
    assert "0.weight" in t.per_sample_left_out or "2.weight" in t.per_sample_left_out
    with pytest.raises(ValueError):
        t.per_sample_grad_norms()  # nothing else has parameters: no norms, said in one line
