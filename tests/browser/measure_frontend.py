"""Measure the explorer: payload bytes and time to first paint (GPT-2-small shape, 40,000-node chain), and
how far the drawn graph can grow before a re-layout takes longer than a second.

    .venv/bin/python tests/browser/measure_frontend.py   # writes docs/frontend_measurements.md
"""

from __future__ import annotations

import json
import pathlib
import platform
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hookwidget as hw  # noqa: E402
from hookwidget.views import (
    export,  # noqa: E402
    payload,  # noqa: E402
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Block(nn.Module):
    """A GPT-2 block from plain layers: LN, q/k/v/proj attention (causal), LN, 4x MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=50257, d=768, layers=12, heads=12, ctx=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def gpt2_trace():
    torch.manual_seed(0)
    model, idx = GPT(), torch.randint(0, 50257, (2, 128))

    def step():
        model.zero_grad()
        logits = model(idx)
        nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()

    return hw.trace(step)


def chain_trace(n_layers=10_000):
    torch.manual_seed(0)
    model, x = nn.Sequential(*(nn.Linear(8, 8) for _ in range(n_layers))), torch.randn(4, 8)
    return hw.trace(lambda: model(x).sum().backward())


def flat_trace(n_ops):
    """n_ops autograd nodes outside any module: every one is drawn (no collapsing)."""
    p = torch.ones(3, requires_grad=True)

    def step():
        x = p
        for _ in range(n_ops):
            x = x * 1.0001
        x.sum().backward()

    return hw.trace(step)


def wide_trace(n_ops):
    """n_ops parallel autograd nodes outside any module (depth 3): every one is drawn."""
    p = torch.ones(3, requires_grad=True)
    return hw.trace(lambda: torch.stack([p * (1 + i / n_ops) for i in range(n_ops)]).sum().backward())


def sizes(t) -> dict:
    t0 = time.perf_counter()
    payload.health(t)  # trace.health(), cached for the summary and every detail
    health_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    s = payload.summary(t)
    summary_s = time.perf_counter() - t0
    layer = max(t.layers, key=lambda n: sum(p.numel() for p in t.layers[n].module.parameters(recurse=False)))
    t0 = time.perf_counter()
    meta, buffers = payload.detail(t, layer)
    detail_s = time.perf_counter() - t0
    return {"nodes": t.graph.number_of_nodes(), "layers": len(t.layers),
            "summary_bytes": len(json.dumps(s, separators=(",", ":"))), "summary_s": summary_s, "health_s": health_s,
            "detail_layer": layer, "detail_meta_bytes": len(json.dumps(meta)),
            "detail_buffer_bytes": sum(len(b) for b in buffers), "detail_s": detail_s}


def first_paint(browser, t, path) -> dict:
    t0 = time.perf_counter()
    export.to_html(t, path)
    export_s = time.perf_counter() - t0
    page = browser.new_page(viewport={"width": 1360, "height": 760})
    t0 = time.perf_counter()
    page.goto(path.as_uri(), timeout=180_000)
    page.wait_for_selector("body[data-ready]", timeout=180_000)
    wall = time.perf_counter() - t0
    nav = page.evaluate("performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd")
    render_ms = page.evaluate("window.__hwFirstPaintMs")
    shown = page.locator(".hw-graph-info").inner_text()
    # Interactivity: time one click that re-lays out the graph (expand the first collapsed box).
    relayout_ms = None
    box = page.locator("[data-expand]").first
    if box.count():
        relayout_ms = page.evaluate("""el => { const t0 = performance.now();
            el.dispatchEvent(new MouseEvent('click', {bubbles: true})); return performance.now() - t0; }""",
                                    box.element_handle())
    page.close()
    return {"html_bytes": path.stat().st_size, "export_s": export_s, "load_to_ready_s": wall,
            "dom_content_loaded_ms": nav, "render_ms": render_ms, "shown": shown, "expand_relayout_ms": relayout_ms}


def main() -> None:
    from conftest import ARGS, CHROMIUM
    from playwright.sync_api import sync_playwright

    out = {}
    tmp = pathlib.Path(tempfile.mkdtemp())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for name, make in (("gpt2_small", gpt2_trace), ("chain_40k", chain_trace)):
            t0 = time.perf_counter()
            t = make()
            trace_s = time.perf_counter() - t0
            out[name] = {"trace_s": trace_s, **sizes(t), **first_paint(browser, t, tmp / f"{name}.html")}
            print(name, out[name], flush=True)
            del t
        for kind, make in (("deep", flat_trace), ("wide", wide_trace)):
            out[f"{kind}_render_ms"] = {}
            for n in (100, 250, 500, 1000):
                r = first_paint(browser, make(n), tmp / f"{kind}{n}.html")
                out[f"{kind}_render_ms"][int(r["shown"].split(" · ")[1].split()[0])] = r["render_ms"]
                print(kind, n, r["render_ms"], r["shown"], flush=True)
        browser.close()
    write_markdown(out)


KEEP = "<!-- written by hand or by benchmarks/explorer_time.py: kept when this script rewrites the page -->"


def _kept_sections(text: str) -> str:
    """The page from the KEEP marker on (the cell-to-explorer breakdown of issue 15), so a rewrite keeps it."""
    i = text.find(KEEP)
    return "" if i < 0 else "\n" + text[i:]


def _int_keys(d: dict) -> dict:
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


def write_markdown(m) -> None:
    (ROOT / "tests" / "artifacts").mkdir(exist_ok=True)
    (ROOT / "tests" / "artifacts" / "frontend_measurements.json").write_text(json.dumps(m, indent=1))
    g, c, deep, wide = m["gpt2_small"], m["chain_40k"], m["deep_render_ms"], m["wide_render_ms"]
    kb = lambda b: f"{b / 1024:,.0f} KiB"  # noqa: E731
    largest = max((n for n, ms in deep.items() if ms < 1000), default=0)
    largest_wide = max((n for n, ms in wide.items() if ms < 1000), default=0)
    lines = [
        "# Front-end measurements",
        "",
        f"Measured by `tests/browser/measure_frontend.py` on {platform.machine()}, {torch.get_num_threads()} torch "
        "threads, Debian chromium headless (no GPU), torch " + torch.__version__ + ".",
        "First paint = the entry's `render()` (collapse + dagre layout + SVG) until it returns, measured in the page;",
        "load-to-ready adds parsing the inlined bundle and payload and the first animation frame.",
        "",
        "| | GPT-2-small shape (12 blocks, d=768, seq 128, batch 2) | 40,000-node chain (10,000 Linear) |",
        "|---|---|---|",
        f"| autograd nodes / layers | {g['nodes']:,} / {g['layers']} | {c['nodes']:,} / {c['layers']:,} |",
        f"| summary payload (traitlet JSON) | {kb(g['summary_bytes'])} | {kb(c['summary_bytes'])} |",
        f"| time to build it: payload / trace.health() | {g['summary_s']:.2f} s / {g['health_s']:.2f} s | "
        f"{c['summary_s']:.2f} s / {c['health_s']:.2f} s (skipped: 10,001 layers) |",
        f"| one layer's detail ({g['detail_layer']} / {c['detail_layer']}) | meta {kb(g['detail_meta_bytes'])} + "
        f"buffers {kb(g['detail_buffer_bytes'])} ({g['detail_s']:.2f} s) | meta {kb(c['detail_meta_bytes'])} + "
        f"buffers {kb(c['detail_buffer_bytes'])} ({c['detail_s']:.3f} s) |",
        f"| standalone page (to_html) | {kb(g['html_bytes'])}, {g['export_s']:.1f} s to write | "
        f"{kb(c['html_bytes'])}, {c['export_s']:.1f} s |",
        f"| first paint (render) | {g['render_ms']:.0f} ms | {c['render_ms']:.0f} ms |",
        f"| load to ready | {g['load_to_ready_s']:.2f} s | {c['load_to_ready_s']:.2f} s |",
        f"| drawn at first paint | {g['shown']} | {c['shown']} |",
        f"| re-layout on one expand click | {g['expand_relayout_ms']:.0f} ms | {c['expand_relayout_ms']:.0f} ms |",
        "",
        "Largest graph that stays interactive: the view starts collapsed (at most 40 boxes, so that labels stay",
        "≥ 11 px at the default zoom; runs of ≥ 3 same-class siblings h.0 … h.11 fold into one box; a module with more",
        "than 50 children is split into chunk groups), so any trace opens; what limits interactivity is how many",
        "boxes are *drawn* at once, and dagre's cost grows with the graph's depth. Rendering N nodes outside any",
        "module (every one drawn; N includes each op's leaf and input nodes): deep = one chain, wide = parallel ops:",
        "",
        "| drawn nodes | " + " | ".join(f"{n:,}" for n in deep) + " |",
        "|---|" + "---|" * len(deep),
        "| deep: first paint (ms) | " + " | ".join(f"{ms:.0f}" for ms in deep.values()) + " |",
        "| wide: first paint (ms) | " + " | ".join(f"{ms:.0f}" for ms in wide.values()) + " |",
        "",
        f"Largest drawn graph laid out in under a second: **{largest:,} nodes deep, {largest_wide:,} wide**. Pan and",
        "zoom only move one SVG transform and stay smooth at every size measured. Expanding past 800 drawn boxes",
        "is refused with a status-line message (dagre needs seconds for a 1,000-deep chain, and under Node it",
        "overflowed the call stack on a 2,000-deep one), and a failed layout is reported there, never swallowed.",
        "Timings were taken on a shared 2-core machine while other test suites ran: treat them as upper bounds.",
        "",
        "The GPT-2-shaped trace opens with its 12 blocks folded into one box `h.0 … h.11 · Block × 12`",
        "(the other boxes: embeddings, final LayerNorm, head, loss ops); one click unfolds the 12 blocks, one more a",
        "block's 8 layers and ~32 ops. The default view does not shrink a tall graph to fit: it keeps the labels at",
        "12 px (zoom ≥ 0.93, checked in tests/browser/test_readability.py: median label height ≥ 11 px at 1100 and",
        "1500 px) and opens at the loss; `fit` shows everything. Selecting a layer (tree, graph, keyboard) unfolds",
        "the groups above it and pans (d3-zoom) to it.",
        "",
    ]
    doc = ROOT / "docs" / "frontend_measurements.md"
    kept = _kept_sections(doc.read_text()) if doc.exists() else ""
    doc.write_text("\n".join(lines) + kept)
    print((ROOT / "docs" / "frontend_measurements.md").read_text())


if __name__ == "__main__":
    if len(sys.argv) == 2:  # re-write the markdown from a saved JSON of measurements
        write_markdown(json.loads(pathlib.Path(sys.argv[1]).read_text(), object_hook=_int_keys))
    else:
        main()
