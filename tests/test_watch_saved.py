"""A watch kept on disk: w.save(path) / hw.load(path), and hw.watch(model, log_dir=d) / hw.load(d). A loaded
watch answers what the live one did (statistics bitwise, anomalies, notes, the kept Traces' queries, the page),
a log_dir is readable with numpy alone and up to its last complete shard after kill -9, and what needs the
live model is refused in one line."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw
from hookwidget.views import payload, watch_export
from hookwidget.views.watch_widget import WatchWidget
from hookwidget.watch import host

MAX_LINE = 300


def one_line(excinfo, *words) -> str:
    text = str(excinfo.value).strip("'\"")  # KeyError quotes its text
    assert "\n" not in text and len(text) <= MAX_LINE, text
    for w in words:
        assert w in text, (w, text)
    return text


def bits(t: torch.Tensor) -> torch.Tensor:
    """The float tensor's bits (NaN equal to itself, -0.0 not to 0.0)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def train(model, steps, nan_at=(), **kwargs):
    """A small loop under a watch: a NaN loss (a skipped optimizer step) at each step of `nan_at`."""
    torch.manual_seed(1)
    x, y = torch.randn(16, 5), torch.randn(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with hw.watch(model, **kwargs) as w:
        for k in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y) * (math.nan if k in nan_at else 1.0)
            loss.backward()
            if k not in nan_at:
                opt.step()
    return w


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))


def same_watch(u, w, traces: bool = True) -> None:
    """u (loaded) answers what w (live, closed) answers."""
    assert bitwise(u.stats, w.stats) and bitwise(u.step_stats, w.step_stats)
    assert u.steps == w.steps and u.layer_names == w.layer_names and u.stat_names == w.stat_names
    assert u.step_stat_names == w.step_stat_names and u.every == w.every
    assert u.anomalies == w.anomalies and u.notes == w.notes and u.skipped == w.skipped
    assert bitwise(u.loss, w.loss) and bitwise(u.grad_norm, w.grad_norm)
    for layer in w.layer_names:
        for stat in w.stat_names:
            assert bitwise(u.series(layer, stat), w.series(layer, stat)), (layer, stat)
    for bad in (("nope", "grad_norm"), ("0", "nope"), ("nope",)):
        with pytest.raises(KeyError) as e1:
            w.series(*bad)
        with pytest.raises(KeyError) as e2:
            u.series(*bad)
        assert str(e1.value) == str(e2.value)
    if traces:
        assert u.kept == w.kept and u.dropped_traces == w.dropped_traces


def same_trace(t, s) -> None:
    """A kept Trace loaded from the watch's file answers the live one's queries."""
    assert repr(s) == repr(t) and s.notes == t.notes and list(s.layers) == list(t.layers)
    assert len(s.steps) == len(t.steps) and repr(s.losses) == repr(t.losses)
    for n in t.factor_layers:
        for query in ("weight_grad", "per_sample_grad_norms"):  # as test_saved: up to float rounding
            a, b = getattr(s, query)(n), getattr(t, query)(n)
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7, equal_nan=True), (query, n)
    assert payload.summary(s) == payload.summary(t)
    for n in t.layers:
        assert payload.detail(s, n) == payload.detail(t, n), n


# -- w.save / hw.load ----------------------------------------------------------------------------------------------
def test_save_and_load_answer_as_the_live_watch(tmp_path):
    w = train(mlp(), 30, nan_at=(20,), per_sample=True)
    assert w.anomalies and 20 in w.kept
    w.save(tmp_path / "w.pt")
    u = hw.load(tmp_path / "w.pt")
    same_watch(u, w)
    assert bitwise(u.per_sample, w.per_sample)
    assert repr(u) == repr(w).replace("(closed)", f"(loaded from {tmp_path / 'w.pt'})")
    for k in w.kept:
        same_trace(w.trace(k), u.trace(k))
    assert u.trace() is u.trace(w.kept[-1])
    # Traces of one model share its stand-ins in the file (stored once)
    assert u.trace(w.kept[-1]).layers["0"].module is u.trace(20).layers["0"].module
    # the page of the loaded watch is the live one's
    assert watch_export.data(u) == watch_export.data(w)
    # a loaded watch saves again as it was
    u.save(tmp_path / "again.pt")
    same_watch(hw.load(tmp_path / "again.pt"), w)


def test_an_open_watch_saves_what_it_has_so_far(tmp_path):
    model = mlp()
    x, y = torch.randn(16, 5), torch.randn(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with hw.watch(model, every=2) as w:
        for k in range(7):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            if k == 4:
                w.save(tmp_path / "mid.pt")
    u = hw.load(tmp_path / "mid.pt")
    assert u.steps == [0, 2, 4] and bitwise(u.stats, w.stats[:3]) and u.kept == [4]
    assert repr(u).endswith("5 steps, 3 recorded, 0 anomalies, traces kept at steps [4]")


def test_a_loaded_watch_goes_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = train(mlp(), 4, log_dir=tmp_path / "log")
    run = hw.load(tmp_path / "log").to_tensorboard(tmp_path / "tb")
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("step/loss")] == [
        (k, pytest.approx(v, rel=1e-6)) for k, v in zip(w.steps, w.loss.tolist())]


def test_the_file_is_data_only(tmp_path):
    w = train(mlp(), 3)
    w.save(tmp_path / "w.pt")
    raw = torch.load(tmp_path / "w.pt", weights_only=True)  # no code is unpickled
    assert raw["format"] == "hookwidget" and raw["kind"] == "watch"


def test_without_flight_recorder_or_per_sample(tmp_path):
    w = train(mlp(), 5, flight_recorder=False)
    w.save(tmp_path / "w.pt")
    u = hw.load(tmp_path / "w.pt")
    same_watch(u, w)
    assert u.kept == [] and u.dropped_traces == 0
    with pytest.raises(KeyError) as e:
        u.trace(0)
    one_line(e, "holds no Traces", "w.save(path)")
    with pytest.raises(KeyError) as e:
        _ = u.per_sample
    one_line(e, "per_sample=True")


def test_the_loaded_view_opens_a_kept_step(tmp_path):
    w = train(mlp(), 6)
    w.save(tmp_path / "w.pt")
    u = hw.load(tmp_path / "w.pt")
    wid = u.widget()
    assert wid is u.widget() and wid.state == "closed" and wid.meta["layers"] == w.layer_names
    sent = []
    wid.send = lambda msg, buffers=None: sent.append((msg, buffers or []))
    wid._on_msg(wid, {"type": "sync", "have": 0, "request_id": "r1"}, [])
    msg, bufs = sent[-1]
    assert msg["steps"] == w.steps and msg["kept"] == w.kept and msg["state"] == "closed"
    assert msg["dtype"] == "float32"  # the widget sends float32 rows (the view draws them)
    np.testing.assert_array_equal(np.frombuffer(bufs[0], np.float32).reshape(6, 2, -1), w.stats.float().numpy())
    wid._on_msg(wid, {"type": "open", "step": 5, "request_id": "r2"}, [])
    assert sent[-1][0]["state"] == "done" and wid._trace_widget.trace is u.trace(5)
    assert isinstance(wid, WatchWidget)
    page = u.to_html(tmp_path / "u.html").read_text()
    assert "hookwidget watch" in page


def test_what_needs_the_live_model_is_refused_in_one_line(tmp_path):
    w = train(mlp(), 2)
    w.save(tmp_path / "w.pt")
    u = hw.load(tmp_path / "w.pt")
    for call in (u.open, u.gather):
        with pytest.raises(RuntimeError) as e:
            call()
        one_line(e, "loaded from", "live model", "hw.watch(model)")
    with pytest.raises(AttributeError) as e:
        _ = u.model
    one_line(e, "loaded from", "not the model")
    u.close()  # nothing to close: no hooks
    with pytest.raises(KeyError) as e:
        u.trace(7)
    one_line(e, "step 7 was not kept", "[1]")
    with pytest.raises(RuntimeError, match="rerun"):
        u.trace(1).rerun()


# -- log_dir -------------------------------------------------------------------------------------------------------
def test_log_dir_holds_the_watch_up_to_close(tmp_path):
    d = tmp_path / "log"
    w = train(mlp(), 30, nan_at=(20,), per_sample=True, log_dir=d, batch=8)
    u = hw.load(d)
    same_watch(u, w, traces=False)
    assert bitwise(u.per_sample, w.per_sample)
    assert repr(u) == f"Watch (loaded from {d}): 2 layers, 30 steps, 30 recorded, {len(w.anomalies)} anomalies"
    shards = sorted(p.name for p in d.iterdir())
    assert shards[-1] == "watch.json" and len(shards) >= 4 and not any(n.endswith(".tmp") for n in shards)
    with pytest.raises(KeyError) as e:
        u.trace(0)
    one_line(e, "log_dir holds statistics", "w.save(path)")
    u.save(tmp_path / "from_log.pt")  # a log saved as one file
    same_watch(hw.load(tmp_path / "from_log.pt"), w, traces=False)


def test_a_loaded_log_finds_its_anomalies_rows_without_reading_every_step(tmp_path, monkeypatch):
    """A long log's step column touches every row's page of its shards (a 1,000-layer × 20,000-step log: 1.1 GB
    resident after to_html, 118 MB now): the anomalies' leads and the page find their rows by bisection, a row at
    a time; the page and the leads are those of the watch that wrote the log."""
    from hookwidget.watch import saved

    d = tmp_path / "log"
    w = train(mlp(), 30, nan_at=(20,), log_dir=d, batch=8)
    u = hw.load(d)

    def whole(self):
        raise AssertionError("read every row's step")

    monkeypatch.setattr(saved.SavedWatch, "_steps", whole)
    assert u.anomalies == w.anomalies and [a.lead for a in u.anomalies] == [a.lead for a in w.anomalies]
    assert u.anomalies
    assert u.to_html(tmp_path / "page.html").read_text().count("this page holds") >= 1


def test_a_slow_run_writes_a_shard_every_few_seconds_below_batch(tmp_path, monkeypatch):
    """Rows reach the disk while the watch is open though fewer than `batch` arrived: at most SHARD_SECONDS
    after they reached the host (0 here: each chunk the watch moves is written), but the newest, which waits for
    the next rows (its optimizer step may still write its update ratio into it)."""
    from hookwidget.views import watch_log

    monkeypatch.setattr(watch_log, "SHARD_SECONDS", 0.0)
    monkeypatch.setattr(host, "FLUSH_SECONDS", 0.0)  # a slow run: each step's end finds the rows before it due
    d, model = tmp_path / "log", mlp()
    x, y = torch.randn(16, 5), torch.randn(16, 2)
    with hw.watch(model, log_dir=d, batch=1000) as w:
        for _ in range(4):
            F.mse_loss(model(x), y).backward()
        deadline = time.monotonic() + 30
        while len(hw.load(d).steps) < 2:
            assert time.monotonic() < deadline, "no rows on disk while the watch is open"
            time.sleep(0.02)
        assert w.active
    assert hw.load(d).steps == [0, 1, 2, 3]


NUMPY_ONLY = textwrap.dedent("""
    import glob, json, sys
    import numpy as np
    d = sys.argv[1]
    meta = json.load(open(f"{d}/watch.json"))
    first = lambda f: int(f.split("rows-")[1].split("-")[0])
    shards = [np.load(f, mmap_mode="r") for f in sorted(glob.glob(f"{d}/rows-*.npy"), key=first)]
    stats = np.concatenate([s["stats"] for s in shards])
    loss = np.concatenate([s["step_stats"] for s in shards])[:, meta["step_stats"].index("loss")]
    last = shards[-1]["step"][-1]
    where = [a[1] for a in json.load(open(f"{d}/events.json"))["anomalies"] if a[0] <= last]
    assert "torch" not in sys.modules and "hookwidget" not in sys.modules
    print(json.dumps({"shape": stats.shape, "layers": meta["layers"], "loss": loss.tolist(),
                      "grad_norm_0": stats[:, 0, meta["stats"].index("grad_norm")].tolist(), "where": where}))
""")


def test_log_dir_is_read_by_numpy_alone(tmp_path):
    d = tmp_path / "log"
    w = train(mlp(), 12, nan_at=(9,), log_dir=d, batch=4, flight_recorder=False)
    out = subprocess.run([sys.executable, "-I", "-c", NUMPY_ONLY, str(d)], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["shape"] == [12, 2, len(w.stat_names)] and got["layers"] == w.layer_names
    assert got["loss"][:9] == w.loss[:9].tolist() and math.isnan(got["loss"][9])
    assert got["grad_norm_0"][:9] == w.series("0", "grad_norm")[:9].tolist()
    assert got["where"] == [a.where for a in w.anomalies]


LOOP = textwrap.dedent("""
    import math, sys
    import torch, torch.nn.functional as F
    from torch import nn
    import hookwidget as hw
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(16, 5), torch.randn(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = hw.watch(model, log_dir=sys.argv[1], batch=4, flight_recorder=False)
    k = 0
    while True:  # until killed
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        k += 1
""")


def reference_losses(n):
    """The losses LOOP's first n steps had (the watch changes nothing: bitwise those of the plain loop)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(16, 5), torch.randn(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    for _ in range(n):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_log_dir_survives_kill_9_up_to_the_last_complete_shard(tmp_path):
    d = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(_root()), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(d)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(list(d.glob("rows-*.npy"))) < 5:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no shards written"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: maybe mid-write of a shard
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    u = hw.load(d)
    n = len(u.steps)
    assert n >= 5 * 4 and u.steps == list(range(n))
    assert u.stats.shape == (n, 2, len(u.stat_names)) and u.layer_names == ["0", "2"]
    assert u.loss.tolist() == reference_losses(n)
    assert any("was not closed" in note for note in u.notes)
    assert torch.isfinite(u.series("2", "grad_norm")).all()
    # numpy alone reads the same rows
    out = subprocess.run([sys.executable, "-I", "-c", NUMPY_ONLY, str(d)], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["shape"][0] == n and got["loss"] == u.loss.tolist()


def _root():
    import pathlib

    return pathlib.Path(hw.__file__).resolve().parents[1]


def test_a_damaged_shard_keeps_the_rows_before_it(tmp_path):
    d = tmp_path / "log"
    w = train(mlp(), 12, log_dir=d, batch=4, flight_recorder=False)
    shards = sorted(d.glob("rows-*.npy"))
    shards[1].write_bytes(b"not a shard")
    u = hw.load(d)
    n = len(np.load(shards[0])["step"])
    assert u.steps == w.steps[:n] and bitwise(u.stats, w.stats[:n])
    assert any(shards[1].name in note and "left out" in note for note in u.notes)


def test_log_dir_refusals_are_one_line(tmp_path):
    d = tmp_path / "log"
    train(mlp(), 2, log_dir=d)
    with pytest.raises(ValueError) as e:
        hw.watch(mlp(), log_dir=d)
    one_line(e, "already holds a watch log", "log_dir=")
    with pytest.raises(ValueError) as e:
        hw.watch(mlp(), log_dir=3)
    one_line(e, "log_dir=3", "e.g. log_dir=")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as e:
        hw.load(tmp_path / "empty")
    one_line(e, "not a watch log", "log_dir=d")
