"""The watch reads no device value on a step's path (issue 42: no host sync per step on a GPU, flight recorder on).

A CPU run is sent down the device path (host_reads.free says no read is free) and every read of a tensor's value
into Python (item, tolist, numpy, bool, float, int, cpu, nonzero) is counted while the loop runs, apart from reads
of what has already reached the host: the rows a transfer landed (HostRows._land, Detector.check) and the scalars
that judge a step (Detector.arrived). On a GPU the same path runs under torch.cuda.set_sync_debug_mode("error")
(tests/test_watch.py, test_watch_steps.py, test_gpu.py: skipped where no GPU is present).

A transfer that has not arrived yet is simulated (arrivals.InFlight.arrived says False until waited for): each
step is then judged a step late, waiting for its values only then, and the watch keeps the same Traces and lists
the same anomalies."""

from __future__ import annotations

import threading
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookwidget import session
from hookwidget._torch import host_reads
from hookwidget.watch import arrivals, detect, host, watch

READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "cpu", "nonzero")


class _Block(nn.Module):
    """A pre-norm attention block with a GELU MLP: the watch's statistics on a (B, T, d) model."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), _Block(), _Block(), nn.LayerNorm(16), nn.Linear(16, 50))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 50, (4, 12), generator=g), torch.randint(0, 50, (4, 12), generator=g)


def _step(model, opt, x, y, scale=1.0):
    opt.zero_grad()
    (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) * scale).backward()
    opt.step()


@pytest.fixture
def device_path(monkeypatch):
    """The device path on the CPU; yields the list of counted reads (name, where) and a switch that counts them."""
    monkeypatch.setattr(host_reads, "free", lambda device: False)
    reads, state, loop_thread = [], {"on": False, "host": 0}, threading.get_ident()

    def landed(fn):  # what runs on values that reached the host: its reads are free
        def run(*a, **k):
            state["host"] += 1
            try:
                return fn(*a, **k)
            finally:
                state["host"] -= 1
        return run

    monkeypatch.setattr(host.HostRows, "_land", landed(host.HostRows._land))
    monkeypatch.setattr(detect.Detector, "check", landed(detect.Detector.check))
    monkeypatch.setattr(arrivals.InFlight, "read", landed(arrivals.InFlight.read))
    # assembling a kept Trace (an anomaly's, keep='s, the latest: not every step's) reads its losses
    monkeypatch.setattr(session.Deferred, "assemble", landed(session.Deferred.assemble))
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(t, *a, _real=real, _name=name, **k):
            if state["on"] and not state["host"] and threading.get_ident() == loop_thread:  # the log's is host
                frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if "torch/" not in f.filename)
                reads.append((_name, f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"))
            return _real(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield reads, state


@pytest.mark.parametrize("options", [{}, {"per_sample": True}, {"flight_recorder": False}, {"keep": "every 5th"}])
def test_a_step_reads_no_device_value(device_path, options):
    """Default watch, per-sample norms, statistics only, and a keep= predicate (the whole row judges a step):
    30 steps, of which the last 20 counted (the first build the watch's index tensors), read nothing; the rows,
    verdicts and kept Traces arrive all the same."""
    reads, state = device_path
    if options.get("keep"):
        options = {"keep": lambda step, stats: step % 5 == 0}
    model, x, y = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    with watch(model, batch=8, **options) as w:
        for k in range(30):
            state["on"] = k >= 10
            _step(model, opt, x, y, scale=40.0 if k == 24 else 1.0)
        state["on"] = False
        assert reads == [], sorted(set(reads))
        assert w.stats.shape[0] == 30 and torch.isfinite(w.step_stats[:, 1]).all()
    if options.get("flight_recorder", True):
        assert 24 in w.kept and 29 in w.kept  # the spike's step and the latest
        assert any(a.step == 24 and a.where == "loss" for a in w.anomalies)
    if "keep" in options:
        assert {0, 5, 10, 15} <= set(w.kept)


def test_the_read_count_catches_a_read_on_the_path(device_path, monkeypatch):
    """The counting above fails where the step's path reads a value (as judging from a .tolist() of the step's
    scalars did before the transfer went non-blocking)."""
    reads, state = device_path
    real = detect.Detector.scalars
    monkeypatch.setattr(detect.Detector, "scalars", lambda self, row, step_row: real(self, row, step_row).tolist()
                        and real(self, row, step_row))
    model, x, y = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    with watch(model, batch=8):
        for k in range(12):
            state["on"] = k >= 10
            _step(model, opt, x, y)
        state["on"] = False
    assert [r[0] for r in reads] == ["tolist", "tolist"]


def _late_run(monkeypatch, late: bool):
    """A spike at step 17, a NaN at 29 (its optimizer step skipped); late: no transfer arrives until waited for."""
    waits = []
    if late:
        monkeypatch.setattr(arrivals.InFlight, "arrived", lambda self: False)
        real = arrivals.InFlight.wait
        monkeypatch.setattr(arrivals.InFlight, "wait", lambda self: waits.append(self.host.numel()) or real(self))
    model, x, y = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    seen = {}  # step -> the steps whose recordings wait for their verdict while its forward runs
    with watch(model, batch=64, window=5) as w:
        def waiting(module, args):  # returns None: the input stays as it is
            seen.setdefault(k, [s for s, _ in w._flight.waiting])

        model[1].register_forward_pre_hook(waiting)
        for k in range(40):
            opt.zero_grad()
            scale = 50.0 if k == 17 else float("nan") if k == 29 else 1.0
            (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) * scale).backward()
            if k != 29:
                opt.step()
    return w, waits, seen


def test_values_that_arrive_a_step_late_give_the_same_verdicts(device_path, monkeypatch):
    """Where the scalars have not arrived when the next forward begins, the step waits for its verdict while the
    next one runs (two steps' recordings alive, no more), and is judged as the next backward ends: the kept
    Traces, the anomalies and the statistics are those of a run whose values arrive at once."""
    now, _, now_waiting = _late_run(monkeypatch, late=False)
    late, waits, late_waiting = _late_run(monkeypatch, late=True)
    assert now_waiting[21] == [] and late_waiting[21] == [20]  # step 20 judged before 21 runs, or a step late
    assert late.kept == now.kept and {17, 29, 39} <= set(now.kept)
    assert late.anomalies == now.anomalies and late.nonfinite == now.nonfinite == {29: 0}
    assert torch.equal(late.stats.nan_to_num(7.0), now.stats.nan_to_num(7.0))
    assert len(waits) >= 39  # every step's scalars waited for, a step late
