"""The generic torch.func rule (issue 14, item 2): modules without an exact (a, δ) rule get per-sample gradients
by rerunning their forward per sample, checked against the step's gradient before use.

References are per-sample autograd loops (each sample run alone, .grad of its own loss), never hookwidget's
numbers. Refusals (dropout in train mode, BatchNorm on batch statistics) must be named in a note."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers_rows import close
from helpers_rows import loop_reference as rows_reference
from torch import nn

import hookwidget as hw
from hookwidget.layers import factors as fx
from hookwidget.layers import generic as generic_layers

B = 3


def loop_reference(model, loss_of, n=B) -> dict:
    return rows_reference(model, loss_of, n)


def norms_of(ref: dict, skip=()) -> torch.Tensor:
    return torch.cat([g.reshape(len(g), -1) for k, g in ref.items() if not k.startswith(tuple(skip))], 1).norm(dim=1)


def traced(model, loss_full, **options):
    def step():
        model.zero_grad(set_to_none=True)
        loss_full().backward()

    return hw.trace(step, model, **options)


def check_layer(t, model, ref, layer: str):
    """Every parameter the layer answers for: per-sample gradients equal the reference, and sum to .grad."""
    module = model.get_submodule(layer)
    names = [k for k, p in module.named_parameters() if p.requires_grad]
    assert names
    for k in names:
        got = t.per_sample_grads(layer, k)
        close(got, ref[f"{layer}.{k}"])
        close(got.sum(0), module.get_parameter(k).grad)


# -- recurrent layers ---------------------------------------------------------------------------------
class Tagger(nn.Module):
    """A 2-layer LSTM given (h0, c0), a head on its output, and a loss term on h_n."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.lstm = nn.LSTM(4, 5, num_layers=2, batch_first=batch_first)
        self.head = nn.Linear(5, 3)

    def forward(self, x, h0, c0):
        out, (h, c) = self.lstm(x, (h0, c0))
        seq = out if self.batch_first else out.transpose(0, 1)  # the head sees the batch first
        return self.head(seq).pow(2).sum() + (h * h.flip(-1)).sum() + c[-1].sum()


@pytest.mark.parametrize("batch_first", [True, False])
def test_lstm_per_sample_gradients_equal_an_autograd_loop(batch_first):
    torch.manual_seed(0)
    model = Tagger(batch_first)
    x = torch.randn(B, 6, 4) if batch_first else torch.randn(6, B, 4)
    h0, c0 = torch.randn(2, B, 5), torch.randn(2, B, 5)
    bd = 0 if batch_first else 1

    def one(i):
        return model(x.narrow(bd, i, 1), h0[:, i:i + 1], c0[:, i:i + 1])

    t = traced(model, lambda: model(x, h0, c0))
    ref = loop_reference(model, one)
    assert t.supports("lstm") and "lstm" in t.factor_layers and not t.per_sample_left_out
    check_layer(t, model, ref, "lstm")
    close(t.per_sample_grad_norms(), norms_of(ref))
    close(t.per_sample_grad_norms("lstm"), norms_of(ref, skip=("head",)))


def vmap_off(monkeypatch) -> None:
    """The vmap rule refuses: rows come from a fast rule or not at all (a wrong fast rule then leaves the layer out
    instead of being rescued by the vmap fallback)."""

    def refuse(*args, **kwargs):
        raise generic_layers.Refused("the vmap rule is off in this test")

    monkeypatch.setattr(generic_layers, "per_sample", refuse)


RECURRENT = {
    "lstm 2 layers, bidirectional": lambda: nn.LSTM(4, 5, num_layers=2, batch_first=True, bidirectional=True),
    "lstm sequence first, given (h0, c0)": lambda: nn.LSTM(4, 5, num_layers=2),
    "gru": lambda: nn.GRU(4, 6, batch_first=True),
    "gru 2 layers, bidirectional, no bias": lambda: nn.GRU(4, 5, num_layers=2, bidirectional=True, bias=False),
    "rnn relu 2 layers": lambda: nn.RNN(4, 5, num_layers=2, nonlinearity="relu", batch_first=True),
}


@pytest.mark.parametrize("capture", ["full", "norms"])
@pytest.mark.parametrize("kind", list(RECURRENT))
def test_recurrent_layers_get_factors_over_time_steps(kind, capture, monkeypatch):
    """layers/recurrent.py: W_ih's, W_hh's and the biases' rows from the gates' pre-activations over time, one
    rerun of the batch. The vmap rule is made to refuse here, so the rows come from the fast rule or not at all
    (a wrong gate equation fails the check and leaves the layer out)."""
    torch.manual_seed(0)
    rnn = RECURRENT[kind]()
    head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 2)
    model = nn.ModuleDict({"rnn": rnn, "head": head})
    bd = 0 if rnn.batch_first else 1
    x = torch.randn(B, 6, 4) if rnn.batch_first else torch.randn(6, B, 4)
    given = "given" in kind
    h0 = (torch.randn(2, B, 5), torch.randn(2, B, 5)) if given else None

    def loss(i=None):
        xb = x if i is None else x.narrow(bd, i, 1)
        hx = None if h0 is None else tuple(h if i is None else h[:, i:i + 1] for h in h0)
        out, h = rnn(xb, hx)
        seq = out if rnn.batch_first else out.transpose(0, 1)
        last = h[0] if isinstance(h, tuple) else h
        return head(seq).pow(2).sum() + (last * last.flip(-1)).sum()

    vmap_off(monkeypatch)
    t = traced(model, loss, capture=capture)
    ref = loop_reference(model, loss)
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grad_norms(), norms_of(ref))
    if capture == "full":
        check_layer(t, model, ref, "rnn")


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_what_the_recurrent_rule_does_not_cover_goes_to_the_vmap_rule():
    """An LSTM with proj_size: the fast rule steps aside, vmap answers, exactly. (A packed sequence, which the fast
    rule once stepped aside for, is now its own: tests/test_bags_packed.py; here a GRU's h_n alone, by the rule.)"""
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6, batch_first=True, proj_size=3)
    model = nn.ModuleDict({"lstm": lstm})
    x = torch.randn(B, 5, 4)
    t = traced(model, lambda: lstm(x)[0].pow(2).sum())
    check_layer(t, model, loop_reference(model, lambda i: lstm(x[i:i + 1])[0].pow(2).sum()), "lstm")
    gru = nn.GRU(4, 5, batch_first=True)
    model = nn.ModuleDict({"gru": gru})
    lengths = torch.tensor([5, 3, 2])

    def packed(i=None):
        xs, ls = (x, lengths) if i is None else (x[i:i + 1], lengths[i:i + 1])
        return gru(nn.utils.rnn.pack_padded_sequence(xs, ls, batch_first=True))[1].pow(2).sum()

    t = traced(model, packed)
    assert not t.per_sample_left_out, t.per_sample_left_out
    check_layer(t, model, loop_reference(model, packed), "gru")


class QVBiasAttention(nn.Module):
    """timm's EvaAttention and BEiT's attention: F.linear with a child's weight (qkv is never called) and a bias made
    of its own q and v biases around a zero k bias buffer."""

    def __init__(self, d=8, heads=2, twice=False):
        super().__init__()
        self.heads, self.twice = heads, twice
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))
        self.register_buffer("k_bias", torch.zeros(d), persistent=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, N, C = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        if self.twice:  # the weight used again: not one F.linear's alone
            qkv = qkv + F.linear(x.flip(1), self.qkv.weight)
        q, k, v = qkv.reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_parameters_of_f_linear_calls_get_a_linears_factors(capture, monkeypatch):
    """layers/linear_calls.py: the weight's rows as outer factors and each bias piece's as a slice of the sum, from one
    rerun of the batch; the vmap rule is off here, so a wrong slice would leave the layer out."""
    torch.manual_seed(0)
    attn = QVBiasAttention()
    model = nn.ModuleDict({"attn": attn})
    x = torch.randn(B, 5, 8)

    vmap_off(monkeypatch)
    t = traced(model, lambda: attn(x).pow(2).sum(), capture=capture)
    ref = loop_reference(model, lambda i: attn(x[i:i + 1]).pow(2).sum())
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grad_norms(), norms_of(ref))
    if capture == "full":
        for k in ("qkv.weight", "q_bias", "v_bias"):
            close(t.per_sample_grads("attn", k), ref[f"attn.{k}"])


def test_a_weight_two_f_linear_calls_share_goes_to_the_vmap_rule(monkeypatch):
    torch.manual_seed(0)
    attn = QVBiasAttention(twice=True)
    model = nn.ModuleDict({"attn": attn})
    x = torch.randn(B, 5, 8, requires_grad=True)  # x.flip(1) in the graph: proj's samples are proven through it
    t = traced(model, lambda: attn(x).pow(2).sum())
    close(t.per_sample_grad_norms(), norms_of(loop_reference(model, lambda i: attn(x[i:i + 1]).pow(2).sum())))

    vmap_off(monkeypatch)
    t = traced(model, lambda: attn(x).pow(2).sum())
    assert "attn.qkv.weight" in t.per_sample_left_out  # the fast rule stepped aside: no rows rather than wrong ones


class Split(torch.autograd.Function):
    """One node, two outputs (as cuDNN's LSTM gives output, h_n and c_n): the gradient of an output the loss
    does not use is left undefined, and a tensor hook on that output is called with None."""
    generate_vmap_rule = True

    @staticmethod
    def forward(h):
        return h * 2, h * 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g1, g2):
        return (0 if g1 is None else g1 * 2) + (0 if g2 is None else g2 * 3)


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return Split.apply(x @ self.w)


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_an_output_whose_gradient_autograd_leaves_undefined(capture):
    """The second output is unused: its δ hook gets None (on CUDA, every LSTM's h_n and c_n where only the
    output is used). No δ arrived there: per-sample gradients as an autograd loop's, .grad untouched, and the
    watch steps through it."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"two": TwoOutputs(), "head": nn.Linear(4, 2)})
    x = torch.randn(B, 4)

    def loss(xb):
        return model["head"](model["two"](xb)[0]).pow(2).sum()

    loss(x).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    t = traced(model, lambda: loss(x), capture=capture)
    assert all(torch.equal(p.grad, want[k]) for k, p in model.named_parameters())
    close(t.per_sample_grad_norms(), norms_of(loop_reference(model, lambda i: loss(x[i:i + 1]))))
    with hw.watch(model, per_sample=True) as w:
        for _ in range(2):
            model.zero_grad()
            loss(x).backward()
    assert torch.isfinite(w.stats[:, :, w.stat_names.index("delta_norm")]).all()


def test_gru_classifier():
    torch.manual_seed(0)
    gru, head = nn.GRU(4, 6, batch_first=True), nn.Linear(6, 2)
    model = nn.ModuleDict({"gru": gru, "head": head})
    x = torch.randn(B, 5, 4)

    def loss(xb):
        return head(gru(xb)[0][:, -1]).pow(2).sum()

    t = traced(model, lambda: loss(x))
    ref = loop_reference(model, lambda i: loss(x[i:i + 1]))
    check_layer(t, model, ref, "gru")
    close(t.per_sample_grad_norms(), norms_of(ref))


# -- attention, embeddings, custom layers --------------------------------------------------------------
def test_multihead_attention_sequence_first_with_weights_and_out_proj():
    """batch_first=False: (T, B, E) in and out, attention weights (B, T, S); out_proj is used as a function,
    never called, so MultiheadAttention answers for it."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2)
    model = nn.ModuleDict({"mha": mha})
    x, R = torch.randn(5, B, 8), torch.randn(B, 5, 5)
    pad = torch.zeros(B, 5, dtype=torch.bool)
    pad[0, -2:] = True

    def loss(xb, pb, rb):
        out, w = mha(xb, xb, xb, key_padding_mask=pb, need_weights=True)
        return out.pow(2).sum() + (w * rb).sum()

    t = traced(model, lambda: loss(x, pad, R))
    ref = loop_reference(model, lambda i: loss(x[:, i:i + 1], pad[i:i + 1], R[i:i + 1]))
    assert not t.per_sample_left_out, t.per_sample_left_out
    check_layer(t, model, ref, "mha")  # in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias
    close(t.per_sample_grad_norms(), norms_of(ref))


class Bagged(nn.Module):
    """An EmbeddingBag called with per_sample_weights (mode "sum") or without, and a head."""

    def __init__(self, bag: nn.EmbeddingBag):
        super().__init__()
        self.bag, self.head = bag, nn.Linear(bag.embedding_dim, 2)

    def forward(self, ids, weights=None):
        return self.head(self.bag(ids, per_sample_weights=weights))


@pytest.mark.parametrize("mode, padding, weighted", [("mean", None, False), ("mean", 0, False), ("sum", 0, True),
                                                     ("sum", None, False), ("max", None, False)])
def test_embedding_bag(monkeypatch, mode, padding, weighted):
    """One bag per sample: rows from the bag's indices and δ (the fast rule, layers/embedding.py) in modes sum and
    mean, padding and per_sample_weights included, repeated indices in a bag too; mode max too (the rows its maximum
    took; bags given by offsets: tests/test_bags_packed.py)."""
    from hookwidget.layers import embedding

    served = []
    real = embedding.bag_factors

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        served.append(out[1])
        return out

    monkeypatch.setattr(embedding, "bag_factors", counting)
    monkeypatch.setattr(generic_layers, "FAST_RULES", [(a, counting if r is real else r)
                                                      for a, r in generic_layers.FAST_RULES])
    torch.manual_seed(0)
    model = Bagged(nn.EmbeddingBag(20, 6, mode=mode, padding_idx=padding))
    ids = torch.randint(0, 8, (B, 7))  # 7 indices out of 8: repeats in every bag
    ids[1, :3] = 0  # padding, where there is a padding_idx
    w = torch.rand(B, 7) if weighted else None
    t = traced(model, lambda: model(ids, w).pow(2).sum())
    ref = loop_reference(model, lambda i: model(ids[i:i + 1], None if w is None else w[i:i + 1]).pow(2).sum())
    check_layer(t, model, ref, "bag")
    close(t.weight_grad("bag"), model.bag.weight.grad)
    close(t.per_sample_grad_norms(), norms_of(ref))
    assert served


class ScaledWordEmbedding(nn.Embedding):
    """Gemma's and BART's scaled word embedding: nn.Embedding's lookup times a scale, in a forward of its own."""

    def forward(self, ids):
        return super().forward(ids) * self.embedding_dim ** 0.5


def test_a_scaled_word_embedding_gets_rows_from_its_lookup():
    """The generic rule serves an Embedding subclass with a forward of its own; the gradient arriving at its one
    lookup gives its rows (layers/embedding.py), exact and within any memory budget: vmap would make B copies of the
    (vocabulary, d) table, over budget_mb=1 here, and leave the table out."""
    torch.manual_seed(0)
    model = nn.Sequential(ScaledWordEmbedding(4000, 32, padding_idx=0), nn.Linear(32, 3))
    ids = torch.randint(0, 4000, (B, 6))
    ids[:, 0] = 7  # a token every sample shares
    ids[1, 1:3] = 0  # padding
    t = traced(model, lambda: model(ids).pow(2).sum(), budget_mb=1)
    ref = loop_reference(model, lambda i: model(ids[i:i + 1]).pow(2).sum())
    assert fx.is_generic(model[0]) and not t.per_sample_left_out
    close(t.per_sample_grad_norms(), norms_of(ref))
    check_layer(t, model, ref, "0")


class HandRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class LoRA(nn.Module):
    """A frozen Linear plus a trainable low-rank update: only A and B train."""

    def __init__(self, base: nn.Linear, r=2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, base.in_features) * 0.3)
        self.B = nn.Parameter(torch.randn(base.out_features, r) * 0.3)

    def forward(self, x):
        return self.base(x) + x @ self.A.T @ self.B.T


class ScaledBlock(nn.Module):
    """An MLP block with a layer-scale Parameter of its own (ConvNeXt's, CaiT's)."""

    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.gamma = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x):
        return x + self.gamma * self.fc2(F.gelu(self.fc1(x)))


def test_rmsnorm_lora_and_layer_scale():
    torch.manual_seed(0)
    model = nn.Sequential(HandRMSNorm(6), LoRA(nn.Linear(6, 6)), ScaledBlock(6), nn.Linear(6, 2))
    x = torch.randn(B, 4, 6)
    t = traced(model, lambda: model(x).pow(2).sum())
    ref = loop_reference(model, lambda i: model(x[i:i + 1]).pow(2).sum())
    assert {"0", "1", "2", "2.fc1", "3"} <= set(t.factor_layers) and not t.per_sample_left_out
    assert fx.is_generic(model[0]) and fx.is_generic(model[1]) and fx.is_generic(model[2])
    for layer in ("0", "1", "2.fc1", "2.fc2", "3"):
        check_layer(t, model, ref, layer)
    close(t.per_sample_grads("2", "gamma"), ref["2.gamma"])  # the block answers for its own parameter only
    close(t.weight_grad("0"), model[0].weight.grad)
    close(t.per_sample_grad_norms(), norms_of(ref))


class TimmLayerNorm(nn.LayerNorm):
    """timm's LayerNorm: its own forward (so no exact rule), F.layer_norm with the parameters in their shape."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class LayerNorm2d(nn.LayerNorm):
    """torchvision's ConvNeXt LayerNorm2d: channels normalised at each pixel, through a permute."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class GroupNormAct(nn.GroupNorm):
    """timm's GroupNormAct: F.group_norm, then an activation."""

    def forward(self, x):
        return F.gelu(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d: F.batch_norm (here in eval mode, its running statistics), then an activation."""

    def forward(self, x):
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.1,
                                   self.eps))


class InstanceNormAct(nn.InstanceNorm2d):
    def forward(self, x):
        return F.silu(F.instance_norm(x, None, None, self.weight, self.bias, True, 0.1, self.eps))


class LayerScale2d(nn.Module):
    """timm's LayerScale2d: its parameter viewed (1, C, 1, 1) for the NCHW layout."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        return x * self.gamma.view(1, -1, 1, 1)


class GlobalResponseNorm(nn.Module):
    """timm's GRN, channels last (permuted here from NCHW and back): weight and bias viewed (1, 1, 1, C), through
    addcmul."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        g = x.norm(p=2, dim=(1, 2), keepdim=True)
        n = g / (g.mean(dim=-1, keepdim=True) + 1e-6)
        return (x + torch.addcmul(self.bias.view((1, 1, 1, -1)), self.weight.reshape(1, 1, 1, -1), x * n)).permute(
            0, 3, 1, 2)


def test_norms_that_take_their_affine_parameters_whole_get_rows_from_one_backward(monkeypatch):
    """F.layer_norm, F.group_norm, F.batch_norm and F.instance_norm want weight and bias in their own shape, and a
    layer scale views its parameter (1, C, 1, 1): the generic rule splits the affine part off, or lays the copies out
    the same way (affine.py), instead of vmapping the forward; a frozen bias, and a 2-D normalised shape, included."""
    from hookwidget.layers import batch_copies, generic

    copies, failed = batch_copies._batch_copies, []

    def watched(module, *args, **kwargs):
        try:
            return copies(module, *args, **kwargs)
        except Exception as e:  # the affine split did not apply: the forward would be vmapped instead
            failed.append(f"{type(module).__name__}: {e}")
            raise

    monkeypatch.setattr(batch_copies, "_batch_copies", watched)
    from hookwidget.layers import affine_nodes  # (which answers first where it can: see the next test)

    monkeypatch.setattr(generic, "FAST_RULES", [(a, r) for a, r in generic.FAST_RULES
                                                if r is not affine_nodes.affine_rows])
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), LayerNorm2d(8), nn.Conv2d(8, 8, 1), GroupNormAct(4, 8),
                         nn.Flatten(), nn.Linear(8 * 25, 4))
    conv[3].bias.requires_grad_(False)
    norms = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2d(4), nn.Conv2d(4, 4, 1), InstanceNormAct(4, affine=True),
                          nn.Flatten(), nn.Linear(4 * 9, 2)).eval()
    norms[1].running_mean.uniform_(-1, 1)
    norms[1].running_var.uniform_(0.5, 2)
    seq = nn.Sequential(nn.Linear(6, 6), TimmLayerNorm(6), TimmLayerNorm([4, 6]), nn.Linear(6, 2))
    scales = nn.Sequential(nn.Conv2d(3, 6, 3), LayerScale2d(6), nn.Conv2d(6, 6, 1), GlobalResponseNorm(6),
                           nn.Flatten(), nn.Linear(6 * 9, 2))
    for model, x in ((conv, torch.randn(B, 3, 5, 5)), (norms, torch.randn(B, 3, 5, 5)), (seq, torch.randn(B, 4, 6)),
                     (scales, torch.randn(B, 3, 5, 5))):
        for m in model.modules():  # non-trivial affine parameters
            for p in m.parameters(recurse=False):
                p.data.add_(torch.randn_like(p) * 0.3)
        t = traced(model, lambda m=model, x=x: m(x).pow(2).sum())
        ref = loop_reference(model, lambda i, m=model, x=x: m(x[i:i + 1]).pow(2).sum())
        assert not t.per_sample_left_out
        generic_layers = [n for n, m in model.named_children() if fx.is_generic(m)]
        assert len(generic_layers) == 2
        for layer in generic_layers:
            check_layer(t, model, ref, layer)
        close(t.per_sample_grad_norms(), norms_of(ref))
    assert not failed


class BatchNormAct2dTrain(nn.BatchNorm2d):
    """timm's BatchNormAct2d as it trains: batch statistics (samples mixed), running statistics updated."""

    def forward(self, x):
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                                   0.1, self.eps))


class LlamaLikeRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: its weight times the normalised input, in that order."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class ScaleShift(nn.Module):
    """A layer scale applied in place (timm's LayerScale(inplace=True)), then a shift viewed (1, C, 1, 1)."""

    def __init__(self, c):
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.full((c,), 0.5)), nn.Parameter(torch.zeros(c))

    def forward(self, x):
        return x.clone().mul_(self.gamma.reshape(1, -1, 1, 1)) + self.beta.view(1, -1, 1, 1)


class InputShift(nn.Module):
    """A learned shift of the raw input (which needs no gradient): x + b."""

    def __init__(self, d):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x + self.b


class SquaredScale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.full((d,), 0.8))

    def forward(self, x):
        return x * self.w.pow(2)


def test_an_affine_module_with_a_forward_of_its_own_gets_rows_from_its_own_backward_nodes(monkeypatch):
    """timm's LayerNorm, LayerNorm2d, GroupNormAct, BatchNormAct2d (eval): the norm node of the call's own graph gives
    its input, its statistics and the gradient arriving at it; an RMSNorm's weight, a layer scale, a shift: the
    product's (or sum's) node gives the other factor and its gradient (affine_nodes.py), through a view or a constant
    added (x̂ ⊙ (1 + w)). No rerun. A frozen bias and a weight-only norm included; a norm called twice, w², and batch
    statistics (which mix samples) go the other ways."""
    from hookwidget.layers import affine_nodes, batch_copies, generic

    served, reran = [], []
    rows, copies = affine_nodes.affine_rows, batch_copies._batch_copies

    def watched_rows(module, *args, **kwargs):
        out = rows(module, *args, **kwargs)
        served.append(type(module).__name__)
        return out

    def watched_copies(module, *args, **kwargs):
        reran.append(type(module).__name__)
        return copies(module, *args, **kwargs)

    monkeypatch.setattr(generic, "FAST_RULES", [(a, watched_rows if r is rows else r) for a, r in generic.FAST_RULES])
    monkeypatch.setattr(batch_copies, "_batch_copies", watched_copies)
    torch.manual_seed(0)
    bn = BatchNormAct2d(4)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    gn = GroupNormAct(2, 4)
    gn.bias.requires_grad_(False)
    image = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), LayerNorm2d(8), nn.Conv2d(8, 4, 1), bn.eval(), gn,
                          ScaleShift(4), LayerScale2d(4), nn.Flatten(), nn.Linear(4 * 25, 3))
    tokens = nn.Sequential(InputShift(6), nn.Linear(6, 6), TimmLayerNorm(6), TimmLayerNorm([4, 6], bias=False),
                           LlamaLikeRMSNorm(6), HandRMSNorm(6), ScaledBlock(6), nn.Linear(6, 2))
    cases = [(image, torch.randn(B, 3, 5, 5)), (tokens, torch.randn(B, 4, 6))]
    for model, x in cases:
        for p in model.parameters():  # non-trivial affine parameters
            p.data.add_(torch.randn_like(p) * 0.3)
        for capture in ("full", "norms"):
            served.clear(), reran.clear()
            t = traced(model, lambda m=model, x=x: m(x).pow(2).sum(), capture=capture)
            ref = loop_reference(model, lambda i, m=model, x=x: m(x[i:i + 1]).pow(2).sum())
            assert not t.per_sample_left_out
            close(t.per_sample_grad_norms(), norms_of(ref))
            if capture == "full":
                for layer, m in model.named_children():
                    for k, q in m.named_parameters(recurse=False) if fx.is_generic(m) else ():
                        if q.requires_grad:
                            close(t.per_sample_grads(layer, k), ref[f"{layer}.{k}"])
            assert sorted(served) == sorted(type(m).__name__ for m in model if fx.is_generic(m)) and not reran

    squared = nn.Sequential(nn.Linear(6, 6), SquaredScale(6), nn.Linear(6, 2))  # x ⊙ w²: w is no factor itself
    x = torch.randn(B, 4, 6)
    served.clear(), reran.clear()
    t = traced(squared, lambda: squared(x).pow(2).sum())
    close(t.per_sample_grad_norms(), norms_of(loop_reference(squared, lambda i: squared(x[i:i + 1]).pow(2).sum())))
    assert not served and reran == ["SquaredScale"]

    twice = nn.Sequential(nn.Linear(6, 6), TimmLayerNorm(6))
    model = nn.Sequential(twice, nn.Linear(6, 2))

    def loss(i=slice(None)):
        h = twice(x[i])
        return model[1](twice[1](h)).pow(2).sum()

    x = torch.randn(B, 4, 6)
    served.clear(), reran.clear()
    t = traced(model, loss)
    ref = loop_reference(model, lambda i: loss(slice(i, i + 1)))
    close(t.per_sample_grad_norms(), norms_of(ref))
    assert not served  # two calls: the vmap rule answers

    train = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2dTrain(4), nn.Flatten(), nn.Linear(36, 2)).train()
    xs = torch.randn(B, 3, 5, 5)
    t = traced(train, lambda: train(xs).pow(2).sum())
    assert set(t.per_sample_left_out) == {"1.weight", "1.bias"}  # batch statistics mix samples: named, not used
    assert "mixes samples" in t.per_sample_left_out["1.weight"]


def test_weight_norm_conv():
    """weight_norm: the conv owns its parametrization's original0 / original1 (the container is no layer)."""
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 4, 3, padding=1))
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8, 2))
    x = torch.randn(B, 3, 8)
    t = traced(model, lambda: model(x).pow(2).sum())
    ref = loop_reference(model, lambda i: model(x[i:i + 1]).pow(2).sum())
    assert not t.per_sample_left_out and not any("ParametrizationList" in n for n in t.notes), t.notes
    check_layer(t, model, ref, "0")
    assert set(t.per_sample_grads("0", "parametrizations.weight.original1").shape) == {B, 4, 3}
    close(t.per_sample_grad_norms(), norms_of(ref))
    # capture="norms" too: the container holds original0 / original1 but answers for neither, so they are the conv's
    # alone (they were left out there, as if two layers shared them)
    t = traced(model, lambda: model(x).pow(2).sum(), capture="norms")
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grad_norms(), norms_of(ref))


@pytest.mark.parametrize("make, shape, dim", [
    (lambda: nn.Conv1d(3, 4, 3, padding=1), (B, 3, 8), 0),
    (lambda: nn.Conv1d(4, 4, 5, padding=2, groups=2), (B, 4, 9), 2),  # wav2vec2's positional conv: dim=2, groups
    (lambda: nn.Conv2d(3, 5, 3, stride=2, bias=False), (B, 3, 7, 6), None),  # the norm of the whole tensor
    (lambda: nn.Conv2d(3, 4, 2, dilation=2), (B, 3, 6, 6), 1),
], ids=["conv1d", "grouped_dim2", "conv2d_whole", "conv2d_dim1"])
def test_weight_normed_convolutions_get_rows_from_their_kernel_gradient(monkeypatch, make, shape, dim):
    """torch's weight_norm (w = g · v / ‖v‖): g's and v's per-sample gradients from the convolution's per-sample
    kernel gradient mapped through weight_norm's backward (a fast rule), not a per-sample rerun: exact against
    the autograd loop, in capture="full" and "norms", with the rerun made to fail."""
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(make(), dim=dim)
    with torch.no_grad():
        conv.parametrizations.weight.original0.mul_(torch.rand_like(conv.parametrizations.weight.original0) + 0.5)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(shape)
    model(x)  # the lazy head takes its size

    def rerun(*args, **kwargs):
        raise AssertionError("the fast rule should serve it")

    monkeypatch.setattr(generic_layers, "per_sample", rerun)
    ref = loop_reference(model, lambda i: model(x[i:i + 1]).pow(2).sum())
    for capture in ("full", "norms"):
        t = traced(model, lambda: model(x).pow(2).sum(), capture=capture)
        assert not t.per_sample_left_out, t.per_sample_left_out
        close(t.per_sample_grad_norms(), norms_of(ref))
    check_layer(t, model, ref, "0")


class ItemScale(nn.Module):
    """Data-dependent control flow through .item(): vmap cannot run it, a per-sample loop can."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        scale = 2.0 if float(x.abs().sum().item()) > 0 else 1.0
        return x * self.weight * scale


def test_when_vmap_cannot_run_a_loop_of_vjps_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(ItemScale(5), nn.Linear(5, 2))
    x = torch.randn(B, 5)
    t = traced(model, lambda: model(x).pow(2).sum())
    ref = loop_reference(model, lambda i: model(x[i:i + 1]).pow(2).sum())
    check_layer(t, model, ref, "0")
    close(t.per_sample_grad_norms(), norms_of(ref))


@dataclass
class Pair:
    main: torch.Tensor
    aux: torch.Tensor


class KeywordGate(nn.Module):
    """Called with keywords only (as Hugging Face calls its modules), returns a dict of two tensors."""

    def __init__(self, d):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(d))

    def forward(self, *, hidden, mask):
        return {"out": hidden * torch.sigmoid(self.gate) * mask[..., None], "gate_use": (hidden * self.gate).sum(-1)}


class TwoHeads(nn.Module):
    """Returns a dataclass whose both fields carry gradient."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))

    def forward(self, h):
        return Pair(h * self.scale, (h * self.scale).pow(2).mean(-1))


@pytest.mark.parametrize("targeted", [False, True])
def test_keyword_inputs_and_dict_and_dataclass_outputs(targeted):
    torch.manual_seed(0)
    gate, heads, lin = KeywordGate(4), TwoHeads(4), nn.Linear(3, 4)
    model = nn.ModuleDict({"lin": lin, "gate": gate, "heads": heads})
    x, mask = torch.randn(B, 5, 3), (torch.rand(B, 5) > 0.3).float()

    def loss(xb, mb):
        o = gate(hidden=lin(xb), mask=mb)
        p = heads(o["out"])
        return p.main.pow(2).sum() + o["gate_use"].pow(2).sum() + p.aux.sum()

    def step():
        model.zero_grad(set_to_none=True)
        loss(x, mask).backward()

    t = hw.trace(step, model) if targeted else hw.trace(step)
    ref = loop_reference(model, lambda i: loss(x[i:i + 1], mask[i:i + 1]))
    g, h = ("gate", "heads") if targeted else ("KeywordGate", "TwoHeads")
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grads(g, "gate"), ref["gate.gate"])
    close(t.per_sample_grads(h, "scale"), ref["heads.scale"])
    close(t.per_sample_grad_norms(), norms_of(ref))


# -- refused, with a note that names the module ---------------------------------------------------------
class Noisy(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x) * self.weight


def test_dropout_in_train_mode_is_refused_with_a_note_and_the_rng_is_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), Noisy(5), nn.Linear(5, 2)).train()
    x = torch.randn(B, 4)
    t = traced(model, lambda: model(x).pow(2).sum())
    state = torch.get_rng_state()
    why = t.per_sample_left_out["1.weight"]
    assert "Noisy draws random numbers" in why and "put it in eval mode" in why
    assert any("1.weight (1: Noisy, generic torch.func rule: Noisy draws random numbers" in n for n in t.notes)
    assert not t.supports("1") and "1" not in t.factor_layers
    with pytest.raises(ValueError, match="layer '1' .*put it in eval mode"):
        t.per_sample_grads("1")
    norms = t.per_sample_grad_norms()  # the other layers still answer
    assert norms.shape == (B,)
    assert torch.equal(state, torch.get_rng_state())


class TrainBN(nn.BatchNorm1d):
    """A BatchNorm subclass with its own forward: no exact rule; on batch statistics samples mix."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_batchnorm_subclass_in_train_mode_mixes_samples_and_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), TrainBN(3), nn.Flatten(), nn.Linear(3 * 4, 2)).train()
    x = torch.randn(B, 2, 6)
    t = traced(model, lambda: model(x).pow(2).sum())
    running = model[1].running_mean.clone(), model[1].running_var.clone(), int(model[1].num_batches_tracked)
    why = t.per_sample_left_out["1.weight"]
    assert "TrainBN mixes samples: per-sample gradients are not separable" in why
    assert any("1.bias (1: TrainBN, generic torch.func rule: TrainBN mixes samples" in n for n in t.notes), t.notes
    with pytest.raises(ValueError, match="mixes samples"):
        t.per_sample_grads("1")
    t.per_sample_grad_norms()
    assert torch.equal(running[0], model[1].running_mean) and torch.equal(running[1], model[1].running_var)
    assert running[2] == int(model[1].num_batches_tracked)  # the reruns updated copies, not the module

    model.eval()  # on running statistics it is exact
    t = traced(model, lambda: model(x).pow(2).sum())
    ref = loop_reference(model, lambda i: model(x[i:i + 1]).pow(2).sum())
    check_layer(t, model, ref, "1")


class Positions(nn.Embedding):
    """Whisper's positional embedding: indexes the table by position, output (T, d) without a batch dimension."""

    def forward(self, ids):
        return self.weight[: ids.shape[1]]


@pytest.mark.parametrize("combine", ["add", "mul"])
def test_a_position_table_without_batch_dimension(combine):
    """(T, d) added to the batch: each sample's δ is what arrives at the add (exact). Multiplied: refused by name."""
    torch.manual_seed(0)
    tok, pos, head = nn.Embedding(10, 4), Positions(8, 4), nn.Linear(4, 2)
    model = nn.ModuleDict({"tok": tok, "pos": pos, "head": head})
    ids = torch.randint(0, 10, (B, 5))

    def loss(i):
        h = tok(i) + pos(i) if combine == "add" else tok(i) * pos(i)
        return head(h).pow(2).sum()

    t = traced(model, lambda: loss(ids))
    ref = loop_reference(model, lambda i: loss(ids[i:i + 1]))
    if combine == "add":
        assert not t.per_sample_left_out
        check_layer(t, model, ref, "pos")
        close(t.per_sample_grad_norms(), norms_of(ref))
    else:
        assert "has no batch dimension of size 3" in t.per_sample_left_out["pos.weight"]
        close(t.per_sample_grad_norms(), norms_of(ref, skip=("pos",)))


class LearnedPositions(nn.Embedding):
    """BART's / OPT's learned positions: overrides forward, (1, T, d) from the ids' length, added to the batch."""

    def forward(self, ids):
        return super().forward(torch.arange(ids.shape[1])[None] + 2)


def test_learned_positions_added_to_the_batch_are_covered_exactly():
    torch.manual_seed(0)
    tok, pos, head = nn.Embedding(10, 4), LearnedPositions(9, 4), nn.Linear(4, 2)
    model = nn.ModuleDict({"tok": tok, "pos": pos, "head": head})
    ids = torch.randint(0, 10, (B, 5))

    def loss(i):
        return head(torch.tanh(tok(i) + pos(i))).pow(2).sum()

    t = traced(model, lambda: loss(ids))
    ref = loop_reference(model, lambda i: loss(ids[i:i + 1]))
    assert not t.per_sample_left_out, t.per_sample_left_out
    check_layer(t, model, ref, "pos")
    close(t.per_sample_grad_norms(), norms_of(ref))


# -- tied weights, optimizer steps, budget, capture modes ------------------------------------------------
class ScaledEmbedding(nn.Embedding):
    """Gemma's / BART's scaled word embedding: overrides forward, so the generic rule serves it."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


def test_a_weight_tied_between_a_generic_and_an_exact_layer_counts_both_shares():
    torch.manual_seed(0)
    emb, head = ScaledEmbedding(9, 4), nn.Linear(4, 9, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    ids = torch.randint(0, 9, (B, 5))

    def loss(i):
        return head(torch.tanh(emb(i))).pow(2).sum()

    t = traced(model, lambda: loss(ids))
    ref = loop_reference(model, lambda i: loss(ids[i:i + 1]))
    assert not t.per_sample_left_out
    close(t.per_sample_grad_norms(), norms_of(ref))
    close(t.per_sample_grads("emb") + t.per_sample_grads("head"), ref["emb.weight"])


def test_an_optimizer_step_inside_the_trace_does_not_change_the_answer():
    """The generic rule reruns forward with the parameters as they were at the call, not as opt.step() left them."""
    torch.manual_seed(0)
    model = nn.Sequential(HandRMSNorm(4), nn.GRU(4, 4, batch_first=True))
    before = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(B, 3, 4)

    def step():
        opt.zero_grad()
        model(x)[0].pow(2).sum().backward()
        opt.step()

    t = hw.trace(step)
    ref = loop_reference(before, lambda i: before(x[i:i + 1])[0].pow(2).sum())
    for layer, module in (("0", before[0]), ("1", before[1])):
        for k, _ in module.named_parameters():
            close(t.per_sample_grads(layer, k), ref[f"{layer}.{k}"])
    close(t.per_sample_grad_norms(), norms_of(ref))


def test_over_the_memory_budget_the_generic_layers_are_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LSTM(4, 64, batch_first=True))
    x = torch.randn(B, 400, 3)  # inputs over the budget (parameter snapshots are copy-on-write: not counted)
    t = traced(model, lambda: model(x)[0].pow(2).sum(), budget_mb=0.01)
    assert any("memory budget 0.01 MB reached" in n for n in t.notes)
    assert "were not kept" in t.per_sample_left_out["1.weight_ih_l0"]
    with pytest.raises(ValueError, match="not kept"):
        t.per_sample_grads("1", "weight_ih_l0")


def test_per_sample_gradients_over_the_budget_are_refused_by_name():
    """The vmap rule's per-sample gradients are B copies of the parameters: over budget_mb they are refused by name
    (an LSTM with proj_size, which the recurrent fast rule does not cover); a plain LSTM's factors are not copies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LSTM(4, 256, batch_first=True, proj_size=128))
    x = torch.randn(8, 5, 3)
    t = traced(model, lambda: model(x)[0].pow(2).sum(), budget_mb=5)
    why = t.per_sample_left_out["1.weight_hh_l0"]
    assert "per-sample gradients would take 5 MB (batch 8), over budget_mb=5; raise budget_mb" in why
    t = traced(model, lambda: model(x)[0].pow(2).sum(), budget_mb=20)
    assert not t.per_sample_left_out
    plain = nn.Sequential(nn.Linear(3, 4), nn.LSTM(4, 256, batch_first=True))  # 8 MB of per-sample copies
    t = traced(plain, lambda: plain(x)[0].pow(2).sum(), budget_mb=5)
    assert not t.per_sample_left_out


def test_capture_norms_covers_the_generic_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.GRU(4, 4, batch_first=True), HandRMSNorm(4))
    x = torch.randn(B, 5, 3)

    def loss(xb):
        return model[2](model[1](model[0](xb))[0]).pow(2).sum()

    t = traced(model, lambda: loss(x), capture="norms")
    ref = loop_reference(model, lambda i: loss(x[i:i + 1]))
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grad_norms(), norms_of(ref))


def test_capture_norms_names_a_weight_a_generic_layer_shares():
    torch.manual_seed(0)
    emb, head, out = ScaledEmbedding(9, 4), nn.Linear(4, 9, bias=False), nn.Linear(9, 2)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "out": out})
    ids = torch.randint(0, 9, (B, 5))

    def loss(i):
        return out(head(torch.tanh(emb(i)))).pow(2).sum()

    t = traced(model, lambda: loss(ids), capture="norms")
    why = t.per_sample_left_out["emb.weight"]
    assert "capture='norms'" in why and "capture='full' counts it" in why
    assert any("emb.weight (shared by emb, head" in n for n in t.notes)
    ref = loop_reference(model, lambda i: loss(ids[i:i + 1]))
    close(t.per_sample_grad_norms(), norms_of(ref, skip=("emb.", "head.")))


class Mixed(nn.Module):
    """LSTM, attention, a train-mode dropout, an .item() layer and a hand-written norm in one model."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.1)
        self.noisy = Noisy(8)
        self.item = ItemScale(8)
        self.norm = HandRMSNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.lstm(x)[0]
        h = h + self.attn(h, h, h)[0]
        return self.head(self.norm(self.item(self.noisy(h)))).pow(2).sum()


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_capture_only_is_bitwise_neutral_and_leaves_the_rng_alone(capture):
    x = torch.randn(B, 5, 4)

    def run(with_trace: bool):
        torch.manual_seed(0)
        model = Mixed().train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def step():
            opt.zero_grad()
            loss = model(x)
            loss.backward()
            opt.step()
            return loss

        t = None
        if with_trace:
            t = hw.trace(step, capture=capture)
            loss = t.loss
        else:
            loss = float(step().detach())
        state = torch.get_rng_state()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        return t, loss, grads, params, state, model

    _, loss0, grads0, params0, state0, _ = run(False)
    t, loss1, grads1, params1, state1, model = run(True)
    assert loss0 == loss1 and torch.equal(state0, state1)
    assert all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    assert all(torch.equal(params0[k], params1[k]) for k in params0)
    flags = [m.training for m in model.modules()]
    t.per_sample_grad_norms()  # the generic reruns: nothing of the model or the RNG changes
    for layer in ("lstm", "item", "norm"):
        assert t.supports(layer), (layer, t.per_sample_left_out)
    assert not t.supports("attn") and not t.supports("noisy")  # dropout in train mode: refused, by name
    assert "put it in eval mode" in t.per_sample_left_out["attn.in_proj_weight"]
    assert torch.equal(state1, torch.get_rng_state()) and flags == [m.training for m in model.modules()]
    assert all(torch.equal(params1[k], p) for k, p in model.named_parameters())


def test_gradient_accumulation_stacks_each_micro_batch():
    """Two backward passes summing into .grad: one row per sample of each micro-batch, each checked on its own step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.GRU(4, 4, batch_first=True))
    xs = [torch.randn(B, 5, 3), torch.randn(2, 5, 3)]

    def loss(xb):
        return model(xb)[0].pow(2).sum()

    def step():
        model.zero_grad(set_to_none=True)
        for x in xs:
            loss(x).backward()

    t = hw.trace(step, model)
    assert t.accumulates and len(t.steps) == 2 and not t.per_sample_left_out
    refs = [loop_reference(model, lambda i, x=x: loss(x[i:i + 1]), n=x.shape[0]) for x in xs]
    close(t.per_sample_grad_norms(), torch.cat([norms_of(r) for r in refs]))
    close(t.per_sample_grads("1", "weight_hh_l0", step=1), refs[1]["1.weight_hh_l0"])
    close(t.per_sample_grads("1", "weight_hh_l0").sum(0), model[1].weight_hh_l0.grad)


class TiedHead(nn.Module):
    """BERT's prediction head: it holds its decoder's bias as its own parameter too."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(4, 5)
        self.bias = self.decoder.bias

    def forward(self, x):
        return self.decoder(x)


@pytest.mark.parametrize("capture", ["summary", "norms", "full"])
def test_a_bias_held_twice_in_every_capture_mode(capture):
    """Summaries keep no a: deciding whether the shared bias is covered must not need the decoder's factors."""
    torch.manual_seed(0)
    model, x = TiedHead(), torch.randn(3, 4)
    t = hw.trace(lambda: model(x).pow(2).sum().backward(), model, capture=capture)
    left = t.per_sample_left_out
    if capture == "summary":  # nothing is covered, and each parameter says why
        assert set(left) == {"decoder.weight", "bias"}
        assert all("not kept (capture='summary'" in why for why in left.values())
    else:
        assert not left
        ref = []
        for i in range(3):
            model.zero_grad()
            model(x[i:i + 1]).pow(2).sum().backward()
            ref.append(torch.cat([model.decoder.weight.grad.flatten(), model.decoder.bias.grad]).norm())
        torch.testing.assert_close(t.per_sample_grad_norms(), torch.stack(ref), rtol=1e-4, atol=1e-6)
