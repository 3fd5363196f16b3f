"""GPT-2 124M in a notebook, as a newcomer meets it (issue 41): Hugging Face's GPT2LMHeadModel with random weights,
batch 4 × 128 tokens, on this CPU. Beside the plain step (forward + backward), in one process, rounds
interleaved: the traced step, what the explorer needs before it paints (payload.summary), a click on each kind of
layer (payload.detail, the kernel's side of a click: first click, nothing cached), the tied head's click where every
reader's factors were kept (its check along random directions runs), `t.to_html`, and the sizes of `t.save` with and
without the activations.

    .venv/bin/python -m benchmarks.gpt2_notebook [--rounds 3] [--out benchmarks/results]

Writes gpt2_notebook.{json,md}. The browser's side of a click, in JupyterLab: benchmarks.click_lab.
"""

from __future__ import annotations

import argparse
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

CLICKS = ["lm_head", "transformer.wte", "transformer.wpe", "transformer.h.0.ln_1", "transformer.h.0.attn.c_attn",
          "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
          "transformer.ln_f"]
AB_REPEATS = 3  # lm_head's detail, and the whole rebuild, each round
KEPT_MB = 8192  # a budget that keeps every a and δ of GPT-2 124M at 4 × 128
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000}  # --tiny: a smoke run of the script


def model_and_step(batch: int, seq: int, tiny: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**(TINY if tiny else {})))
    idx = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step():
        model.zero_grad()
        model(idx, labels=idx).loss.backward()

    return model, step


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def whole_rebuild(t, name: str):
    """The detail as it was before a large weight's factors were pictured and checked along directions: W.grad
    rebuilt whole and compared entry by entry (views/payload/grads.py with no size limit)."""
    from hookwidget.views.payload import grads

    limit, grads.WHOLE_LIMIT = grads.WHOLE_LIMIT, float("inf")
    try:
        return payload.detail(t, name)
    finally:
        grads.WHOLE_LIMIT = limit


def one_round(step, tmp: pathlib.Path) -> dict:
    row = {"plain_s": timed(step)[0]}
    row["trace_s"], t = timed(lambda: hw.trace(step))
    row["summary_s"] = timed(lambda: payload.summary(t))[0]
    row["click_s"] = {name: timed(lambda name=name: payload.detail(t, name))[0] for name in CLICKS}
    # A/B, interleaved: the head's detail again, beside the detail that rebuilds its W.grad whole (as before)
    ab = [(timed(lambda: payload.detail(t, "lm_head"))[0], timed(lambda: whole_rebuild(t, "lm_head"))[0])
          for _ in range(AB_REPEATS)]
    row["click_again_s"] = statistics.median(a for a, _ in ab)
    row["click_whole_s"] = statistics.median(b for _, b in ab)
    del t
    # The tied head with every reader's factors kept (the default budget keeps lm_head's but not wte's δ): its
    # detail then checks W.grad against both along random directions (views/payload/grads.py).
    kept = hw.trace(step, budget_mb=KEPT_MB)
    payload.summary(kept)  # what the explorer computes before it paints, as for the clicks above
    row["click_kept_s"], (meta, _) = timed(lambda kept=kept: payload.detail(kept, "lm_head"))
    row["kept_check"] = meta.get("grad_check")
    del kept
    t = hw.trace(step)
    row["to_html_s"] = timed(lambda: t.to_html(tmp / "trace.html"))[0]
    row["html_mib"] = (tmp / "trace.html").stat().st_size / 2**20
    row["save_s"] = timed(lambda: t.save(tmp / "t.pt"))[0]
    row["save_mib"] = (tmp / "t.pt").stat().st_size / 2**20
    row["save_light_s"] = timed(lambda: t.save(tmp / "light.pt", activations=False))[0]
    row["save_light_mib"] = (tmp / "light.pt").stat().st_size / 2**20
    return row


def report(rows: list[dict], batch: int, seq: int, tiny: bool, load: tuple = ()) -> tuple[dict, str]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in ("click_s", "kept_check")}
    clicks = {n: statistics.median(r["click_s"][n] for r in rows) for n in CLICKS}
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads")
    lines = [f"# GPT-2 {'(--tiny)' if tiny else '124M'} in a notebook (batch {batch} × {seq}, random weights)", "",
             f"{machine}; median of {len(rows)} interleaved rounds; `python -m benchmarks.gpt2_notebook`.", "",
             "| what | seconds | × the plain step |", "|---|---|---|"]
    plain = med["plain_s"]
    for key, label in [("plain_s", "plain forward + backward"), ("trace_s", "the same step under hw.trace"),
                       ("summary_s", "what the explorer needs before it paints (payload.summary)"),
                       ("to_html_s", f"t.to_html (a {med['html_mib']:.1f} MiB page)"),
                       ("save_s", f"t.save ({med['save_mib']:.0f} MiB)"),
                       ("save_light_s", f"t.save(activations=False) ({med['save_light_mib']:.0f} MiB)")]:
        lines.append(f"| {label} | {med[key]:.2f} | {med[key] / plain:.2f}× |")
    lines += ["", "A click on a layer, the kernel's side (payload.detail, first click):", "",
              "| layer | seconds |", "|---|---|"]
    lines += [f"| `{n}` | {v:.2f} |" for n, v in clicks.items()]
    lines += ["", f"A/B, {AB_REPEATS} times a round, interleaved: `lm_head`'s detail {med['click_again_s']:.2f} s; "
              f"with its 50257 × 768 W.grad rebuilt whole and compared entry by entry, as before large weights were "
              f"checked along directions, {med['click_whole_s']:.2f} s "
              f"({med['click_whole_s'] / med['click_again_s']:.1f}×)."]
    check = rows[-1]["kept_check"]
    kept = (f"`lm_head` traced with budget_mb={KEPT_MB} (every reader of the tied weight kept): "
            f"{med['click_kept_s']:.2f} s")
    if check:
        kept += (f", W.grad checked against lm_head's and transformer.wte's factors along {check['directions']} "
                 f"random directions: agree {check['agree']}, |uᵀ(W.grad − Σ δ⊗a)v| = "
                 + ", ".join(f"{d:.1e}" for d in check["differences"]) + " where uᵀ W.grad v = "
                 + ", ".join(f"{v:.3g}" for v in check["values"]))
    lines += ["", kept + "."]
    if load:
        lines += ["", f"Load average at start / end: {list(load[0])} / {list(load[1])} (other work shares this CPU)."]
    return {"batch": batch, "seq": seq, "machine": machine, "load": list(load), "rounds": rows, "median": med,
            "clicks": clicks}, \
        "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    ap.add_argument("--tiny", action="store_true", help="a 2-block GPT-2 of width 64: checks the script runs")
    args = ap.parse_args()
    _, step = model_and_step(args.batch, args.seq, args.tiny)
    step()  # warm-up
    start = [round(v, 2) for v in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [one_round(step, pathlib.Path(tmp)) for _ in range(args.rounds)]
    data, md = report(rows, args.batch, args.seq, args.tiny, (start, [round(v, 2) for v in os.getloadavg()]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt2_notebook.json").write_text(json.dumps(data, indent=1))
    (out / "gpt2_notebook.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
