"""The performance charts are drawn from the results now committed, and say what they show.

benchmarks/charts.py writes the SHA-256 of the JSON each chart was drawn from into the SVG: a result re-measured
without `python -m benchmarks.charts` run again leaves a chart of old figures, and fails here. Byte-equality with a
fresh drawing is not asked for: the SVG's geometry depends on the installed matplotlib.
"""

import re
from pathlib import Path

import pytest

from benchmarks import charts

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("chart", charts.CHARTS, ids=lambda c: c.name)
def test_each_committed_chart_is_drawn_from_the_committed_results(chart):
    svg = (charts.OUT / f"{chart.name}.svg").read_text()
    assert f"sha256 {charts.digest(charts.RESULTS / chart.source)}" in svg, \
        f"{chart.name}.svg is older than benchmarks/results/{chart.source}: run python -m benchmarks.charts"
    assert f"({chart.name}.svg)" in (ROOT / "docs" / "performance.md").read_text().replace("img/charts/", "")


def test_a_chart_carries_its_caption_and_loads_nothing(tmp_path):
    chart = next(c for c in charts.CHARTS if c.name == "watch_time_cpu")
    svg = charts.draw(chart, tmp_path).read_text()
    text = " ".join(re.findall(r">([^<>]+)</text>", svg))
    for words in ("Machine: CPU", "Command: python -m benchmarks.watch_overhead", "Measured: median CPU time",
                  "hand-written hooks (the floor)", "wandb.watch, log_freq=1", "hw.watch, statistics only"):
        assert words in text, words
    assert not re.search(r"""(?:href|src)=["']https?://""", svg)  # the DTD and namespaces are names, not fetched


def test_the_readers_reject_a_results_file_they_do_not_know():
    with pytest.raises(ValueError):
        charts.series(charts.Chart("x", "unknown.json", "", "", "", "", False), {})
