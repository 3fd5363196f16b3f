"""w.rows, w.n_rows and w.lod (watch/lod.py) against plain numpy reductions of the rows, on a live watch and a
loaded one; lod.Level (the in-RAM summary that merges bins pairwise) against the same reductions."""

import numpy as np
import pytest
import torch
from torch import nn

import hookwidget as hw
from hookwidget.capture.stat_rows import S
from hookwidget.watch import lod


def _run(steps=37, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = hw.watch(model, flight_recorder=False, batch=5, **kw)
    for _ in range(steps):
        model(torch.randn(6, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    w.close()
    return w


def _reference(stats, step_stats, steps, start, stop, size):
    """Bin by bin with plain loops: rows [start, stop) cut at multiples of size."""
    out = []
    j = start
    while j < stop:
        end = min(stop, (j // size + 1) * size)
        x, y = stats[j:end].astype(np.float64), step_stats[j:end].astype(np.float64)
        fin, sfin = np.isfinite(x), np.isfinite(y)
        with np.errstate(invalid="ignore", divide="ignore"):
            b = {"start": j, "first": steps[j], "last_step": steps[end - 1], "rows": end - j,
                 "min": np.where(fin.any(0), np.where(fin, x, np.inf).min(0), np.nan),
                 "max": np.where(fin.any(0), np.where(fin, x, -np.inf).max(0), np.nan),
                 "mean": np.where(fin.any(0), np.where(fin, x, 0).sum(0) / fin.sum(0), np.nan),
                 "last": x[-1], "count": fin.sum(0),
                 "step_min": np.where(sfin.any(0), np.where(sfin, y, np.inf).min(0), np.nan),
                 "step_mean": np.where(sfin.any(0), np.where(sfin, y, 0).sum(0) / sfin.sum(0), np.nan),
                 "nonfinite": np.array([any(x[r, li, S[c]] > 0 for r in range(len(x))
                                            for c in ("delta_nan", "delta_inf", "a_nonfinite", "grad_nan", "grad_inf"))
                                        or np.isinf(x[:, li]).any() for li in range(x.shape[1])]),
                 "step_nonfinite": not np.isfinite(y).all()}
        out.append(b)
        j = end
    return out


def _check(bins, ref):
    assert len(bins) == len(ref)
    for i, r in enumerate(ref):
        for k in ("start", "first", "last_step", "rows", "step_nonfinite"):
            assert getattr(bins, k)[i] == r[k], k
        np.testing.assert_array_equal(bins.nonfinite[i], r["nonfinite"])
        np.testing.assert_array_equal(bins.count[i], r["count"])
        for k in ("min", "max", "last", "step_min"):  # exact: float32 of the value itself
            np.testing.assert_array_equal(getattr(bins, k)[i], r[k].astype(np.float32), err_msg=k)
        for k in ("mean", "step_mean"):  # float32 means, merged weighed by their counts: float32 rounding
            np.testing.assert_allclose(getattr(bins, k)[i], r[k], rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=k)
        assert bins.min.dtype == bins.mean.dtype == np.float32


def test_rows_are_the_stats_by_range():
    w = _run()
    assert w.n_rows == len(w.steps) == 37
    steps, stats, step_stats = w.rows(5, 12)
    assert steps.tolist() == w.steps[5:12]
    assert torch.equal(stats, w.stats[5:12]) and torch.equal(step_stats, w.step_stats[5:12])
    steps, stats, _ = w.rows(-3)
    assert steps.tolist() == w.steps[-3:] and torch.equal(stats, w.stats[-3:])
    assert w.rows(30, 20)[1].shape == (0, 2, len(w.stat_names))
    with pytest.raises(TypeError, match="row indices"):
        w.rows(1.5)


@pytest.mark.parametrize("bins,start,stop", [(4, 0, None), (1, 0, None), (100, 0, None), (5, 3, 30), (3, 7, 8)])
def test_lod_is_numpy_reductions_of_the_rows(bins, start, stop):
    w = _run()
    stats, step_stats = w.stats.numpy().copy(), w.step_stats.numpy().copy()
    got = w.lod(bins, start, stop)
    stop = w.n_rows if stop is None else stop
    assert got.size & (got.size - 1) == 0 and len(got) <= bins
    assert got.size == 1 or (stop - 1) // (got.size // 2) - start // (got.size // 2) + 1 > bins  # the finest fitting
    _check(got, _reference(stats, step_stats, w.steps, start, stop, got.size))
    with pytest.raises(ValueError, match="bins"):
        w.lod(0)


def test_lod_flags_nonfinite_layers_and_steps():
    rng = np.random.default_rng(1)
    stats = rng.random((20, 3, len(S))).astype(np.float32)
    stats[:, :, [S[c] for c in ("delta_nan", "delta_inf", "a_nonfinite", "grad_nan", "grad_inf")]] = 0
    stats[:, 2, S["update_ratio"]] = np.nan  # not measured: no flag
    stats[6, 1, S["grad_nan"]] = 4
    stats[13, 0, S["a_rms"]] = np.inf
    step_stats = rng.random((20, 2))
    step_stats[17, 0] = np.nan
    b = lod.reduce(np.arange(20) * 3, stats, step_stats, 0, 4)
    assert b.nonfinite.tolist() == [[False] * 3, [False, True, False], [False] * 3, [True, False, False],
                                    [False] * 3]
    assert b.step_nonfinite.tolist() == [False, False, False, False, True]
    assert np.isnan(b.min[:, 2, S["update_ratio"]]).all() and (b.count[:, 2, S["update_ratio"]] == 0).all()
    assert b.max[3, 0, S["a_rms"]] == stats[12:16, 0, S["a_rms"]][np.isfinite(stats[12:16, 0, S["a_rms"]])].max()
    _check(b, _reference(stats, step_stats, np.arange(20) * 3, 0, 20, 4))


@pytest.mark.parametrize("chunks", [[1] * 70, [7, 1, 30, 2, 64, 3], [137]])
def test_level_merges_pairwise_to_a_fixed_number_of_bins(chunks):
    rng = np.random.default_rng(2)
    n = sum(chunks)
    stats = rng.standard_normal((n, 2, len(S))).astype(np.float32)
    stats[rng.random(stats.shape) < 0.05] = np.nan
    step_stats = rng.standard_normal((n, 2))
    steps = np.arange(n) * 2 + 1
    level, at = lod.Level(2, len(S), cap=8), 0
    for c in chunks:
        level.add(steps[at:at + c], stats[at:at + c], step_stats[at:at + c])
        at += c
        assert len(level.bins) < 8 and level.end == at
        assert level.done == len(level.bins) * level.size and level.open.rows.sum() < level.size
    assert n // level.size < 8 <= n // (level.size // 2)  # the finest size whose complete bins stay under the cap
    whole = lod.concat([level.bins, level.open], 2, len(S), level.size)
    _check(whole, _reference(stats, step_stats, steps, 0, n, level.size))
