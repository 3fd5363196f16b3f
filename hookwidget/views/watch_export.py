"""`Watch.to_html`: one self-contained page with the watch explorer (heatmap, sparklines, loss, kept steps),
read-only, for sharing a training run without a kernel.

Built like the trace page (views/export.py): the bundle and the data inlined, a strict CSP, every
inlined text escaped. Statistics travel as base64 float64 (NaN and Inf survive, JSON has neither);
kept Traces carry their summaries, and their tensor detail while the page stays under DETAIL_BUDGET.
"""

from __future__ import annotations

import base64
import pathlib

from hookwidget.views import payload
from hookwidget.views.anomalies import anomaly_entry
from hookwidget.views.export import details, standalone_page

DETAIL_BUDGET = 24 * 2**20  # bytes of kept Traces' tensor detail inlined, over all of them


def to_html(watch, path) -> pathlib.Path:
    """Write the watch explorer of `watch` to `path` (one HTML file); returns the path."""
    path = pathlib.Path(path)
    path.write_text(page(watch), encoding="utf-8")
    return path


def data(watch) -> dict:
    """What the page shows: names, statistics (base64 float64), steps, anomalies, kept Traces."""
    stats, step_stats, steps = watch.stats, watch.step_stats, watch.steps
    traces, used = {}, 0
    for k in watch.kept:
        t = watch.trace(k)
        entry = {"summary": payload.summary(t), "diff": None, "details": {}, "details_note": ""}
        if used < DETAIL_BUDGET:
            d = details(t)
            size = sum(len(b) for v in d["details"].values() for b in v["buffers"]) * 3 // 4
            if used + size <= DETAIL_BUDGET:
                entry.update(d)
                used += size
        if not entry["details"]:
            entry["details_note"] = "tensor detail of this step was left out to keep the page small"
        traces[str(k)] = entry
    return {
        "meta": {"layers": list(watch.layer_names), "stats": list(watch.stat_names),
                 "step_stats": list(watch.step_stat_names), "every": watch.every},
        "steps": [int(s) for s in steps],
        "stats": base64.b64encode(stats.double().contiguous().numpy().tobytes()).decode("ascii"),
        "step_stats": base64.b64encode(step_stats.double().contiguous().numpy().tobytes()).decode("ascii"),
        "anomalies": [anomaly_entry(a) for a in watch.anomalies],
        "nonfinite": [[int(k), int(v)] for k, v in watch.nonfinite.items()],
        "kept": [int(k) for k in watch.kept], "dropped": watch.dropped_traces,
        "state": "open" if watch.active else "closed", "traces": traces,
    }


def page(watch, title: str = "hookwidget watch") -> str:
    """The HTML text of the standalone page."""
    return standalone_page("watch_standalone.js", data(watch), title)
