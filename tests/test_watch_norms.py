"""stats.l2 / l2_batch, the one 2-norm the watch uses: bitwise the plain reduction where nothing overflows,
float64 where a float32 sum of squares would (finite entries past ~1e19), no host read on the way."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw
from hookwidget.stats import fused_norms, l2, l2_batch


def test_bitwise_the_plain_reduction_where_nothing_overflows():
    torch.manual_seed(0)
    ts = [torch.randn(7, 5), torch.randn(300, dtype=torch.float64), torch.randn(4, 4).T, torch.randn(33)]
    for t in ts:
        assert torch.equal(l2(t), torch.linalg.vector_norm(t))
    got = l2_batch(ts)
    assert all(torch.equal(a, b) for a, b in zip(got, torch._foreach_norm(ts)))
    low = [torch.randn(50, dtype=torch.bfloat16), torch.randn(9, dtype=torch.float16)]
    for t in low:  # accumulated in float32
        want = torch.linalg.vector_norm(t, dtype=torch.float32)
        assert torch.equal(l2(t), want) and l2(t).dtype == torch.float32
    assert all(torch.equal(a, torch.linalg.vector_norm(t, dtype=torch.float32)) for a, t in zip(l2_batch(low), low))


def test_overflow_safe():
    big = torch.full((4,), 1e20)
    assert math.isinf(torch.linalg.vector_norm(big).item())  # the plain float32 reduction overflows
    assert l2(big).item() == pytest.approx(2e20) and l2(big).dtype == torch.float64
    bf = torch.full((8,), 3e19, dtype=torch.bfloat16)
    got = l2_batch([big, torch.ones(4), bf])
    assert got[0].item() == pytest.approx(2e20) and got[1].item() == 2.0
    assert got[2].item() == pytest.approx(float(bf[0]) * 8 ** 0.5, rel=1e-6)
    assert fused_norms({"x": big})["x"][0].item() == pytest.approx(2e20)


def test_non_finite_empty_integer_and_one_at_a_time():
    assert math.isnan(l2(torch.tensor([1.0, float("nan")])).item())
    assert math.isinf(l2(torch.tensor([1.0, float("inf")])).item())
    assert l2(torch.empty(0)).item() == 0.0
    assert l2(torch.arange(5)).item() == pytest.approx(30 ** 0.5)
    ts = [torch.randn(3), torch.full((2,), 1e20)]
    one = l2_batch(ts, batched=False)
    assert torch.equal(one[0], torch.linalg.vector_norm(ts[0])) and one[1].item() == pytest.approx(2 ** 0.5 * 1e20)


def test_the_watch_reports_an_activation_past_float32s_sum_of_squares():
    """An input of 1e20: ‖a‖² overflows float32, yet every entry is finite: a_rms is 1e20, not inf, and no
    anomaly says 'non-finite'."""
    model = nn.Sequential(nn.Linear(3, 2))
    with torch.no_grad():
        model[0].weight.fill_(1e-20)
        model[0].bias.zero_()
    x = torch.full((4, 3), 1e20)
    with hw.watch(model, flight_recorder=False) as w:
        model.zero_grad()
        F.mse_loss(model(x), torch.zeros(4, 2)).backward()
    assert w.series("0", "a_rms")[0].item() == pytest.approx(1e20)
    assert w.series("0", "a_nonfinite")[0].item() == 0
    assert not any("non-finite" in a[2] for a in w.anomalies)


def test_the_sync_free_path_agrees(monkeypatch):
    """Inside torch.compile overflow is found by torch.where, not by reading the norms: run that path here by
    making the CPU look compiled."""
    ts = [torch.randn(6), torch.full((4,), 1e20), torch.randn(3, dtype=torch.bfloat16)]
    plain = [l2(t) for t in ts]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for got in ([l2(t) for t in ts], l2_batch(ts)):
        assert got[1].item() == pytest.approx(2e20)
        assert torch.equal(got[0], plain[0].double()) and torch.equal(got[2], plain[2].double())


def test_the_device_path_accumulates_in_float64(monkeypatch):
    """Off the CPU every norm is one float64-accumulating multi-tensor reduction (stats._wide): run that path here.
    Overflow-safe by itself, float64 out, for one tensor and for groups of several dtypes; and a watch that takes
    it records the statistics the CPU path does."""
    import hookwidget.stats as stats

    torch.manual_seed(0)
    ts = [torch.randn(50), torch.full((7,), 1e30), torch.randn(3, 5).half(), torch.zeros(0), torch.randn(4, 4)]
    want = [torch.linalg.vector_norm(t.double()) for t in ts]

    def run():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        torch.manual_seed(1)
        x = torch.randn(5, 4)
        with hw.watch(model, flight_recorder=False) as w:
            for _ in range(3):
                model.zero_grad()
                F.mse_loss(model(x), torch.zeros(5, 2)).backward()
        return w.stats

    torch.manual_seed(2)
    cpu_path = run()
    monkeypatch.setattr(stats, "_wide", lambda t: True)
    for got, ref in (([l2(t) for t in ts], want), (l2_batch(ts), want), (l2_batch(ts[:2]), want[:2])):
        for g, w in zip(got, ref):
            assert g.dtype == torch.float64 and g.item() == pytest.approx(w.item(), rel=1e-12)
    torch.manual_seed(2)
    device_path = run()
    assert torch.allclose(device_path, cpu_path, rtol=1e-6, equal_nan=True)
