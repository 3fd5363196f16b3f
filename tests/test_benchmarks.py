"""Smoke tests of the benchmark scripts (no timing assertion): they run and write their JSON and Markdown;
hookwidget's per-sample norms agree with torch.func's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HANG = 1800  # seconds: a guard against a hang, not a speed test (the suite passes on a loaded machine)



@pytest.mark.slow
def test_quick_benchmark_writes_results_and_norms_agree(tmp_path):
    pytest.importorskip("psutil")
    variants = "plain,hookwidget summary,hookwidget full,hookwidget norms,torch.func norms"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--models", "mlp", "--variants", variants,
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "cpu.json").read_text())
    mlp = res["models"]["mlp"]
    assert set(mlp["ratio"]) == set(variants.split(",")), mlp["skipped"]
    assert mlp["max_rel_diff_vs_torch_func"]["hookwidget norms"] < 1e-4
    assert mlp["observation_bitwise"]["hookwidget full"] is True
    assert "| hookwidget norms |" in (tmp_path / "cpu.md").read_text()


@pytest.mark.slow
def test_house_ab_times_both_versions_in_one_process(tmp_path):
    from benchmarks.house_ab import BEFORE

    if subprocess.run(["git", "cat-file", "-e", f"{BEFORE}^{{commit}}"], cwd=ROOT).returncode != 0:
        pytest.skip(f"commit {BEFORE[:9]} is not in this checkout (shallow clone)")
    r = subprocess.run([sys.executable, "-m", "benchmarks.house_ab", "--quick", "--rounds", "1", "--models", "mlp",
                        "--watch-models", "mlp", "--watch-steps", "5", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "house_ab.json").read_text())
    assert set(res["chain"]["cost"]) == {"summary", "full", "norms"}
    assert set(res["models"]["mlp"]["times_s"]) == {"plain"} | {f"{v} {c}" for v in ("before", "after")
                                                                  for c in ("summary", "full", "norms")}
    assert set(res["watch"]["mlp"]["cost"]) == {"watch", "watch+fr"}
    assert res["before"].startswith(BEFORE[:7])
    assert "| full |" in (tmp_path / "house_ab.md").read_text()


@pytest.mark.slow
def test_watch_overhead_times_every_monitor_and_none_leaves_a_hook(tmp_path):
    """The side-by-side benchmark in a tiny configuration: every variant whose package imports has its row (timed,
    or failing with its reason), peak memory and growth are measured, and no block left a hook on the model (the
    benchmark raises HooksLeft otherwise). No timing is asserted."""
    from benchmarks.watch_overhead import LABELS
    from benchmarks.watch_peers import PEERS, missing

    variants = ["plain", "floor", "watch", "watch+fr", "per_sample"] + [v for v in PEERS if missing(v) is None]
    r = subprocess.run([sys.executable, "-m", "benchmarks.watch_overhead", "--steps", "3", "--repeats", "1",
                        "--models", "mlp", "--variants", ",".join(variants), "--growth", "200", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HooksLeft" not in r.stderr
    res = json.loads((tmp_path / "watch_overhead.json").read_text())
    mlp = res["timing"]["models"]["mlp"]
    assert res["timing"]["variants"] == variants
    assert set(mlp["x_plain"]) | set(mlp["errors"]) == set(variants), mlp["errors"]
    assert {"plain", "floor", "watch", "watch+fr", "per_sample"} <= set(mlp["x_floor"])
    peaks = res["memory"]["models"]["mlp"]
    assert set(peaks["mib"]) | set(peaks["errors"]) == set(variants)
    assert all(m > 0 for m in peaks["mib"].values())
    assert set(res["growth"]) == {"watch", "watch+fr"}
    assert all(g["bytes_per_step"] > 0 for g in res["growth"].values())
    md = (tmp_path / "watch_overhead.md").read_text()
    for v in variants:
        assert md.count(f"| {LABELS[v]} |") >= 2, v  # a row in the time table and one in the memory table
    assert "bytes per step" in md and "Load average" in md


def test_watch_shares_times_both_per_sample_modes_side_by_side(tmp_path):
    """Issue 43's side-by-side in a tiny configuration: plain, per_sample="norms" and per_sample=True each timed
    (no hook left behind: the loop raises HooksLeft), the table written. No timing is asserted."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.watch_shares", "--models", "mlp", "--steps", "3",
                        "--repeats", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=HANG)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "watch_shares.json").read_text())
    assert set(res["models"]["mlp"]["x_plain"]) == {"plain", "per_sample_norms", "per_sample"}
    assert "shares' cost" in (tmp_path / "watch_shares.md").read_text()


@pytest.mark.slow
def test_watch_ranks_times_every_variant_and_the_watch_changes_no_loss(tmp_path):
    """The FSDP2 benchmark on 2 gloo ranks in a tiny configuration: every variant has its row, and every watched
    block's losses are bitwise plain's. No timing is asserted."""
    from benchmarks.watch_ranks import VARIANTS

    r = subprocess.run([sys.executable, "-m", "benchmarks.watch_ranks", "--steps", "3", "--repeats", "1", "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "watch_ranks.json").read_text())
    assert set(res["variants"]) == set(VARIANTS) and res["world"] == 2
    assert all(v["losses_bitwise"] and v["steps"] == 3 and v["wall_ms"] > 0 for v in res["variants"].values())
    assert "| global+fr |" in (tmp_path / "watch_ranks.md").read_text()


@pytest.mark.slow
def test_per_sample_zoo_writes_the_table_and_norms_are_exact(tmp_path):
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-m", "benchmarks.per_sample_zoo", "--models", "siamese,llama_like,gpt2",
                        "--repeats", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=HANG)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "per_sample_zoo.json").read_text())
    assert list(res["models"]) == ["siamese", "llama_like", "gpt2"]
    for r in res["models"].values():
        assert {"plain", "hookwidget"} <= set(r["ratio"]) and "torch.func" in r["ratio"], r["refused"]
        assert r["max_rel_diff"]["hookwidget"] <= 1e-5 and r["max_rel_diff"]["torch.func"] <= 1e-5
        assert r["peak_mb"]["plain"] > 0
    assert "Opacus ghost" in res["models"]["gpt2"]["refused"]  # tied weights: ghost clipping refuses them
    md = (tmp_path / "per_sample_zoo.md").read_text()
    assert "| hookwidget vs fastest peer |" in md
    assert "is never slower than every peer" in md


@pytest.mark.slow
def test_per_sample_zoo_runs_the_cases_at_another_batch(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.per_sample_zoo", "--batch", "5", "--models", "llama_like",
                        "--repeats", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=HANG)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "per_sample_zoo_b5.json").read_text())
    case = res["models"]["llama_like"]
    assert res["batch"] == case["B"] == 5
    assert case["max_rel_diff"]["hookwidget"] <= 1e-5  # against the autograd loop over the 5 samples
    assert "B = 5 per model" in (tmp_path / "per_sample_zoo_b5.md").read_text()


@pytest.mark.parametrize("name", ["gpt tied", "token MLP"])
def test_the_hand_written_floor_computes_the_same_norms_as_torch_func(name):
    """benchmarks/ghost_floor.py is the floor the speed table compares with: it must compute the same norms."""
    from benchmarks.ghost_floor import make_ghost_floor
    from benchmarks.per_sample_norms import build
    from benchmarks.variants import make_torch_func

    model, x, y, loss = build(name)
    floor, ref = make_ghost_floor(model, x, y, loss)(), make_torch_func(model, x, y, loss)()
    assert float(((floor - ref).abs() / ref).max()) < 1e-5


@pytest.mark.slow
def test_the_gpt2_notebook_benchmark_runs_and_writes_its_table(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpt2_notebook", "--tiny", "--rounds", "1", "--seq", "16",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / "gpt2_notebook.json").read_text())
    assert set(data["clicks"]) >= {"lm_head", "transformer.wte"} and data["median"]["save_light_mib"] > 0
    assert data["median"]["save_light_mib"] < data["median"]["save_mib"]
    assert "| the same step under hw.trace |" in (tmp_path / "gpt2_notebook.md").read_text()
