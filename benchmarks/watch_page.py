"""The watch's page at the scale of real runs (issue 42): `to_html` bytes and the time chromium takes to open it,
for a synthetic run of 168 and 1,000 layers × 10,000 and 100,000 steps, before (main at cd8b631: every statistic
as base64 float64) and after (a level-of-detail page within a 16 MiB budget).

The run is synthetic and made in memory (a SavedWatch over float32 tensors), with a spike in layer 7's gradient
norm at a known step and a non-finite step, both anomalies. Runs whose float32 rows do not fit this machine's
share of RAM (1,000 × 100,000: 5.2 GB) are measured only where `--big` says so. "Before" pages are written by
main's own watch_export.data (git show cd8b631:hookwidget/views/watch_export.py, run in this process) where the
page is under 400 MB, else their size is computed from the same format (base64 of n × L × 13 float64) and they are
not opened (the issue: 2.3 GB, "not opened").

    PYTHONPATH=. python -m benchmarks.watch_page [--quick] [--big]

Writes benchmarks/results/watch_page.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import torch

from hookwidget.capture.stat_rows import STAT_NAMES, STEP_STAT_NAMES

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SPIKE_RATIO = 1e3


def synthetic_rows(L: int, n: int, seed: int = 0) -> tuple:
    """(stats (n, L, 13) float32, step_stats (n, 2) float32, anomalies [(step, where, reason)]): smooth noisy
    norms, a gradient-norm spike ×1000 in layer 7 at row n·0.37, the loss NaN at row n·0.81."""
    g = np.random.default_rng(seed)
    K = len(STAT_NAMES)
    stats = np.empty((n, L, K), np.float32)
    t = np.linspace(0, 1, n, dtype=np.float32)[:, None]
    base = g.uniform(0.5, 2.0, (1, L)).astype(np.float32)
    for k, name in enumerate(STAT_NAMES):
        if name in ("delta_nan", "delta_inf", "a_nonfinite", "grad_nan", "grad_inf"):
            stats[:, :, k] = 0
        elif name == "lr":
            stats[:, :, k] = 1e-3
        else:
            stats[:, :, k] = base * (1 + 0.5 * np.exp(-4 * t)) * (1 + 0.05 * g.standard_normal((n, L), np.float32))
    spike, bad = int(n * 0.37), int(n * 0.81)
    stats[spike, min(7, L - 1), STAT_NAMES.index("grad_norm")] *= SPIKE_RATIO
    loss = 2.0 * np.exp(-3 * t[:, 0]) + 0.01 * g.standard_normal(n)
    step_stats = np.stack([loss, stats[:, :, STAT_NAMES.index("grad_norm")].sum(1)],
                          axis=1).astype(np.float32)
    step_stats[bad, 0] = np.nan
    anomalies = [(spike, f"layers.{min(7, L - 1)}", f"spike: grad_norm ×{SPIKE_RATIO:g}"),
                 (bad, "loss", "non-finite loss")]
    return stats, step_stats, anomalies


def synthetic_log(L: int, n: int, log_dir: pathlib.Path, shard: int = 1000, seed: int = 0) -> list:
    """Write an L-layer × n-step run into `log_dir` in the watch's log format (views/watch_log.py, version 2: .npy
    shards of `shard` rows, events.json, lod.npz, watch.json closed), a shard at a time (RAM: one shard), as a
    closed `hw.watch(..., log_dir=d)` leaves it; returns its anomalies [(step, where, reason)]. The rows follow
    synthetic_rows' recipe, drawn shard by shard (so not the same noise): smooth norms with 5% noise, the
    gradient-norm spike ×1000 in layer 7 at row n·0.37, the loss NaN at row n·0.81. The summary (lod.npz) is the
    watch's own (watch/lod.py Level at history.py's size), as the watch writes it at close."""
    from hookwidget.views import watch_log
    from hookwidget.watch import history, lod

    K, log_dir = len(STAT_NAMES), pathlib.Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    bins = history.LOD_BYTES // (L * K * history.BIN_BYTES)
    level = lod.Level(L, K, min(history.MAX_BINS, max(history.MIN_BINS, 1 << (bins.bit_length() - 1))))
    base = np.random.default_rng(seed).uniform(0.5, 2.0, (1, L)).astype(np.float32)
    spike, bad, k_grad = int(n * 0.37), int(n * 0.81), STAT_NAMES.index("grad_norm")
    row = watch_log.row_dtype(L, K, np.float32, False)
    for first in range(0, n, shard):
        m = min(shard, n - first)
        g = np.random.default_rng([seed, first])
        t = (np.arange(first, first + m, dtype=np.float32) / max(n - 1, 1))[:, None]
        out = np.zeros(m, row)
        out["step"] = np.arange(first, first + m)
        stats = out["stats"]
        for k, name in enumerate(STAT_NAMES):
            if name == "lr":
                stats[:, :, k] = 1e-3
            elif name not in ("delta_nan", "delta_inf", "a_nonfinite", "grad_nan", "grad_inf"):
                noise = 1 + 0.05 * g.standard_normal((m, L), np.float32)
                stats[:, :, k] = base * (1 + 0.5 * np.exp(-4 * t)) * noise
        if first <= spike < first + m:
            stats[spike - first, min(7, L - 1), k_grad] *= SPIKE_RATIO
        out["step_stats"][:, 0] = 2.0 * np.exp(-3 * t[:, 0]) + 0.01 * g.standard_normal(m)
        out["step_stats"][:, 1] = stats[:, :, k_grad].sum(1)
        if first <= bad < first + m:
            out["step_stats"][bad - first, 0] = np.nan
        np.save(log_dir / f"rows-{first:09d}-{m}.npy", out, allow_pickle=False)
        level.add(out["step"], stats, out["step_stats"])
    whole = lod.concat([level.bins, level.open], L, K, level.size)  # as history.History.lod_arrays
    np.savez(log_dir / watch_log.LOD, end=np.int64(level.end), size=np.int64(level.size), cap=np.int64(level.cap),
             **{k: v for k, v in vars(whole).items() if k != "size"})
    anomalies = [(spike, f"layers.{min(7, L - 1)}", f"spike: grad_norm ×{SPIKE_RATIO:g}"),
                 (bad, "loss", "non-finite loss")]
    events = {"anomalies": [list(a) for a in anomalies], "skipped": [], "nonfinite": {}}
    (log_dir / watch_log.EVENTS).write_text(json.dumps(events), encoding="utf-8")
    meta = {"format": watch_log.FORMAT, "version": watch_log.VERSION, "layers": [f"layers.{i}" for i in range(L)],
            "stats": list(STAT_NAMES), "step_stats": list(STEP_STAT_NAMES), "every": 1, "per_sample": False,
            "dtype": "float32", "closed": True, "notes": [], "seen": n}
    (log_dir / watch_log.META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return anomalies


def synthetic_watch(L: int, n: int, seed: int = 0):
    """An in-memory SavedWatch of L layers named layers.0 … (a chain: they fold into blocks) × n steps."""
    from hookwidget.watch.saved import SavedWatch, _InMemory  # the rows of a w.save file: what hw.load makes of one

    stats, step_stats, anomalies = synthetic_rows(L, n, seed)
    meta = {"layers": [f"layers.{i}" for i in range(L)], "stat_names": list(STAT_NAMES),
            "step_stat_names": list(STEP_STAT_NAMES), "every": 1, "per_sample": False, "dtype": "float32"}
    rows = _InMemory(torch.from_numpy(stats), torch.from_numpy(step_stats), range(n), None)
    return SavedWatch("synthetic", meta, rows, anomalies, [], [], traces=None)


def before_page(watch) -> str:
    """The page main wrote before this change (cd8b631's watch_export, run here on the same watch)."""
    src = subprocess.run(["git", "show", "cd8b631:hookwidget/views/watch_export.py"], capture_output=True, text=True,
                         check=True, cwd=pathlib.Path(__file__).resolve().parents[1]).stdout
    mod = types.ModuleType("watch_export_cd8b631")
    exec(compile(src, "watch_export_cd8b631", "exec"), mod.__dict__)  # noqa: S102 - main's own module, for the A/B
    return mod.page(watch)


def before_bytes(L: int, n: int) -> int:
    """Bytes of main's page without writing it: its data is dominated by base64 float64 of every statistic."""
    K = len(STAT_NAMES)
    return 4 * -(-(n * L * K * 8) // 3) + 4 * -(-(n * 2 * 8) // 3) + n * 8


def open_seconds(path: pathlib.Path, timeout: float = 120.0) -> float:
    """Seconds from navigation until the page says it is drawn (body[data-ready]), in Debian's chromium."""
    return _opened(path, timeout, lambda page, root: {})["open_s"]


# Each anomaly the view marks: its step and the alpha of the marks strip's pixel in its column (0: not painted).
MARKS = """(root) => {
    const v = root.hwView, canvas = root.querySelector('[data-testid=watch-marks]'), ctx = canvas.getContext('2d');
    return v.markColumns().map(({ step, x }) => [step, ctx.getImageData(Math.round(x) + 1, 2, 1, 1).data[3]]);
}"""


def open_and_look(path: pathlib.Path, timeout: float = 120.0) -> dict:
    """open_seconds' figure, then what the drawn page shows: each anomaly's mark, what it says it holds, JS heap."""
    return _opened(path, timeout, lambda page, root: {
        "marks": root.evaluate(MARKS), "held": root.locator('[data-testid="watch-held"]').inner_text(),
        "js_heap_mb": round(page.evaluate("performance.memory.usedJSHeapSize") / 2**20, 1)})


def _opened(path: pathlib.Path, timeout: float, look) -> dict:
    """{"open_s": seconds until the page is drawn, **look(page, the view's root)}, in Debian's chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        t0 = time.perf_counter()
        page.goto(path.as_uri(), timeout=timeout * 1000)
        page.wait_for_selector("body[data-ready='1']", timeout=timeout * 1000)
        seconds = time.perf_counter() - t0
        out = {"open_s": round(seconds, 2), **look(page, page.locator('[data-testid="watch"]'))}
        browser.close()
    return out


def measure_log(L: int, n: int, tmp: pathlib.Path) -> dict:
    """A run written in the log format (synthetic_log), loaded with hw.load, written with to_html, opened."""
    import resource

    import hookwidget as hw
    from hookwidget.views import watch_export

    d = tmp / f"log_{L}_{n}"
    t0 = time.perf_counter()
    anomalies = synthetic_log(L, n, d)
    row = {"layers": L, "steps": n, "log_write_s": round(time.perf_counter() - t0, 1),
           "log_bytes": sum(f.stat().st_size for f in d.iterdir()), "load_average_before": os.getloadavg()}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    w = hw.load(d)
    row["load_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    page = watch_export.to_html(w, tmp / f"log_{L}_{n}.html")
    row["to_html_s"] = round(time.perf_counter() - t0, 2)
    row["peak_rss_growth_mb"] = round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)
    status = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines())
    row["rss_anon_mb"], row["rss_file_mb"] = (round(int(status[k].split()[0]) / 1024) for k in ("RssAnon", "RssFile"))
    row["page_bytes"] = page.stat().st_size
    row.update(open_and_look(page))
    row["anomalies"] = [a[0] for a in anomalies]
    row["every_anomaly_marked"] = (sorted(s for s, _ in row["marks"]) == sorted(row["anomalies"])
                                   and all(alpha > 0 for _, alpha in row["marks"]))
    row["load_average_after"] = os.getloadavg()
    page.unlink()
    shutil.rmtree(d)
    return row


def measure(L: int, n: int, tmp: pathlib.Path, before: bool) -> dict:
    from hookwidget.views import watch_export

    t0 = time.perf_counter()
    w = synthetic_watch(L, n)
    made = time.perf_counter() - t0
    row = {"layers": L, "steps": n, "make_s": round(made, 2)}
    t0 = time.perf_counter()
    after = watch_export.to_html(w, tmp / f"after_{L}_{n}.html")
    row["after_write_s"] = round(time.perf_counter() - t0, 2)
    row["after_bytes"] = after.stat().st_size
    row["after_open_s"] = round(open_seconds(after), 2)
    row["after_held"] = watch_export.data(w)["held"] if n <= 10_000 else None
    row["before_bytes_formula"] = before_bytes(L, n)
    if before and row["before_bytes_formula"] < 400 * 2**20:
        t0 = time.perf_counter()
        text = before_page(w)
        path = tmp / f"before_{L}_{n}.html"
        path.write_text(text, encoding="utf-8")
        row["before_write_s"] = round(time.perf_counter() - t0, 2)
        row["before_bytes"] = path.stat().st_size
        row["before_open_s"] = round(open_seconds(path, timeout=300), 2)
        path.unlink()
    after.unlink()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10,000 steps only")
    ap.add_argument("--big", action="store_true", help="also 1,000 layers × 100,000 steps (5.2 GB of float32 in RAM)")
    ap.add_argument("--no-before", action="store_true", help="skip writing and opening main's pages")
    ap.add_argument("--log", action="store_true", help="only 1,000 layers × 100,000 steps written as a log_dir (5.2 "
                    "GB on disk, a shard in RAM), loaded with hw.load: benchmarks/results/watch_page_log.{json,md}")
    args = ap.parse_args(argv)
    if args.log:
        return log_main()
    cases = [(168, 10_000), (1000, 10_000)] + ([] if args.quick else [(168, 100_000)])
    cases += [(1000, 100_000)] if args.big else []
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for L, n in cases:
            rows.append(measure(L, n, pathlib.Path(d), before=not args.no_before))
            print(json.dumps(rows[-1]), file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "watch_page.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n", encoding="utf-8")
    lines = ["# The watch's page at scale (benchmarks/watch_page.py)", "",
             "Synthetic runs (in-memory SavedWatch, 13 statistics a layer); chromium (Debian) opening the page until "
             "it is drawn, at 1500 px. Before: main at cd8b631 (every statistic as base64 float64), written by its "
             "own watch_export in this process where under 400 MB, else sized by its format and not opened.", "",
             "| layers × steps | before: page | before: open | after: page | after: open | to_html after |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        before = r.get("before_bytes", r["before_bytes_formula"])
        lines.append(f"| {r['layers']:,} × {r['steps']:,} | {before / 2**20:,.1f} MiB | "
                     f"{str(r['before_open_s']) + ' s' if 'before_open_s' in r else 'not opened'} | "
                     f"{r['after_bytes'] / 2**20:.2f} MiB | {r['after_open_s']} s | {r['after_write_s']} s |")
    lines += ["", "What the after pages hold (the page says it):", ""]
    lines += [f"- {r['layers']:,} × {r['steps']:,}: {r['after_held']}" for r in rows if r["after_held"]]
    (RESULTS / "watch_page.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def log_main(L: int = 1000, n: int = 100_000) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("HW_BENCH_TMP")) as d:
        row = measure_log(L, n, pathlib.Path(d))
    print(json.dumps(row), file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "watch_page_log.json").write_text(json.dumps(row, indent=1) + "\n", encoding="utf-8")
    lines = [f"# The watch's page of a {L:,}-layer × {n:,}-step log (benchmarks/watch_page.py --log)", "",
             f"A synthetic run written in the log format (synthetic_log: {row['log_bytes'] / 2**30:.2f} GiB of .npy "
             f"shards, lod.npz, events.json; written in {row['log_write_s']} s), read with `hw.load`, written with "
             "`w.to_html` and opened in Debian's chromium at 1500 px until drawn.", "",
             "| `hw.load` | `to_html` | page | open in chromium | JS heap | every anomaly marked | load average |",
             "|---|---|---|---|---|---|---|",
             f"| {row['load_s']} s | {row['to_html_s']} s | {row['page_bytes'] / 2**20:.2f} MiB | {row['open_s']} s | "
             f"{row['js_heap_mb']} MB | {'yes' if row['every_anomaly_marked'] else 'NO'} ({row['marks']}) | "
             f"{row['load_average_before'][0]:.1f} before, {row['load_average_after'][0]:.1f} after |", "",
             f"The page says: {row['held']}", "",
             f"Peak RSS growth of the process while loading and writing the page: {row['peak_rss_growth_mb']} MB; "
             f"after it, {row['rss_anon_mb']} MB anonymous and {row['rss_file_mb']} MB of memory-mapped shards (page "
             "cache the kernel can drop: the shards are read through np.load(mmap_mode='r'))."]
    (RESULTS / "watch_page_log.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
