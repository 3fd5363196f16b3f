"""Smoke test of the benchmark script (no timing assertion): it runs, writes its JSON and Markdown,
and hookwidget's per-sample norms agree with torch.func's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("psutil")


@pytest.mark.slow
def test_quick_benchmark_writes_results_and_norms_agree(tmp_path):
    variants = "plain,hookwidget summary,hookwidget full,hookwidget norms,torch.func norms"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--models", "mlp", "--variants", variants,
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "cpu.json").read_text())
    mlp = res["models"]["mlp"]
    assert set(mlp["ratio"]) == set(variants.split(",")), mlp["skipped"]
    assert mlp["max_rel_diff_vs_torch_func"]["hookwidget norms"] < 1e-4
    assert mlp["observation_bitwise"]["hookwidget full"] is True
    assert "| hookwidget norms |" in (tmp_path / "cpu.md").read_text()
