"""`Watch.to_html`: one self-contained page with the watch explorer (heatmap, sparklines, loss, kept steps),
read-only, for sharing a training run without a kernel, within a byte budget whatever the run's length and width.

Built like the trace page (views/export.py): the bundle and the data inlined, a strict CSP, every inlined text
escaped. A run of 168 layers × 100,000 steps is 2.2 GB of float32 statistics, so the page holds a level of detail
(the watch's `w.lod`, watch/lod.py) that fits `budget` bytes, and says on the page what it holds:

- full-resolution rows (float32, base64) for the last steps and around each anomaly and kept step, where a
  reader zooms in: TAIL_SHARE and AROUND_SHARE of the budget at most;
- an overview of the whole run in as many power-of-two bins as the rest of the budget pays for: per bin, layer
  and statistic the min, max and mean over its finite values as bfloat16 (float32's range, NaN and ±Inf, 3
  significant digits: float16 would overflow to Inf above 65,504, where gradient norms go; a spike keeps its
  height in the max), the loss and global gradient norm's min, max, mean and last as float32;
- the kept Traces' summaries, and their tensor detail while it fits DETAIL_SHARE of the budget.

The anomalies, kept steps and non-finite stretches travel whole (the view marks them at every zoom).
"""

from __future__ import annotations

import base64
import pathlib

import numpy as np

from hookwidget.views import payload
from hookwidget.views.anomalies import anomaly_entry
from hookwidget.views.export import STATIC, details, json_for_script, standalone_page

BUDGET = 16 * 2**20  # bytes of the page by default
TAIL_SHARE, AROUND_SHARE, DETAIL_SHARE = 0.15, 0.25, 0.15  # of the budget left once the page's fixed parts are in
TAIL, AROUND = 2048, 32  # at full resolution at most: the last rows, the rows either side of an anomaly or kept step
MAX_BINS = 4096  # an overview finer than the widest screen has no use
PAGE_SLACK = 8192  # the HTML around the data


def to_html(watch, path, budget: int = BUDGET) -> pathlib.Path:
    """Write the watch explorer of `watch` to `path` (one HTML file of at most `budget` bytes); returns the path."""
    path = pathlib.Path(path)
    path.write_text(page(watch, budget=budget), encoding="utf-8")
    return path


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def b64_len(nbytes: int) -> int:
    return 4 * -(-nbytes // 3)


def bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; NaN stays NaN, ±Inf stays ±Inf."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def data(watch, budget: int = BUDGET) -> dict:
    """What the page shows, within `budget` bytes of page: names, an overview in bins, full-resolution segments,
    anomalies, kept steps and Traces, and `held`: the sentence that says what resolution the page holds."""
    if not isinstance(budget, int) or budget < 2**20:
        raise ValueError(f"to_html(budget={budget!r}): the page's size in bytes, an int of at least 1 MiB (2**20)")
    L, K, n = len(watch.layer_names), len(watch.stat_names), watch.n_rows
    anomalies = watch.anomalies  # read once: a SavedWatch works each one's lead out on every read
    out = {
        "meta": {"layers": list(watch.layer_names), "stats": list(watch.stat_names),
                 "step_stats": list(watch.step_stat_names), "every": watch.every},
        "n_rows": n, "anomalies": [anomaly_entry(a) for a in anomalies],
        "nonfinite": [[int(k), int(v)] for k, v in watch.nonfinite.items()],
        "kept": [int(k) for k in watch.kept], "dropped": watch.dropped_traces,
        "state": "open" if watch.active else "closed", "traces": {}, "segments": [], "overview": None, "held": "",
    }
    left = budget - PAGE_SLACK - (STATIC / "watch_standalone.js").stat().st_size - len(json_for_script(out))
    left -= _traces(watch, out["traces"], int(left * DETAIL_SHARE), left // 4)
    row_bytes = b64_len(L * K * 4) + b64_len(8) + 12  # a full-resolution row: stats, loss and norm, its step
    tail = min(TAIL, n, max(0, int(left * TAIL_SHARE) // row_bytes))
    marks = sorted({int(a.step) for a in anomalies} | {int(k) for k in watch.kept})
    around = _around(watch, marks, n - tail, int(left * AROUND_SHARE) // row_bytes)
    ranges = _union(around + ([(n - tail, n)] if tail else []))
    for a, b in ranges:
        steps, stats, step_stats = watch.rows(a, b)
        out["segments"].append({"start": a, "steps": [int(s) for s in steps],
                                "stats": b64(stats.float().numpy()), "step_stats": b64(step_stats.float().numpy())})
    left -= sum(len(json_for_script(s)) for s in out["segments"])
    bin_bytes = 3 * b64_len(L * K * 2) // 1 + b64_len(8 * 4) + 36  # min, max, mean bfloat16; 8 step floats; 3 ints
    bins = min(MAX_BINS, max(1, left // bin_bytes))
    out["overview"] = _overview(watch.lod(int(bins)) if n else None)
    out["held"] = held_text(watch, out, tail, around)
    return out


def _traces(watch, traces: dict, detail_budget: int, summary_budget: int) -> int:
    """Fill `traces` with each kept step's summary (while they fit `summary_budget`) and tensor detail (while it
    fits `detail_budget`); returns the bytes used."""
    used = detail = 0
    for k in watch.kept:
        t = watch.trace(k)
        entry = {"summary": payload.summary(t), "diff": None, "details": {}, "details_note": ""}
        size = len(json_for_script(entry))
        if used + size > summary_budget:
            traces[str(k)] = None  # the view says its Trace is not in this page
            continue
        d = details(t)
        extra = sum(b64_len(len(b)) for v in d["details"].values() for b in v["buffers"])
        if detail + extra <= detail_budget:
            entry.update(d)
            detail += extra
        if not entry["details"]:
            entry["details_note"] = "tensor detail of this step was left out to keep the page small"
        traces[str(k)] = entry
        used += size + (extra if entry["details"] else 0)
    return used


def _around(watch, marks: list, tail_from: int, rows: int) -> list:
    """Row ranges of up to AROUND rows either side of each marked step (anomalies, kept steps) before the tail,
    fewer each when `rows` cannot pay for AROUND: (start, stop) pairs."""
    at = [r for r in (watch._row_of(s) for s in marks) if r is not None and r < tail_from]  # a row at a time
    if not at or rows <= 0:
        return []
    half = min(AROUND, (rows // len(at) - 1) // 2)
    if half < 0:
        at, half = at[:rows], 0
    return [(max(0, r - half), min(tail_from, r + half + 1)) for r in at]


def _union(ranges: list) -> list:
    out = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _overview(b) -> dict | None:
    if b is None or not len(b):
        return None
    step = np.stack([b.step_min, b.step_max, b.step_mean, b.step_last], axis=1).astype(np.float32)  # (m, 4, 2)
    return {"size": int(b.size), "first": b.first.tolist(), "last_step": b.last_step.tolist(), "rows": b.rows.tolist(),
            "min": b64(bfloat16(b.min)), "max": b64(bfloat16(b.max)), "mean": b64(bfloat16(b.mean)), "step": b64(step)}


def held_text(watch, out: dict, tail: int, around: list) -> str:
    """What the page holds, in words: the overview's bins, the full-resolution rows."""
    o, n = out["overview"], out["n_rows"]
    if not n:
        return "no step recorded"
    steps = watch._step_index()
    if o["size"] == 1:
        return f"this page holds every recorded step ({steps[0]:,}–{steps[-1]:,}) at full resolution."
    m = len(o["rows"])
    parts = [f"this page holds steps {steps[0]:,}–{steps[-1]:,} in {m:,} bin{'s' if m != 1 else ''}"
             f" of {o['size']:,} recorded step{'s' if o['size'] != 1 else ''} (min, max, mean)"]
    full = []
    if tail:
        full.append(f"the last {tail:,} steps")
    if around:
        full.append(f"{min(len(around), len(out['anomalies']) + len(out['kept']))} anomalies and kept steps"
                    f" ± {max(b - a for a, b in around) // 2:,} steps")
    if full:
        parts.append("full resolution for " + " and around ".join(full))
    missing = [k for k, v in out["traces"].items() if v is None]
    if missing:
        parts.append(f"the Traces of steps {', '.join(missing)} were left out (over the page's budget)")
    return "; ".join(parts) + "."


def page(watch, title: str = "hookwidget watch", budget: int = BUDGET) -> str:
    """The HTML text of the standalone page."""
    return standalone_page("watch_standalone.js", data(watch, budget), title)

