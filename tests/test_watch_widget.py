"""The watch explorer, Python side: rows pushed while the loop runs (throttled, from rows already on the
host), the payload equal to w.stats, the kept-step explorer, the standalone page, names as text."""

import base64
import importlib
import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookwidget.watch import host, watch
from hookwidget.watch.core import Watch

ww = importlib.import_module("hookwidget.views.watch_widget")  # hookwidget.watch is also the function watch()
EVIL = '</script><script>__pwned=1</script>'


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.blocks = nn.ModuleDict({EVIL: nn.Linear(8, 8)})
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        for m in self.blocks.values():
            x = m(torch.tanh(self.fc1(x)))
        return self.fc2(torch.relu(x))


def setup(seed=0):
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05), torch.randn(16, 6), torch.randn(16, 2)


def step(model, opt, x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach().clone()


class Clock:
    """A stand-in for time.monotonic, moved by the test."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(ww, "time", c)
    monkeypatch.setattr(host, "time", c)  # rows move on its time too
    return c


def capture(widget):
    sent = []
    widget.send = lambda msg, buffers=None: sent.append((msg, buffers or []))
    return sent


def rows_of(sent, L, K):
    """The rows the front-end ends up with: every rows message placed at its start."""
    out, per, steps = {}, {}, {}
    for msg, bufs in sent:
        if msg["type"] != "rows":
            continue
        dtype = np.dtype(msg.get("dtype", "float64"))  # float32: the widget sends the rows as the view holds them
        s = np.frombuffer(bufs[0], dtype=dtype).reshape(msg["count"], L, K)
        t = np.frombuffer(bufs[1], dtype=dtype).reshape(msg["count"], 2)
        for i in range(msg["count"]):
            out[msg["start"] + i], per[msg["start"] + i], steps[msg["start"] + i] = s[i], t[i], msg["steps"][i]
    n = max(out) + 1 if out else 0
    assert sorted(out) == list(range(n))
    return np.stack([out[i] for i in range(n)]), np.stack([per[i] for i in range(n)]), [steps[i] for i in range(n)]


def test_rows_pushed_while_the_loop_runs_equal_w_stats(clock):
    model, opt, x, y = setup()
    w = watch(model)
    wid = w.widget()
    sent = capture(wid)
    during = []
    for _ in range(12):
        step(model, opt, x, y)
        clock.now += 0.2  # a 0.2 s step: a push every third step
        during.append(sum(m["type"] == "rows" for m, _ in sent))
    assert during[-1] >= 3 and during == sorted(during)  # pushed during the loop, not only at the end
    assert wid.state == "open"
    w.close()
    assert wid.state == "closed" and sent[-1][0]["state"] == "closed"
    L, K = len(w.layer_names), len(w.stat_names)
    stats, step_stats, steps = rows_of(sent, L, K)
    np.testing.assert_array_equal(stats, w.stats.float().numpy())  # NaN where w.stats has NaN, bitwise elsewhere
    np.testing.assert_array_equal(step_stats, w.step_stats.float().numpy())
    assert steps == w.steps == list(range(12))
    assert sent[-1][0]["kept"] == w.kept
    # Only new rows each time: no row was sent twice.
    assert sum(m["count"] for m, _ in sent if m["type"] == "rows") == 12


def test_pushes_are_throttled_to_the_interval(clock):
    model, opt, x, y = setup()
    w = watch(model)
    sent = capture(w.widget())
    times = []
    for _ in range(30):
        step(model, opt, x, y)
        clock.now += 0.05
        if sent and (not times or len(sent) > len(times)):
            times.append(clock.now)
    w.close()
    pushes = [m for m, _ in sent if m["type"] == "rows"]
    assert 2 <= len(pushes) <= 4  # 30 steps × 0.05 s = 1.5 s: about one push per 0.5 s, plus the last at close
    assert all(b - a >= 0.5 - 1e-9 for a, b in zip(times, times[1:]))


def test_no_extra_transfer_and_nothing_changed(clock, monkeypatch):
    """Without the flight recorder rows reach the host every `batch` steps: the widget adds no transfer,
    and the loop's losses and .grad are bitwise those without it."""
    calls = {"n": 0}
    real = Watch._flush

    def counting(self, upto=None, wait=True):  # count the calls that move rows (one device-to-host transfer each)
        calls["n"] += any(upto is None or s.index <= upto for s in self._rows.pending)
        return real(self, upto, wait)

    monkeypatch.setattr(Watch, "_flush", counting)
    monkeypatch.setattr(host, "FLUSH_SECONDS", 1e9)  # by the batch only
    results = []
    for with_widget in (False, True):
        model, opt, x, y = setup()
        calls["n"] = 0
        w = watch(model, flight_recorder=False, batch=4)
        sent = capture(w.widget()) if with_widget else []
        losses = []
        for _ in range(10):
            losses.append(step(model, opt, x, y))
            clock.now += 1.0
        during = calls["n"]
        w.close()
        results.append((during, torch.stack(losses), [p.grad.clone() for p in model.parameters()]))
        if with_widget:
            assert [m["start"] for m, _ in sent if m["type"] == "rows"][:2] == [0, 4]  # as the watch batches: 4 rows
    (n0, l0, g0), (n1, l1, g1) = results
    assert n0 == n1
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_a_failing_display_never_breaks_the_loop(clock, caplog):
    model, opt, x, y = setup()
    w = watch(model)
    wid = w.widget()

    def broken(msg, buffers=None):
        raise ConnectionError("front-end gone")

    wid.send = broken
    for _ in range(4):
        step(model, opt, x, y)
        clock.now += 1.0
    w.close()
    assert w.steps == [0, 1, 2, 3]
    assert "live watch update failed" in caplog.text


def test_sync_open_and_rejected_messages(clock):
    model, opt, x, y = setup()
    with watch(model, keep=lambda k, stats: k == 0) as w:
        for _ in range(6):
            step(model, opt, x, y)
    wid = w.widget()  # made after the loop: it starts from w.stats
    sent = capture(wid)
    wid._on_msg(wid, {"type": "sync", "have": 4, "request_id": "r1"}, [])
    msg, bufs = sent[-1]
    assert (msg["type"], msg["start"], msg["count"], msg["steps"]) == ("rows", 4, 2, [4, 5])
    np.testing.assert_array_equal(np.frombuffer(bufs[0], np.float32).reshape(2, len(w.layer_names), -1),
                                  w.stats[4:].float().numpy())
    wid._on_msg(wid, {"type": "open", "step": 0, "request_id": "r2"}, [])
    assert sent[-1][0] == {"type": "status", "request_id": "r2", "state": "done",
                           "text": "step 0: its kept Trace is open below"}
    assert wid.trace_step == 0 and wid.trace_model == wid._trace_widget.model_id
    assert wid._trace_widget.trace is w.trace(0)
    assert wid._trace_widget.summary["modules"][0]["name"] == "Net"
    kept = wid._trace_widget
    kept_sent = capture(kept)
    kept._on_msg(kept, {"type": "add_hook", "target": "fc1", "kind": "grad_zero", "params": {}, "request_id": "h1"}, [])
    assert kept_sent[-1][0]["state"] == "error" and "hw.trace(step_fn)" in kept_sent[-1][0]["text"]
    assert w.trace(0).session.interventions == []  # nothing reaches the recordings' session (the training)
    wid._on_msg(wid, {"type": "open", "step": 3, "request_id": "r3"}, [])
    assert sent[-1][0]["state"] == "error" and "kept steps: [0, 5]" in sent[-1][0]["text"]
    for bad in ({"type": "open", "step": True, "request_id": "r4"}, {"type": "open", "step": -1, "request_id": "r5"},
                {"type": "sync", "have": 0, "request_id": "r6", "code": "x"}, {"type": "eval", "request_id": "r7"}):
        wid._on_msg(wid, bad, [])
        assert sent[-1][0]["state"] == "error" and sent[-1][0]["text"].startswith("rejected message:"), bad


def test_plain_text_outside_jupyter_and_one_widget_per_watch():
    model, opt, x, y = setup()
    with watch(model) as w:
        step(model, opt, x, y)
    bundle = w._repr_mimebundle_()
    assert bundle == {"text/plain": repr(w)}
    assert w.widget() is w.widget()
    assert w.widget().meta["layers"] == ["fc1", f"blocks.{EVIL}", "fc2"]


def test_in_a_kernel_the_watch_shows_as_its_widget(monkeypatch):
    model, opt, x, y = setup()
    with watch(model) as w:
        step(model, opt, x, y)
    monkeypatch.setattr(ww, "_kernel_shell", lambda: object())
    data, _metadata = w._repr_mimebundle_()
    assert data["text/plain"] == repr(w)
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == w.widget().model_id


def page_data(text):
    m = re.search(r'<script type="application/json" id="hw-data">(.*?)</script>', text, re.S)
    return json.loads(m.group(1))


def test_to_html_writes_the_data_with_names_as_text(tmp_path):
    model, opt, x, y = setup()
    with watch(model, spike=0.5, window=3) as w:
        for _ in range(8):
            step(model, opt, x, y)
        with torch.no_grad():
            model.fc1.weight.fill_(float("nan"))
        step(model, opt, x, y)
    path = w.to_html(tmp_path / "watch.html")
    text = path.read_text(encoding="utf-8")
    assert EVIL not in text and "</script><script>" not in text  # the name cannot end a script early
    assert text.count("<script") == 2
    data = page_data(text)
    assert data["meta"]["layers"][1] == f"blocks.{EVIL}"  # and reads back as the same text
    L, K = len(w.layer_names), len(w.stat_names)
    # A short run: every row at full resolution in one float32 segment (views/watch_export.py).
    assert [s["start"] for s in data["segments"]] == [0] and data["segments"][0]["steps"] == w.steps
    stats = np.frombuffer(base64.b64decode(data["segments"][0]["stats"]), dtype=np.float32).reshape(-1, L, K)
    np.testing.assert_array_equal(stats, w.stats.float().numpy())
    assert np.isnan(stats[-1]).any()
    assert data["kept"] == w.kept
    assert data["anomalies"]
    assert [a[:3] for a in data["anomalies"]] == [[a.step, a.where, a.reason] for a in w.anomalies]
    assert [a[3] and a[3]["text"] for a in data["anomalies"]] == [a.lead and a.lead.text for a in w.anomalies]
    assert set(data["traces"]) == {str(k) for k in w.kept}
    assert data["traces"][str(w.kept[0])]["details"]  # the kept Traces' detail travels too


def test_a_watch_left_open_across_cells_is_pushed_after_each_cell(clock):
    model, opt, x, y = setup()
    w = watch(model, flight_recorder=False)  # rows stay on the device up to `batch` steps
    wid = w.widget()
    sent = capture(wid)
    for _ in range(3):
        step(model, opt, x, y)  # the clock stands still: no push during the "cell"
    assert sent == []
    wid._after_cell()  # IPython's post_run_cell: the complete steps (their optimizer step ran) go out
    assert [(m["start"], m["count"]) for m, _ in sent] == [(0, 2)]
    wid._after_cell()
    assert len(sent) == 1  # nothing new, nothing sent
    w.close()
    assert [(m["start"], m["count"], m["state"]) for m, _ in sent][1:] == [(2, 1, "closed")]
    np.testing.assert_array_equal(rows_of(sent, len(w.layer_names), len(w.stat_names))[0], w.stats.float().numpy())


def test_rows_recorded_before_the_widget_come_in_the_views_sync_not_in_a_push(clock):
    """A widget made after 4 steps pushes only the steps after it; the 4 before reach a view through its sync (the
    answer a view asks for when it opens: bounded, where a push of them was the whole run in one message)."""
    model, opt, x, y = setup()
    w = watch(model, flight_recorder=False)
    for _ in range(4):
        step(model, opt, x, y)
    before = len(w.steps)  # a read: the rows reach the host
    assert before == w.n_rows >= 3
    wid = w.widget()
    sent = capture(wid)
    for _ in range(2):
        step(model, opt, x, y)
    wid._after_cell()
    assert [m["start"] for m, _ in sent if m["type"] == "rows"] == [before]  # the new steps only
    w.close()
    sent.clear()
    wid._on_msg(wid, {"type": "sync", "have": 0, "request_id": "s"}, [])
    assert [(m["type"], m["start"]) for m, _ in sent] == [("rows", 0)]  # a short run: every row, no overview
    np.testing.assert_array_equal(rows_of(sent, len(w.layer_names), len(w.stat_names))[0], w.stats.float().numpy())
