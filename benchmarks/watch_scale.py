"""The watch at the length of real runs (issue 42): memory bounded whatever the steps, the history on disk read
lazily.

    python -m benchmarks.watch_scale [--steps N] [--live-steps N] [--out DIR]

1. Synthetic logs, written directly with the writer (views/watch_log.WatchLog, no model): 168 and 1,000 layers ×
   `--steps` rows (random statistics, a few NaN), the summary (lod.npz) as a watch leaves it; then, each in a fresh
   process (nothing cached in Python; the files are in the page cache, as right after a run), `hw.load(d)`, one
   `w.series(layer, stat)` over the whole run, `w.lod(1000)` of the whole run, `w.rows(-100)` (the latest 100 rows)
   and `w.rows` of 100 rows in the middle. Disk bytes per step. Times that grow with the rows are extrapolated
   linearly to 100,000 steps (stated as such); hw.load's grows with the number of shards (it opens each one's
   header).
2. A live watch of a chain of 1,000 nn.Linear(8, 8) (flight_recorder=False, batch=64: the watch's defaults but the
   flight recorder, whose kept Traces are bounded by max_kept anyway), trained for `--live-steps` steps: w.memory
   (bytes of the rows it holds in RAM: the window, the summary, the step indices) and the bytes of tensors the
   python heap reaches from the watch, at checkpoints: flat once the window is full, but for 8 bytes a step.
Writes results/watch_scale.md and watch_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hookwidget.capture.stat_rows import STAT_NAMES, STEP_STAT_NAMES  # noqa: E402
from hookwidget.views.watch_log import WatchLog  # noqa: E402
from hookwidget.watch import history, lod  # noqa: E402

CHUNK = 64  # rows per shard, as a watch with batch=64 writes them


def write_log(d: str, layers: int, steps: int) -> float:
    """A log of `layers` × `steps` rows as a float32 watch writes it; returns the seconds it took."""
    K = len(STAT_NAMES)
    fake = types.SimpleNamespace(layer_names=[f"blocks.{i // 7}.lin{i % 7}" for i in range(layers)],
                                 stat_names=STAT_NAMES, step_stat_names=STEP_STAT_NAMES, every=1, notes=[],
                                 seen=steps, tracks_per_sample=False, batch=CHUNK, skipped=[],
                                 _detector=types.SimpleNamespace(anomalies=[], stretches={}))
    log = WatchLog(d, fake, np.float32, durable=False)  # as a watch's temporary folder (log_dir=: fsync per shard)
    cap = min(history.MAX_BINS, max(history.MIN_BINS, history._pow2_floor(
        history.LOD_BYTES // (layers * K * history.BIN_BYTES))))
    level = lod.Level(layers, K, cap)
    log.lod_source = lambda: history.History.lod_arrays(types.SimpleNamespace(level=level, L=layers, K=K))
    rng = np.random.default_rng(0)
    base = rng.random((CHUNK, layers, K), dtype=np.float32)
    t0 = time.perf_counter()
    for at in range(0, steps, CHUNK):
        n = min(CHUNK, steps - at)
        stats = base[:n] * np.float32(1 + at / steps)
        stats[:, :, STAT_NAMES.index("delta_nan")] = 0
        step_stats = np.stack([np.linspace(2, 1, n), np.full(n, 0.5)], axis=1)
        steps_ = list(range(at, at + n))
        log.rows(stats, step_stats, steps_)
        level.add(np.asarray(steps_), stats, step_stats)
    log.close()
    return time.perf_counter() - t0


READ = """
import json, sys, time
t0 = time.perf_counter()
import hookwidget as hw
t_import = time.perf_counter() - t0
t0 = time.perf_counter(); w = hw.load(sys.argv[1]); t_load = time.perf_counter() - t0
layer = w.layer_names[len(w.layer_names) // 2]
t0 = time.perf_counter(); s = w.series(layer, "grad_norm"); t_series = time.perf_counter() - t0
t0 = time.perf_counter(); b = w.lod(1000); t_lod = time.perf_counter() - t0
t0 = time.perf_counter(); r = w.rows(-100); t_tail = time.perf_counter() - t0
mid = w.n_rows // 2
t0 = time.perf_counter(); r2 = w.rows(mid, mid + 100); t_mid = time.perf_counter() - t0
t0 = time.perf_counter(); z = w.lod(1000, mid, mid + 100); t_zoom = time.perf_counter() - t0
assert len(s) == w.n_rows and r[1].shape[0] == 100 and r2[1].shape[0] == 100 and len(z) == 100
print(json.dumps({"rows": w.n_rows, "import_s": t_import, "load_s": t_load, "series_s": t_series,
                  "lod_s": t_lod, "lod_bins": len(b), "lod_size": b.size, "rows_tail_s": t_tail,
                  "rows_mid_s": t_mid, "zoom_100_s": t_zoom}))
"""


def synthetic(layers: int, steps: int) -> dict:
    d = tempfile.mkdtemp(prefix=f"watch_scale_{layers}_")
    try:
        log_dir = os.path.join(d, "log")
        write_s = write_log(log_dir, layers, steps)
        disk = sum(f.stat().st_size for f in Path(log_dir).iterdir())
        shard_bytes = sum(f.stat().st_size for f in Path(log_dir).glob("rows-*.npy"))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", READ, log_dir], capture_output=True, text=True, env=env,
                             check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(d, ignore_errors=True)
    scale = 100_000 / steps
    return {"layers": layers, "steps": steps, "write_s": write_s, "disk_bytes": disk,
            "disk_bytes_per_step": shard_bytes / steps, **got,
            "at_100k": {"load_s": got["load_s"] * scale, "series_s": got["series_s"] * scale,
                        "disk_gb": shard_bytes / steps * 100_000 / 1e9}}


def live(layers: int, steps: int, checkpoints: list) -> dict:
    import torch
    from torch import nn

    import hookwidget as hw

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    out, t0 = [], time.perf_counter()
    with hw.watch(model, flight_recorder=False) as w:
        for k in range(1, steps + 1):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            if k in checkpoints:
                w.sync()
                h = w._history
                tensors = sum(t.nelement() * t.element_size() for c in h.chunks for t in c[1:] if t is not None)
                out.append({"step": k, "memory_mb": w.memory / 2**20, "window_rows_mb": tensors / 2**20,
                            "summary_mb": h.level.nbytes / 2**20, "steps_index_mb": len(h.steps) * 8 / 2**20,
                            "ram_rows": h.n - h.ram_start, "summary_bins": len(h.level.bins),
                            "summary_size": h.level.size, "s_per_step": (time.perf_counter() - t0) / k})
    return {"layers": layers, "steps": steps, "window_rows": w._history.window, "checkpoints": out,
            "series_equal": bool(np.array_equal(w.series("500", "grad_norm").numpy(), w.stats[:, 500, 7].numpy()))}


def report(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_scale.json").write_text(json.dumps(res, indent=1))
    lines = ["# watch_scale (issue 42): bounded memory, the history on disk", "",
             f"`python -m benchmarks.watch_scale --steps {res['args']['steps']} --live-steps "
             f"{res['args']['live_steps']}` on this machine ({os.cpu_count()} CPUs, shared), {res['when']}.", "",
             "## Synthetic logs (written with the writer; read in a fresh process, files in the page cache)", "",
             "| layers | steps | disk / step | hw.load | w.series (whole run) | w.lod(1000) | w.rows(-100) | "
             "w.rows(mid, +100) | w.lod(1000) of 100 rows | at 100,000 steps: disk, hw.load, w.series |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in res["synthetic"]:
        a, star = s["at_100k"], "*" if s["steps"] < 100_000 else ""
        lines.append(f"| {s['layers']} | {s['steps']:,} | {s['disk_bytes_per_step'] / 1024:.1f} KiB | "
                     f"{s['load_s']:.3f} s | {s['series_s']:.3f} s | {s['lod_s']:.3f} s ({s['lod_bins']} bins of "
                     f"{s['lod_size']}) | {s['rows_tail_s'] * 1e3:.1f} ms | {s['rows_mid_s'] * 1e3:.1f} ms | "
                     f"{s['zoom_100_s'] * 1e3:.1f} ms | {a['disk_gb']:.2f} GB, {a['load_s']:.2f} s{star}, "
                     f"{a['series_s']:.2f} s{star} |")
    lines += ["", "\\* extrapolated linearly from the measured steps where fewer than 100,000 were written "
              "(hw.load stats each shard: linear in shards; w.series reads one value per row). hw.load reads "
              "watch.json, the shard names, events.json and lod.npz (the summary, whose size does not grow with "
              "the steps); w.lod(1000) of the whole run answers from that summary (fewer, coarser bins where the "
              "rows weigh more than 128 MiB).", "",
              f"## A live watch of {res['live']['layers']} × nn.Linear(8, 8) (flight_recorder=False)", "",
              f"Window: {res['live']['window_rows']} rows at full resolution in RAM; `w.series` equal to "
              f"`w.stats[:, layer, stat]` over the whole run: {res['live']['series_equal']}.", "",
              "| step | w.memory | window rows | summary | step indices | rows in RAM | summary bins × size | "
              "s / step |", "|---|---|---|---|---|---|---|---|"]
    for c in res["live"]["checkpoints"]:
        lines.append(f"| {c['step']:,} | {c['memory_mb']:.1f} MB | {c['window_rows_mb']:.1f} MB | "
                     f"{c['summary_mb']:.1f} MB | {c['steps_index_mb']:.3f} MB | {c['ram_rows']} | "
                     f"{c['summary_bins']} × {c['summary_size']} | {c['s_per_step'] * 1e3:.1f} ms |")
    (out / "watch_scale.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--steps-wide", type=int, default=None, help="steps of the 1,000-layer log (default: --steps)")
    ap.add_argument("--live-steps", type=int, default=2048, help="0: keep the previous run's live figures")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    res = {"args": {"steps": a.steps, "live_steps": a.live_steps}, "when": time.strftime("%Y-%m-%d %H:%M UTC"),
           "synthetic": [synthetic(168, a.steps), synthetic(1000, a.steps_wide or a.steps)]}
    marks = sorted({m for m in (256, 512, 1024, 1536, 2048, 4096, 8192, a.live_steps) if m <= a.live_steps})
    if a.live_steps:
        res["live"] = live(1000, a.live_steps, marks)
    else:  # --live-steps 0: the live watch's figures of the previous run, kept
        res["live"] = json.loads((Path(a.out) / "watch_scale.json").read_text())["live"]
        res["args"]["live_steps"] = res["live"]["steps"]
    report(res, Path(a.out))
    print((Path(a.out) / "watch_scale.md").read_text())


if __name__ == "__main__":
    main()
