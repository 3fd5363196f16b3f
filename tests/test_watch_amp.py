"""hw.watch under automatic mixed precision: bf16 autocast on CPU, and a GradScaler loop where one
step's gradients overflow. References: the same loop run by plain PyTorch (hooks written by hand,
the scaler's own unscale_), after the watched one."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_watch_compile import LAYERS, Reference, assert_matches, make
from torch import nn

import hookwidget as hw


def test_bf16_autocast_statistics_and_bitwise_neutral():
    model = make(inplace=False)
    ref = Reference(copy.deepcopy(model), LAYERS)
    x, y = torch.randn(32, 5), torch.randn(32, 3)
    opt, ref_opt = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(ref.model.parameters(), 1e-2)
    losses = []
    with hw.watch(model) as w:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
            losses.append(loss.detach())
    ref_losses = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_losses.append(ref.step(x, y, ref_opt).detach())
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.model.parameters()))
    assert losses[0].dtype == torch.float32  # mse_loss autocasts to float32; δ and a of layers 2, 4 are bf16
    assert_matches(w, ref)


class Scaled(nn.Module):
    """Wraps the model; on call `at` the output is multiplied by `big` (scaled gradients overflow)."""

    def __init__(self, model, at, big):
        super().__init__()
        self.model, self.at, self.big, self.calls = model, at, big, 0

    def forward(self, x):
        out = self.model(x)
        self.calls += 1
        return out * self.big if self.calls - 1 == self.at else out


def scaler_loop(model, opt, scaler, x, y, steps, ref=None):
    """The GradScaler loop; with `ref`, the plain-PyTorch reference: unscaled δ, .grad (scaler.unscale_)."""
    scales = []
    for _ in range(steps):
        opt.zero_grad()
        if ref is not None:
            ref.cur = {}
        loss = F.mse_loss(model(x), y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        if ref is not None:
            scaler.unscale_(opt)  # PyTorch divides .grad by the scale itself
            row = ref.cur
            for name in ref.layers:
                row[name]["delta_norm"] /= scale
                row[name]["delta_max"] /= scale
                ps = list(ref.model.get_submodule(name).parameters())
                row[name]["grad_norm"] = torch.cat([p.grad.double().flatten() for p in ps]).norm().item()
            ref.rows.append((loss.item(), row))
        scaler.step(opt)
        scaler.update()
        scales.append((scale, scaler.get_scale()))
    return scales


SCALE = torch.amp.GradScaler.scale


@pytest.mark.parametrize("explicit", [True, False])
def test_grad_scaler_skipped_step_marked_and_statistics_unscaled(explicit):
    """With scaler=, or without: the watch then learns the scaler from its scale() call."""
    inner = make(inplace=False)
    model = Scaled(inner, at=2, big=1e34)
    ref_model = Scaled(copy.deepcopy(inner), at=2, big=1e34)
    ref = Reference(ref_model, ["model." + n for n in LAYERS])
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    opt, ref_opt = torch.optim.SGD(model.parameters(), 0.1), torch.optim.SGD(ref_model.parameters(), 0.1)
    scaler, ref_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    with hw.watch(model, scaler=scaler if explicit else None) as w:
        scaler_loop(model, opt, scaler, x, y, 5)
    assert torch.amp.GradScaler.scale is SCALE  # torch's own again
    scales = scaler_loop(ref_model, ref_opt, ref_scaler, x, y, 5, ref=ref)
    skipped = [k for k, (before, after) in enumerate(scales) if after < before]
    assert skipped == [2] and w.skipped == [2]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))  # neutral
    ratio = w.stats[:, :, w.stat_names.index("update_ratio")]
    assert torch.isnan(ratio[2]).all() and not torch.isnan(ratio[[0, 1, 3, 4]]).any()
    # unscaled statistics, equal to the reference's (the scaler's own unscale_) on the finite steps
    keep = [0, 1, 3, 4]
    for k in keep:
        loss, row = ref.rows[k]
        assert w.loss[k].item() == pytest.approx(loss, rel=1e-6)
        for name in LAYERS:
            for stat in ("delta_norm", "delta_max", "grad_norm", "a_rms"):
                assert w.series("model." + name, stat)[k].item() == pytest.approx(row["model." + name][stat],
                                                                                  rel=1e-5), (k, name, stat)
    # the skipped step: said to be the scaler's, first; anything non-finite there says so too
    at2 = [a for a in w.anomalies if a.step == 2]
    assert at2[0].where == "scaler" and "GradScaler skipped" in at2[0].reason
    assert "65536 -> 32768" in at2[0].reason
    assert len(at2) > 1 and all("GradScaler skipped" in a.reason for a in at2)
    assert not [a for a in w.anomalies if a.step != 2]
    assert 2 in w.kept  # its Trace is kept, as for any anomaly
    assert not math.isfinite(w.grad_norm[2].item())


def test_scale_stand_in_removed_whatever_happens():
    model = make(inplace=False)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(KeyboardInterrupt):
        with hw.watch(model, flight_recorder=False) as w:
            assert torch.amp.GradScaler.scale is not SCALE
            scaler.scale(F.mse_loss(model(torch.randn(4, 5)), torch.randn(4, 3))).backward()
            raise KeyboardInterrupt
    assert torch.amp.GradScaler.scale is SCALE and w.steps == [0]
    w2 = hw.watch(model, flight_recorder=False)
    w3 = hw.watch(model, flight_recorder=False)
    w2.close()  # out of order: the stand-in stays for w3, then goes
    assert torch.amp.GradScaler.scale is not SCALE
    w3.close()
    assert torch.amp.GradScaler.scale is SCALE


def test_scaler_must_be_a_grad_scaler():
    with pytest.raises(TypeError, match="GradScaler"):
        hw.watch(make(inplace=False), scaler=object())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grad_scaler_on_gpu_without_host_sync_in_the_watch():
    """float16 autocast and a GradScaler on CUDA: forward and backward (every hook of the watch, the end of
    the step, the scale it reads) make no host sync; the scaler's own step() syncs, so it runs outside."""
    dev = torch.device("cuda")
    model = Scaled(make(inplace=False), at=3, big=1e34).to(dev)
    x, y = torch.randn(16, 5, device=dev), torch.randn(16, 3, device=dev)
    opt, scaler = torch.optim.SGD(model.parameters(), 0.1), torch.amp.GradScaler("cuda", init_scale=1024.0)
    with hw.watch(model, scaler=scaler, flight_recorder=False, batch=64) as w:
        for k in range(6):
            opt.zero_grad()
            if k > 0:  # step 0 fills the watch's caches (index tensors copied to the device once)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.mse_loss(model(x), y)
                scaler.scale(loss).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            scaler.step(opt)
            scaler.update()
    assert w.skipped == [3] and w.anomalies[0].where == "scaler" and "1024 -> 512" in w.anomalies[0].reason
    ratio = w.stats[:, :, w.stat_names.index("update_ratio")]
    assert torch.isnan(ratio[3]).all() and torch.isfinite(ratio[[0, 1, 2, 4, 5]]).all()
    assert torch.isfinite(w.loss[[0, 1, 2, 4, 5]]).all() and w.loss[0].item() < 100  # unscaled
