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
