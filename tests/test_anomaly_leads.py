"""The lead of an anomaly, computed in Python from the watch's rows (hookwidget/watch/leads.py): the earliest
leading statistic out of its window, and a recorded learning rate's rise named directly."""

import math
import re

import numpy as np
import pytest

from hookwidget.watch import leads
from hookwidget.watch.leads import Rows, departure, fmt, lead_of

STATS = ["delta_norm", "delta_max", "delta_nan", "delta_inf", "a_rms", "a_zero_frac", "a_nonfinite", "grad_norm",
         "weight_norm", "update_ratio", "grad_nan", "grad_inf"]
LAYERS = ["fc1", "fc2", "fc3"]


def diverging(n=300, lr=None) -> Rows:
    """A run whose learning rate is raised ×300 at step 200: the update ratio jumps there, gradients stay normal;
    the loss spikes at 201 and the gradients blow up after (the first gradient norm is Inf at 203). `lr(r, l)`:
    the learning rate the watch recorded, or none recorded."""
    stats = STATS + ["lr"] if lr else STATS
    rng = np.random.default_rng(1)
    s = np.zeros((n, 3, len(stats)))
    t = np.zeros((n, 2))
    k = {name: i for i, name in enumerate(stats)}
    for r in range(n):
        blow = 10.0 ** min(40, 3 * (r - 200)) if r > 200 else 1.0
        noise = 1 + 0.2 * (rng.random(6) - 0.5)
        for layer in range(3):
            if lr:
                s[r, layer, k["lr"]] = lr(r, layer)
            s[r, layer, k["delta_norm"]] = 0.1 * noise[0] * blow
            s[r, layer, k["a_rms"]] = 0.5 * noise[1]
            s[r, layer, k["weight_norm"]] = 3 * noise[2]
            s[r, layer, k["grad_norm"]] = math.inf if (r, layer) == (203, 0) else 0.2 * noise[3] * blow
            s[r, layer, k["update_ratio"]] = math.nan if r == 0 else 1e-3 * noise[4] * (300 if r >= 200 else 1)
        t[r] = (2 * blow if r > 200 else 1 / (1 + r / 50), math.inf if r == 203 else 0.35 * noise[5] * blow)
    return Rows(s, t, range(n), LAYERS, stats, ["loss", "grad_norm"])


def test_the_update_ratio_jumping_everywhere_is_named_a_learning_rate_change():
    rows = diverging()
    lead = leads.leads(rows, [201, 202, 201])[201]
    assert (lead.step, lead.stat, lead.lr, lead.layers) == (200, "update_ratio", True, tuple(LAYERS))
    assert lead.ratio > 200
    assert re.match(r"^step 200: update ratio .*×\d+ in 3 layers.*learning rate", lead.text), lead.text
    assert leads.leads(rows, [202])[202].step == 200


def test_a_recorded_learning_rate_rise_is_the_lead_named_directly():
    lead = lead_of(diverging(300, lambda r, layer: 0.3 if r >= 200 else 1e-3), 201)
    assert (lead.step, lead.stat, lead.lr, lead.layers) == (200, "lr", True, tuple(LAYERS))
    assert lead.ratio == pytest.approx(300)
    assert re.match(r"^step 200: learning rate ×300 \(0\.001 → 0\.3\) in 3 layers \(fc1, fc2, …\), "
                    r"update ratio ‖ΔW‖/‖W‖ ×\d+$", lead.text), lead.text


def test_a_schedulers_decay_and_warmup_are_no_lead_and_groups_are_read_by_value():
    decay = diverging(300, lambda r, layer: 0.1 * 0.1 ** (r // 50) * ((r + 1) / 10 if r < 10 else 1))
    assert lead_of(decay, 201).stat == "update_ratio"  # the inferred lead, not a learning-rate rise
    groups = diverging(300, lambda r, layer: (0.01 if layer == 2 else 0.001) * (math.nan if r == 190 else 1)
                       * (300 if r >= 200 else 1))
    assert re.match(r"^step 200: learning rate ×300 in 3 layers", lead_of(groups, 201).text)  # values differ


def test_a_steady_run_has_no_lead_and_a_jump_leaves_its_window():
    assert lead_of(diverging(), 150) is None
    values = np.array([40.0 if r == 50 else 1 + (r % 3) * 0.01 for r in range(100)])
    assert departure(values, 49) is None
    assert departure(values, 50)[0] > 30
    assert departure(values, 3) is None  # too few rows before it for a window


def test_only_gradients_jumping_make_a_gradient_lead():
    rows = diverging()
    rows.stats[:, :, STATS.index("update_ratio")] = 1e-3  # no learning-rate change: the blow-up leads
    lead = lead_of(rows, 205)
    assert lead.stat == "grad_norm" and lead.step == 201 and not lead.lr


@pytest.mark.parametrize("v, text", [(0.001, "0.001"), (0.3, "0.3"), (1234.5, "1,235"), (3, "3"), (2.5e-5, "2.5e-5"),
                                     (1e10, "1e10"), (-0.12345, "-0.1235"), (math.nan, "nan")])
def test_numbers_read_as_the_view_writes_them(v, text):
    assert fmt(v) == text


def test_a_live_watch_names_the_lead_in_python_saved_and_loaded_alike(tmp_path):
    """Issue 42: the lead is part of w.anomalies (not only of the view), and a saved watch reads the same."""
    import torch
    from torch import nn

    import hookwidget as hw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 4)
    y = x.sum(1, keepdim=True)
    with hw.watch(model) as w:
        for step in range(230):
            if step == 200:
                opt.param_groups[0]["lr"] = 3.0
            batch = torch.randint(0, 512, (32,))
            opt.zero_grad()
            nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
            opt.step()
    first = w.anomalies[0]
    assert first.step == 201 and first.lead.step == 200 and first.lead.stat == "lr"
    assert first.lead.text.startswith("step 200: learning rate ×60 (0.05 → 3) in 2 layers (0, 2)")
    step, where, reason = first  # still the (step, where, reason) tuple it was
    assert (step, where) == (201, "loss") and first == (201, "loss", reason)
    w.save(tmp_path / "run.pt")
    loaded = hw.load(tmp_path / "run.pt")
    assert [a.lead for a in loaded.anomalies] == [a.lead for a in w.anomalies]
