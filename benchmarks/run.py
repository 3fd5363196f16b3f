"""Run every variant of every model interleaved, report medians as ratios to plain, write JSON + Markdown."""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import threading
import time

import psutil
import torch

from . import models
from .graphs import graph_build_times
from .variants import VARIANTS, Unavailable


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--models", default="mlp,cnn,transformer,gpt2")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 repeats, a 2-block GPT-2")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    repeats = 3 if args.quick else args.repeats
    names = [v.strip() for v in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    results = {"device": _device_name(args.device), "torch": torch.__version__, "repeats": repeats,
               "models": {}, "graph_build_s": graph_build_times(args.device)}
    for name in args.models.split(","):
        r = repeats if not (name == "gpt2" and args.device == "cpu") else max(3, repeats // 3)
        results["models"][name] = bench_model(name, args.device, names, r, small=args.quick)
        print(json.dumps({name: results["models"][name]["ratio"]}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if args.device == "cuda" else "cpu"
    (out / f"{tag}.json").write_text(json.dumps(results, indent=1))
    (out / f"{tag}.md").write_text(markdown(results))
    print(markdown(results))


def bench_model(name: str, device: str, variant_names: list, repeats: int, small: bool) -> dict:
    model, x, y, loss = models.build(name, device, small=small)
    steps, skipped = {}, {}
    for v in variant_names:
        try:
            steps[v] = VARIANTS[v](model, x, y, loss)
            for _ in range(2):  # warm-up (and a first check that it runs here)
                steps[v]()
        except Unavailable as e:
            skipped[v] = str(e)
            steps.pop(v, None)
        except Exception as e:  # noqa: BLE001 - a failing tool is a row in the table, not a crash
            skipped[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            steps.pop(v, None)
        _sync(device)
    times = {v: [] for v in steps}
    for _ in range(repeats):  # interleaved: drift and noise hit every variant alike
        for v, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    peak = {v: _peak_memory(step, device) for v, step in steps.items()}
    norms = {v: steps[v]() for v in steps}
    ref = norms.get("torch.func norms")
    agree = {v: float(((n - ref).abs() / ref.abs().clamp_min(1e-30)).max())
             for v, n in norms.items() if n is not None and ref is not None and v != "torch.func norms"}
    plain = med.get("plain")
    return {
        "params": models.param_count(model), "modules": models.count_modules(model),
        "median_s": med, "ratio": {v: m / plain for v, m in med.items()} if plain else {},
        "peak_mb": peak, "peak_ratio": {v: p / peak["plain"] for v, p in peak.items()} if peak.get("plain") else {},
        "max_rel_diff_vs_torch_func": agree, "skipped": skipped,
        "own_us_per_module": {v: (med[v] - plain) / models.count_modules(model) * 1e6
                              for v in med if v.startswith("hookwidget") and plain},
    }


def _peak_memory(step, device: str) -> float:
    """Peak memory of one step above what was in use before it, in MB (CUDA: allocator; CPU: RSS sampled)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    step()
    done.set()
    th.join()
    return max(peak[0] - base, 0) / 2**20


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def markdown(results: dict) -> str:
    variants = list(dict.fromkeys(v for m in results["models"].values() for v in [*m["ratio"], *m["skipped"]]))
    lines = [f"Device: {results['device']}, torch {results['torch']}, median of {results['repeats']} interleaved "
             "repeats after warm-up. Time as a ratio to plain forward+backward of the same model "
             "(peak memory ratio in brackets; CPU memory is sampled RSS, so small models read near 0).", "",
             "| variant | " + " | ".join(results["models"]) + " |", "|---|" + "---|" * len(results["models"])]
    for v in variants:
        cells = []
        for m in results["models"].values():
            if v in m["ratio"]:
                pr = m["peak_ratio"].get(v)
                cells.append(f"{m['ratio'][v]:.2f}×" + (f" ({pr:.2f}×)" if pr else ""))
            else:
                cells.append("n/a")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    plain = " | ".join(f"{m['median_s']['plain'] * 1e3:.1f} ms" for m in results["models"].values())
    lines.append(f"| *plain, absolute* | {plain} |")
    lines += ["", "hookwidget's own cost per module per step (full capture): " + ", ".join(
        f"{k} {m['own_us_per_module'].get('hookwidget full', float('nan')):.1f} µs"
        for k, m in results["models"].items()) + "."]
    lines.append("Per-sample norms, max relative difference to torch.func: " + "; ".join(
        f"{k}: " + ", ".join(f"{v} {d:.1e}" for v, d in m["max_rel_diff_vs_torch_func"].items())
        for k, m in results["models"].items()) + ".")
    for k, m in results["models"].items():
        for v, why in m["skipped"].items():
            lines.append(f"- {k} / {v}: not measured: {why}")
    g = results["graph_build_s"]
    lines.append(f"\nGraph build (walk + networkx): {g['transformer_nodes']}-node 12-block transformer graph "
                 f"{g['transformer'] * 1e3:.0f} ms; {g['chain_nodes']}-node chain {g['chain'] * 1e3:.0f} ms.")
    return "\n".join(lines) + "\n"
