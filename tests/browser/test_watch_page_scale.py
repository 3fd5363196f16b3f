"""w.to_html of a wide, long run (issue 42): a synthetic watch of 1,000 layers within the 16 MiB budget opens in
chromium, every anomaly is marked, the layers read as blocks that expand, and zooming to an anomaly shows its
full-resolution values, equal to the run's own rows (the synthetic float32 data, not hookwidget's reading of it).
The time to open is printed and measured in benchmarks/watch_page.py; here only a hang guard."""

import time

import numpy as np
import pytest

from benchmarks.watch_page import synthetic_rows, synthetic_watch
from hookwidget.capture.stat_rows import STAT_NAMES

L, N = 1000, 4096
HANG_S = 60  # a guard against a page that never draws, not a speed target (benchmarks/results/watch_page.md)


@pytest.fixture(scope="module")
def page_path(tmp_path_factory):
    from hookwidget.views import watch_export

    w = synthetic_watch(L, N)
    return watch_export.to_html(w, tmp_path_factory.mktemp("wide") / "watch.html")


MARKS = """(root) => {
    const v = root.hwView, canvas = root.querySelector('[data-testid=watch-marks]'), ctx = canvas.getContext('2d');
    return v.markColumns().map(({ step, x }) => [step, ctx.getImageData(Math.round(x) + 1, 2, 1, 1).data[3]]);
}"""


@pytest.mark.parametrize("width", [1100, 1500])
def test_a_page_of_1000_layers_opens_marks_every_anomaly_and_expands_a_block(page, img_dir, page_path, width):
    from hookwidget.views.watch_export import BUDGET

    assert page_path.stat().st_size <= BUDGET
    page.set_viewport_size({"width": width, "height": 1000})
    t0 = time.perf_counter()
    page.goto(page_path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=HANG_S * 1000)
    print(f"opened in {time.perf_counter() - t0:.2f} s at {width} px ({page_path.stat().st_size / 2**20:.1f} MiB)")
    root = page.locator('[data-testid="watch"]')
    stats, _, anomalies = synthetic_rows(L, N)
    # Every anomaly is marked in the column that holds it: a painted pixel there.
    marks = root.evaluate(MARKS)
    assert sorted(s for s, _ in marks) == sorted(s for s, _, _ in anomalies)
    assert all(alpha > 0 for _, alpha in marks), marks
    assert "this page holds steps 0–4,095 in " in root.locator('[data-testid="watch-held"]').inner_text()
    # 1,000 layers read as 21 rows: the chain folded, in blocks of 50.
    labels = root.locator(".hw-w-label")
    assert labels.count() == 21
    assert labels.nth(0).inner_text().startswith("▾ layers.0 … layers.999 (1000 blocks")
    root.screenshot(path=str(img_dir / f"watch_page_1000_layers_{width}.png"))
    labels.nth(1).click()  # layers.0 … layers.49 expands
    assert labels.count() == 71 and labels.nth(2).get_attribute("title") == "layers.0"
    # Zoomed to the spike: drawn from full-resolution rows, equal to the run's float32 values.
    spike = anomalies[0][0]
    root.evaluate(f"(root) => root.hwView.setView({{ v0: {spike - 10}, v1: {spike + 10} }})")
    assert root.locator('[data-testid="watch-resolution"]').inner_text() == "drawn at full resolution: a column a step"
    got = root.evaluate("(root) => root.hwView.shownValues(7, 'grad_norm')")
    want = stats[spike - 10:spike + 10, 7, STAT_NAMES.index("grad_norm")]
    assert [c["first"] for c in got] == list(range(spike - 10, spike + 10))
    assert np.array_equal(np.array([c["value"] for c in got], np.float32), want)
    root.screenshot(path=str(img_dir / f"watch_page_1000_layers_zoomed_{width}.png"))
    assert not page.errors, page.errors
