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

Before / after (--before COMMIT, default the commit before issue 43's speed-up of the panel; "" skips it): the
package at COMMIT is imported next to the working tree's in this process (house_ab.materialise) and each round
opens the panel on a fresh trace of each version in turn (the order reversed every other round), so that the load
of a shared machine hits both alike: on one thread (torch.set_num_threads(1), as house_ab.py), CPU seconds of this
process and wall seconds, medians, and the median of the per-round ratios after / before. One thread because on a
loaded 2-core machine two threads mostly wait for each other (measured at load 8: 12-26 s wall to open the panel at
2 threads, 3-6 s at one); the table above is at torch's default threads, as a user opens the panel. The load
average is recorded per round.

    .venv/bin/python -m benchmarks.shares_panel [--rounds 3] [--tiny] [--before COMMIT] [--out benchmarks/results]

Writes shares_panel.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

import torch

import hookwidget as hw
from hookwidget.views import payload
from hookwidget.views.payload import shares as panel

from .house_ab import _describe, materialise
from .run import RESULTS, write_results

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000}
LAYER = "transformer.h.0.mlp.c_fc"
BEFORE = "5761338"  # the commit before the panel's speed-up (9.1 s to open on GPT-2 124M, measured loaded)


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


def clocked(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of fn()."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def versus_round(versions: dict, step, order: list) -> dict:
    """Each version in turn: a fresh trace, then the whole model's shares opened (nothing cached) and one layer's."""
    row = {name: opened(versions[name], step) for name in order}
    row["load"] = os.getloadavg()[0]
    return row


def opened(hw_v, step) -> dict:
    view = importlib.import_module(f"{hw_v.__name__}.views.payload.shares").shares_view
    t = hw_v.trace(step, budget_mb=float("inf"))
    return {"open": clocked(lambda: view(t, "", None)), "layer": clocked(lambda: view(t, LAYER, None))}


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
    row["load"] = os.getloadavg()[0]
    shares = t.shares()
    row["left_out"], row["params_counted"] = len(shares.left_out), len(shares.params)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="a 2-block model: a smoke run of the script")
    ap.add_argument("--before", default=BEFORE, help="the commit to compare opening the panel with ('': none)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    step = model_and_step(args.batch, args.seq, args.tiny)
    step()  # warm-up
    vocab = [f"t{i}" for i in range(50257)]
    rows = [one_round(step, lambda i: vocab[i]) for _ in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "page_live_only"}
    fastest = {k: min(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}  # load only ever adds time
    results = {"model": "GPT-2 124M" if not args.tiny else "GPT-2 tiny", "batch": args.batch, "seq": args.seq,
               "rounds": rows, "median": med, "fastest": fastest, "threads": torch.get_num_threads(),
               "platform": platform.platform(),
               "left_out": rows[-1]["left_out"], "params_counted": rows[-1]["params_counted"],
               "static_macs": panel.STATIC_MACS}
    if args.before:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the work, not the wait: see the docstring
        try:
            with tempfile.TemporaryDirectory() as tmp:
                versions = {"before": materialise(args.before, pathlib.Path(tmp)), "after": hw}
                ab = [versus_round(versions, step, ["before", "after"] if r % 2 == 0 else ["after", "before"])
                      for r in range(args.rounds)]
        finally:
            torch.set_num_threads(threads)
        results["versus"] = {"before": _describe(args.before), "after": _describe("HEAD"), "rounds": ab,
                             "summary": versus_summary(ab)}
    write_results(results, args.out, "shares_panel", markdown)


def versus_summary(ab: list) -> dict:
    """Per what (open, layer) and clock (wall, cpu): medians of each version and of the per-round ratios."""
    out = {}
    for what in ("open", "layer"):
        for i, clock in enumerate(("wall", "cpu")):
            b = [r["before"][what][i] for r in ab]
            a = [r["after"][what][i] for r in ab]
            ratios = [x / y for x, y in zip(a, b)]
            out[f"{what}_{clock}"] = {"before": statistics.median(b), "after": statistics.median(a),
                                      "ratio": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    return out


def markdown(r: dict) -> str:
    m, f = r["median"], r.get("fastest") or r["median"]
    loads = ", ".join(f"{x['load']:.1f}" for x in r["rounds"] if "load" in x) or "not recorded"
    lines = [f"# The explorer's shares panel: {r['model']}, batch {r['batch']} × {r['seq']} tokens, CPU "
             f"({r['threads']} threads)", "",
             f"{len(r['rounds'])} rounds, wall seconds; {r['params_counted']} parameters counted, "
             f"{r['left_out']} left out. Load average (1 min) per round: {loads} (2 cores: above 2, other processes "
             "hold them, and two threads mostly wait on each other; the one-thread comparison below measures the "
             "work).", "", "| what | median | fastest round |", "|---|---|---|",
             f"| payload.summary (the paint; the panel adds nothing to it) | {m['summary_s']:.3f} | "
             f"{f['summary_s']:.3f} |",
             f"| opening the panel: the whole model's shares, first time | {m['open_s']:.3f} | {f['open_s']:.3f} |",
             f"| clicking a sample: its strip and tokens' text (shares cached) | {m['click_s']:.3f} | "
             f"{f['click_s']:.3f} |",
             f"| opening it on one layer ({LAYER}), first time | {m['layer_s']:.3f} | {f['layer_s']:.3f} |",
             f"| what to_html adds ({'live-only: ' if r['rounds'][-1]['page_live_only'] else ''}{m['macs']:.1e} "
             f"multiply-adds, bound {r['static_macs']:.0e}) | {m['page_s']:.3f} | {f['page_s']:.3f} |",
             f"| what inlining the bar and every strip would add | {m['page_inlined_s']:.3f} | "
             f"{f['page_inlined_s']:.3f} |",
             "", f"The inlined panel data would be {m['page_kib']:.0f} KiB of JSON.", ""]
    v = r.get("versus")
    if v:
        loads = ", ".join(f"{x['load']:.1f}" for x in v["rounds"])
        lines += ["## Before / after, interleaved in one process", "",
                  f"before: `{v['before']}`; after: `{v['after']}`. One thread; {len(v['rounds'])} rounds, each a "
                  "fresh trace of each version in turn (order reversed every other round); load average (1 min) per "
                  "round: "
                  f"{loads}. after / before: median of the per-round ratios, with their range.", "",
                  "| what | clock | before (s) | after (s) | after / before | per round |", "|---|---|---|---|---|---|"]
        for key, label in (("open", "opening the panel: whole model, first time"),
                           ("layer", f"opening it on one layer ({LAYER}), first time")):
            for clock in ("wall", "cpu"):
                x = v["summary"][f"{key}_{clock}"]
                lines.append(f"| {label} | {clock} | {x['before']:.3f} | {x['after']:.3f} | **{x['ratio']:.3f}** | "
                             f"{x['range'][0]:.3f}–{x['range'][1]:.3f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
