"""The live watch view at the scale of real runs (issue 42), in a real JupyterLab: 1,000 layers stream at 20 steps a
second into the widget while the page records its frames (requestAnimationFrame deltas, printed; the figure is in
benchmarks/results/watch_page.md, no timing is asserted), the view holds the overview's bins and the latest rows,
not every row, and a zoom to 100 steps older than those asks the kernel, whose full-resolution values the view
then draws, equal to the run's own float32 rows.

A 1,000-layer model runs at about 2 steps a second on this CPU (0.45 s a step for 1,000 Linear(8, 8) under the
watch), so the rows are a synthetic run's (benchmarks/watch_page.synthetic_rows) fed to the widget the way the
watch feeds it (its listener, at 20 rows a second), which is what the front-end sees of a fast loop."""

import json
import os

import numpy as np
import pytest
from browser_session import notebook, run_cell, start_cell
from lab_server import jupyter, write_notebook

from benchmarks.watch_page import synthetic_rows
from hookwidget.capture.stat_rows import STAT_NAMES

pytestmark = pytest.mark.browser
L, N0, N = 1000, 1200, 1600  # rows recorded before the view opens, rows at the end

SETUP = f"""\
import time
from benchmarks.watch_page import synthetic_watch
from hookwidget.views.watch_widget import WatchWidget

full = synthetic_watch({L}, {N})
leads = full.anomalies  # worked out once
S, SS = full.stats, full.step_stats  # read once: full.stats reads the whole run (83 MB) on each use


class Replay:
    \"\"\"The synthetic run as a live watch: rows become visible to the widget as the loop below records them.\"\"\"
    active, every, dropped_traces, found_nonfinite, _flight = True, 1, 0, {{}}, None

    def __init__(self, w, n):
        self.w, self.n, self.fn = w, n, None
        self.layer_names, self.stat_names, self.step_stat_names = w.layer_names, w.stat_names, w.step_stat_names

    steps = property(lambda self: self.w.steps[:self.n])
    stats = property(lambda self: self.w.stats[:self.n])
    step_stats = property(lambda self: self.w.step_stats[:self.n])
    n_rows = property(lambda self: self.n)
    _n = property(lambda self: self.n)
    found_anomalies = property(lambda self: [a for a in leads if a.step < self.n])

    def listen(self, fn):
        self.fn = fn

    def sync(self):
        pass

    def rows(self, start=0, stop=None):
        return self.w.rows(start, self.n if stop is None else min(stop, self.n))

    def lod(self, bins, start=0, stop=None):
        return self.w.lod(bins, start, self.n if stop is None else min(stop, self.n))


run = Replay(full, {N0})
wid = WatchWidget(run)
wid"""

STREAM = f"""\
t0 = time.monotonic()
for i in range({N0}, {N}):
    run.n = i + 1
    run.fn("rows", S[i:i + 1], SS[i:i + 1], [i])  # the new row, as the watch hands it over
    time.sleep(max(0.0, t0 + (i + 1 - {N0}) / 20 - time.monotonic()))  # 20 steps a second
run.active = False
run.fn("closed")"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("watchscale")
    write_notebook(root / "scale.ipynb", [SETUP, STREAM])
    with jupyter(root) as (base, token):
        yield {"url": f"{base}/lab/tree/scale.ipynb?token={token}"}


FRAMES = """() => {
    window.__frames = [];
    let last = performance.now();
    const tick = (t) => {
        window.__frames.push(t - last);
        last = t;
        if (!window.__stopFrames) requestAnimationFrame(tick);
    };
    requestAnimationFrame(tick);
}"""
STEPS = "Number(document.querySelector('[data-testid=watch-heatmap]')?.dataset.steps)"
HELD = """(root) => { const s = root.hwView.store;
    return { bins: s.overview.m, size: s.overview.size, first: s.received(0), last: s.received(s.n - 1) }; }"""


def spread(name: str, ms) -> dict:
    ms = np.asarray(ms, dtype=float)
    out = {"what": name, "count": int(ms.size), "p50_ms": round(float(np.median(ms)), 1),
           "p95_ms": round(float(np.percentile(ms, 95)), 1), "max_ms": round(float(ms.max()), 1),
           "min_ms": round(float(ms.min()), 1), "over_50_ms": int((ms > 50).sum()),
           "over_100_ms": int((ms > 100).sum()), "load_average": [round(x, 1) for x in os.getloadavg()]}
    print(json.dumps(out))
    return out


def test_1000_layers_stream_at_20_steps_a_second_and_a_zoom_shows_full_resolution(browser, lab, img_dir):
    with notebook(browser, lab["url"], 1500, 1400, failure=img_dir / "watch_live_scale_failure.png") as page:
        page.add_style_tag(content=".Toastify { display: none !important; }")
        run_cell(page, 0, timeout=180_000)
        page.wait_for_function(f"{STEPS} === {N0}", timeout=120_000)
        page.evaluate(FRAMES)
        page.locator('[data-testid="watch"]').evaluate("(root) => { root.hwView.redraws.length = 0; }")  # the stream's
        start_cell(page, 1)
        page.wait_for_function(f"document.querySelector('[data-testid=watch-state]').textContent === 'closed'"
                               f" && {STEPS} === {N}", timeout=120_000, polling=200)
        spread("frames (requestAnimationFrame deltas) while streaming",
               page.evaluate("() => { window.__stopFrames = true; return window.__frames; }")[1:])
        root = page.locator('[data-testid="watch"]')
        spread("the view's redraws while streaming", root.evaluate("(root) => root.hwView.redraws"))
        root.screenshot(path=str(img_dir / "watch_live_1000_layers_1500.png"))
        # What the view holds: the overview's bins (48 MiB at most: 154 of 1,000 × 13 values), the latest rows.
        held = root.evaluate(HELD)
        print("the view holds:", held)
        assert held["bins"] * held["size"] >= N and held["bins"] <= 154, held
        assert not held["first"] and held["last"], held
        # A zoom to 100 steps older than the latest rows: the view asks the kernel, then draws its rows.
        stats, _, _ = synthetic_rows(L, N)
        k = STAT_NAMES.index("grad_norm")
        root.evaluate("(root) => root.hwView.setView({ v0: 100, v1: 200 })")
        page.wait_for_function("document.querySelector('[data-testid=watch-heatmap]').dataset.resolution === '1'",
                               timeout=30_000)
        for layer in (0, 7, 999):
            got = root.evaluate(f"(root) => root.hwView.shownValues({layer}, 'grad_norm')")
            assert [c["first"] for c in got] == list(range(100, 200)) and {c["size"] for c in got} == {1}
            assert np.array_equal(np.array([c["value"] for c in got], np.float32), stats[100:200, layer, k])
        resolution = root.locator('[data-testid="watch-resolution"]').inner_text()
        assert resolution == "drawn at full resolution: a column a step"
        root.screenshot(path=str(img_dir / "watch_live_1000_layers_zoomed_1500.png"))
        assert not page.errors, page.errors
