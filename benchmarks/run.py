"""Run every variant of every model interleaved, report medians as ratios to plain, write JSON + Markdown.

Timing: all variants of one model in one process, one step of each in turn per repeat (drift and
noise from other processes hit every variant alike), median after warm-up. Memory: peak above the
state before a step (parameters only, every .grad freed): on CUDA the allocator's peak; on CPU the
process's peak RSS (VmHWM, reset through /proc/self/clear_refs) in a child process run with glibc
told to return freed memory at once (MALLOC_MMAP_THRESHOLD_), so RSS follows live tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch

from . import models
from .graphs import graph_build_times
from .report import markdown
from .variants import ALL_VARIANTS, NORM_VARIANTS, VARIANTS, Unavailable

RESULTS = pathlib.Path(__file__).parent / "results"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--models", default="mlp,cnn,transformer,gpt2,hooks",
                    help="comma-separated subset of " + ", ".join(models.MODELS))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per variant (at least; small models "
                    "get more, up to 1 s of plain steps; GPT-2 on CPU gets max(3, repeats // 3))")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, a 2-block small-vocabulary GPT-2; "
                    "on CPU 1 thread and no memory measurement unless --threads / --memory")
    ap.add_argument("--memory", action="store_true", help="measure peak memory in a --quick run too")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--out", default=str(RESULTS), help="folder for <device>.json and <device>.md")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run on a GPU machine or use --device cpu")
    if args.quick and args.device == "cpu":
        args.threads = args.threads or 1
        args.no_memory = args.no_memory or not args.memory
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":  # float32 everywhere: TF32 convolutions made Opacus' CNN norms differ by 9e-5
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    names = _choices(args.models, models.MODELS, "model")
    variants = _choices(args.variants, VARIANTS, "variant")
    if "plain" not in variants:
        variants.insert(0, "plain")
    repeats = 2 if args.quick else args.repeats
    results = {"device": _device_name(args.device), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "repeats": repeats, "quick": args.quick, "load_average": _loadavg(), "models": {},
               "graph_build_s": graph_build_times(args.device)}
    print(json.dumps({"graph_build_s": results["graph_build_s"]}), flush=True)
    for name in names:
        r = max(3, repeats // 3) if (name == "gpt2" and args.device == "cpu" and not args.quick) else repeats
        res = bench_model(name, args.device, variants, r, quick=args.quick)
        if not args.no_memory:
            res["peak_mb"] = peak_memory(name, args.device, list(res["median_s"]), args.quick, args.threads)
            base = res["peak_mb"].get("plain")
            res["peak_ratio"] = {v: p / base for v, p in res["peak_mb"].items()} if base else {}
        results["models"][name] = res
        print(json.dumps({name: {v: round(x, 3) for v, x in res["ratio"].items()}}), flush=True)
    write_results(results, args.out, args.device, markdown)


def write_results(results: dict, out: str, stem: str, markdown) -> None:
    """End a run: the load average now, then <out>/<stem>.json and <stem>.md (printed too)."""
    results["load_average_end"] = _loadavg()
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(markdown(results))
    print(markdown(results))


def bench_model(name: str, device: str, variant_names: list, repeats: int, quick: bool) -> dict:
    model, x, y, loss = models.build(name, device, small=quick)
    steps, skipped, notes, warm = {}, {}, {}, {}
    if name == "hooks":  # hookwidget's own per-module cost: the other tools are not the question here
        variant_names = [v for v in variant_names if v == "plain" or v.startswith("hookwidget")]
    for v in variant_names:
        try:
            steps[v] = VARIANTS[v](model, x, y, loss)
            warmups = 1 if quick or (name == "gpt2" and device == "cpu") else 2
            for _ in range(warmups):  # warm-up (and a first check that it runs here)
                _sync(device)
                t0 = time.perf_counter()
                steps[v]()
                _sync(device)
                warm[v] = time.perf_counter() - t0
                steps[v].reset()
            if steps[v].note:
                notes[v] = steps[v].note
        except Exception as e:  # noqa: BLE001 - a failing tool is a row in the table, not a crash
            msg = str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            skipped[v] = msg[:200]
            steps.pop(v, None)
    if "plain" in steps and not quick:  # small models: more repeats, up to about 1 s of plain steps
        repeats = max(repeats, min(200, int(1.0 / max(warm["plain"], 1e-6))))
    times = {v: [] for v in steps}
    for _ in range(repeats):
        for v, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[v].append(time.perf_counter() - t0)
            step.reset()  # free per-sample results before the next tool runs (GPT-2: 2 GB each)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    agree = _norms_agree(steps)
    plain = med.get("plain")
    n_mod = models.count_modules(model)
    res = {
        "params": models.param_count(model), "modules": n_mod, "repeats": repeats,
        "median_s": med, "min_s": {v: min(ts) for v, ts in times.items()},
        "ratio": {v: m / plain for v, m in med.items()} if plain else {},
        "max_rel_diff_vs_torch_func": agree, "skipped": skipped, "notes": notes,
        "own_us_per_module": {v: (med[v] - plain) / n_mod * 1e6 for v in med if v.startswith("hookwidget") and plain},
        "observation_bitwise": _bitwise_neutral(steps, model, x, y, loss, device) if "plain" in steps else None,
    }
    return res


def _norms_agree(steps: dict) -> dict:
    """Max relative difference of each tool's per-sample norms to torch.func's (float32)."""
    if "torch.func norms" not in steps:
        return {}
    ref = steps["torch.func norms"]().double()
    out = {}
    for v in NORM_VARIANTS:
        if v in steps and v != "torch.func norms" and not steps[v].partial:
            n = steps[v]().double()
            out[v] = float(((n - ref).abs() / ref.abs().clamp_min(1e-30)).max())
    return out


def _bitwise_neutral(steps, model, x, y, loss, device) -> dict:
    """Observation changes nothing: every .grad after hookwidget's full capture is bitwise equal to
    a plain step's. On CUDA with deterministic algorithms on, and two plain runs must agree first."""
    prev = torch.are_deterministic_algorithms_enabled()
    if device == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        params = [p for p in model.parameters() if p.requires_grad]

        def grads(fn):
            fn()
            _sync(device)
            return [None if p.grad is None else p.grad.clone() for p in params]

        def same(a, b):
            return all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
                       for u, v in zip(a, b))

        base, again = grads(steps["plain"]), grads(steps["plain"])
        if not same(base, again):
            return {"baseline_reproducible": False}
        out = {"baseline_reproducible": True}
        for v in ("hookwidget summary", "hookwidget full", "hookwidget norms"):
            if v in steps:
                out[v] = same(base, grads(steps[v]))
        return out
    finally:
        if device == "cuda":
            torch.use_deterministic_algorithms(prev)


def peak_memory(name: str, device: str, variants: list, quick: bool, threads) -> dict:
    if device == "cuda":
        return measure_memory(name, device, variants, quick)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, "-m", "benchmarks.memory", name, ",".join(variants)] + (["--quick"] if quick else [])
    if threads:
        cmd += ["--threads", str(threads)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=pathlib.Path(__file__).parent.parent)
    if r.returncode != 0:
        print(f"memory measurement of {name} failed: {r.stderr[-500:]}", file=sys.stderr)
        return {}
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure_memory(name: str, device: str, variants: list, quick: bool) -> dict:
    """Peak MB of one step above the state before it (parameters, no .grad), per variant."""
    model, x, y, loss = models.build(name, device, small=quick)
    out = {}
    for v in variants:
        try:
            step = ALL_VARIANTS[v](model, x, y, loss)
            step()
        except Exception:  # noqa: BLE001 - already reported by the timing run
            continue
        step.reset()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            out[v] = cuda_peak_mb(step)
        else:
            base = _reset_peak_rss()
            step()
            out[v] = (_peak_rss() - base) / 2**20
        step.reset()
        del step
    return out


def cuda_peak_mb(step) -> float:
    """Peak MB that one call of `step` allocates on the GPU above the CUDA allocator's count before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _reset_peak_rss() -> int:
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def _peak_rss() -> int:
    return _status("VmHWM")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _choices(text: str, valid, what: str) -> list:
    out = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in out if v not in valid]
    if bad:
        raise SystemExit(f"unknown {what}(s) {bad}; choose from {list(valid)}")
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"

