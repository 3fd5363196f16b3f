"""The Markdown table of a benchmark run (results/<device>.md)."""

from __future__ import annotations

# Issue 15's targets, as ratios to plain forward+backward: time by (device, variant), the MLP's own where
# it has one; peak memory by variant; hookwidget's own µs per hooked module on the Linear chain (CPU).
TIME_TARGETS = {
    "cpu": {"hookwidget summary": {"mlp": 1.1, "*": 1.05}, "hookwidget full": {"mlp": 1.15, "*": 1.05},
            "hookwidget norms": {"*": 1.25}},
    "cuda": {"hookwidget summary": {"*": 1.05}, "hookwidget full": {"*": 1.1}, "hookwidget norms": {"*": 1.3}},
}
PEAK_TARGETS = {"hookwidget summary": 1.05, "hookwidget full": 1.5}
US_PER_MODULE_TARGETS = {"hookwidget full": 40, "hookwidget summary": 50}
FASTER_THAN = ("torch.func norms", "Opacus norms")  # norms at least 1.4× faster than these on:
FASTER_ON, FASTER_BY = ("transformer", "gpt2"), 1.4


def time_target(device: str, variant: str, model: str) -> float | None:
    by_model = TIME_TARGETS["cuda" if device.startswith("CUDA") else "cpu"].get(variant, {})
    return by_model.get(model, by_model.get("*"))


def _mark(value: float, target: float | None) -> str:
    return "" if target is None else (" ✓" if value <= target else " ✗")


def markdown(results: dict) -> str:
    ms = results["models"]
    table_models = [k for k in ms if k != "hooks"]
    variants = list(dict.fromkeys(v for k in table_models for v in [*ms[k]["ratio"], *ms[k]["skipped"]]))
    lines = [f"**{results['device']}**, torch {results['torch']}, {results['threads']} threads; median of "
             f"≥{results['repeats']} interleaved repeats after warm-up"
             + (" (GPT-2 on CPU: fewer)" if results["device"].startswith("CPU") else "")
             + (" — QUICK SMOKE RUN, not a measurement" if results.get("quick") else "") + ".",
             "Time as a ratio to plain forward+backward of the same model; peak memory of a step as a ratio to "
             "plain's in brackets.", "",
             "| variant | " + " | ".join(_model_title(k, ms[k]) for k in table_models) + " |",
             "|---|" + "---|" * len(table_models)]
    for v in variants:
        cells = []
        for k in table_models:
            m = ms[k]
            if v in m["ratio"]:
                pr = m.get("peak_ratio", {}).get(v)
                mark = _mark(m["ratio"][v], time_target(results["device"], v, k))
                cells.append(f"{m['ratio'][v]:.2f}×{mark}"
                             + (f" ({pr:.2f}×{_mark(pr, PEAK_TARGETS.get(v))})" if pr is not None else "")
                             + ("¹" if v in m.get("notes", {}) else ""))
            else:
                cells.append("n/a²" if v in m["skipped"] else "–")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines.append("| *plain: time, peak* | " + " | ".join(
        f"{ms[k]['median_s']['plain'] * 1e3:.1f} ms, {ms[k].get('peak_mb', {}).get('plain', float('nan')):.0f} MB"
        for k in table_models) + " |")
    lines.append("| *norms: max rel. diff to torch.func* | " + " | ".join(
        ", ".join(f"{v.split()[0]} {d:.1e}" for v, d in ms[k]["max_rel_diff_vs_torch_func"].items()) or "–"
        for k in table_models) + " |")
    lines.append("| *capture bitwise neutral (.grad)* | " + " | ".join(_bitwise(ms[k]) for k in table_models) + " |")
    lines.append(_faster_row(results))
    lines.append("")
    lines.append("✓ / ✗: meets / misses issue 15's target: " + (
        "summaries ≤ 1.05×, full capture ≤ 1.1×, norms ≤ 1.3×" if results["device"].startswith("CUDA") else
        "summaries ≤ 1.1× on the MLP and ≤ 1.05× elsewhere, full capture ≤ 1.15× on the MLP and ≤ 1.05× "
        "elsewhere, norms ≤ 1.25×") + f"; peak memory (in brackets) ≤ {PEAK_TARGETS['hookwidget full']}× for full "
        f"capture and ≤ {PEAK_TARGETS['hookwidget summary']}× for summaries; hookwidget's norms ≥ {FASTER_BY}× "
        f"faster than {' and '.join(v.split()[0] for v in FASTER_THAN)} on the {' and '.join(FASTER_ON)} models.")
    for k in table_models:
        for v, why in ms[k].get("notes", {}).items():
            lines.append(f"¹ {k} / {v}: {why}.")
        for v, why in ms[k]["skipped"].items():
            lines.append(f"² {k} / {v}: not measured: {why}")
    own = [f"{k} {ms[k]['own_us_per_module'].get('hookwidget full', float('nan')):.0f} µs"
           for k in table_models if ms[k].get("own_us_per_module")]
    if "hooks" in ms:
        h = ms["hooks"]
        per = ", ".join(f"{v.split()[1]} {u:.0f} µs"
                        + (f" ({_mark(u, US_PER_MODULE_TARGETS[v]).strip()} ≤ {US_PER_MODULE_TARGETS[v]} µs)"
                           if v in US_PER_MODULE_TARGETS and not results["device"].startswith("CUDA") else "")
                        for v, u in h["own_us_per_module"].items())
        lines.append(f"\nhookwidget's own cost per hooked module per step, on a chain of {h['modules'] - 1} "
                     f"Linear(16, 16) (arithmetic negligible, plain {h['median_s']['plain'] * 1e3:.2f} ms): {per}. "
                     "On the models above ((time − plain) / modules, full capture): " + ", ".join(own) + ".")
    g = results["graph_build_s"]
    lines.append(f"\nGraph build (iterative walk + networkx DiGraph): {g['transformer_nodes']}-node 12-block "
                 f"GPT-2-shaped graph {g['transformer'] * 1e3:.0f} ms; {g['chain_nodes']}-node chain "
                 f"{g['chain'] * 1e3:.0f} ms (best of 5).")
    if results.get("load_average"):
        lines.append(f"\nLoad average at start / end: {results['load_average']} / {results.get('load_average_end')}.")
    return "\n".join(lines) + "\n"


def _model_title(k: str, m: dict) -> str:
    return f"{k} ({m['params'] / 1e6:.2g}M params)"


def _bitwise(m: dict) -> str:
    b = m.get("observation_bitwise")
    if not b:
        return "–"
    if not b.get("baseline_reproducible"):
        return "plain not reproducible"
    return "yes" if all(v for k, v in b.items() if k != "baseline_reproducible") else \
        "NO: " + ", ".join(k for k, v in b.items() if v is False)


def _faster_row(results: dict) -> str:
    """How many times faster hookwidget's norms are than each peer's, on the models that have that target."""
    ms = results["models"]
    cells = []
    for k in [k for k in ms if k != "hooks"]:
        r = ms[k]["ratio"]
        own = r.get("hookwidget norms")
        parts = [f"{v.split()[0]} {r[v] / own:.2f}×" + (_mark(FASTER_BY, r[v] / own) if k in FASTER_ON else "")
                 for v in FASTER_THAN if own and v in r]
        cells.append(", ".join(parts) or "–")
    return "| *hookwidget norms: times faster than* | " + " | ".join(cells) + " |"
