"""Per-sample norms at full coverage (issue 14, item 5): models that need rules beyond Linear/Embedding/LayerNorm.

`python -m benchmarks.full_coverage [--models vit,gpt2mha] [--repeats 5] [--no-memory]`

The ViT-shaped model has a patch-embedding conv, a class token and a position embedding held by the model itself
and nn.MultiheadAttention blocks; the GPT-2 variant fused q/k/v (nn.MultiheadAttention with a causal mask) and a
position embedding called on arange(T). Every variant of one model runs interleaved in one process, one thread,
time.process_time medians; peak memory in a child process (benchmarks/memory.py). Checks: hookwidget's norms
against torch.func's (max relative difference) and its coverage (t.per_sample_left_out empty). The rows "(vmap
rule only)" switch the generic rule's fast rules off (nn.MultiheadAttention by vmap of its vjp): the figure before them.
Writes benchmarks/results/full_coverage.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

import hookwidget as hw

from . import models
from .run import RESULTS, _loadavg, peak_memory, write_results
from .variants import ALL_VARIANTS, Unavailable, interleaved

VARIANTS = ("plain", "hookwidget norms", "hookwidget full norms", "hookwidget norms (vmap rule only)",
            "hookwidget full norms (vmap rule only)", "torch.func norms", "Opacus norms", "BackPACK norms")


def bench(name: str, repeats: int) -> dict:
    model, x, y, loss = models.build(name, "cpu")
    steps, skipped, notes = {}, {}, {}
    for v in VARIANTS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                steps[v] = ALL_VARIANTS[v](model, x, y, loss)
                steps[v]()
            steps[v].reset()
            if steps[v].note:
                notes[v] = steps[v].note
        except Exception as e:  # noqa: BLE001  (a tool that cannot run here is a note, not a crash)
            msg = str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {str(e).splitlines()[0]}"
            skipped[v] = msg[:200]
            steps.pop(v, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = interleaved(steps, repeats, clock=time.process_time)
        ref = steps["torch.func norms"]().double()
        agree = {}
        for v in ("hookwidget norms", "hookwidget full norms", "Opacus norms", "BackPACK norms"):
            if v in steps and not steps[v].partial:
                n = steps[v]().double()
                agree[v] = float(((n - ref).abs() / ref.abs()).max())
                steps[v].reset()
        coverage = {}
        for capture in ("norms", "full"):
            def plain():
                model.zero_grad(set_to_none=True)
                loss(model(x), y).backward()

            t = hw.trace(plain, capture=capture)
            t.per_sample_grad_norms()
            coverage[capture] = dict(t.per_sample_left_out)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    return {"params": models.param_count(model), "repeats": repeats, "median_s": med,
            "ratio": {v: m / med["plain"] for v, m in med.items()}, "skipped": skipped, "notes": notes,
            "max_rel_diff_vs_torch_func": agree, "left_out": coverage,
            "n_params": sum(1 for p in model.parameters() if p.requires_grad)}


def markdown(res: dict) -> str:
    ms = res["models"]
    lines = ["Per-sample gradient norms over every parameter (issue 14, item 5; `python -m benchmarks.full_coverage`). "
             "vit: 32×32 images, 4×4 patch-embedding conv (64 patches + class token), class token and position "
             "embedding as Parameters of the model, 6 blocks of nn.MultiheadAttention(batch_first=True) (d=192, "
             "3 heads, MLP 768), LayerNorm, B=16. gpt2mha: vocabulary 8192, d=256, 4 heads, 4 blocks of "
             "nn.MultiheadAttention(batch_first=True) with a causal float mask (fused q/k/v in in_proj_weight), "
             "position nn.Embedding called on arange(T), T=64, B=8, untied head. Target: hookwidget ≥ 1.4× faster than "
             "torch.func and Opacus, peak memory ≤ 1.5× plain.", "",
             f"CPU, torch {res['torch']}, 1 thread; time.process_time medians of {res['repeats']} interleaved repeats "
             "after one warm-up. Time as a ratio to plain forward+backward; peak memory as a ratio to plain's in "
             "brackets; hookwidget / other: how many times faster hookwidget norms is.", "",
             "| variant | " + " | ".join(f"{k} ({m['params'] / 1e6:.2g}M params)" for k, m in ms.items()) + " |",
             "|---|" + "---|" * len(ms)]
    for v in VARIANTS:
        cells = []
        for m in ms.values():
            if v in m["ratio"]:
                pr = m.get("peak_ratio", {}).get(v)
                cells.append(f"{m['ratio'][v]:.2f}×" + (f" ({pr:.2f}×)" if pr is not None else "")
                             + ("¹" if v in m["notes"] else ""))
            else:
                cells.append("n/a²")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    for hv in ("hookwidget norms", "hookwidget full norms"):
        lines.append(f"| *{hv}: times faster than torch.func / Opacus / BackPACK* | " + " | ".join(
            " / ".join(f"{m['median_s'][o] / m['median_s'][hv]:.2f}×" if o in m["median_s"] and hv in m["median_s"]
                       else "n/a" for o in ("torch.func norms", "Opacus norms", "BackPACK norms"))
            for m in ms.values()) + " |")
    lines.append("| *plain: time, peak* | " + " | ".join(
        f"{m['median_s']['plain'] * 1e3:.0f} ms, {m.get('peak_mb', {}).get('plain', float('nan')):.0f} MB"
        for m in ms.values()) + " |")
    lines.append("| *norms: max rel. diff to torch.func* | " + " | ".join(
        ", ".join(f"{v.replace(' norms', '')} {d:.1e}" for v, d in m["max_rel_diff_vs_torch_func"].items())
        for m in ms.values()) + " |")
    lines.append("| *coverage (parameters left out: norms / full)* | " + " | ".join(
        f"{len(m['left_out']['norms'])} / {len(m['left_out']['full'])} of {m['n_params']}" for m in ms.values()) + " |")
    lines.append("")
    for k, m in ms.items():
        for v, why in m["notes"].items():
            lines.append(f"¹ {k} / {v}: {why}.")
        for v, why in m["skipped"].items():
            lines.append(f"² {k} / {v}: not measured: {why}")
        for capture, left in m["left_out"].items():
            for p, why in left.items():
                lines.append(f"- {k}, capture={capture!r}: left out {p}: {why}")
    lines.append(f"\nLoad average at start / end: {res['load_average']} / {res.get('load_average_end')}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.full_coverage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vit,gpt2mha")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"torch": torch.__version__, "repeats": args.repeats, "load_average": _loadavg(), "models": {}}
    for name in args.models.split(","):
        r = bench(name, args.repeats)
        if not args.no_memory:
            r["peak_mb"] = peak_memory(name, "cpu", list(r["median_s"]), False, 1)
            base = r["peak_mb"].get("plain")
            r["peak_ratio"] = {v: p / base for v, p in r["peak_mb"].items()} if base else {}
        res["models"][name] = r
        print(json.dumps({name: {v: round(x, 3) for v, x in r["ratio"].items()}}), flush=True)
    write_results(res, args.out, "full_coverage", markdown)


if __name__ == "__main__":
    main()
