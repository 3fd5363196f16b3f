"""What hw.watch costs per training step on a CUDA GPU, and whether any step waits for the host.

    python -m benchmarks.watch_gpu [--steps 200] [--rounds 3] [--models mlp,transformer,gpt2,gpt2_small]

The models, the loss and the hand-written floor (hooks computing the same statistics, counting NaN/Inf on the
device) are benchmarks/watch_overhead.py's (that script times CPU time on one thread; a GPU step is measured here
in wall time); gpt2_small is Hugging Face's GPT-2 124M, batch 8 × 512 tokens, bf16 autocast. Each variant runs
20 warm-up steps, then `--steps` steps, then its rows come to the host (part of the cost). Before timing, 40
steps of each variant run under torch.cuda.set_sync_debug_mode("error") (fewer than the 64 rows the watch moves
to the host at once): a step that synchronises with the host raises, and the table marks that variant "(syncs)".
Variants alternate within each of `--rounds` rounds; the median per-step time and its ratio to plain are
reported.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

import hookwidget as hw
from benchmarks.watch_overhead import Floor, build, loss_of

VARIANTS = ("plain", "floor", "watch", "watch+fr", "per_sample")
RESULTS = pathlib.Path(__file__).parent / "results"


def monitor(model, variant: str):
    """What the variant puts on `model` (None: plain); close() takes it off (the floor's flush() reads it)."""
    return {"plain": lambda: None, "floor": lambda: Floor(model),
            "watch": lambda: hw.watch(model, flight_recorder=False),
            "watch+fr": lambda: hw.watch(model),
            "per_sample": lambda: hw.watch(model, flight_recorder=False, per_sample=True)}[variant]()


def gpt2_small(batch: int = 8, tokens: int = 512):
    """GPT-2 small (Hugging Face's 124M config, random weights, nothing downloaded) and a batch of token ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(attn_implementation="eager")).train()
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens))
    return model, ids, ids


def training_step(model, x, y):
    """One Adam step of `model` on (x, y): a Hugging Face model's own loss under bf16 autocast (the issue's GPT-2
    small), else watch_overhead.py's loss."""
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    hf = hasattr(model, "config")
    kind = next(model.parameters()).device.type

    def step():
        opt.zero_grad()
        if hf:
            with torch.autocast(kind, dtype=torch.bfloat16):
                loss = model(x, labels=y).loss
        else:
            loss = loss_of(model(x), y)
        loss.backward()
        opt.step()

    return step


def time_loop(model, x, y, steps: int, variant: str, check: bool = False) -> float:
    """Seconds per step (wall time, rows brought to the host at the end). With `check`, the steps run under
    torch.cuda.set_sync_debug_mode("error") and fewer than the watch's batch of 64 rows are taken, so that no
    planned transfer to the host falls inside: a step that synchronises raises."""
    step = training_step(model, x, y)
    w = monitor(model, variant)
    try:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if isinstance(w, Floor):
            w.flush()
        elif w is not None:
            _ = w.stats
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        if w is not None:
            w.close()
    return elapsed / steps


def sync_free(model, x, y, variant: str) -> bool:
    """Whether 40 steps (within one batch of rows) run without any host sync."""
    try:
        time_loop(model, x, y, 40, variant, check=True)
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="mlp,transformer,gpt2,gpt2_small")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("watch_gpu: no CUDA device")
    rows = {}
    for name in args.models.split(","):
        model, x, y = gpt2_small() if name == "gpt2_small" else build(name)
        model, x, y = model.cuda(), x.cuda(), y.cuda()
        times: dict = {v: [] for v in VARIANTS}
        free = {v: sync_free(model, x, y, v) for v in VARIANTS}
        for r in range(args.rounds):
            for v in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
                times[v].append(time_loop(model, x, y, args.steps, v))
        plain, floor = statistics.median(times["plain"]), statistics.median(times["floor"])
        rows[name] = {v: {"ms": 1e3 * statistics.median(ts), "x_plain": statistics.median(ts) / plain,
                          "x_floor": statistics.median(ts) / floor, "sync_free": free[v]}
                      for v, ts in times.items()}
        print(name, {v: round(r["x_plain"], 2) for v, r in rows[name].items()}, flush=True)
    device = torch.cuda.get_device_name()
    lines = [f"# hw.watch on {device} (torch {torch.__version__}; {args.steps} steps × {args.rounds} rounds, "
             "wall time, medians)", "", "| model | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    for name, vs in rows.items():
        cells = [f"{vs[v]['ms']:.2f} ms" if v == "plain" else f"{vs[v]['x_plain']:.2f}×"
                 + ("" if v == "floor" else f" ({vs[v]['x_floor']:.2f}× floor)")
                 + ("" if vs[v]["sync_free"] else " (syncs)") for v in VARIANTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "× plain, and in brackets × the floor (hand-written hooks for the same statistics, "
              "benchmarks/watch_overhead.py's Floor). 40 steps of each variant ran under "
              "torch.cuda.set_sync_debug_mode(\"error\") first; \"(syncs)\" "
              "marks one whose steps synchronised with the host."]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_gpu.md").write_text("\n".join(lines) + "\n")
    (out / "watch_gpu.json").write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows},
                                                   indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
