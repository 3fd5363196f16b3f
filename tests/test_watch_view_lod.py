"""The watch's view at any length and width (issue 42): the page within its byte budget holding an overview in
bins and full-resolution rows where they matter, the live widget answering a zoom from w.rows / w.lod. References
are numpy reductions over the rows and torch's own bfloat16, never the code under test."""

import base64
import importlib
import json

import jsonschema
import numpy as np
import pytest
import torch

from benchmarks.watch_page import synthetic_watch
from hookwidget.views import watch_export
from hookwidget.views.widget import PAYLOAD_SCHEMA

ww = importlib.import_module("hookwidget.views.watch_widget")
SPEC = json.loads(PAYLOAD_SCHEMA.read_text(encoding="utf-8"))


def check(name, value):
    jsonschema.validate(value, {"$defs": SPEC["$defs"], "$ref": f"#/$defs/{name}"})


def unb64(text, dtype):
    return np.frombuffer(base64.b64decode(text), dtype)


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def test_bfloat16_rounds_as_torch_does_and_keeps_nan_and_inf():
    x = np.array([1.0, 2011.0, 1e30, -3.3e-5, np.inf, -np.inf, np.nan, 2.0**18, 1.00390625, 1.01171875], np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = watch_export.bfloat16(x)
    assert np.array_equal(got[~np.isnan(x)], want[~np.isnan(x)])
    assert np.isnan(bf16_to_f32(got)[6]) and bf16_to_f32(got)[4] == np.inf and bf16_to_f32(got)[7] == 2.0**18


@pytest.fixture(scope="module")
def wide():
    return synthetic_watch(300, 3000)


@pytest.mark.parametrize("budget", [2 * 2**20, 4 * 2**20])
def test_the_page_fits_its_budget_and_holds_what_it_says(wide, tmp_path, budget):
    w = wide
    path = watch_export.to_html(w, tmp_path / "w.html", budget=budget)
    assert path.stat().st_size <= budget
    d = watch_export.data(w, budget)
    steps, stats, step_stats = (t.numpy() for t in w.rows())
    L, K = stats.shape[1:]
    # The overview: every row in bins of one power-of-two size, equal to numpy's min/max/mean over each bin's rows
    # (to bfloat16's 8 significant bits).
    o = d["overview"]
    size, m = o["size"], len(o["rows"])
    assert size & (size - 1) == 0 and m == -(-len(steps) // size) and sum(o["rows"]) == len(steps)
    mx = bf16_to_f32(unb64(o["max"], np.uint16)).reshape(m, L, K)
    mn = bf16_to_f32(unb64(o["min"], np.uint16)).reshape(m, L, K)
    mean = bf16_to_f32(unb64(o["mean"], np.uint16)).reshape(m, L, K)
    for b in range(m):
        rows = stats[b * size:(b + 1) * size].astype(np.float64)
        np.testing.assert_allclose(mx[b], rows.max(0), rtol=2**-8)
        np.testing.assert_allclose(mn[b], rows.min(0), rtol=2**-8)
        np.testing.assert_allclose(mean[b], rows.mean(0), rtol=2**-7)
        assert o["first"][b] == steps[b * size] and o["last_step"][b] == steps[min(len(steps), (b + 1) * size) - 1]
    # The spike (the synthetic run's anomaly) keeps its height in its bin's max.
    spike = w.anomalies[0].step
    k = list(w.stat_names).index("grad_norm")
    assert mx[spike // size, 7, k] == pytest.approx(stats[spike, 7, k], rel=2**-8)
    # Full-resolution segments: exactly w.rows as float32, one around each anomaly, the last steps.
    held = set()
    for seg in d["segments"]:
        a, n = seg["start"], len(seg["steps"])
        assert seg["steps"] == steps[a:a + n].tolist()
        assert np.array_equal(unb64(seg["stats"], np.float32).reshape(n, L, K), stats[a:a + n].astype(np.float32))
        got = unb64(seg["step_stats"], np.float32).reshape(n, 2)
        assert np.array_equal(got, step_stats[a:a + n].astype(np.float32), equal_nan=True)
        held |= set(range(a, a + n))
    assert {a.step for a in w.anomalies} <= held and len(steps) - 1 in held
    assert d["held"].startswith(f"this page holds steps 0–2,999 in {m:,} bins of {size:,} recorded steps")
    assert "full resolution for the last" in d["held"]


def test_a_bigger_budget_holds_finer_bins(wide):
    sizes = [watch_export.data(wide, b)["overview"]["size"] for b in (2 * 2**20, 8 * 2**20)]
    assert sizes[1] < sizes[0]


def test_a_budget_too_small_is_refused_in_one_line(wide, tmp_path):
    with pytest.raises(ValueError, match=r"^to_html\(budget=1000\): .* at least 1 MiB"):
        watch_export.to_html(wide, tmp_path / "w.html", budget=1000)


def widget_of(w):
    wid = ww.WatchWidget(w)
    sent = []
    wid.send = lambda content, buffers=None: sent.append((content, buffers or []))
    return wid, sent


def test_a_zoomed_window_is_answered_at_full_resolution_from_w_rows(wide):
    wid, sent = widget_of(wide)
    wid._on_msg(wid, {"type": "sync", "have": 0, "request_id": "s"}, [])
    k = list(wide.stat_names).index("grad_norm")
    content = {"type": "window", "start": 1100, "stop": 1200, "bins": 800, "stat": k, "request_id": "w"}
    check("request_window", content)
    wid._on_msg(wid, content, [])
    msg, bufs = sent[-1]
    check("reply_lod", msg)
    assert (msg["role"], msg["size"], msg["start"], msg["stat"]) == ("window", 1, 1100, k)
    got = np.frombuffer(bufs[0], np.float32).reshape(100, -1)
    for layer in (0, 7, 299):
        assert np.array_equal(got[:, layer], wide.series(f"layers.{layer}", "grad_norm")[1100:1200].float().numpy())
    assert msg["first"] == wide.steps[1100:1200]


def test_a_wide_window_is_answered_in_bins_of_one_statistic_from_w_lod(wide):
    wid, sent = widget_of(wide)
    wid._on_msg(wid, {"type": "sync", "have": 0, "request_id": "s"}, [])
    # The sync of a run longer than the view's tail: the overview of every row, then the latest rows.
    (over, _), (rows, _) = sent[-2], sent[-1]
    check("reply_lod", over)
    check("reply_rows", rows)
    assert over["role"] == "overview" and over["stop"] == 3000
    assert len(over["rows"]) <= ww.overview_bins(300 * 13) < 3000
    assert rows["start"] == 3000 - 1024 and rows["count"] == 1024  # 1,024 rows of 300 × 13 float32: under 16 MiB
    # A wider run's tail is as many rows as 16 MiB of float32 holds (a view opening on it decodes no more).
    wide_row = 1000 * 13 * 4
    assert ww.tail_rows(1000 * 13) * wide_row <= 16 * 2**20 < (ww.tail_rows(1000 * 13) + 1) * wide_row
    k = list(wide.stat_names).index("update_ratio")
    old = ww.WINDOW_BYTES
    ww.WINDOW_BYTES = 300 * 4 * 50  # 50 rows of one statistic: 1,000 rows go as bins
    try:
        wid._on_msg(wid, {"type": "window", "start": 1000, "stop": 2000, "bins": 100, "stat": k, "request_id": "w"}, [])
    finally:
        ww.WINDOW_BYTES = old
    msg, bufs = sent[-1]
    check("reply_lod", msg)
    _, stats, _ = (t.numpy() for t in wide.rows(1000, 2000))
    size, m = msg["size"], len(msg["rows"])
    assert msg["start"] % size == 0 and size > 1 and m <= 100
    mx = np.frombuffer(bufs[1], np.float32).reshape(m, -1)
    for b in range(m):
        a = max(1000, msg["start"] + b * size) - 1000
        assert np.array_equal(mx[b], stats[a:a + msg["rows"][b], :, k].max(0).astype(np.float32))


def test_a_window_outside_the_watch_is_refused_in_one_line(wide):
    wid, sent = widget_of(wide)
    wid._on_msg(wid, {"type": "sync", "have": 0, "request_id": "s"}, [])
    wid._on_msg(wid, {"type": "window", "start": 10, "stop": 20, "bins": 5, "stat": 99, "request_id": "w"}, [])
    assert sent[-1][0]["state"] == "error" and "statistic 99" in sent[-1][0]["text"]


def test_a_watch_writes_its_page_within_the_budget_it_is_given(wide, tmp_path):
    """w.to_html(path, budget=) is the public way to the page's byte budget (views.watch_export's own)."""
    path = wide.to_html(tmp_path / "w.html", budget=2 * 2**20)
    assert 2**20 < path.stat().st_size <= 2 * 2**20
    with pytest.raises(ValueError, match=r"^to_html\(budget=1000\): .* at least 1 MiB"):
        wide.to_html(tmp_path / "small.html", budget=1000)
    assert not (tmp_path / "small.html").exists()
