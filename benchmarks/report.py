"""The Markdown table of a benchmark run (results/<device>.md)."""

from __future__ import annotations

TARGETS = {"hookwidget summary": 1.1, "hookwidget full": 1.3, "hookwidget norms": 1.25}


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
                mark = "" if v not in TARGETS or m["ratio"][v] <= TARGETS[v] else " ✗"
                cells.append(f"{m['ratio'][v]:.2f}×{mark}" + (f" ({pr:.2f}×)" if pr is not None else "")
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
    lines.append("")
    lines.append("✗: misses its target (summary ≤ 1.1×, full ≤ 1.3×, norms ≤ 1.25×).")
    for k in table_models:
        for v, why in ms[k].get("notes", {}).items():
            lines.append(f"¹ {k} / {v}: {why}.")
        for v, why in ms[k]["skipped"].items():
            lines.append(f"² {k} / {v}: not measured: {why}")
    own = [f"{k} {ms[k]['own_us_per_module'].get('hookwidget full', float('nan')):.0f} µs"
           for k in table_models if ms[k].get("own_us_per_module")]
    if "hooks" in ms:
        h = ms["hooks"]
        per = ", ".join(f"{v.split()[1]} {u:.0f} µs" for v, u in h["own_us_per_module"].items())
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
