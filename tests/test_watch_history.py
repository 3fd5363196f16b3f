"""A watch's memory does not grow with the run (watch/history.py): a window of rows in RAM, a summary, the rest on
disk; what it answers stays the whole run's, exactly. The log is read lazily (format 2), version 1 logs still
read, the temporary folder goes with the watch."""

import gc
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw
from hookwidget.watch import history, leads, lod, reads


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN included)."""
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(ints[a.dtype]),
                                                                     b.contiguous().view(ints[b.dtype]))


def small_window(monkeypatch, rows=16, bins=8):
    monkeypatch.setattr(history, "MIN_WINDOW", rows)
    monkeypatch.setattr(history, "MAX_WINDOW", rows)
    monkeypatch.setattr(history, "MIN_BINS", bins)
    monkeypatch.setattr(history, "MAX_BINS", bins)
    monkeypatch.setattr(history, "FOLD_ROWS", 4)


def loop(steps, lr_jump=None, **kw):
    """A small MLP trained `steps` steps; the gradient norms of its layers measured by hand beside the watch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))
    x, y = torch.randn(32, 5), torch.randn(32, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    by_hand = []
    with hw.watch(model, flight_recorder=False, batch=8, **kw) as w:
        for k in range(steps):
            if k == lr_jump:
                opt.param_groups[0]["lr"] = 3.0
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            grads = [torch.linalg.vector_norm(torch.cat([p.grad.flatten().double() for p in m.parameters()]))
                     for m in (model[0], model[2])]
            by_hand.append((loss.item(), *[g.item() for g in grads]))
            opt.step()
    return w, np.array(by_hand)


def test_ram_holds_a_window_and_the_whole_run_still_answers(monkeypatch):
    small_window(monkeypatch)
    w, by_hand = loop(200)
    h = w._history
    assert h.window == 16 and h.n == 200
    in_ram = sum(len(c[1]) for c in h.chunks)
    assert in_ram <= 16 + 4 + 8 and h.ram_start > 0  # the window, rows not yet summarised, a chunk not yet due out
    # the whole run, from disk and RAM: equal to what the loop measured by hand (float32 of each figure)
    assert w.stats.shape == (200, 2, len(w.stat_names)) and w.stats.dtype == torch.float32
    assert w.loss.dtype == torch.float64 and w.loss.tolist() == by_hand[:, 0].tolist()
    for li, name in enumerate(["0", "2"]):  # on the CPU the watch's norms accumulate in float32: float32's tolerance
        want = torch.tensor(by_hand[:, 1 + li]).float()
        torch.testing.assert_close(w.series(name, "grad_norm"), want, rtol=3e-7, atol=0)
        assert torch.equal(w.stats[:, li, w.stat_names.index("grad_norm")], w.series(name, "grad_norm"))
    steps, stats, step_stats = w.rows(3, 40)  # across the disk / RAM cut
    assert steps.tolist() == list(range(3, 40)) and torch.equal(stats, w.stats[3:40])
    assert torch.equal(step_stats, w.step_stats[3:40])
    assert w.steps == list(range(200)) and w.n_rows == 200


def test_memory_is_flat_in_steps_but_for_the_step_index(monkeypatch):
    small_window(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    seen = {}
    with hw.watch(model, flight_recorder=False, batch=8) as w:
        for k in range(1, 513):
            model(x).pow(2).mean().backward()
            model.zero_grad()
            if k in (128, 512):
                w.sync()
                deadline = 200
                while w._log.written < k - 24 and deadline:  # the writer's thread catches up
                    import time

                    time.sleep(0.01)
                    deadline -= 1
                w._history._evict()
                seen[k] = (w.memory, len(w._history.level.bins), sum(len(c[1]) for c in w._history.chunks))
    (m1, b1, r1), (m2, b2, r2) = seen[128], seen[512]
    assert b1 < 8 and b2 < 8 and r1 <= 16 + 4 + 8 and r2 <= 16 + 4 + 8
    # the same but for 8 bytes a step of step indices, and a window that may hold a chunk more or less
    chunk = 8 * 2 * len(w.stat_names) * 4
    assert abs((m2 - m1) - 8 * (512 - 128)) <= 2 * chunk


def test_lod_from_the_summary_equals_lod_of_the_rows(monkeypatch):
    small_window(monkeypatch, rows=16, bins=8)
    monkeypatch.setattr(reads, "READ_BYTES", 0)  # always from the summary where it is coarser
    w, _ = loop(150)
    level = w._history.level
    assert level.size == 32 and level.done == 128
    stats, step_stats = w.stats.numpy(), w.step_stats.numpy()
    for bins, start, stop in ((1000, 0, 150), (3, 0, 150), (2, 5, 140), (100, 40, 130)):
        got = w.lod(bins, start, stop)
        size = max(level.size, lod.size_for(bins, start, stop))
        want = lod.reduce(np.arange(start, stop), stats[start:stop], step_stats[start:stop], start, size)
        assert got.size == size and len(got) == len(want)
        for k in ("start", "first", "last_step", "rows", "min", "max", "last", "count", "nonfinite",
                  "step_min", "step_max", "step_nonfinite"):
            np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=k)
        np.testing.assert_allclose(got.mean, want.mean, rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(reads, "READ_BYTES", 1 << 30)  # rows cheap to read: the finest size that fits
    assert w.lod(1000, 0, 150).size == 1


def test_leads_read_a_window_of_rows_before_each_anomaly(monkeypatch):
    small_window(monkeypatch)
    w, _ = loop(120, lr_jump=60)
    assert w._history.ram_start > 61  # the anomaly's rows left RAM
    found = w.anomalies
    assert found and found[0].step >= 60
    steps, stats, step_stats = w.rows()
    whole = leads.Rows(stats.numpy(), step_stats.numpy(), steps.tolist(), w.layer_names, w.stat_names,
                       w.step_stat_names)
    want = leads.with_leads(list(w._detector.anomalies), whole)  # the rule over every row
    assert [a.lead for a in found] == [a.lead for a in want]
    assert found[0].lead is not None and found[0].lead.step == 60 and found[0].lead.lr


def test_a_loaded_log_is_lazy_and_answers_the_same(tmp_path, monkeypatch):
    small_window(monkeypatch)
    d = tmp_path / "log"
    w, _ = loop(100, lr_jump=50, log_dir=d)
    meta = json.loads((d / "watch.json").read_text())
    assert meta["version"] == 2 and meta["dtype"] == "float32" and (d / "lod.npz").exists()
    u = hw.load(d)
    last = {len(u._rows.index) - 1}
    assert set(u._rows._maps) <= last  # no shard read by hw.load but the last one's last step (where it ends)
    assert u.n_rows == 100 and u._level().end == 100  # the summary from lod.npz
    assert set(u._rows._maps) <= last
    assert same(u.series("2", "grad_norm"), w.series("2", "grad_norm"))
    assert same(u.stats, w.stats) and same(u.step_stats, w.step_stats) and u.steps == w.steps
    assert [(a, a.lead) for a in u.anomalies] == [(a, a.lead) for a in w.anomalies]
    a, b = u.lod(4), w.lod(4)
    assert all(np.array_equal(getattr(a, k), getattr(b, k), equal_nan=True) for k in vars(a) if k != "size")


def test_a_version_1_log_is_still_read(tmp_path):
    d = tmp_path / "v1"
    d.mkdir()
    L, K = 2, 13
    meta = {"format": "hookwidget-watch-log", "version": 1, "layers": ["a", "b"], "stats": [f"s{i}" for i in range(K)],
            "step_stats": ["loss", "grad_norm"], "every": 1, "per_sample": False, "closed": True, "notes": [],
            "seen": 6}
    (d / "watch.json").write_text(json.dumps(meta))
    rng = np.random.default_rng(0)
    stats = rng.random((6, L, K))
    for i, (a, b) in enumerate(((0, 4), (4, 6))):
        np.savez_compressed(d / f"rows-{i:06d}.npz", steps=np.arange(a, b), stats=stats[a:b],
                            step_stats=np.full((b - a, 2), 1.5), anomaly_step=np.array([a], np.int64),
                            anomaly_where=np.array(["a"]), anomaly_reason=np.array([f"at {a}"]),
                            skipped=np.zeros(0, np.int64))
    u = hw.load(d)
    assert u.steps == list(range(6)) and u.stats.dtype == torch.float64
    assert np.array_equal(u.stats.numpy(), stats) and u.series("b", "s3").tolist() == stats[:, 1, 3].tolist()
    assert [tuple(a) for a in u.anomalies] == [(0, "a", "at 0"), (4, "a", "at 4")]


def test_the_temporary_folder_goes_with_the_watch_and_log_dir_stays(tmp_path):
    w, _ = loop(10)
    folder = w.log_dir
    assert os.path.isdir(folder) and os.path.basename(folder).startswith("hookwidget-watch-")
    assert hw.load(folder).n_rows == 10  # readable while the watch lives
    del w
    gc.collect()
    assert not os.path.exists(folder)
    kept, _ = loop(10, log_dir=tmp_path / "kept")
    del kept
    gc.collect()
    assert hw.load(tmp_path / "kept").n_rows == 10


def test_a_float64_model_keeps_float64_rows():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    with hw.watch(model, flight_recorder=False) as w:
        for _ in range(3):
            model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    assert w.stats.dtype == torch.float64 and w.rows()[1].dtype == torch.float64
    want = torch.linalg.vector_norm(torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()]))
    assert math.isclose(w.series("Linear", "grad_norm")[-1].item(), want.item(), rel_tol=1e-12)
