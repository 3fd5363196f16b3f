"""What the samples' shares cost hw.watch(per_sample=True) per training step (issue 43), side by side with
per_sample=True without them, on CPU with one thread.

    python -m benchmarks.watch_shares [--models gpt2] [--steps 40] [--repeats 5] [--out benchmarks/results]

Variants (benchmarks/watch_overhead.py's loop and timing: CPU time per step, blocks interleaved, the order
reversed every other round, medians): plain; per_sample_norms, hw.watch(model, flight_recorder=False,
per_sample="norms"): the largest per-sample norm only, as per_sample=True was before shares; per_sample,
per_sample=True: with the shares. The target (issue 43): per_sample within +0.10× (of plain's time)
of per_sample_norms. Results: <out>/watch_shares.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.watch_overhead import LABELS, MODELS, ROOT, _device, time_models

VARIANTS = ["plain", "per_sample_norms", "per_sample"]


def load(avg) -> str:
    return "/".join(f"{v:.2f}" for v in avg)


def markdown(res: dict) -> str:
    lines = ["# What the samples' shares cost hw.watch(per_sample=True) (CPU, 1 thread)", "",
             f"{res['device']}, torch {res['torch']}, 1 thread, Adam, `python -m benchmarks.watch_shares "
             f"--models {','.join(res['models'])} --steps {res['steps']} --repeats {res['repeats']}`: one process, "
             f"blocks interleaved, medians of CPU time per step. Load average (1/5/15 min) {load(res['load_start'])} "
             f"at the start, {load(res['load_end'])} at the end.", "",
             "| model | " + " | ".join(LABELS[v] for v in VARIANTS) + " | shares' cost (× plain) |",
             "|---|" + "---|" * (len(VARIANTS) + 1)]
    for name, r in res["models"].items():
        x = r["x_plain"]
        cells = [f"{x[v]:.2f}× ({r['ms'][v]:.1f} ms)" for v in VARIANTS]
        lines.append(f"| {MODELS[name]} | " + " | ".join(cells) +
                     f" | +{x['per_sample'] - x['per_sample_norms']:.2f}× |")
    lines += ["", "Rounds (× plain): " + "; ".join(
        f"{name} {v}: " + " ".join(f"{a:.2f}" for a in r["rounds_x_plain"][v])
        for name, r in res["models"].items() for v in VARIANTS[1:])]
    lines += ["", "Why over the issue's +0.10× target: an exact share ⟨G_{b,t}, G⟩ = δ_btᵀ G a_bt needs one (tokens × "
              "out)(out × in) product per layer, as large as the layer's forward (a third of its training step); the "
              "Gram form over token pairs costs more at these shapes. The tied LM head, whose vocabulary-wide δ is "
              "let go before the embedding's arrives (capture/sample_shares.py), builds its own gradient once more. "
              "On the GPT-2 shape (512 tokens) that is, per step: the blocks' 8 Linears 512 × 393,216 = 201 M "
              "multiply-adds, the head 2 × 512 × 2048 × 128 = 268 M, its embedding part 512² × 128 = 34 M; about "
              "half of what the training step itself does (3 × 335 M in its Linears and head). "
              "per_sample=\"norms\" keeps the old cost."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:  # as watch_overhead.py runs: glibc's trimming out of reach
        env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="4294967296", MALLOC_MMAP_THRESHOLD_="4294967296",
                   PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.watch_shares", *sys.argv[1:]], env)
    torch.set_num_threads(1)
    load, t0 = os.getloadavg(), time.time()
    models = time_models(args.models.split(","), VARIANTS, args.steps, args.repeats)
    res = {"device": _device(), "torch": torch.__version__, "steps": args.steps, "repeats": args.repeats,
           "models": models, "load_start": load, "load_end": os.getloadavg(), "seconds": time.time() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_shares.json").write_text(json.dumps(res, indent=1))
    (out / "watch_shares.md").write_text(markdown(res))


if __name__ == "__main__":
    main()
