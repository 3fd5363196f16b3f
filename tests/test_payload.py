"""payload: summaries match the Trace, detail tensors travel as downsampled float32 buffers."""

import json
import math

import numpy as np
import pytest
import torch

import hookwidget as hw
from hookwidget.views import payload


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
    # A token sequence (B, T, d) is sent as one T × d picture per sample, not a (B·T) × d strip.
    assert info["true_shape"] == [5, 6, 4] and info["shape"] == [5, 6, 4] and info["layout"] == "sequence"
    np.testing.assert_array_equal(a, x.detach().numpy())  # fc1's input is x itself
    st = info["stats"]  # statistics of the whole tensor, beside the picture
    x = x.detach()
    assert st["min"] == float(x.min()) and st["max"] == float(x.max()) and st["nan"] == 0 and st["inf"] == 0
    assert abs(st["mean"] - float(x.double().mean())) < 1e-12
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
    assert meta["max_abs_diff"] == pytest.approx(shown, rel=1e-6)  # a float32 difference: within half an ulp
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


def test_stats_are_of_the_full_tensor_not_the_downsampled_picture():
    t = torch.zeros(1000, 1000)
    t[3, 7] = 1000.0  # one spike: averaged away in a 200 × 200 picture
    t[5, 5] = float("nan")
    t[6, 6] = float("-inf")
    view, info = payload.downsample(t)
    assert view.shape == (200, 200) and info["max"] < 1000  # the picture's own range
    st = payload.stats(t)
    assert st["max"] == 1000.0 and st["min"] == 0.0 and st["nan"] == 1 and st["inf"] == 1
    finite = t[torch.isfinite(t)].double()
    # float32 reductions past 65,536 entries: display precision (4 significant digits) and then some
    assert st["mean"] == pytest.approx(float(finite.mean()), rel=1e-5)
    assert st["std"] == pytest.approx(float(finite.std(unbiased=False)), rel=1e-5)


def test_conv_activation_is_a_grid_of_channel_maps_per_sample():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3), torch.nn.Flatten(), torch.nn.Linear(5 * 6 * 6, 2))
    x = torch.randn(4, 3, 8, 8)
    t = hw.trace(lambda: model(x).sum().backward())
    meta, buffers = payload.detail(t, "0")
    a, info = _tensor(meta, buffers, "a")
    assert info["layout"] == "channels" and info["shape"] == [4, 3, 8, 8] and info["samples"] == 4
    np.testing.assert_array_equal(a, x.numpy())
    d, info = _tensor(meta, buffers, "delta")
    assert info["layout"] == "channels" and info["shape"] == [4, 5, 6, 6]


def test_forward_only_trace_has_no_grads_and_says_so():
    model = torch.nn.Linear(3, 2)
    t = hw.trace(lambda: model(torch.randn(4, 3)))
    s = payload.summary(t)
    assert s["has_grads"] is False
    assert any("no gradients captured" in n for n in s["notes"])


class NoisyScale(torch.nn.Module):
    """A parameter applied after dropout in its own forward: the generic rule cannot replay the random mask."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, self.training) * self.scale


def test_unsupported_layer_says_why_in_one_line_without_a_storage_table():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), NoisyScale(), torch.nn.Linear(4, 1))
    t = hw.trace(lambda: model(torch.randn(6, 3)).sum().backward())
    assert not t.supports("1")
    meta, _ = payload.detail(t, "1")
    assert "NoisyScale" in meta["unsupported"] and "\n" not in meta["unsupported"]
    assert "random" in meta["unsupported"]
    assert "storage" not in meta and "grad_rebuilt" not in meta["tensors"]
    assert not any(n.startswith("ValueError") for n in meta["notes"])


def test_diff_rel_change_new_where_before_is_zero_and_hooked_marked(seed_mlp):
    t = hw.trace(seed_mlp[3])
    t.add_hook("fc2", "grad_scale", factor=0.5)
    t2 = t.rerun()
    d = payload.diff(t.session.baseline if getattr(t, "session", None) else t, t2)
    rows = {p["name"]: p for p in d["params"]}
    assert rows["fc2.weight"]["hooked"] and not rows["fc1.weight"]["hooked"]
    assert abs(rows["fc2.weight"]["rel_change"] - 0.5) < 1e-6 and abs(rows["fc2.weight"]["cosine"] - 1) < 1e-6
    assert d["against"] == "baseline"

    class P:  # g0 = 0, g1 != 0
        rel_change, before, after = float("inf"), 0.0, 1.0

    assert payload._rel(P) == "new"


def test_module_rows_carry_the_layer_overviews_norms(traced):
    """The layer overview (js/explorer/overview.js) reads, before any click: own parameters, ‖W.grad‖₂ of them,
    ‖a‖₂ and ‖δ‖₂ of the first call, and the health flags."""
    model, _, t = traced
    rows = {r["name"]: r for r in payload.summary(t)["modules"]}
    with_params = [n for n, r in rows.items() if r["own_params"]]
    assert with_params == [n for n in t.layers if any(True for _ in t.layers[n].module.parameters(recurse=False))]
    assert rows["SeedMLP"]["own_params"] == [] and rows["SeedMLP"]["grad_norm"] is None
    c = t.layers["fc2"].calls[0]
    assert rows["fc2"]["a"]["norm"] == pytest.approx(float(c.a.norm()), rel=1e-6)
    assert rows["fc2"]["delta"]["norm"] == pytest.approx(float(c.delta.norm()), rel=1e-6)
    assert rows["fc2"]["grad_norm"] == pytest.approx(float(model.fc2.weight.grad.norm()), rel=1e-6)
    assert all(isinstance(r["flags"], list) for r in rows.values())


def test_full_tensor_statistics_count_nan_and_inf_and_describe_the_finite_entries():
    t = torch.tensor([[1.0, -2.0, float("nan")], [float("inf"), 4.0, 0.5]])
    s = payload.stats(t)
    finite = t[torch.isfinite(t)].double()
    assert (s["nan"], s["inf"], s["numel"]) == (1, 1, 6)
    assert (s["min"], s["max"]) == (float(finite.min()), float(finite.max()))
    assert s["mean"] == pytest.approx(float(finite.mean()))
    assert s["std"] == pytest.approx(float(finite.std(unbiased=False)))
    clean = payload.stats(torch.arange(6.0).reshape(2, 3))
    assert (clean["nan"], clean["inf"], clean["min"], clean["max"]) == (0, 0, 0.0, 5.0)
    assert clean["norm"] == pytest.approx(float(torch.arange(6.0).norm()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tensor_statistics_are_accurate_without_cancellation(dtype):
    """Past CHUNK entries the statistics of a float32 or half tensor are accumulated a piece at a time in float64:
    a mean far from zero must not cancel the std (E[x²] − mean² in float32 would print std 0 here, and in float64
    keep a few digits: a second pass takes Σ(x − mean)²)."""
    g = torch.Generator().manual_seed(0)
    spread = 1e-3 if dtype == torch.float32 else 1.0  # bfloat16 has no 1e-3 steps at 1000
    t = (1000.0 + spread * torch.randn(3 * payload.CHUNK + 17, generator=g)).to(dtype)
    s, ref = payload.stats(t), t.double()
    rounding = 1e-7 if dtype == torch.float32 else 1e-12
    assert s["mean"] == pytest.approx(float(ref.mean()), rel=rounding)
    assert s["std"] == pytest.approx(float(ref.std(unbiased=False)), rel=1e-6)
    assert (s["min"], s["max"]) == (float(t.min()), float(t.max()))
    t = t.float()
    b = t + torch.randn(t.shape, generator=g) * 1e-4
    assert payload.max_abs_diff(t, b) == pytest.approx(float((t.double() - b.double()).abs().max()), rel=1e-6)
    b[5] = float("nan")  # one NaN anywhere is the answer, as torch's max gives it
    assert math.isnan(payload.max_abs_diff(t, b))


def test_first_sample_gradient_is_row_zero_of_the_per_sample_gradients():
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    idx = torch.randint(0, 20, (5, 7))
    t = hw.trace(lambda: seq(idx).pow(2).sum().backward())
    conv = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(48, 2))
    x = torch.randn(4, 2, 6, 6)
    tc = hw.trace(lambda: conv(x).sum().backward())
    for tr, name in [(t, "0"), (t, "1"), (t, "3"), (tc, "0"), (tc, "2")]:
        assert torch.equal(payload.first_sample_grad(tr, name), tr.per_sample_grads(name)[0]), name


def test_a_generic_rule_layer_shows_its_per_sample_norms():
    """An LSTM's parameters have other names than `weight`: its detail still shows the per-sample norms the
    generic rule gives (checked against an autograd loop over the samples)."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4, batch_first=True)
    model = torch.nn.Sequential(lstm)
    x = torch.randn(5, 6, 3)
    t = hw.trace(lambda: lstm(x)[0].pow(2).sum().backward(), model)
    meta, buffers = payload.detail(t, "0")
    assert "unsupported" not in meta
    ref = []
    for i in range(5):
        lstm.zero_grad()
        lstm(x[i:i + 1])[0].pow(2).sum().backward()
        ref.append(torch.cat([p.grad.flatten() for p in lstm.parameters()]).norm())
    torch.testing.assert_close(t.per_sample_grad_norms("0"), torch.stack(ref), rtol=1e-4, atol=1e-6)
    assert "per_sample_norms" in meta["tensors"]


def test_summary_norms_match_autograd_and_stay_plain_json_where_a_gradient_is_not_finite(traced):
    """Parameter and layer norms come from one multi-tensor pass (graph.l2_norms); checked against each
    .grad's own norm, and a NaN gradient must reach the JSON as the string "nan"."""
    model, _, t = traced
    s = payload.summary(t)
    for name, p in model.named_parameters():
        assert s["params"][name] == pytest.approx(float(p.grad.norm()), rel=1e-6), name
    net = torch.nn.Linear(3, 2)
    bad = hw.trace(lambda: (net(torch.randn(4, 3)).sum() * float("nan")).backward())
    s = payload.summary(bad)
    json.dumps(s, allow_nan=False)
    assert s["params"]["weight"] == "nan"
    (row,) = s["modules"]  # a traced bare layer: its row is named by its class, its weight "weight"
    assert row["own_params"] == ["weight", "bias"] and row["grad_norm"] == "nan"
    meta, _ = payload.detail(bad, row["name"])
    assert "grad_autograd" in meta["tensors"]  # its .grad found under the trace's name for it


def test_a_tensor_the_graph_reduced_is_not_reduced_again_and_a_changed_one_is(traced):
    """graph.build notes the norms of the .grad and δ tensors it reduces; the payload takes them from there.
    A tensor changed in place since (its version moved on) or freed (its id reused) gets no stale value."""
    from hookwidget import stats

    model, _, t = traced
    _ = t.graph  # built: it noted the norms it reduced
    g = t.param_grads["fc1.weight"]
    assert stats.known_l2(g) == pytest.approx(float(model.fc1.weight.grad.norm()), rel=1e-6)
    x = torch.tensor([3.0, 4.0])
    assert stats.l2_norms([x, torch.arange(3), torch.empty(0)]) == [pytest.approx(5.0), pytest.approx(5 ** 0.5), 0.0]
    x.mul_(2)
    assert stats.known_l2(x) is None and stats.l2_norms([x]) == [pytest.approx(10.0)]
    key = id(x)
    del x
    assert key not in stats._L2  # dropped with the tensor: a new tensor at that id starts unknown
    with torch.inference_mode():  # no version counter: reduced every time, never remembered
        z = torch.tensor([6.0, 8.0])
    assert stats.l2_norms([z]) == [pytest.approx(10.0)] and stats.known_l2(z) is None


class _ReusedPoolCNN(torch.nn.Module):
    """Issue 25's CNN: biases that feed a BatchNorm (their exact gradient is 0) and one pool called twice."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.pool, self.fc = torch.nn.MaxPool2d(2), torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        return self.fc(x.flatten(1))


def test_diff_ranks_real_changes_first_and_marks_float_noise():
    """Issue 25: under grad_scale(0.1) on conv2 the BatchNorm-fed conv1.bias (gradient ~1e-7, pure rounding) changes
    by a 'relative' 0.97: it is noise, ranked last, no cosine, not changed; the first row is a real change."""
    torch.manual_seed(0)
    model, x, y = _ReusedPoolCNN(), torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))

    def step():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    t = hw.trace(step)
    t.add_hook("conv2", "grad_scale", factor=0.1)
    t2 = t.rerun()
    d = payload.diff(t, t2)
    json.dumps(d, allow_nan=False)
    rows = {p["name"]: p for p in d["params"]}
    for bias in ("conv1.bias", "conv2.bias"):
        assert rows[bias]["noise"] and rows[bias]["cosine"] is None and rows[bias]["rel_change"] > 0.5
    first = d["params"][0]
    assert first["name"] in ("conv2.weight", "conv1.weight") and not first["noise"]
    assert abs(first["rel_change"] - 0.9) < 1e-4 and abs(first["cosine"] - 1) < 1e-6
    assert [p["noise"] for p in d["params"]][-2:] == [True, True]
    impacts = [p["impact"] for p in d["params"] if not p["noise"]]
    assert impacts == sorted(impacts, reverse=True) and d["grad_scale"] > 0
    assert abs(rows["conv1.weight"]["impact"] - rows["conv1.weight"]["change"] / d["grad_scale"]) < 1e-12
    assert not [n for n in d["changed_nodes"] if t2.graph.nodes[n].get("param") == "conv1.bias"]
    pd = t2.diff(t)
    assert "conv1.bias" not in pd.changed and pd.ranked[0].name == first["name"]
    assert "noise" in repr(pd)
