"""Coverage and exactness of hookwidget's factor rules on real torchvision and timm models (issue 14).

    .venv/bin/python -m benchmarks.zoo_real_coverage     (or: .venv/bin/python benchmarks/zoo_real_coverage.py)

Runs every model of tests/zoo_real.py (the libraries' own classes, built small, random weights) through
tests/zoo.py's measurement, prints the table and writes it to benchmarks/results/zoo_real_coverage.md, in
the format of benchmarks/results/zoo_coverage.md (whose functions it uses). Exits with a one-line message
where torchvision or timm does not import (scripts/install.sh installs them).
"""

from __future__ import annotations

import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import zoo_real  # noqa: E402

from benchmarks.zoo_coverage import TARGET, _fmt_n, table  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "zoo_real_coverage.md"


def report(results: list, seconds: float) -> str:
    import timm
    import torchvision

    n_exact = sum(not r["exact_failures"] for r in results)
    n_norms = sum(r["norms_rel_err"] <= 1e-4 for r in results)
    n_cov = sum(r["coverage"] >= TARGET for r in results)
    silent = [(r["name"], x["param"]) for r in results for x in r["left_out"] if x["reason"] is None]
    by_type = defaultdict(lambda: [0, set(), set()])  # type -> elements, models, reasons
    for r in results:
        for x in r["left_out"]:
            e = by_type[x["type"]]
            e[0] += x["numel"]
            e[1].add(r["key"])
            e[2].add(x["reason"] or "NO NOTE (silent)")
    out = [
        "# Zoo coverage: real torchvision and timm models (issue 14)",
        "",
        f"`python -m benchmarks.zoo_real_coverage`: {len(results)} models built from torchvision's and timm's own "
        f"classes (tests/zoo_real.py: reduced depth and width, random weights, nothing downloaded), one training "
        f"step each with a sum-reduced cross-entropy, batch {zoo_real.B}, eval mode (models with BatchNorm also "
        f"traced in train mode for exactness), measured as tests/zoo.py measures its zoo. torch {torch.__version__}, "
        f"torchvision {torchvision.__version__}, timm {timm.__version__}, {platform.machine()}, {seconds:.1f} s.",
        "",
        "- **coverage**: share of gradient elements (parameters with a `.grad`) that `per_sample_grad_norms()` "
        f"covers; ✗ below the issue's {TARGET:.0%} target.",
        "- **exact**: `weight_grad` / `bias_grad` of every layer in `t.factor_layers` equal autograd's `.grad` "
        "(rtol 1e-4; tied weights summed over the layers that share them); ✗ names the parameter.",
        "- **norms rel. err**: `per_sample_grad_norms()` against a per-sample loop of autograd (each sample run "
        "alone) over the same parameters; ✓ at most 1e-4.",
        "- **left out**: parameters outside per-sample norms, by module type, with the reason from the note of "
        "`t.notes` that names the layer (NO NOTE: dropped silently).",
        "",
        table(results),
        "",
        f"Exact: {n_exact}/{len(results)}; norms agree: {n_norms}/{len(results)}; coverage ≥ {TARGET:.0%}: "
        f"{n_cov}/{len(results)}; parameters left out without a note: {len(silent)}"
        + (" (" + ", ".join(f"{m}: {p}" for m, p in silent) + ")" if silent else "") + ".",
        "",
        "## What keeps coverage down, by module type",
        "",
        "| module type | elements left out | models | why (the note) |",
        "|---|---|---|---|",
    ]
    for t, (n, models, why) in sorted(by_type.items(), key=lambda kv: -kv[1][0]):
        out.append(f"| {t} | {_fmt_n(n)} | {', '.join(sorted(models))} | {'; '.join(sorted(why))} |")
    out += [
        "",
        "MobileViT folds patches into rows (its transformer sees batch × patch area rows): rows folded by a view, "
        "and the outputs of layers that keep rows (LayerNorm, Linear, nn activations), are unfolded exactly; rows "
        "after a functional operation are not taken for samples and are left out with a note. "
        "Known failure (a strict xfail in tests/test_zoo_real.py): **efficientformer_l1**, a "
        "torch bug, not hookwidget's: BatchNorm2d's eval-mode backward on CPU is wrong for a batch of one whose "
        "grad_output is channels-last with batch stride C (Flat's transpose makes one), so the samples-run-alone "
        "reference is wrong there; against per-sample gradients from the batch's own graph "
        "(test_per_sample_norms_equal_batched_autograd) hookwidget's norms agree to 1e-7. efficientformer runs "
        "in float64: its conv biases before BatchNorm have an analytically zero gradient in train mode, and the "
        "float32 rounding in `.grad` there is above tests/zoo.py's exactness tolerance. torchvision's ResNet "
        "fixes its widths at 64..512, hence its 4.9M parameters (one BasicBlock per stage).",
    ]
    return "\n".join(out) + "\n"


def main() -> None:
    missing = zoo_real.available()
    if missing:
        sys.exit(f"zoo_real_coverage: torchvision/timm not importable: {missing}")
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    def progress(r):
        exact = "yes" if not r["exact_failures"] else "NO"
        print(f"{r['name']:<52} coverage {100 * r['coverage']:5.1f}%  exact {exact}  norms rel.err "
              f"{r['norms_rel_err']:.1e}  ({r['seconds']:.2f} s)", flush=True)

    results = zoo_real.measure_all(progress=progress)
    text = report(results, time.perf_counter() - t0)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print()
    print(text)
    print(f"written: {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
