"""What hw.watch adds to a training step on a GPU, counted on the CPU: the operations it launches and the values it
reads on the host, per step, beyond plain.

    python -m benchmarks.watch_launches [--steps 5] [--models gpt2,gpt2_small]

No GPU is needed: a CPU run is sent down the device path (`hookwidget._torch.host_reads.free` says no read is
free, as on a GPU, so the statistics take the branches a GPU takes) and every aten operation dispatched during the
counted steps (forward, backward, optimizer, the watch's hooks; a torch_dispatch mode sees them all) is counted,
apart from those that launch no kernel on a device (views and aliases of an input's storage, empty allocations).
On a GPU each counted operation is one kernel launch or more (a multi-tensor `_foreach_*` op: one per chunk of
tensors), 5–10 µs of host time each on the launch-bound small models (docs/guide/watch.md, "On a GPU"). Reads:
`aten._local_scalar_dense` (`.item()`, `float(t)`, `bool(t)`) and copies to the CPU that are not non-blocking.

Models: watch_overhead.py's GPT-2 shape (d 128 × 2), and GPT-2 small's layers (Hugging Face `GPT2LMHeadModel`,
the 124M config: 12 blocks of 768, random weights, nothing downloaded; batch 2 × 32 tokens here, as the counts do
not depend on the batch) under bf16 autocast, as the issue's GPU benchmark runs it. Variants as
benchmarks/watch_gpu.py's. Results: benchmarks/results/watch_launches.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.watch_gpu import VARIANTS, gpt2_small, monitor, training_step
from benchmarks.watch_overhead import build
from hookwidget._torch import host_reads

RESULTS = pathlib.Path(__file__).parent / "results"
NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "alias",
             "_local_scalar_dense")


class Count(TorchDispatchMode):
    """Counts the dispatched operations that launch work on a device, and the host reads."""

    def __init__(self):
        super().__init__()
        self.ops, self.reads, self.names = 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]  # "add_.Tensor" -> "add_"
        if name == "_local_scalar_dense" or name == "_to_copy" and (kwargs or {}).get("device") == "cpu" \
                and not (kwargs or {}).get("non_blocking"):
            self.reads += 1
        if name in NO_KERNEL or not name.endswith("_") and _aliases(out, args):
            return out
        self.ops += 1
        self.names[name] = self.names.get(name, 0) + 1
        return out


def _aliases(out, args) -> bool:
    """Whether `out` (its first tensor) shares the storage of a tensor in `args`: a view, no kernel."""
    first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)),
                 None)
    if first is None or first.untyped_storage().nbytes() == 0:
        return first is not None
    ptr = first.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


def count(model, x, y, variant: str, steps: int) -> Count:
    step = training_step(model, x, y)
    w = monitor(model, variant)
    try:
        for _ in range(3):  # the first steps build index tensors, once
            step()
        with Count() as c:
            for _ in range(steps):
                step()
        return c
    finally:
        if w is not None:
            w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--models", default="gpt2,gpt2_small")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    free, host_reads.free = host_reads.free, lambda device: False  # the device path, on the CPU
    rows = {}
    try:
        for name in args.models.split(","):
            model, x, y = gpt2_small(2, 32) if name == "gpt2_small" else build(name)  # counts: batch-independent
            got = {v: count(model, x, y, v, args.steps) for v in VARIANTS}
            rows[name] = {v: {"ops": c.ops / args.steps, "reads": c.reads / args.steps} for v, c in got.items()}
            print(name, {v: (r["ops"], r["reads"]) for v, r in rows[name].items()}, flush=True)
    finally:
        host_reads.free = free
    lines = [f"# What hw.watch launches and reads a step, counted on the CPU on the device path (torch "
             f"{torch.__version__}, {args.steps} steps)", "",
             "| model | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    for name, vs in rows.items():
        plain, reads = vs["plain"]["ops"], vs["plain"]["reads"]
        cells = [f"{vs[v]['ops']:.0f} ops, {vs[v]['reads']:.0f} reads" if v == "plain" else
                 f"+{vs[v]['ops'] - plain:.0f} ops, {vs[v]['reads'] - reads:+.0f} reads" for v in VARIANTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Operations that launch a kernel on a device, per step, and reads of a value on the host per step "
              "(each a sync on a GPU, where the value is on the device); the variants' beyond plain. Plain's reads "
              "are Adam's step counters (one a parameter), CPU tensors on a GPU too: free there. "
              "watch: `flight_recorder=False`; watch+fr: the "
              "default; per_sample: `per_sample=True, flight_recorder=False`; floor: hand-written hooks for the "
              "same statistics (watch_overhead.py's Floor). gpt2: the GPT-2 shape of watch_overhead.py; gpt2_small: "
              "Hugging Face GPT-2's 124M config under bf16 autocast."]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_launches.md").write_text("\n".join(lines) + "\n")
    (out / "watch_launches.json").write_text(json.dumps({"torch": torch.__version__, "steps": args.steps,
                                                         "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
