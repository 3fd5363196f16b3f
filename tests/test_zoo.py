"""Issue 14, coverage and exactness: a zoo of small architectures (tests/zoo.py) traced for one training step.

Per model: weight_grad / bias_grad of every factor layer equal autograd's .grad (tied weights: summed over
the layers sharing them); per-sample gradient norms equal a per-sample loop of autograd over the same
parameters; every parameter left out of per-sample norms is named by a note. Coverage figures are not
asserted (benchmarks/zoo_coverage.py writes them to benchmarks/results/zoo_coverage.md). The transformers
models are skipped where transformers is not installed.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # zoo, whether or not tests/ is a package
import zoo  # noqa: E402
from helpers_zoo import one_thread, params  # noqa: E402, F401  (one_thread: an autouse fixture)

# Known hookwidget failures, as strict xfails: each turns into an XPASS (a failure) once fixed.
KNOWN: dict = {}


def _params(kind: str) -> list:
    return params(zoo.BUILDERS, KNOWN, kind)


@functools.cache
def _measured(key: str) -> dict:
    return zoo.measure(key)


def result(key: str) -> dict:
    if zoo.BUILDERS[key] in zoo.TRANSFORMERS:
        pytest.importorskip("transformers")
    return _measured(key)


def test_zoo_has_twenty_architectures():
    assert len(zoo.BUILDERS) >= 20
    assert len(zoo.TORCH) >= 10 and len(zoo.TRANSFORMERS) >= 10


@pytest.mark.parametrize("key", _params("exact"))
def test_weight_grad_equals_autograd(key):
    r = result(key)
    assert r["compared_params"] > 0, f"{r['name']}: no factor layer"
    assert not r["exact_failures"], f"{r['name']}: weight_grad/bias_grad differ from .grad: " + "; ".join(
        f"{n} {p} {why}" for n, p, why in r["exact_failures"])


@pytest.mark.parametrize("key", _params("norms"))
def test_per_sample_norms_equal_autograd_loop(key):
    r = result(key)
    assert r["loss_split_ok"], f"{r['name']}: the batch loss is not the sum of per-sample losses (reference invalid)"
    assert "norms_error" not in r, f"{r['name']}: per_sample_grad_norms() raised {r.get('norms_error')}"
    assert r["norms_rel_err"] <= 1e-4, (f"{r['name']}: per-sample norms {r['hw_norms'].tolist()} vs autograd "
                                        f"{r['ref_norms'].tolist()} (max rel err {r['norms_rel_err']:.3g})")


@pytest.mark.parametrize("key", _params("silent"))
def test_nothing_dropped_silently(key):
    r = result(key)
    silent = [f"{x['param']} ({x['type']})" for x in r["left_out"] if x["reason"] is None]
    assert not silent, f"{r['name']}: left out of per-sample norms with no note naming their layer: {silent}"
    assert 0 < r["coverage"] <= 1
