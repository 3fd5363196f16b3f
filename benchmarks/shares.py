"""Gradient shares (issue 43) against per-sample gradient norms, on one traced step of a GPT-shaped model.

    python -m benchmarks.shares                      # CPU, 2 threads
    python -m benchmarks.shares --device cuda --repeats 20

Model: the 3-block GPT of benchmarks/per_sample_norms.py (vocabulary 4096, d=192, 3 heads, T=64, B=8, LM head tied
to the token embedding), and --big: a GPT-2-small-shaped one (vocabulary 8192, d=768, 12 heads, 4 blocks, T=128,
B=8). One step traced with capture="full"; then, interleaved (one call of each in turn per repeat, after a
warm-up that lets each trace settle its cached coverage decisions), the queries on that trace:
    norms          t.per_sample_grad_norms()            ghost norms over all layers (the yardstick)
    shares         t.shares()                           samples and positions, the cheaper form per parameter
    shares (G)     attribution.shares(method="grad")    the product with G everywhere
    shares (Gram)  attribution.shares(method="gram")    token-pair Gram products where a parameter allows them
Medians and ratios to `norms`; the shares' largest difference from the product form is printed as a check.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

import hookwidget as hw
from hookwidget.analysis import attribution

from .models import GPT2, _ce_seq
from .run import RESULTS, write_results
from .variants import interleaved


def build(big: bool, device: str):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    vocab, d, heads, layers, seq = (8192, 768, 12, 4, 128) if big else (4096, 192, 3, 3, 64)
    model = GPT2(vocab=vocab, d=d, heads=heads, layers=layers, seq=seq).to(device)
    nn.init.normal_(model.tok.weight, std=0.02)  # GPT-2's tables (see per_sample_norms.py)
    nn.init.normal_(model.pos.weight, std=0.01)
    model.head.weight = model.tok.weight
    x, y = (torch.randint(0, vocab, (8, seq), generator=g).to(device) for _ in range(2))
    return model, x, y


class Query:
    """One query on the trace, timed with a device sync (reset: nothing to undo)."""

    def __init__(self, fn, device: str):
        self.fn, self.device = fn, device

    def __call__(self):
        out = self.fn()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return out

    def reset(self):
        pass


def bench(big: bool, device: str, repeats: int) -> dict:
    model, x, y = build(big, device)

    def step():
        model.zero_grad()
        _ce_seq(model(x), y).backward()

    t = hw.trace(step)
    queries = {
        "norms": Query(lambda: t.per_sample_grad_norms(), device),
        "shares": Query(lambda: t.shares(), device),
        "shares (G)": Query(lambda: attribution.shares(t, None, None, method="grad"), device),
        "shares (Gram)": Query(lambda: attribution.shares(t, None, None, method="gram"), device),
    }
    out = {v: q() for v, q in queries.items()}  # warm-up: coverage decided once per trace
    check = max(float((out[v].samples - out["shares (G)"].samples).abs().max()) for v in ("shares", "shares (Gram)"))
    times = interleaved(queries, repeats)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    s = out["shares"]
    return {"model": "GPT-2-small-shaped (d=768, 4 blocks, T=128, B=8)" if big else "3-block GPT (d=192, T=64, B=8)",
            "device": device, "repeats": repeats, "median_s": med,
            "ratio_to_norms": {v: m / med["norms"] for v, m in med.items()},
            "max_abs_diff_vs_product_form": check, "sum_of_shares": float(s.samples.sum()),
            "top": s.top(3), "left_out": list(s.left_out)}


def markdown(res: dict) -> str:
    lines = [f"# Gradient shares vs per-sample norms: {res['model']}, {res['device']}, {res['repeats']} repeats", "",
             "| query | median ms | ratio to norms |", "|---|---|---|"]
    for v, m in res["median_s"].items():
        lines.append(f"| {v} | {m * 1e3:.1f} | {res['ratio_to_norms'][v]:.2f} |")
    lines += ["", f"shares sum to {res['sum_of_shares']:.9f}; largest difference of a form from the product form: "
              f"{res['max_abs_diff_vs_product_form']:.2e}; left out: {res['left_out'] or 'nothing'}"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = bench(args.big, args.device, args.repeats)
    write_results(res, args.out, f"shares{'_big' if args.big else ''}{'_cuda' if args.device == 'cuda' else ''}",
                  markdown)


if __name__ == "__main__":
    main()
