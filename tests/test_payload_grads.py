"""The detail's W.grad section (views/payload/grads.py): a large weight's Σ δ⊗a pictured from its factors and checked
against .grad along random directions, a tied weight compared as the sum of every layer that reads it. References
come from autograd (a layer's share of a tied weight: the same model with that layer's weight untied)."""

import json

import jsonschema
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw
from hookwidget.layers import freivalds
from hookwidget.views import payload
from hookwidget.views.payload import grads
from hookwidget.views.widget import PAYLOAD_SCHEMA

SPEC = json.loads(PAYLOAD_SCHEMA.read_text(encoding="utf-8"))


def _picture(meta, buffers, key):
    info = meta["tensors"][key]
    return np.frombuffer(buffers[info["buffer"]], dtype=info["dtype"]).reshape(info["shape"]), info


def _valid(meta):
    schema = {"$defs": SPEC["$defs"], "$ref": "#/$defs/detail_meta"}
    jsonschema.Draft202012Validator(schema).validate(json.loads(json.dumps(meta, allow_nan=False)))


def _pooled(g: torch.Tensor) -> np.ndarray:
    rows, cols = g.shape
    side = payload.MAX_SIDE
    return F.adaptive_avg_pool2d(g.double()[None, None], (min(rows, side), min(cols, side)))[0, 0].numpy()


class TiedLM(nn.Module):
    """A token table and a head reading the same weight (GPT-2's), sizes that pool into overlapping windows."""

    def __init__(self, vocab=1003, d=257, tied=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.wte(idx))))


def _tied_and_untied():
    torch.manual_seed(0)
    tied = TiedLM()
    untied = TiedLM(tied=False)
    untied.load_state_dict(tied.state_dict())
    untied.head.weight = nn.Parameter(tied.wte.weight.detach().clone())  # the head's share, by autograd
    idx = torch.randint(0, 1003, (3, 11))
    target = torch.randint(0, 1003, (3, 11))

    def step(m):
        m.zero_grad()
        F.cross_entropy(m(idx).flatten(0, 1), target.flatten()).backward()

    step(untied)
    return tied, untied, lambda: step(tied)


@pytest.fixture
def directions_path(monkeypatch):
    """Every weight takes the large-weight path (a test-sized model stands for GPT-2's 38M-float head)."""
    monkeypatch.setattr(grads, "WHOLE_LIMIT", 0)


def test_a_large_linear_pictures_its_factors_as_the_block_means_of_its_grad(directions_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(301, 503), nn.Tanh(), nn.Linear(503, 7))
    x = torch.randn(4, 9, 301)
    t = hw.trace(lambda: model(x).pow(2).sum().backward())
    meta, buffers = payload.detail(t, "0")
    _valid(meta)
    pic, info = _picture(meta, buffers, "grad_rebuilt")
    ref = _pooled(model[0].weight.grad)
    assert info["true_shape"] == [503, 301] and pic.shape == ref.shape == (200, 200)
    np.testing.assert_allclose(pic, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert info["stats"] is None  # the whole tensor was not rebuilt: no statistics claimed for it
    check = meta["grad_check"]
    assert "max_abs_diff" not in meta and check["agree"] and check["layers"] == ["0"]
    U, V = freivalds.directions((503, 301), "cpu")
    g = model[0].weight.grad.double()
    want = [float(U[:, k] @ g @ V[:, k]) for k in range(U.shape[1])]
    assert check["values"] == pytest.approx(want, rel=1e-5)  # uᵀ W is projected in W's float32
    assert all(d <= 1e-5 * abs(v) for d, v in zip(check["differences"], want))


def test_a_tied_weight_pictures_each_readers_share_and_checks_their_sum(directions_path):
    tied, untied, step = _tied_and_untied()
    t = hw.trace(step)
    head, head_buffers = payload.detail(t, "head")
    table, table_buffers = payload.detail(t, "wte")
    _valid(head)
    head_pic, _ = _picture(head, head_buffers, "grad_rebuilt")
    np.testing.assert_allclose(head_pic, _pooled(untied.head.weight.grad), rtol=0,
                               atol=1e-5 * np.abs(head_pic).max())
    table_pic, _ = _picture(table, table_buffers, "grad_rebuilt")  # the one-hot factor: rows picked by token ids
    np.testing.assert_allclose(table_pic, _pooled(untied.wte.weight.grad), rtol=0,
                               atol=1e-5 * np.abs(table_pic).max())
    assert head["grad_check"]["layers"] == ["head", "wte"] and table["grad_check"]["layers"] == ["wte", "head"]
    assert head["grad_check"]["agree"] and table["grad_check"]["agree"]
    assert any("also read by wte" in n and "head's share" in n for n in head["notes"])
    autograd, _ = _picture(head, head_buffers, "grad_autograd")
    np.testing.assert_allclose(autograd, _pooled(tied.wte.weight.grad), rtol=0, atol=1e-6 * np.abs(autograd).max())


def test_a_small_tied_weight_is_compared_whole_with_every_readers_sum():
    """Below WHOLE_LIMIT the sum is rebuilt and compared entry by entry: against every reader's factors, so the
    difference is rounding, where the head's share alone differs from .grad by the table's share."""
    tied, untied, step = _tied_and_untied()
    t = hw.trace(step)
    meta, buffers = payload.detail(t, "head")
    share = untied.head.weight.grad
    assert float((tied.wte.weight.grad - share).abs().max()) > 1e-3  # the table's share is not small
    assert meta["max_abs_diff"] <= 1e-6 and "grad_check" not in meta
    pic, info = _picture(meta, buffers, "grad_rebuilt")
    np.testing.assert_allclose(pic, _pooled(share), rtol=0, atol=1e-5 * np.abs(pic).max())
    assert info["stats"]["norm"] == pytest.approx(float(share.norm()), rel=1e-5)


def test_a_reader_whose_factors_were_not_kept_leaves_the_comparison_out_with_its_name(directions_path):
    _, _, step = _tied_and_untied()
    t = hw.trace(step)
    t.layers["wte"].calls[0].delta = None  # as over budget_mb: the table's δ kept as a summary only
    meta, _ = payload.detail(t, "head")
    _valid(meta)
    assert "grad_check" not in meta and "max_abs_diff" not in meta
    assert any(n.startswith("W.grad not compared with the factors: wte (") for n in meta["notes"])
    assert "grad_rebuilt" in meta["tensors"]  # the head's own share is still shown


class ReadTwice(nn.Module):
    """The layer's weight is also read outside the layer's call: its factors miss that part of .grad."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(13, 17)

    def forward(self, x):
        return self.lin(x) + F.linear(x.flip(-1), self.lin.weight)


def test_factors_that_miss_part_of_the_grad_disagree_along_the_directions_by_that_part(directions_path):
    torch.manual_seed(0)
    model = ReadTwice()
    x = torch.randn(6, 13)
    t = hw.trace(lambda: model(x).pow(2).sum().backward())
    meta, _ = payload.detail(t, "lin")
    check = meta["grad_check"]
    assert not check["agree"]
    ref = ReadTwice()  # the part read outside the layer, by autograd: the same step with the layer's call detached
    ref.load_state_dict(model.state_dict())
    y = ref.lin(x).detach() + F.linear(x.flip(-1), ref.lin.weight)
    y.pow(2).sum().backward()
    U, V = freivalds.directions((17, 13), "cpu")
    missing = [abs(float(U[:, k] @ ref.lin.weight.grad.double() @ V[:, k])) for k in range(U.shape[1])]
    assert check["differences"] == pytest.approx(missing, rel=1e-4)
    assert all(d > tol for d, tol in zip(check["differences"], check["tolerances"]))


def test_a_convolution_is_rebuilt_whole_at_any_size(directions_path):
    """Its factors cannot be projected (no unfolded input is built): the whole rebuild and max |diff| stay."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3)
    x = torch.randn(2, 3, 8, 8)
    t = hw.trace(lambda: conv(x).pow(2).sum().backward(), nn.Sequential(conv))
    meta, _ = payload.detail(t, "0")
    assert "grad_check" not in meta and meta["max_abs_diff"] <= 1e-5
    assert meta["tensors"]["grad_rebuilt"]["stats"] is not None


def test_large_float32_statistics_in_one_float64_pass_match_float64():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3 * payload.CHUNK + 17, generator=g) * 1e-4 + 3e-5
    s, ref = payload.stats(t), t.double()
    assert s["mean"] == pytest.approx(float(ref.mean()), rel=1e-12)
    assert s["std"] == pytest.approx(float(ref.std(unbiased=False)), rel=1e-10)


def test_a_long_note_is_cut_in_the_detail_with_a_pointer_to_the_whole():
    """GPT-2 124M's per-sample note lists 148 parameters (27,500 characters): the detail shows its start."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(30)])
    x = torch.randn(4, 8)
    t = hw.trace(lambda: model(x).sum().backward(), budget_mb=0.001)  # nothing kept: every parameter left out
    whole = next(str(n) for n in t.note_records if "3" in n.layers and len(str(n)) > 1000)
    meta, _ = payload.detail(t, "3")
    cut = next(n for n in meta["notes"] if n.endswith("… (the whole note: t.notes)"))
    assert whole.startswith(cut[:-len("… (the whole note: t.notes)")]) and len(cut) < 500
