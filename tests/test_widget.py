"""HookWidget: the message protocol, driven as the front-end would, with the kernel side real."""

import logging
import pathlib

import numpy as np
import pytest
import torch

import hookwidget as hw
from hookwidget.views.widget import HookWidget


@pytest.fixture
def widget(seed_mlp):
    model, x, y, step = seed_mlp
    t = hw.trace(step)
    w = HookWidget(t)
    w.test_keep = t  # the widget holds its trace weakly: the test is the user holding `t`
    w.sent = []
    w.send = lambda content, buffers=None: w.sent.append((content, buffers or []))
    return model, x, step, w


def msg(w, **content):
    w.sent.clear()
    w._on_msg(w, content, [])
    return w.sent


def test_esm_points_to_the_built_bundle_and_summary_syncs():
    from hookwidget.views.widget import ESM

    assert ESM == pathlib.Path(hw.__file__).parent / "static" / "widget.js"
    assert str(HookWidget._esm) == ESM.read_text()
    assert HookWidget.summary.metadata.get("sync") and HookWidget.readonly.metadata.get("sync")


def test_trace_displays_as_its_widget(seed_mlp):
    t = hw.trace(seed_mlp[3])
    w = t.widget()
    assert isinstance(w, HookWidget) and w.trace is t
    assert {"graph", "modules", "kinds", "hooks", "loss"} <= set(w.summary)


def test_display_carries_a_static_snapshot_beside_the_view(seed_mlp):
    """Where the view cannot render (its model gone, an untrusted notebook, nbconvert), the snapshot shows."""
    t = hw.trace(seed_mlp[3])
    data = t._repr_mimebundle_()
    data = data[0] if isinstance(data, tuple) else data
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "static snapshot" in data["text/html"] and "<td>fc2</td>" in data["text/html"]


def test_detail_reply_carries_buffers(widget):
    model, x, _, w = widget
    [(reply, buffers)] = msg(w, type="detail", target="fc1", request_id="r1")
    assert reply["type"] == "detail" and reply["request_id"] == "r1" and reply["target"] == "fc1"
    info = reply["meta"]["tensors"]["grad_autograd"]
    got = np.frombuffer(buffers[info["buffer"]], dtype="float32").reshape(info["shape"])
    np.testing.assert_array_equal(got, model.fc1.weight.grad.numpy())


@pytest.mark.parametrize("content, why", [
    ({"type": "exec", "code": "import os", "request_id": "r"}, "unknown type"),
    ({"type": "detail", "target": "fc1", "request_id": "r", "extra": 1}, "unknown key"),
    ({"type": "detail", "request_id": "r"}, "missing key"),
    ({"type": "detail", "target": 5, "request_id": "r"}, "target must be"),
    ({"type": "add_hook", "target": "fc1", "kind": "callable", "params": {}, "request_id": "r"}, "Python function"),
    ({"type": "add_hook", "target": "fc1", "kind": "rm -rf", "params": {}, "request_id": "r"}, "unknown intervention"),
    ({"type": "add_hook", "target": "fc1", "kind": "grad_scale", "params": {"factor": "__import__('os')"},
      "request_id": "r"}, "numbers"),
    ({"type": "add_hook", "target": "fc1", "kind": "grad_scale", "params": {"factor": True}, "request_id": "r"},
     "numbers"),
    ({"type": "rerun", "request_id": {"x": 1}}, "request_id"),
    ("rerun", "expected an object"),
])
def test_malformed_messages_are_rejected_with_one_logged_line(widget, caplog, content, why):
    *_, w = widget
    before = w.trace
    with caplog.at_level(logging.WARNING, logger="hookwidget"):
        w.sent.clear()
        w._on_msg(w, content, [])
    [(reply, _)] = w.sent
    assert reply["type"] == "status" and reply["state"] == "error" and why in reply["text"]
    assert "\n" not in reply["text"]
    [record] = [r for r in caplog.records if r.name == "hookwidget"]
    assert why in record.getMessage() and "\n" not in record.getMessage()
    assert w.trace is before and before.interventions == []


def test_bad_params_for_a_kind_come_back_as_an_error(widget):
    *_, w = widget
    [(reply, _)] = msg(w, type="add_hook", target="fc1", kind="grad_clamp", params={"min": 1, "max": -1},
                       request_id="r")
    assert reply["state"] == "error" and "min=1.0 is above max=-1.0" in reply["text"]
    [(reply, _)] = msg(w, type="add_hook", target="nope", kind="grad_zero", params={}, request_id="r")
    assert reply["state"] == "error" and "unknown target" in reply["text"]


def test_toggle_grad_zero_reruns_and_reports_the_diff(widget):
    model, x, step, w = widget
    first = w.trace
    [(reply, _)] = msg(w, type="add_hook", target="fc1", kind="grad_zero", params={}, request_id="a")
    assert reply["state"] == "done" and w.summary["hooks"] == [{"target": "fc1", "kind": "grad_zero", "params": {}}]
    replies = [r for r, _ in msg(w, type="rerun", request_id="b")]
    assert [r.get("state", r["type"]) for r in replies] == ["running", "trace", "done"]
    diff = replies[1]["diff"]
    assert w.trace is not first and diff["changed_modules"] == ["fc1"]
    # Reference: the same step with a plain tensor hook zeroing fc1's output gradient.
    def zero_grad_of_output(module, inputs, output):
        output.register_hook(torch.zeros_like)

    h = model.fc1.register_forward_hook(zero_grad_of_output)
    try:
        step()
    finally:
        h.remove()
    params = {p["name"]: p for p in diff["params"]}
    assert params["fc1.weight"]["after"] == float(model.fc1.weight.grad.norm()) == 0.0
    assert params["fc2.weight"]["after"] == pytest.approx(float(model.fc2.weight.grad.double().norm()))
    assert w.summary["params"]["fc1.weight"] == 0.0
    [(reply, _)] = msg(w, type="remove_hook", target="fc1", kind="grad_zero", request_id="c")
    assert reply["state"] == "done" and w.summary["hooks"] == []
    replies = [r for r, _ in msg(w, type="rerun", request_id="d")]
    assert {p["name"]: p for p in replies[1]["diff"]["params"]}["fc1.weight"]["after"] > 0


def test_rerun_errors_are_reported_not_swallowed(seed_mlp):
    with hw.tracing() as t:
        seed_mlp[3]()
    w = HookWidget(t)
    w.sent = []
    w.send = lambda content, buffers=None: w.sent.append(content)
    w._on_msg(w, {"type": "rerun", "request_id": 7}, [])
    assert w.sent[-1]["state"] == "error" and "RuntimeError: rerun needs the code" in w.sent[-1]["text"]
    assert w.sent[-1]["request_id"] == 7


def test_a_missing_bundle_shows_how_to_build_it(tmp_path):
    import subprocess
    import sys

    # A fresh interpreter where static/widget.js does not exist: the widget explains instead of failing.
    code = ("import pathlib, hookwidget.views.widget as w; "
            "print(w.HookWidget._esm if isinstance(w.HookWidget._esm, str) else 'file')")
    env_path = tmp_path / "pkg"
    import shutil

    shutil.copytree(pathlib.Path(hw.__file__).parent, env_path / "hookwidget",
                    ignore=shutil.ignore_patterns("static", "__pycache__"))
    out = subprocess.run([sys.executable, "-c", code], cwd=env_path, capture_output=True, text=True, check=True)
    assert "npm run build" in out.stdout


def test_widget_does_not_keep_a_displayed_trace_alive(seed_mlp):
    import gc
    import weakref

    t = hw.trace(seed_mlp[3])
    w = t.widget()
    w.sent = []
    w.send = lambda content, buffers=None: w.sent.append((content, buffers or []))
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None
    [(reply, _)] = msg(w, type="detail", target="fc1", request_id="r9")
    assert reply["state"] == "error" and reply["text"].startswith("this trace was freed") and "t = hw.trace(" in \
        reply["text"]
    # A trace nothing holds (no variable) is freed at once, without the collector: the widget says how to keep it.
    w = hw.trace(seed_mlp[3]).widget()
    w.sent = []
    w.send = lambda content, buffers=None: w.sent.append((content, buffers or []))
    [(reply, _)] = msg(w, type="detail", target="fc1", request_id="r10")
    assert reply["state"] == "error" and "keep it in a variable" in reply["text"]


def test_widget_and_python_share_the_hooks_and_the_latest_trace(widget):
    _, _, _, w = widget
    t = w.test_keep
    msg(w, type="add_hook", target="fc2", kind="grad_scale", params={"factor": 0.5}, request_id="a1")
    assert [(iv.target, iv.kind.name) for iv in t.interventions] == [("fc2", "grad_scale")]
    assert w.summary["hooks"] == [{"target": "fc2", "kind": "grad_scale", "params": {"factor": 0.5}}]
    sent = msg(w, type="rerun", request_id="a2")
    trace_msg = next(c for c, _ in sent if c["type"] == "trace")
    assert trace_msg["diff"]["against"] == "baseline"
    assert w.trace is t.session.latest and w.trace is not t
    msg(w, type="remove_hook", target="fc2", kind="grad_scale", request_id="a3")
    assert t.interventions == [] and w.summary["hooks"] == []


def test_rejected_hook_is_an_error_reply_and_adds_nothing(widget):
    _, _, _, w = widget
    [(reply, _)] = msg(w, type="add_hook", target="fc1", kind="grad_clamp", params={"min": 1, "max": -1},
                       request_id="c1")
    assert reply["request_id"] == "c1" and reply["state"] == "error" and "min" in reply["text"]
    assert w.test_keep.interventions == []


def test_to_html_exports_what_is_on_screen(widget, tmp_path):
    _, _, _, w = widget
    msg(w, type="add_hook", target="fc2", kind="grad_scale", params={"factor": 0.5}, request_id="e1")
    msg(w, type="rerun", request_id="e2")
    assert w.diff["against"] == "baseline"
    text = w.to_html(tmp_path / "now.html").read_text()
    assert '"hooks":[{"target":"fc2","kind":"grad_scale"' in text and '"against":"baseline"' in text


def _pairs(hooks):
    return sorted((h["target"], h["kind"]) for h in hooks)


def test_python_changes_reach_the_widget_without_a_message(widget):
    """One source of truth: hooks and reruns made in a cell show at once; t.interventions equals the UI's hooks
    after every change, whichever side made it."""
    _, _, _, w = widget
    t = w.test_keep
    python = lambda: sorted((iv.target, iv.kind.name) for iv in t.interventions)  # noqa: E731
    t.add_hook("fc1", "grad_zero")
    assert w.summary["hooks"] == [{"target": "fc1", "kind": "grad_zero", "params": {}}]
    t2 = t.rerun()
    assert w.trace is t2 and w.summary["loss"] == pytest.approx(t2.loss)
    assert w.diff["against"] == "baseline" and w.diff["hooks"] == ["fc1"]
    msg(w, type="add_hook", target="fc2", kind="grad_scale", params={"factor": 0.5}, request_id="u1")
    assert python() == _pairs(w.summary["hooks"]) == [("fc1", "grad_zero"), ("fc2", "grad_scale")]
    t.remove_hook("fc1", "grad_zero")
    assert python() == _pairs(w.summary["hooks"]) == [("fc2", "grad_scale")]
    msg(w, type="remove_hook", target="fc2", kind="grad_scale", request_id="u2")
    assert python() == _pairs(w.summary["hooks"]) == []


def test_displaying_the_trace_after_a_python_rerun_shows_the_rerun_and_its_diff(seed_mlp):
    """Issue 41: t.add_hook, t.rerun(), then `t` displayed: the explorer shows the rerun (its loss, the hook),
    the diff against the hook-free run and the changed layer, not the first run."""
    t = hw.trace(seed_mlp[3])
    t.add_hook("fc2", "out_scale", factor=0.5)
    t2 = t.rerun()
    w = HookWidget(t)
    assert w.trace is t2 and w.summary["loss"] == t2.loss != t.loss
    assert w.summary["hooks"] == [{"target": "fc2", "kind": "out_scale", "params": {"factor": 0.5}}]
    assert w.diff["against"] == "baseline" and w.diff["loss_before"] == t.loss and w.diff["loss_after"] == t2.loss
    assert "fc2" in w.diff["changed_modules"]
    fresh = HookWidget(hw.trace(seed_mlp[3]))  # a trace with no rerun shows itself, no diff
    assert fresh.diff is None


def test_an_explorer_of_a_step_kept_by_hw_watch_stays_on_that_step(seed_mlp):
    """The flight recorder's kept steps share one session whose latest moves on: displaying an earlier kept step shows
    that step (its loss, its detail), not the latest."""
    model, x, y, step = seed_mlp
    with hw.watch(model, keep=lambda k, stats: k == 0) as w:
        for _ in range(3):
            step()
            with torch.no_grad():
                model.fc1.weight.mul_(0.5)  # each step's loss differs
    first, last = w.trace(0), w.trace(-1)
    assert first is not last and first.loss != last.loss
    view = HookWidget(first)
    assert view.trace is first and view.summary["loss"] == first.loss and view.diff is None  # detail asks view.trace


def test_a_failing_display_never_fails_the_users_rerun(widget, monkeypatch, caplog):
    _, _, _, w = widget
    t = w.test_keep
    t.add_hook("fc1", "grad_zero")

    def broken(_trace):
        raise RuntimeError("display broke")

    monkeypatch.setattr("hookwidget.views.payload.summary", broken)
    with caplog.at_level(logging.WARNING, logger="hookwidget"):
        t2 = t.rerun()
    assert t2.session.latest is t2 and "display broke" in caplog.text


def test_the_session_holds_its_listeners_weakly(seed_mlp):
    import gc
    import weakref

    class Screen:
        def __init__(self):
            self.seen = []

        def changed(self, what):
            self.seen.append(what)

    t = hw.trace(seed_mlp[3])
    screen = Screen()
    t.session.on_change(screen.changed)
    t.add_hook("fc1", "grad_zero")
    t.rerun()
    assert screen.seen == ["hooks", "latest"]
    ref = weakref.ref(screen)
    del screen
    gc.collect()
    assert ref() is None  # the session did not keep it
    t.remove_hook("fc1", "grad_zero")  # the dead listener is skipped and dropped
    assert t.session._listeners == []
