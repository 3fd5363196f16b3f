"""payload: summaries match the Trace, detail tensors travel as downsampled float32 buffers."""

import json

import numpy as np
import pytest
import torch

import hookwidget as hw
from hookwidget import payload


@pytest.fixture
def traced(seed_mlp):
    model, x, y, step = seed_mlp
    return model, x, hw.trace(step)


def _tensor(meta, buffers, key):
    info = meta["tensors"][key]
    return np.frombuffer(buffers[info["buffer"]], dtype=info["dtype"]).reshape(info["shape"]), info


def test_summary_graph_matches_networkx_and_is_plain_json(traced):
    _, _, t = traced
    s = payload.summary(t)
    json.dumps(s, allow_nan=False)
    g = s["graph"]
    assert g["id"] == list(t.graph.nodes)
    edges = {(g["id"][u], g["id"][v]) for u, v in zip(g["edges"][::2], g["edges"][1::2])}
    assert edges == set(t.graph.edges)
    i = g["id"].index("AccumulateGrad#0")
    assert (g["role"][i], g["param"][i], g["module"][i]) == ("param", "fc2.weight", "fc2")


def test_module_tree_names_classes_counts_and_parents(traced):
    model, _, t = traced
    rows = {r["name"]: r for r in payload.summary(t)["modules"]}
    assert rows["fc1"]["cls"] == "Linear" and rows["fc1"]["params"] == model.fc1.weight.numel()
    assert rows["fc1"]["parent"] == "SeedMLP" and rows["SeedMLP"]["parent"] is None
    assert rows["fc1"]["calls"] == 1 and rows["fc1"]["a"]["shape"] == [5, 6, 4]
    assert rows["fc1"]["grad_norm"] == pytest.approx(float(model.fc1.weight.grad.norm()), rel=1e-6)


def test_module_rows_carry_the_users_own_hooks(seed_mlp):
    model, x, y, step = seed_mlp

    def probe(m, i, o):
        return None

    handles = [model.fc1.register_forward_hook(probe), model.fc1.weight.register_hook(lambda g: g)]
    try:
        rows = {r["name"]: r for r in payload.summary(hw.trace(step))["modules"]}
    finally:
        for h in handles:
            h.remove()
    assert [h.split(":")[0] for h in rows["fc1"]["user_hooks"]] == ["forward", "tensor"]
    assert "probe" in rows["fc1"]["user_hooks"][0]
    assert rows["fc2"]["user_hooks"] == []


def test_layer_detail_buffers_against_autograd(traced):
    model, x, t = traced
    meta, buffers = payload.detail(t, "fc1")
    assert all(isinstance(b, bytes) for b in buffers)
    json.dumps(meta, allow_nan=False)
    a, info = _tensor(meta, buffers, "a")
    assert info["true_shape"] == [5, 6, 4] and info["shape"] == [30, 4]
    np.testing.assert_array_equal(a, x.detach().reshape(30, 4).numpy())  # fc1's input is x itself
    grad, _ = _tensor(meta, buffers, "grad_autograd")
    np.testing.assert_array_equal(grad, model.fc1.weight.grad.numpy())
    assert meta["max_abs_diff"] <= 1e-5
    norms, info = _tensor(meta, buffers, "per_sample_norms")
    assert info["shape"] == [5]
    assert meta["storage"]["weight_grad_floats"] == 12 and meta["storage"]["factor_floats"] == 30 * 7


def test_max_abs_diff_is_the_reference_difference(traced):
    model, x, t = traced
    meta, _ = payload.detail(t, "fc2")
    ref = torch.einsum("bto,bti->oi", t.layers["fc2"].delta.double(), t.layers["fc2"].a.double())
    shown = float((model.fc2.weight.grad.double() - t.weight_grad("fc2").double()).abs().max())
    assert meta["max_abs_diff"] == shown
    # and the rebuilt gradient it compares is the float64 sum of δ ⊗ a, up to float32 rounding
    assert float((t.weight_grad("fc2").double() - ref).abs().max()) <= 1e-5


def test_param_node_detail_carries_its_grad(traced):
    model, _, t = traced
    meta, buffers = payload.detail(t, "AccumulateGrad#0")
    assert meta["param"] == "fc2.weight" and meta["role"] == "param"
    grad, _ = _tensor(meta, buffers, "grad_autograd")
    np.testing.assert_array_equal(grad, model.fc2.weight.grad.numpy())


def test_unknown_target_is_a_clear_error(traced):
    with pytest.raises(KeyError, match="unknown target"):
        payload.detail(traced[2], "nope")


def test_downsample_block_means_and_true_shape():
    x = torch.randn(1000, 400, dtype=torch.float64)
    arr, info = payload.downsample(x, "rows")
    assert info["shape"] == [200, 200] and info["true_shape"] == [1000, 400]
    ref = x.reshape(200, 5, 200, 2).mean((1, 3)).float().numpy()
    np.testing.assert_allclose(arr, ref, rtol=1e-5, atol=1e-6)
    arr, info = payload.downsample(torch.randn(2, 128, 768), "rows")
    assert info["shape"] == [200, 200] and info["true_shape"] == [2, 128, 768]
    arr, info = payload.downsample(torch.randn(4096), "vector")
    assert info["shape"] == [1000]


def test_nonfinite_values_are_json_safe():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]])
    arr, info = payload.downsample(x)
    assert info["nonfinite"] == 2 and info["min"] == -2.0 and info["max"] == 1.0
    assert np.isnan(arr[0, 1]) and np.isinf(arr[1, 0])
    assert payload._num(float("nan")) == "nan" and payload._num(float("-inf")) == "-inf"


def test_diff_names_changed_modules_and_nodes(traced):
    model, _, t = traced
    t.add_hook("fc1", "grad_zero")
    t2 = t.rerun()
    d = payload.diff(t, t2)
    json.dumps(d, allow_nan=False)
    assert d["changed_modules"] == ["fc1"]
    assert "AccumulateGrad#2" in d["changed_nodes"] and "AccumulateGrad#0" not in d["changed_nodes"]
    after = {p["name"]: p for p in d["params"]}
    assert after["fc1.weight"]["after"] == 0.0 and after["fc2.weight"]["rel_change"] == 0.0


def test_health_is_computed_once_per_trace(seed_mlp, monkeypatch):
    t = hw.trace(seed_mlp[3])
    calls, original = [], type(t).health
    monkeypatch.setattr(type(t), "health", lambda self, **kw: calls.append(1) or original(self, **kw))
    payload.summary(t)
    payload.detail(t, "fc1")
    payload.detail(t, "fc2")
    assert len(calls) == 1


def test_tensor_info_counts_nan_and_inf():
    info = payload._tensor_info(torch.tensor([1.0, float("nan"), float("inf"), 2.0]), None)
    assert info["nonfinite"] == 2 and info["norm"] == "nan"
    info = payload._tensor_info(torch.tensor([3.0, 4.0]), None)
    assert info["nonfinite"] == 0 and info["norm"] == 5.0
