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
from helpers_zoo import check_exact, check_norms, check_nothing_silent, one_thread, params  # noqa: E402, F401  (one_thread: an autouse fixture)

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
    check_exact(result(key))


@pytest.mark.parametrize("key", _params("norms"))
def test_per_sample_norms_equal_autograd_loop(key):
    check_norms(result(key), zoo.B)


@pytest.mark.parametrize("key", _params("silent"))
def test_nothing_dropped_silently(key):
    check_nothing_silent(result(key))
