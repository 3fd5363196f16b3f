"""nn.MultiheadAttention's fast exact rule (layers/attention.py): token factors of in_proj and out_proj from one
full-batch backward, instead of vmap of the module's vjp. References are per-sample autograd loops; where the
rule does not cover a call (dropout in train mode, weights with a gradient) the vmap rule must answer, exactly."""

from __future__ import annotations

import pytest
import torch
from helpers_rows import close
from helpers_rows import loop_reference as rows_reference
from torch import nn

import hookwidget as hw
from hookwidget.layers import attention
from hookwidget.layers import factors as fx

B = 4


def loop_reference(model, loss_of, n=B) -> dict:
    return rows_reference(model, loss_of, n)


def traced(model, loss_full, **options):
    def step():
        model.zero_grad(set_to_none=True)
        loss_full().backward()

    return hw.trace(step, model, **options)


def used_fast(t, layer: str) -> bool:
    rows = next(v for k, v in t.facts.items() if k[0] == "rows" and k[1] == layer)
    return isinstance(rows, dict) and all(isinstance(g, fx.Factor) for g in rows.values())


def check(t, model, ref, layer="mha"):
    module = model.get_submodule(layer)
    for k, p in module.named_parameters():
        if p.requires_grad:
            got = t.per_sample_grads(layer, k)
            close(got, ref[f"{layer}.{k}"])
            close(got.sum(0), p.grad)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    close(t.per_sample_grad_norms(), norms)


class Wrap(nn.Module):
    """A Linear before the attention (batch first only: a Linear's leading dimension is taken for the batch)."""

    def __init__(self, mha, d):
        super().__init__()
        self.pre, self.mha = (nn.Linear(d, d) if mha.batch_first else None), mha

    def forward(self, x, kv=None, **kw):
        h = self.pre(x) if self.pre is not None else x
        return self.mha(h, h if kv is None else kv, h if kv is None else kv, **kw)


CASES = {
    "self batch_first": dict(batch_first=True),
    "self seq-first": dict(batch_first=False),
    "no bias": dict(batch_first=True, bias=False),
    "causal float mask": dict(batch_first=True, mask="causal"),
    "bool mask + key padding": dict(batch_first=True, mask="bool", pad=True),
    "cross attention": dict(batch_first=True, cross=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("capture", ["full", "norms"])
def test_fast_rule_equals_an_autograd_loop(case, capture):
    c = CASES[case]
    torch.manual_seed(0)
    d, T, S, H = 8, 5, 6, 2
    bf = c["batch_first"]
    mha = nn.MultiheadAttention(d, H, bias=c.get("bias", True), batch_first=bf)
    model = Wrap(mha, d)
    x = torch.randn(B, T, d) if bf else torch.randn(T, B, d)
    kv = (torch.randn(B, S, d) if bf else torch.randn(S, B, d)) if c.get("cross") else None
    L = S if kv is not None else T
    kw = {"need_weights": False}
    if c.get("mask") == "causal":
        kw["attn_mask"] = torch.triu(torch.full((T, L), float("-inf")), 1)
    elif c.get("mask") == "bool":
        kw["attn_mask"] = torch.triu(torch.ones(T, L, dtype=torch.bool), 2)
    elif c.get("mask") == "3d":
        kw["attn_mask"] = torch.randn(B * H, T, L)
    if c.get("pad"):
        pad = torch.zeros(B, L, dtype=torch.bool)
        pad[1, -2:] = True
        kw["key_padding_mask"] = pad
    bdim = 0 if bf else 1

    def loss(i=None):
        if i is None:
            return model(x, kv, **kw)[0].pow(2).sum()
        kwi = dict(kw)
        if "key_padding_mask" in kw:
            kwi["key_padding_mask"] = kw["key_padding_mask"][i:i + 1]
        if c.get("mask") == "3d":
            kwi["attn_mask"] = kw["attn_mask"].view(B, H, T, L)[i]
        xi = x.narrow(bdim, i, 1)
        kvi = None if kv is None else kv.narrow(bdim, i, 1)
        return model(xi, kvi, **kwi)[0].pow(2).sum()

    t = traced(model, loss, capture=capture)
    ref = loop_reference(model, loss)
    assert not t.per_sample_left_out, t.per_sample_left_out
    if capture == "full":
        check(t, model, ref)
    else:
        close(t.per_sample_grad_norms(), torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1))
    assert used_fast(t, "mha")


def test_self_attention_keeps_one_copy_of_the_tensor_it_passes_three_times(monkeypatch):
    """Query, key and value passed as one tensor are kept as one copy, passed three times: the fast rule sees the
    call as forward did, without comparing three copies element by element (torch.equal)."""
    torch.manual_seed(0)
    model = Wrap(nn.MultiheadAttention(8, 2, batch_first=True), 8)
    x = torch.randn(B, 5, 8)
    compared = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(a.shape) or equal(a, b))
    t = traced(model, lambda: model(x)[0].pow(2).sum())
    args = t.layers["mha"].calls[0].inputs[0]
    assert args[0] is args[1] is args[2]
    close(t.per_sample_grad_norms(), torch.cat([g.flatten(1) for g in loop_reference(
        model, lambda i=None: model(x if i is None else x[i:i + 1])[0].pow(2).sum()).values()], 1).norm(dim=1))
    assert used_fast(t, "mha") and not compared


def test_the_fast_factors_equal_each_sample_alone_and_take_the_gram_form():
    """in_proj as one outer factor over the packed q|k|v δ; out_proj over the attention output."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    model = Wrap(mha, 16)
    x = torch.randn(B, 3, 16)
    t = traced(model, lambda: model(x)[0].pow(2).sum())
    rows = next(v for k, v in t.facts.items() if k[0] == "rows")
    f = rows["in_proj_weight"]
    assert f.kind == "outer" and f.D.shape == (B, 3, 48) and f.X.shape == (B, 3, 16)
    assert fx.gram_applies(f)
    assert rows["out_proj.weight"].kind == "outer"


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_takes_its_factors_from_its_own_backward(monkeypatch, batch_first):
    """Self-attention: o (saved by out_proj's matmul) and δ(q|k|v) (kept at in_proj's matmul) come from the call's
    own graph: no attention is rerun to compute them, and they still equal each sample's gradient alone."""
    torch.manual_seed(0)
    d, T = 8, 5
    model = Wrap(nn.MultiheadAttention(d, 2, batch_first=batch_first), d)
    x = torch.randn(B, T, d) if batch_first else torch.randn(T, B, d)
    dim = 0 if batch_first else 1

    def no_rerun(*a, **k):  # the module's own forward (need_weights=True) takes another path: bmm, softmax
        raise AssertionError("the attention was rerun")

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", no_rerun)
    t = traced(model, lambda: model(x)[0].pow(2).sum())
    assert set(t.layers["mha"].calls[0].rule_parts) == {"o", "d_in"}
    ref = loop_reference(model, lambda i: model(x.narrow(dim, i, 1))[0].pow(2).sum())
    check(t, model, ref)
    assert used_fast(t, "mha")


def test_cross_attention_keeps_nothing_from_its_graph():
    torch.manual_seed(0)
    model = Wrap(nn.MultiheadAttention(8, 2, batch_first=True), 8)
    x, kv = torch.randn(B, 5, 8), torch.randn(B, 6, 8)
    t = traced(model, lambda: model(x, kv)[0].pow(2).sum())
    assert t.layers["mha"].calls[0].rule_parts is None


def test_dropout_in_eval_is_fast_and_in_train_is_refused():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
    model = Wrap(mha, 8)
    x = torch.randn(B, 5, 8)
    model.eval()
    t = traced(model, lambda: model(x)[0].pow(2).sum())
    ref = loop_reference(model, lambda i: model(x[i:i + 1])[0].pow(2).sum())
    check(t, model, ref)
    assert used_fast(t, "mha")
    model.train()
    t = traced(model, lambda: model(x)[0].pow(2).sum())
    assert "random numbers" in t.per_sample_left_out["mha.in_proj_weight"]


def test_attention_weights_with_a_gradient_fall_back_to_the_vmap_rule():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    model = Wrap(mha, 8)
    x, R = torch.randn(B, 5, 8), torch.randn(B, 5, 5)

    def loss(xb, rb):
        out, w = model(xb, need_weights=True)
        return out.pow(2).sum() + (w * rb).sum()

    t = traced(model, lambda: loss(x, R))
    ref = loop_reference(model, lambda i: loss(x[i:i + 1], R[i:i + 1]))
    check(t, model, ref)
    assert not used_fast(t, "mha")


def test_a_subclass_gets_no_fast_rule():
    class Mine(nn.MultiheadAttention):
        def forward(self, *a, **k):
            out, w = super().forward(*a, **k)
            return out * 2, w

    assert attention.applies(nn.MultiheadAttention(8, 2))
    assert not attention.applies(Mine(8, 2))
    m = nn.MultiheadAttention(8, 2)
    m.forward = lambda *a, **k: None
    assert not attention.applies(m)


def _refused_and_answered_by_vmap(monkeypatch, rule):
    """Trace with `rule` as the only fast rule: it must be refused and the vmap rule answer, exactly."""
    from hookwidget.layers import generic

    monkeypatch.setattr(generic, "FAST_RULES", [(attention.applies, rule)])
    torch.manual_seed(0)
    model = Wrap(nn.MultiheadAttention(8, 2, batch_first=True), 8)
    x = torch.randn(B, 5, 8)
    t = traced(model, lambda: model(x)[0].pow(2).sum())
    ref = loop_reference(model, lambda i: model(x[i:i + 1])[0].pow(2).sum())
    check(t, model, ref)
    assert not used_fast(t, "mha")
    return t, model


def test_rows_of_swapped_samples_are_caught_and_the_vmap_rule_answers(monkeypatch):
    """A fast rule that gives the right sum with samples swapped fails the two-sample check."""
    def swapped(*args):
        fs, key = attention.mha_factors(*args)
        for f in fs.values():
            f.D = f.D.flip(0)
            if f._X is not None:
                f.X = f._X.flip(0)
        return fs, key

    _refused_and_answered_by_vmap(monkeypatch, swapped)


def test_rows_that_do_not_add_up_are_caught_by_the_projected_sum(monkeypatch):
    """One sample's rows off by 1% (not the sample checked element by element): the random-direction check of
    the sum (generic_rows._adds_up) refuses them and the vmap rule answers, exactly."""
    from hookwidget.analysis import generic as generic_rows

    def off(*args):
        fs, key = attention.mha_factors(*args)
        D = fs["in_proj_weight"].D.clone()
        D[0] *= 1.01
        for n in ("in_proj_weight", "in_proj_bias"):
            fs[n].D = D
        return fs, key

    t, model = _refused_and_answered_by_vmap(monkeypatch, off)
    good = attention.mha_factors  # and the same check passes the rule's own rows
    call = t.layers["mha"].calls[0]
    names = ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    f = good(model.mha, call, names, B)[0]["in_proj_weight"]
    assert generic_rows._adds_up(f, model.mha.in_proj_weight.grad)
    assert not generic_rows._adds_up(f, model.mha.in_proj_weight.grad * 1.001)


def test_capture_norms_takes_each_sample_delta_of_a_position_table_where_capture_kept_it():
    """norms._per_sample_call: a (T, d) table added to the batch, with the gradient at the add kept (bdelta)."""
    from types import SimpleNamespace

    from hookwidget.capture.norms import _per_sample_call

    emb = nn.Embedding(6, 3)
    pos = torch.arange(6)
    bd = torch.randn(B, 6, 3)
    call = SimpleNamespace(a=pos, delta=bd.sum(0), bdelta=bd)
    got = _per_sample_call(call, emb)
    assert got.delta is bd and got.a.shape == (B, 6)
    norms = fx.per_sample_norm_sq(fx.factors(emb, [got])[0])
    ref = torch.stack([torch.zeros(6, 3).index_add_(0, pos, bd[b]).pow(2).sum() for b in range(B)])
    close(norms, ref)
    assert _per_sample_call(SimpleNamespace(a=pos, delta=bd.sum(0) + 1, bdelta=bd), emb) is not None
    assert _per_sample_call(SimpleNamespace(a=pos, delta=bd.sum(0) + 1, bdelta=bd), emb).delta.shape == (6, 3)


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_vit_and_gpt2_shaped_models_are_covered_exactly(capture):
    """The full-coverage benchmark models, tiny: a ViT with class token and position embedding held by the model
    (the generic rule) and MultiheadAttention blocks (the fast rule); a GPT-2 with fused q/k/v and a position table
    called on arange(T). Norms over every parameter equal an autograd loop."""
    from benchmarks.models import GPT2MHA, ViT

    torch.manual_seed(0)
    cases = [(ViT(d=16, heads=2, layers=2, patch=4, image=8, classes=3), torch.randn(B, 3, 8, 8),
              torch.randint(0, 3, (B,))),
             (GPT2MHA(vocab=50, d=16, heads=2, layers=2, seq=8), torch.randint(0, 50, (B, 8)),
              torch.randint(0, 50, (B, 8)))]
    for model, x, y in cases:
        def loss(xb, yb, model=model):
            return nn.functional.cross_entropy(model(xb).flatten(0, -2), yb.flatten(), reduction="sum")

        t = traced(model, lambda x=x, y=y: loss(x, y), capture=capture)
        ref = loop_reference(model, lambda i, x=x, y=y: loss(x[i:i + 1], y[i:i + 1]))
        assert not t.per_sample_left_out, t.per_sample_left_out
        norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
        close(t.per_sample_grad_norms(), norms)
        assert all(used_fast(t, f"blocks.{i}.attn") for i in range(2))


class Tokens(nn.Module):
    """A model holding (1, T, d) parameters of its own, used as `how` says."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.pos = nn.Parameter(torch.randn(1, 4, 4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if self.how == "broadcast":  # ViT: concatenated with and added to the batch
            h = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        elif self.how == "alpha":  # added with alpha=2: the gradient at the add is not the position table's
            h = torch.add(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1), self.pos, alpha=2.0)
        elif self.how == "index":  # p[0]: the same outputs with the parameter copied per sample, other rows
            h = torch.cat([self.cls[0].expand(x.shape[0], 1, 4), x], 1) + self.pos[0]
        else:  # p.sum(0): other outputs
            h = torch.cat([self.cls.sum(0).expand(x.shape[0], 1, 4), x], 1) * self.pos.sum(0)
        return self.fc(torch.tanh(h))


@pytest.mark.parametrize("how", ["broadcast", "alpha", "index", "sum"])
@pytest.mark.parametrize("capture", ["full", "norms"])
def test_a_models_own_parameters_added_to_the_batch(how, capture):
    """The broadcast rule (batch_copies.broadcast_params) serves ViT's class token and position embedding from the
    gradient capture kept where they meet the batch (an expand, an add: no rerun of the model); where the forward
    indexes or reduces them, or adds them scaled, it is refused and the vmap rule answers, exactly."""
    torch.manual_seed(0)
    model = Tokens(how)
    x = torch.randn(B, 3, 4, requires_grad=True)  # in the graph: torch.cat of the raw data would hide its samples
    t = traced(model, lambda: model(x).pow(2).sum(), capture=capture)
    ref = loop_reference(model, lambda i: model(x[i:i + 1]).pow(2).sum())
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grad_norms(), torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1))
    if capture == "full":
        for k in ("cls", "pos"):
            close(t.per_sample_grads("Tokens", k), ref[k])
    assert used_fast(t, "Tokens") == (how == "broadcast")
    joined = t.layers["Tokens"].calls[0].join_rows or {}
    assert set(joined) == ({"cls", "pos"} if how in ("broadcast", "alpha") else set())
