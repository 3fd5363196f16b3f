"""Per-sample gradient norms on the issue-24 models, and the check of layers/cost.py's per-layer choice.

    python -m benchmarks.per_sample_norms            # both parts, 2 threads
    python -m benchmarks.per_sample_norms --costs    # only the cost-model check

Models: a 3-block GPT (vocabulary 4096, d=192, 3 heads, T=64, B=8, causal scaled_dot_product_attention; its tables
initialised as GPT-2's), its LM head tied to the token embedding and untied, and a token MLP (Linear
256→1024→256→10 over B=16 × T=64 tokens).
Variants, interleaved in one process (one step of each in turn per repeat), medians as ratios to plain
forward+backward: plain, hookwidget (hw.trace(step, capture="norms") + per_sample_grad_norms()), torch.func
(vmap of grad), and the floor: exact norms written by hand for these models with the same kernels and the least
hooking (ghost_floor.py), what any exact per-layer method pays here. The cost check times, for a grid of
(B, T, d_in, d_out), the ghost norm and the materialised per-sample gradient's norm of one outer factor, fits
cost.MEMORY, and counts where the model picks the faster.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from hookwidget.layers import cost
from hookwidget.layers.base import Factor
from hookwidget.layers.factors import per_sample_norm_sq

from .ghost_floor import make_ghost_floor
from .models import GPT2, _ce_seq
from .run import RESULTS, write_results
from .variants import interleaved, make_hookwidget, make_plain, make_torch_func

GRID = [(8, T, i, o) for T in (4, 16, 64, 256) for i, o in ((16, 16), (12, 2), (192, 192), (256, 1024),
                                                           (1024, 256), (256, 10), (192, 4096))]


def build(name: str):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name.startswith("gpt"):
        model = GPT2(vocab=4096, d=192, heads=3, layers=3, seq=64)
        # GPT-2's initialisation of its tables (nn.Embedding's N(0, 1) would make a tied head's logits ~14 wide:
        # a saturated softmax whose gradients are denormal floats, which slow every matmul of the step on CPU)
        nn.init.normal_(model.tok.weight, std=0.02)
        nn.init.normal_(model.pos.weight, std=0.01)
        if name == "gpt tied":
            model.head.weight = model.tok.weight
        x, y = (torch.randint(0, 4096, (8, 64), generator=g) for _ in range(2))
        return model, x, y, _ce_seq
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(), nn.Linear(256, 10))
    return model, torch.randn(16, 64, 256, generator=g), torch.randint(0, 10, (16, 64), generator=g), _ce_seq


FLOOR = "hand-written floor"
VARIANTS = {"plain": make_plain, "hookwidget norms": make_hookwidget("norms"), "torch.func norms": make_torch_func,
            FLOOR: make_ghost_floor}


def bench(name: str, repeats: int) -> dict:
    model, x, y, loss = build(name)
    steps = {v: make(model, x, y, loss) for v, make in VARIANTS.items()}
    norms = {}
    for v, step in steps.items():  # warm-up, and the norms to compare
        norms[v] = step()
        step.reset()
    times = interleaved(steps, repeats)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    ref = norms["torch.func norms"]
    diff, floor_diff = (float(((norms[v] - ref).abs() / ref.abs().clamp_min(1e-12)).max())
                        for v in ("hookwidget norms", FLOOR))
    low = {v: min(ts) for v, ts in times.items()}
    return {"median_s": med, "ratio": {v: m / med["plain"] for v, m in med.items()}, "repeats": repeats,
            "min_s": low, "min_ratio": {v: m / low["plain"] for v, m in low.items()},
            "max_rel_diff_vs_torch_func": diff, "floor_max_rel_diff_vs_torch_func": floor_diff}


def _time(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)  # microseconds-long kernels on a shared CPU: the minimum is the kernel, the rest is the neighbours


def check_costs(repeats: int) -> dict:
    """Time both exact methods per shape; fit MEMORY (the one free constant) by the fewest wrong choices."""
    rows = []
    for B, T, i, o in GRID:
        f = Factor("weight", "outer", torch.randn(B, T, o), torch.randn(B, T, i), (o, i))
        t = {m: _time(lambda m=m, f=f: per_sample_norm_sq(f, method=m), repeats) for m in ("ghost", "grad")}
        rows.append({"B": B, "T": T, "d_in": i, "d_out": o, "ghost_s": t["ghost"], "grad_s": t["grad"]})

    def wrong(mem: float) -> list:
        T, i, o = "T", "d_in", "d_out"
        return [r for r in rows if (r[T] ** 2 * (r[i] + r[o] + mem) < r[i] * r[o] * (r[T] + mem))
                != (r["ghost_s"] < r["grad_s"])]

    fits = {mem: wrong(mem) for mem in (0, 2, 4, 8, 16, 24, 32, 48, 64, 128)}
    costly = {mem: sum(abs(r["ghost_s"] - r["grad_s"]) for r in w) for mem, w in fits.items()}
    for r in rows:
        r["chosen"] = cost.method(Factor("weight", "outer", torch.empty(1, r["T"], r["d_out"]), None,
                                         (r["d_out"], r["d_in"])))
        r["faster"] = "ghost" if r["ghost_s"] < r["grad_s"] else "grad"
    return {"rows": rows, "wrong_by_memory": {m: len(w) for m, w in fits.items()},
            "lost_s_by_memory": costly, "memory_used": cost.MEMORY}


def markdown(res: dict) -> str:
    out = [f"# Per-sample gradient norms (issue 24)\n\n{res['device']}, torch {res['torch']}, "
           f"{res['threads']} threads; load average {res['load_average']} → {res.get('load_average_end')}.\n"]
    if res.get("models"):
        out += ["Medians (minimums in brackets) as ratios to plain forward+backward, interleaved in one process. "
                "hookwidget: hw.trace(step, capture='norms') + per_sample_grad_norms(); torch.func: vmap(grad); "
                "the floor: exact norms written by hand for these models, the same kernels and the least hooking "
                "(benchmarks/ghost_floor.py). The CPU is shared with other jobs: the load average above says how "
                "much; minimums are the steadier figure.", "",
                "| model | plain | hookwidget norms | torch.func norms | hand-written floor | hookwidget faster than "
                "torch.func by | max rel diff to torch.func (hookwidget / floor) |",
                "|---|---|---|---|---|---|---|"]
        for name, r in res["models"].items():
            ra, lo = r["ratio"], r["min_ratio"]
            hw_, tf, fl = (f"{ra[v]:.2f}× ({lo[v]:.2f}×)" if v in ra else "–"
                           for v in ("hookwidget norms", "torch.func norms", FLOOR))
            fast = ra["torch.func norms"] / ra["hookwidget norms"]
            out.append(f"| {name} | 1.00× ({r['median_s']['plain'] * 1e3:.1f} ms) | {hw_} | {tf} | {fl} | "
                       f"{fast:.2f}× | {r['max_rel_diff_vs_torch_func']:.1e} / "
                       f"{r.get('floor_max_rel_diff_vs_torch_func', float('nan')):.1e} |")
    c = res.get("costs")
    if c:
        out += ["", "## The per-layer choice: ghost norm vs materialised per-sample gradient (one outer factor)", "",
                f"Wrong choices by MEMORY: {c['wrong_by_memory']}; time lost by them (s): "
                + ", ".join(f"{m}: {s * 1e3:.2f} ms" for m, s in c["lost_s_by_memory"].items())
                + f". layers/cost.py uses MEMORY = {c['memory_used']:g}.", "",
                "| B | T | d_in | d_out | ghost ms | grad ms | faster | chosen |", "|---|---|---|---|---|---|---|---|"]
        for r in c["rows"]:
            mark = "" if r["chosen"] == r["faster"] else " ✗"
            out.append(f"| {r['B']} | {r['T']} | {r['d_in']} | {r['d_out']} | {r['ghost_s'] * 1e3:.3f} | "
                       f"{r['grad_s'] * 1e3:.3f} | {r['faster']} | {r['chosen']}{mark} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--costs", action="store_true", help="only the cost-model check")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import os
    import platform
    res = {"device": platform.processor() or platform.machine(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0], "models": {}}
    res["costs"] = check_costs(args.repeats)
    print(markdown(res), flush=True)
    if not args.costs:
        for name in ("gpt tied", "gpt untied", "token MLP"):
            res["models"][name] = bench(name, args.repeats)
            print(name, {v: round(r, 3) for v, r in res["models"][name]["ratio"].items()}, flush=True)
    write_results(res, args.out, "per_sample_norms", markdown)


if __name__ == "__main__":
    main()
