"""What the zoo's test modules share: their parameters with known failures as strict xfails, one torch thread."""

from __future__ import annotations

import pytest
import torch


def params(builders, known: dict, kind: str) -> list:
    """A pytest.param per zoo key; a strict xfail where (key, kind) is a known failure (an XPASS fails once fixed)."""
    out = []
    for key in builders:
        marks = [pytest.mark.xfail(strict=True, reason=known[key, kind])] if (key, kind) in known else []
        out.append(pytest.param(key, marks=marks, id=key))
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small models: one thread is several times faster than two on a shared machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the checks of one zoo measurement (tests/zoo.py's `measure`) ---------------------------------------
def check_exact(r: dict) -> None:
    """weight_grad / bias_grad of every factor layer equal autograd's .grad."""
    assert r["compared_params"] > 0, f"{r['name']}: no factor layer"
    assert not r["exact_failures"], f"{r['name']}: weight_grad/bias_grad differ from .grad: " + "; ".join(
        f"{n} {p} {why}" for n, p, why in r["exact_failures"])


def check_norms(r: dict, batch: int) -> None:
    """Per-sample norms equal the per-sample autograd loop's, to 1e-4 relative."""
    assert r["loss_split_ok"], f"{r['name']}: the batch loss is not the sum of per-sample losses (reference invalid)"
    assert "norms_error" not in r, f"{r['name']}: per_sample_grad_norms() raised {r.get('norms_error')}"
    assert r["hw_norms"] is not None and r["hw_norms"].shape == r["ref_norms"].shape, (
        f"{r['name']}: per_sample_grad_norms() has shape {tuple(r['hw_norms'].shape)} for a batch of {batch}")
    assert r["norms_rel_err"] <= 1e-4, (f"{r['name']}: per-sample norms {r['hw_norms'].tolist()} vs autograd "
                                        f"{r['ref_norms'].tolist()} (max rel err {r['norms_rel_err']:.3g})")


def check_nothing_silent(r: dict) -> None:
    """Every parameter left out of per-sample norms is named by a note."""
    silent = [f"{x['param']} ({x['type']})" for x in r["left_out"] if x["reason"] is None]
    assert not silent, f"{r['name']}: left out of per-sample norms with no note naming their layer: {silent}"
    assert 0 < r["coverage"] <= 1
