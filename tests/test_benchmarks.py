"""Smoke test of the benchmark script: it runs, writes its tables, and its norms agree with torch.func.
Timing figures are not asserted here; they live in benchmarks/results/."""

import json
import subprocess
import sys


def test_quick_benchmark_writes_results_and_norms_agree(tmp_path):
    subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--models", "mlp",
                    "--variants", "plain,hookwidget full,hookwidget norms,torch.func norms", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=300)
    res = json.loads((tmp_path / "cpu.json").read_text())
    mlp = res["models"]["mlp"]
    assert set(mlp["ratio"]) == {"plain", "hookwidget full", "hookwidget norms", "torch.func norms"}
    assert mlp["max_rel_diff_vs_torch_func"]["hookwidget norms"] < 1e-4
    assert res["graph_build_s"]["chain_nodes"] >= 40_000
    assert "| hookwidget norms |" in (tmp_path / "cpu.md").read_text()
