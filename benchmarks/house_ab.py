"""A/B of issue 22's move ("One house"): hookwidget as it was at --before (default 34ea78c, the commit before the
move) against the working tree, both imported in ONE process and timed interleaved, so that load and drift on a
shared machine hit both alike.

    python -m benchmarks.house_ab [--quick] [--before COMMIT] [--rounds N] [--out DIR]

The package at COMMIT is extracted (`git archive COMMIT hookwidget`) into a temporary folder as `hookwidget_before`,
with the working tree's built hookwidget/static; its own absolute imports (`from hookwidget.x import ...`, as the
house writes them) are renamed to `hookwidget_before`, so any commit compares (checked: no import of the working
tree's `hookwidget` is left in it, and every module it loads comes from that folder). `--before HEAD` measures an
uncommitted change.

Three tables, CPU, `torch.set_num_threads(1)`, `time.process_time` (this process's CPU time: wall time is not
reliable on a shared machine); each round times every variant once (a trace variant: the fastest of 4 equal chunks
of steps), the order reversed every other round (A B A B ..., then ... B A B A); medians over rounds; after / before
is the median of the per-round ratios of the two versions' costs (their samples taken next to each other), with
their range:
  per module  a chain of 100 Linear(64, 64), B=32: (`trace(step, capture=c)` − plain step) / modules, for c in
              summary, full, norms (norms with `per_sample_grad_norms()`, as run.py's table)
  models      the models of run.py's CPU table whose step takes well under a second (mlp, cnn, transformer):
              `trace(step, capture=c)` as × plain
  watch       watch_overhead.py's models (its MLP and small encoder) and loop (Adam; zero_grad, forward, backward,
              step every step): `watch(model, flight_recorder=False)` and `watch(model)` as × plain
Writes results/house_ab.md and house_ab.json.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import io
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
from torch import nn

import hookwidget

from . import models, watch_overhead
from .run import RESULTS, _device_name, _loadavg, write_results
from .variants import make_plain

BEFORE = "34ea78ca96688e2907227bffddd523732040c8a8"
ROOT = pathlib.Path(__file__).resolve().parent.parent
CAPTURES = ("summary", "full", "norms")
WATCH_VARIANTS = {"watch": "watch(model, flight_recorder=False)", "watch+fr": "watch(model)"}


def materialise(commit: str, into: pathlib.Path):
    """hookwidget at `commit`, imported as `hookwidget_before` from `into` (which goes on sys.path)."""
    tar = subprocess.run(["git", "archive", commit, "hookwidget"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    pkg = into / "hookwidget_before"
    (into / "hookwidget").rename(pkg)
    static = ROOT / "hookwidget" / "static"  # built, not committed: the widgets load it
    if static.is_dir():
        shutil.copytree(static, pkg / "static", dirs_exist_ok=True)
    for p in pkg.rglob("*.py"):  # a package that imports itself absolutely (the house's): renamed in its imports
        p.write_text(re.sub(r"^(\s*)(from|import) hookwidget\b", r"\1\2 hookwidget_before", p.read_text(),
                            flags=re.M))
    absolute = [f"{p.relative_to(into)}:{n.lineno}" for p in pkg.rglob("*.py")
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
                and any(m == "hookwidget" or m.startswith("hookwidget.") for m in _imported(n))]
    if absolute:
        raise SystemExit(f"hookwidget at {commit[:9]} imports the working tree's hookwidget "
                         f"({', '.join(absolute[:5])})")
    sys.path.insert(0, str(into))
    before = importlib.import_module("hookwidget_before")
    stray = [m for m, mod in sys.modules.items() if m.startswith("hookwidget_before")
             and getattr(mod, "__file__", None) and not pathlib.Path(mod.__file__).is_relative_to(into)]
    if stray or not pathlib.Path(hookwidget.__file__).is_relative_to(ROOT):
        raise SystemExit(f"the two versions are mixed up: {stray or hookwidget.__file__}")
    return before


def _imported(node) -> list:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [] if node.level else [node.module or ""]


def per_step(fn, target_s: float, chunks: int = 4):
    """A sampler: runs `fn` twice (warm-up); then each call runs it for about target_s, in `chunks` timed runs of
    equal length, and returns the fastest chunk's time per call (other processes' load only ever adds time)."""
    t0 = time.process_time()
    fn()
    fn()
    n = max(1, round(target_s / chunks / max((time.process_time() - t0) / 2, 1e-6)))

    def sample() -> float:
        best = float("inf")
        for _ in range(chunks):
            t0 = time.process_time()
            for _ in range(n):
                fn()
            best = min(best, (time.process_time() - t0) / n)
        return best

    return sample


def interleaved(samplers: dict, rounds: int) -> dict:
    """{name: [seconds per step of each round]}; the order reversed every other round."""
    times = {k: [] for k in samplers}
    keys = list(samplers)
    for r in range(rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            gc.collect()  # what the last sample left for the collector is not charged to the next
            times[k].append(samplers[k]())
    return times


def trace_samplers(versions: dict, model, x, y, loss, target_s: float) -> dict:
    plain = make_plain(model, x, y, loss)
    samplers = {"plain": per_step(plain, target_s)}
    for c in CAPTURES:
        for v, hw in versions.items():
            if c == "norms":
                samplers[f"{v} {c}"] = per_step(lambda hw=hw: hw.trace(plain, capture="norms").per_sample_grad_norms(),
                                                target_s)
            else:
                samplers[f"{v} {c}"] = per_step(lambda hw=hw, c=c: hw.trace(plain, capture=c), target_s)
    return samplers


def watch_samplers(versions: dict, model, x, y, steps: int) -> dict:
    loop = watch_overhead.time_loop
    samplers = {"plain": lambda: loop(model, x, y, steps, "plain")}
    for w in WATCH_VARIANTS:
        for v, hw in versions.items():
            samplers[f"{v} {w}"] = lambda w=w, hw=hw: loop(model, x, y, steps, w, watch=hw.watch)
    return samplers


def compare(times: dict, variants, per: float = 0.0) -> dict:
    """Per variant, each version's cost per round: as × plain (per=0), or (time − plain) / per in µs; the medians,
    and after / before: the median of the per-round ratios of the two versions' costs, with their range."""
    plain = times["plain"]

    def cost(ts):
        return [(t - p) / per * 1e6 if per else t / p for t, p in zip(ts, plain)]

    out = {}
    for v in variants:
        b, a = cost(times[f"before {v}"]), cost(times[f"after {v}"])
        ratios = [x / y for x, y in zip(a, b)]
        out[v] = {"before": statistics.median(b), "after": statistics.median(a),
                  "after_over_before": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    return out


def measure(label: str, samplers: dict, variants, rounds: int, per: float = 0.0) -> dict:
    times = interleaved(samplers, rounds)
    res = {"plain_ms": statistics.median(times["plain"]) * 1e3, "cost": compare(times, variants, per),
           "times_s": times}
    print(json.dumps({label: {v: round(r["after_over_before"], 3) for v, r in res["cost"].items()}}), flush=True)
    return res


def _row(label: str, r: dict, unit: str) -> str:
    fmt = "{:.1f} µs" if unit == "us" else "{:.3f}×"
    lo, hi = r["range"]
    return (f"| {label} | {fmt.format(r['before'])} | {fmt.format(r['after'])} | **{r['after_over_before']:.3f}** "
            f"| {lo:.3f}–{hi:.3f} |")


def markdown(res: dict) -> str:
    head = "| {} | before | after | after / before | per round |\n|---|---|---|---|---|"
    lines = [f"**{res['device']}**, torch {res['torch']}, 1 thread, `time.process_time`; {res['rounds']} interleaved "
             f"rounds, medians" + (" — QUICK RUN: few rounds, short samples" if res["quick"] else "") + ".",
             f"before: `{res['before']}`; after: `{res['after']}`.",
             "after / before: median of the per-round ratios of the two versions' costs (their samples taken next to "
             "each other; 1.000 = no change, above 1 = after costs more); per round: the range of those ratios.", "",
             f"### Per-module cost: chain of {res['chain']['modules'] - 1} Linear(64, 64), B=32 "
             f"(plain {res['chain']['plain_ms']:.2f} ms; (trace − plain) / {res['chain']['modules']} modules)", "",
             head.format("capture")]
    lines += [_row(c, r, "us") for c, r in res["chain"]["cost"].items()]
    if res["models"]:
        lines += ["", "### Models: `hw.trace(step, capture=...)` as × plain forward+backward", "",
                  head.format("model / capture")]
    for m, r in res["models"].items():
        lines += [_row(f"{m} ({r['plain_ms']:.1f} ms) {c}", x, "x") for c, x in r["cost"].items()]
    if res["watch"]:
        lines += ["", f"### Watch: watch_overhead.py's loop, {res['watch_steps']} steps a sample, as × plain", "",
                  head.format("model / variant")]
    for m, r in res["watch"].items():
        lines += [_row(f"{m} ({r['plain_ms']:.2f} ms) {WATCH_VARIANTS[w]}", x, "x") for w, x in r["cost"].items()]
    lines.append(f"\nLoad average at start / end: {res['load_average']} / {res['load_average_end']}.")
    return "\n".join(lines) + "\n"


def _describe(rev: str) -> str:
    """The last commit at or before `rev` that changed hookwidget/: its short hash and subject."""
    out = subprocess.run(["git", "log", "-1", "--format=%h %s", rev, "--", "hookwidget"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    return (out[:80] + "…" if len(out) > 80 else out) or rev


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.house_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=BEFORE, help="the commit to compare the working tree with")
    ap.add_argument("--quick", action="store_true", help="3 rounds, short samples, 100 watch steps")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, --quick 3)")
    ap.add_argument("--models", default="mlp,cnn,transformer", help="models of benchmarks/models.py for the table")
    ap.add_argument("--watch-models", default="mlp,transformer", help="models of watch_overhead.py")
    ap.add_argument("--watch-steps", type=int, default=None, help="timed steps a watch sample (default 200, "
                    "--quick 100)")
    ap.add_argument("--out", default=str(RESULTS), help="folder for house_ab.md and house_ab.json")
    args = ap.parse_args(argv)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:  # as watch_overhead.py: no page faults from heap trimming
        env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="4294967296", MALLOC_MMAP_THRESHOLD_="4294967296")
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.house_ab", *sys.argv[1:]], env)
    torch.set_num_threads(1)
    rounds = args.rounds or (3 if args.quick else 7)
    target = 0.05 if args.quick else 0.2
    steps = args.watch_steps or (100 if args.quick else 200)
    dirty = subprocess.run(["git", "status", "--porcelain", "hookwidget"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    res = {"device": _device_name("cpu"), "torch": torch.__version__, "rounds": rounds, "quick": args.quick,
           "before": _describe(args.before), "after": _describe("HEAD") + (" + uncommitted changes" if dirty else ""),
           "watch_steps": steps, "load_average": _loadavg(), "models": {}, "watch": {}}
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"before": materialise(args.before, pathlib.Path(tmp)), "after": hookwidget}
        torch.manual_seed(0)
        chain = nn.Sequential(*[nn.Linear(64, 64) for _ in range(100)])
        x, y = torch.randn(32, 64), torch.randn(32, 64)
        n_mod = models.count_modules(chain)
        res["chain"] = measure("chain", trace_samplers(versions, chain, x, y, models._mse, target), CAPTURES, rounds,
                               per=n_mod)
        res["chain"]["modules"] = n_mod
        for name in filter(None, args.models.split(",")):
            model, x, y, loss = models.build(name, "cpu", small=args.quick)
            res["models"][name] = measure(name, trace_samplers(versions, model, x, y, loss, target), CAPTURES, rounds)
        for name in filter(None, args.watch_models.split(",")):
            model, x, y = watch_overhead.build(name)
            watch_overhead.time_loop(model, x, y, 50, "plain")  # untimed: a first loop pays one-off costs
            res["watch"][name] = measure(f"watch {name}", watch_samplers(versions, model, x, y, steps), WATCH_VARIANTS,
                                         rounds)
    write_results(res, args.out, "house_ab", markdown)


if __name__ == "__main__":
    main()
