"""A click on a layer until its detail shows, in a real JupyterLab with the file browser open (issue 41: ≤ 0.5 s
after the first paint), on GPT-2 124M (Hugging Face's, random weights, batch 4 × 128) and the CNN, at 1100 and
1500 px. The flow of tests/browser/test_lab_click_answers.py (tests/browser/lab_clicks.py, written once): each
model traced once in one kernel; for each width and round its explorer displayed again (a fresh explorer: every
click asks the kernel), then a real mouse click on each layer, timed in the page from the click event to the
detail drawn with its head in view. Kernel, transfer, decoding, drawing and scrolling all count.

    .venv/bin/python -m benchmarks.click_lab [--rounds 3] [--out benchmarks/results]

Writes click_lab.{json,md}: the median of the rounds per width and layer, and over every GPT-2 click.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BROWSER = ROOT / "tests" / "browser"
WIDTHS = (1100, 1500)
HANG_MS = 60_000


def measure(rounds: int) -> list[dict]:
    sys.path.insert(0, str(BROWSER))
    from conftest import ARGS, CHROMIUM
    from lab_clicks import CELLS, CNN_AGAIN, CNN_CLICKS, GPT2_AGAIN, GPT2_CLICKS, click_in_view, display, lab_notebook
    from lab_server import jupyter, write_notebook
    from playwright.sync_api import sync_playwright

    root = pathlib.Path(tempfile.mkdtemp())
    write_notebook(root / "click.ipynb", CELLS)
    rows = []
    with jupyter(root) as (base, token), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        with lab_notebook(browser, f"{base}/lab/tree/click.ipynb?token={token}", WIDTHS[0]) as page:
            for r in range(rounds):
                for width in WIDTHS:  # interleaved: each round visits both widths
                    page.set_viewport_size({"width": width, "height": 900})
                    for cell, model, clicks in [(CNN_AGAIN, "cnn", CNN_CLICKS), (GPT2_AGAIN, "gpt2_124m", GPT2_CLICKS)]:
                        display(page, cell)
                        for name, via in clicks:
                            ms = click_in_view(page, cell, name, via, HANG_MS)
                            rows.append({"round": r, "width": width, "model": model, "layer": name, "ms": ms})
                            print(f"round {r}, {width} px, {model} {name}: {ms:.0f} ms", flush=True)
                            page.wait_for_timeout(300)
        browser.close()
    return rows


def report(rows: list[dict], rounds: int, load: tuple) -> tuple[dict, str]:
    keys = sorted({(r["model"], r["layer"], r["width"]) for r in rows}, key=lambda k: (k[0] != "gpt2_124m", k))
    med = {f"{m} {layer} {w}": statistics.median(r["ms"] for r in rows if (r["model"], r["layer"], r["width"])
                                                 == (m, layer, w)) for m, layer, w in keys}
    gpt2 = [r["ms"] for r in rows if r["model"] == "gpt2_124m"]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; Debian chromium, JupyterLab"
    lines = ["# A click until its detail shows, in JupyterLab with the file browser open", "",
             f"{machine}; median of {rounds} rounds (each width in each round, a freshly displayed explorer); "
             "`python -m benchmarks.click_lab`. From the click event to the detail drawn with its head in view "
             "(the kernel's payload.detail, the transfer, decoding, drawing, scrolling).", "",
             "| model | layer | 1100 px (ms) | 1500 px (ms) |", "|---|---|---|---|"]
    for m, layer in dict.fromkeys((m, layer) for m, layer, _ in keys):
        lines.append(f"| {m} | `{layer}` | " + " | ".join(f"{med[f'{m} {layer} {w}']:.0f}" for w in WIDTHS) + " |")
    lines += ["", f"Every GPT-2 124M click: median {statistics.median(gpt2):.0f} ms, slowest {max(gpt2):.0f} ms "
              f"({len(gpt2)} clicks).", "",
              f"Load average at start / end: {load[0]} / {load[1]} (other work shares this CPU)."]
    return {"machine": machine, "load": list(load), "rounds": rows, "median_ms": med,
            "gpt2_median_ms": statistics.median(gpt2), "gpt2_max_ms": max(gpt2)}, "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    start = [round(v, 2) for v in os.getloadavg()]
    rows = measure(args.rounds)
    data, md = report(rows, args.rounds, (start, [round(v, 2) for v in os.getloadavg()]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "click_lab.json").write_text(json.dumps(data, indent=1))
    (out / "click_lab.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
