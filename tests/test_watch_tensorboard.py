"""TensorBoard event files of a watch, read back with TensorBoard's EventAccumulator and compared with
the losses and gradient norms of the loop (plain PyTorch) and with w.stats."""

import math
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw
from hookwidget.watch import host

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.randn(16, 5), torch.randn(16, 2)


def loop(model, x, y, steps, nan_at=None, on_step=None):
    """Returns the loop's own losses and global gradient norms (from .grad, after each backward)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, norms = [], []
    for k in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * (math.nan if k == nan_at else 1.0)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double().norm().item())
        if k != nan_at:
            opt.step()
        if on_step is not None:
            on_step(k)
    return losses, norms


def read(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


@pytest.mark.parametrize("live", [False, True])
def test_event_files_hold_every_layer_statistic_and_step(tmp_path, live, monkeypatch):
    monkeypatch.setattr(host, "FLUSH_SECONDS", 0.0)  # a slow run's pace
    model, x, y = model_and_data()
    steps = 6
    kwargs = {"tensorboard": tmp_path / "live"} if live else {}
    seen = []

    def on_step(k):  # live: the steps reach the event files while the loop runs (written by a thread)
        deadline = time.monotonic() + 20
        while live and k == 3 and not seen and time.monotonic() < deadline:
            acc = read(tmp_path / "live")
            steps = [k for k, _ in scalars(acc, "step/loss")] if "step/loss" in acc.Tags()["scalars"] else []
            seen.extend(steps if steps == [0, 1, 2] else [])
            time.sleep(0.05)

    with hw.watch(model, batch=4, **kwargs) as w:
        losses, norms = loop(model, x, y, steps, nan_at=4, on_step=on_step)
    assert seen == ([0, 1, 2] if live else [])
    log_dir = tmp_path / "live" if live else w.to_tensorboard(tmp_path / "after")
    acc = read(log_dir)
    tags = set(acc.Tags()["scalars"])
    assert tags == {f"{s}/{n}" for s in w.stat_names for n in w.layer_names} | {"step/loss", "step/grad_norm"}
    loss, gnorm = scalars(acc, "step/loss"), scalars(acc, "step/grad_norm")
    assert [k for k, _ in loss] == list(range(steps))
    assert all(same(v, ref) for (_, v), ref in zip(loss, losses))  # the loop's own, NaN step included
    assert all(same(v, ref) for (_, v), ref in zip(gnorm, norms))
    assert math.isnan(loss[4][1])  # NaN is written, not dropped
    for li, n in enumerate(w.layer_names):
        for si, s in enumerate(w.stat_names):
            got = scalars(acc, f"{s}/{n}")
            assert [k for k, _ in got] == w.steps
            assert all(same(v, w.stats[r, li, si].item()) for r, (_, v) in enumerate(got)), (n, s)
    text = acc.Tensors("anomalies/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "step 4, 2: non-finite from here on" in text and "| non-finite loss (nan) |" in text


def test_missing_tensorboard_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    model, x, y = model_and_data()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError) as e:
        hw.watch(model, tensorboard=tmp_path)
    assert str(e.value) == "TensorBoard is not installed: pip install hookwidget[tensorboard]"
    with hw.watch(model) as w:
        loop(model, x, y, 1)
    with pytest.raises(ImportError, match=r"pip install hookwidget\[tensorboard\]"):
        w.to_tensorboard(tmp_path)
