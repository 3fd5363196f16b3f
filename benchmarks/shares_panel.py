"""The explorer's shares panel (issue 43) on GPT-2 124M: what it adds to the explorer's paint, and what it costs
when opened. Hugging Face's GPT2LMHeadModel with random weights (attn_implementation="eager", as the figures
in results/shares_panel.md were measured), batch 4 × 128, on this CPU; each round traces the step
afresh with budget_mb=inf (every a and δ kept: the default 512 MB keeps summaries past the first blocks) and then,
in turn:

    summary        payload.summary(t): what the explorer needs before it paints (the panel adds nothing to it)
    open panel     shares_view(t, "", None): the whole model's shares, first time (nothing cached)
    click sample   shares_view(t, "", b): a sample's strip with its tokens' text (the shares cached)
    open on layer  shares_view(t, "transformer.h.0.mlp.c_fc", None): one layer's, first time
    page shares    static_shares(t): what to_html adds for the page's panel (live-only past STATIC_MACS), and what
                   inlining it (bar + every strip) would cost

    .venv/bin/python -m benchmarks.shares_panel [--rounds 3] [--tiny] [--out benchmarks/results]

Writes shares_panel.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import hookwidget as hw
from hookwidget.views import payload
from hookwidget.views.payload import shares as panel

from .run import RESULTS, write_results

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000}
LAYER = "transformer.h.0.mlp.c_fc"


def model_and_step(batch: int, seq: int, tiny: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**(TINY if tiny else {}), attn_implementation="eager"))
    idx = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step():
        model.zero_grad()
        model(idx, labels=idx).loss.backward()

    return step


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_round(step, decode) -> dict:
    t = hw.trace(step, decode=decode, budget_mb=float("inf"))  # fresh: nothing cached on it; every (a, δ) kept
    row = {"summary_s": timed(lambda: payload.summary(t)),
           "open_s": timed(lambda: panel.shares_view(t, "", None)),
           "click_s": timed(lambda: panel.shares_view(t, "", 1)),
           "layer_s": timed(lambda: panel.shares_view(t, LAYER, None))}
    panel._cache.pop(t, None)
    row["page_s"] = timed(lambda: panel.static_shares(t))  # past STATIC_MACS: a live-only line, nothing computed
    row["page_live_only"] = "error" in panel.static_shares(t)
    bound, panel.STATIC_MACS = panel.STATIC_MACS, float("inf")
    try:  # what inlining the panel would cost this model (shares not cached)
        panel._cache.pop(t, None)
        row["page_inlined_s"] = timed(lambda: panel.static_shares(t))
        row["page_kib"] = len(json.dumps(panel.static_shares(t))) / 1024
    finally:
        panel.STATIC_MACS = bound
    row["macs"] = panel.shares_macs(t)
    shares = t.shares()
    row["left_out"], row["params_counted"] = len(shares.left_out), len(shares.params)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="a 2-block model: a smoke run of the script")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    step = model_and_step(args.batch, args.seq, args.tiny)
    step()  # warm-up
    vocab = [f"t{i}" for i in range(50257)]
    rows = [one_round(step, lambda i: vocab[i]) for _ in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "page_live_only"}
    results = {"model": "GPT-2 124M" if not args.tiny else "GPT-2 tiny", "batch": args.batch, "seq": args.seq,
               "rounds": rows, "median": med, "threads": torch.get_num_threads(), "platform": platform.platform(),
               "left_out": rows[-1]["left_out"], "params_counted": rows[-1]["params_counted"],
               "static_macs": panel.STATIC_MACS}
    write_results(results, args.out, "shares_panel", markdown)


def markdown(r: dict) -> str:
    m = r["median"]
    lines = [f"# The explorer's shares panel: {r['model']}, batch {r['batch']} × {r['seq']} tokens, CPU "
             f"({r['threads']} threads)", "",
             f"Medians of {len(r['rounds'])} rounds; {r['params_counted']} parameters counted, "
             f"{r['left_out']} left out.",
             "", "| what | seconds |", "|---|---|",
             f"| payload.summary (the paint; the panel adds nothing to it) | {m['summary_s']:.3f} |",
             f"| opening the panel: the whole model's shares, first time | {m['open_s']:.3f} |",
             f"| clicking a sample: its strip and tokens' text (shares cached) | {m['click_s']:.3f} |",
             f"| opening it on one layer ({LAYER}), first time | {m['layer_s']:.3f} |",
             f"| what to_html adds ({'live-only: ' if r['rounds'][-1]['page_live_only'] else ''}{m['macs']:.1e} "
             f"multiply-adds, bound {r['static_macs']:.0e}) | {m['page_s']:.3f} |",
             f"| what inlining the bar and every strip would add | {m['page_inlined_s']:.3f} |",
             "", f"The inlined panel data would be {m['page_kib']:.0f} KiB of JSON.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
