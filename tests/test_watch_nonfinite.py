"""Non-finite runs (issue 41): a run that diverges gives one anomaly for the onset and a count of the non-finite steps
after it, in Python (w.nonfinite), in a saved watch and in the view's data. The reference is the plain loop's own
losses and .grad, checked by hand; nothing comes from hookwidget."""

import math

import torch
from torch import nn

import hookwidget as hw
from hookwidget.views.watch_export import data


def diverging(watched: bool, steps=300, blow_up=150):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    bad = []
    w = hw.watch(model, flight_recorder=True) if watched else None
    try:
        for k in range(steps):
            if k == blow_up:
                for g in opt.param_groups:
                    g["lr"] = 1e6  # the learning rate a schedule got wrong
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            finite = math.isfinite(loss.item()) and all(torch.isfinite(p.grad).all() for p in model.parameters())
            bad.append(not finite)
            opt.step()
    finally:
        if w is not None:
            w.close()
    return bad, w


def test_a_diverging_run_is_one_anomaly_and_a_count(tmp_path):
    bad, w = diverging(True)
    onset = bad.index(True)
    assert onset > 150 and all(bad[onset:])  # the hand-checked loop: non-finite from the onset to the end
    nonfinite = [a for a in w.anomalies if "non-finite" in a.reason]
    assert [a.step for a in nonfinite] == [onset]  # was 4 an onset step, then ~4 a step (585 in 300 steps)
    assert w.nonfinite == {onset: len(bad) - 1 - onset}
    assert onset in w.kept and all(k <= onset or k == len(bad) - 1 for k in w.kept)  # the onset's Trace, the latest
    w.save(tmp_path / "run.pt")
    assert hw.load(tmp_path / "run.pt").nonfinite == w.nonfinite
    assert data(w)["nonfinite"] == [[onset, len(bad) - 1 - onset]]


def test_a_run_that_recovers_starts_a_new_stretch():
    """A step whose non-finite .grad the loop skips (as a GradScaler does) and the finite steps after it: each
    non-finite step is an onset of its own, nothing counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    with hw.watch(model) as w:
        for k in range(8):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * (math.nan if k in (2, 3, 6) else 1.0)
            loss.backward()
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                opt.step()
    assert [a.step for a in w.anomalies] == [2, 6] and w.nonfinite == {2: 1, 6: 0}
