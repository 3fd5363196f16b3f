"""Charts of the committed benchmark results, for docs/performance.md: `python -m benchmarks.charts`.

Reads benchmarks/results/*.json (what `python -m benchmarks`, `benchmarks.watch_overhead` and `benchmarks.watch_gpu`
wrote; nothing is measured here) and writes one SVG per chart into docs/img/charts/. The tables in the results'
.md files give every figure; a chart shows at a glance where hookwidget sits between plain PyTorch, the
hand-written floor and its peers. Each chart carries its caption in the image (the machine, the command that
measured it, what was measured), so a chart copied elsewhere still says what it is, and the SHA-256 of the JSON it
was drawn from (`<desc>`), which tests/test_charts.py compares with the JSON now committed: a result re-measured
without its chart redrawn fails the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img" / "charts"

HOOKWIDGET, FLOOR, PEER, PLAIN = "#1b7f79", "#555555", "#c7a35a", "#bbbbbb"  # teal: hookwidget (the graph's teal)


@dataclass(frozen=True)
class Chart:
    """One chart: which results file, which figures of it, and the words around it."""

    name: str  # the SVG's file name, without .svg
    source: str  # the results file it is drawn from
    title: str
    command: str  # what measured it (benchmarks/README.md)
    measured: str  # what the bars are
    unit: str  # the x axis
    log: bool  # a log x axis (ratios spanning decades)


CHARTS = [
    Chart("trace_time_cpu", "cpu.json", "A traced step beside its peers, CPU", "python -m benchmarks --threads 1",
          "median time of one forward+backward step (≥ 10 interleaved repeats after warm-up), as a ratio to the "
          "plain step of the same model; per-sample norms agree with torch.func to ≤ 3.3e-7", "× plain (log)", True),
    Chart("trace_memory_cpu", "cpu.json", "Peak memory of a traced step, CPU", "python -m benchmarks --threads 1",
          "peak memory allocated during one step, as a ratio to the plain step's", "× plain peak (log)", True),
    Chart("trace_time_cuda", "cuda.json", "A traced step beside its peers, GPU", "python -m benchmarks --device cuda",
          "median time of one forward+backward step (≥ 10 interleaved repeats after warm-up), as a ratio to the "
          "plain step of the same model", "× plain (log)", True),
    Chart("watch_time_cpu", "watch_overhead.json", "hw.watch over a training loop beside its floor and peers, CPU",
          "python -m benchmarks.watch_overhead --steps 60 --repeats 3",
          "median CPU time of one Adam training step (this process and its children), each monitor set up and torn "
          "down per block, blocks interleaved over 3 rounds; the floor is hand-written hooks computing the same 12 "
          "statistics", "× plain (log)", True),
    Chart("watch_memory_cpu", "watch_overhead.json", "Peak memory of a watched training loop, CPU",
          "python -m benchmarks.watch_overhead --steps 60 --repeats 3",
          "resident high-water mark (VmHWM) of one process per monitor after its steps, as a ratio to plain's; the "
          "flight recorder's includes the anomalous steps it kept whole", "× plain peak (log)", True),
    Chart("watch_time_gpu", "watch_gpu.json", "hw.watch over a training loop, GPU", "bash benchmarks/gpu.sh "
          "(python -m benchmarks.watch_gpu)", "median wall time of one training step, 100 steps × 3 rounds; the "
          "floor is hand-written hooks computing the same statistics, NaN/Inf counted on the device",
          "× plain", False),
]

TRACE_LABELS = {"plain": "plain", "hookwidget summary": "hookwidget, summary", "hookwidget full": "hookwidget, full",
                "hookwidget norms": "hookwidget, per-sample norms", "torch.func norms": "torch.func norms",
                "Opacus norms": "Opacus norms", "BackPACK norms": "BackPACK norms",
                "TorchLens +grads": "TorchLens + grads"}
WATCH_LABELS = {"plain": "plain", "floor": "hand-written hooks (the floor)", "watch": "hw.watch, statistics only",
                "watch+fr": "hw.watch (default: flight recorder)", "per_sample": "hw.watch, per_sample=True",
                "wandb1": "wandb.watch, log_freq=1", "wandb100": "wandb.watch, log_freq=100",
                "torchlens": "TorchLens HistoryCollector", "torchlens_all": "TorchLens, all four streams",
                "cockpit": "Cockpit (economy)"}
TRACE_MODELS = {"mlp": "MLP (0.67M params)", "cnn": "CNN", "transformer": "transformer (1.6M)", "gpt2": "GPT-2 small"}
WATCH_MODELS = {"mlp": "MLP 784-512-512-10", "transformer": "small encoder d 128 × 2",
                "nn_encoder": "nn.TransformerEncoder d 256 × 4", "gpt2": "GPT-2 shape d 128 × 2"}
TICKS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def series(chart: Chart, data: dict) -> tuple[list[str], list[str], dict, str]:
    """(models, variants, {(model, variant): value or None}, machine) of a chart, from its results file."""
    if chart.source in ("cpu.json", "cuda.json"):
        models = [m for m in ("mlp", "cnn", "transformer", "gpt2") if m in data["models"]]
        key = "ratio" if chart.name.startswith("trace_time") else "peak_ratio"
        variants = [v for v in TRACE_LABELS if any(v in data["models"][m].get(key, {}) for m in models)]
        values = {(m, v): data["models"][m].get(key, {}).get(v) for m in models for v in variants}
        machine = f"{data['device']}, torch {data['torch']}, {data['threads']} thread(s)"
        return models, variants, values, machine
    if chart.source == "watch_overhead.json":
        part = data["timing"] if chart.name == "watch_time_cpu" else data["memory"]
        models = list(part["models"])
        variants = [v for v in WATCH_LABELS if v in part["variants"]]
        values = {}
        for m in models:
            row = part["models"][m]
            for v in variants:
                if chart.name == "watch_time_cpu":
                    values[m, v] = row["x_plain"].get(v)
                else:
                    mib = row["mib"].get(v)
                    values[m, v] = None if mib is None or v in row.get("errors", {}) else mib / row["mib"]["plain"]
        t = data["timing"]
        return models, variants, values, f"{t['device']}, torch {t['torch']}, 1 thread"
    if chart.source == "watch_gpu.json":
        models = list(data["rows"])
        variants = [v for v in WATCH_LABELS if any(v in data["rows"][m] for m in models)]
        values = {(m, v): data["rows"][m].get(v, {}).get("x_plain") for m in models for v in variants}
        return models, variants, values, f"{data['device']}, torch {data['torch']}"
    raise ValueError(f"no reader for {chart.source}")


def colour(variant: str) -> str:
    if variant == "plain":
        return PLAIN
    if variant == "floor":
        return FLOOR
    return HOOKWIDGET if variant.startswith(("hookwidget", "watch", "per_sample")) else PEER


def draw(chart: Chart, out_dir: Path = OUT) -> Path:
    """Write out_dir/<name>.svg; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    plt.rcParams.update({"svg.hashsalt": "hookwidget-charts", "svg.fonttype": "none", "font.size": 9})
    source = RESULTS / chart.source
    data = json.loads(source.read_text())
    models, variants, values, machine = series(chart, data)
    trace = chart.source in ("cpu.json", "cuda.json")
    labels, model_labels = (TRACE_LABELS, TRACE_MODELS) if trace else (WATCH_LABELS, WATCH_MODELS)
    caption = (f"Machine: {machine}. Command: {chart.command}. Measured: {chart.measured}."
               f"{' Dashed line: the floor.' if any(v == 'floor' for v in variants) else ''}"
               f" Source: benchmarks/results/{chart.source}.")
    width_in = 2.6 * len(models) + 1.8
    lines = textwrap.wrap(caption, int(width_in * 17))
    height_in = 0.3 * len(variants) + 1.6 + 0.13 * len(lines)
    fig, axes = plt.subplots(1, len(models), figsize=(width_in, height_in), sharey=True, squeeze=False)
    ys = list(range(len(variants)))[::-1]
    for ax, m in zip(axes[0], models):
        floor = values.get((m, "floor"))
        for y, v in zip(ys, variants):
            value = values.get((m, v))
            if value is None:
                ax.text(1.0, y, " not run / fails", va="center", fontsize=7, color="#999999")
                continue
            ax.barh(y, value, color=colour(v), height=0.7)
            ax.text(value, y, f" {value:.2f}×", va="center", fontsize=7)
        ax.axvline(1.0, color="#888888", lw=0.8)
        if floor is not None:
            ax.axvline(floor, color=FLOOR, lw=0.8, ls="--")
        finite = [values[m, v] for v in variants if values.get((m, v)) is not None]
        low, high = (min(0.5, min(finite) * 0.8) if chart.log else 0), max(finite) * (3 if chart.log else 1.35)
        if chart.log:  # a few round ticks: matplotlib's minor labels collide on a short log axis
            ax.set_xscale("log")
            ticks = TICKS if high / low < 30 else [t for t in TICKS if f"{t:g}"[0] == "1"]
            ax.xaxis.set_major_locator(FixedLocator([t for t in ticks if low <= t <= high]))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(low, high)
        ax.set_title(model_labels.get(m, m), fontsize=9)
        ax.set_xlabel(chart.unit, fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].set_yticks(ys, [labels.get(v, v) for v in variants])
    fig.suptitle(chart.title, fontsize=11, x=0.01, ha="left")
    fig.text(0.01, 0.08 / height_in, "\n".join(lines), fontsize=7, va="bottom", ha="left", color="#333333")
    fig.tight_layout(rect=(0, (0.2 + 0.13 * len(lines)) / height_in, 1, 1 - 0.3 / height_in))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{chart.name}.svg"
    fig.savefig(path, format="svg", metadata={"Date": None, "Description": f"sha256 {digest(source)} "
                                              f"of benchmarks/results/{chart.source}; {caption}"})
    plt.close(fig)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the SVGs (default docs/img/charts)")
    args = parser.parse_args(argv)
    for chart in CHARTS:
        if (RESULTS / chart.source).exists():
            print(draw(chart, args.out).relative_to(ROOT) if args.out == OUT else draw(chart, args.out))


if __name__ == "__main__":
    main()
