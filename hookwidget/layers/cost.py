"""The one place that chooses, per factor and call, how an exact per-sample norm is computed: the ghost (Gram)
form or the materialised per-sample gradient, from the shapes alone.

Per sample (the batch B cancels), in multiply-adds, with M what writing and reading back one float costs:
    ghost         T²·(d_in + d_out + M)   two Gram products (T×T each) and their elementwise product
    materialised  d_in·d_out·(T + M)      the (d_out, d_in) gradient, then its square and sum
An embedding (kind "onehot", d_in = its rows) has no input Gram product, only "same token": T²·(1 + d_out + M)
against a scatter into rows × d_out zeros, T·d_out + rows·d_out·M. A parameter shared by several layers
(a tied LM head) adds, per pair of contributions, a cross term of the ghost's cost over T_i·T_j.
M was measured on the project's 2-core CPU by `python -m benchmarks.per_sample_norms --costs` (the fit
and the agreement of the choice with the faster measured method are in benchmarks/results/per_sample_norms.md).
"""

from __future__ import annotations

import math

MEMORY = 32.0  # multiply-adds that moving one float costs (the --costs fit: 24 to 64 choose alike)


def dims(f) -> tuple[int, int, int] | None:
    """(T, d_in, d_out) of a factor with a ghost form (outer, onehot), else None."""
    if f.kind not in ("outer", "onehot") or len(f.D.shape) != 3:
        return None
    T, d_out = f.D.shape[1], f.D.shape[2]
    d_in = f.rows if f.kind == "onehot" else math.prod(f.shape) // max(d_out, 1)
    return T, d_in, d_out


def ghost_cost(kind: str, T: int, d_in: int, d_out: int, T2: int | None = None) -> float:
    """The ghost form's cost per sample; with T2, the cross term of two contributions (T and T2 tokens)."""
    pairs = T * (T if T2 is None else T2)
    return pairs * ((1 if kind == "onehot" else d_in) + d_out + MEMORY)


def grad_cost(kind: str, T: int, d_in: int, d_out: int) -> float:
    """The materialised per-sample gradient's cost per sample, with its squared norm."""
    if kind == "onehot":
        return T * d_out + d_in * d_out * MEMORY
    return d_in * d_out * (T + MEMORY)


def method(f) -> str:
    """'ghost' or 'grad': the cheaper exact per-sample norm of one factor."""
    d = dims(f)
    if d is None:
        return "grad"
    return "ghost" if ghost_cost(f.kind, *d) < grad_cost(f.kind, *d) else "grad"


def shared_method(fs: list) -> str:
    """'ghost' (each contribution's ghost norm plus their cross terms) or 'grad' (the summed per-sample
    gradient) for one parameter that several layers or calls contribute to."""
    if not ghost_form(fs):
        return "grad"
    ds = [dims(f) for f in fs]
    ghost = sum(ghost_cost(f.kind, *d) for f, d in zip(fs, ds))
    ghost += sum(_cross_cost(fs[i], ds[i], fs[j], ds[j]) for i in range(len(fs)) for j in range(i))
    size = math.prod(fs[0].shape)
    grad = size * (sum(d[0] for f, d in zip(fs, ds) if f.kind == "outer") + MEMORY)
    grad += sum(d[0] * d[2] for f, d in zip(fs, ds) if f.kind == "onehot")
    return "ghost" if ghost < grad else "grad"


def ghost_form(fs: list) -> bool:
    """Whether every contribution has a ghost form with its input at hand (a convolution's would be unfolded)."""
    return all(dims(f) is not None and f.conv is None for f in fs)


def _cross_cost(f, d, g, e) -> float:
    """⟨G_f, G_g⟩ per sample: a T_f × T_g product over the features the two share, and a few passes over it."""
    pairs = d[0] * e[0]
    if f.kind == "outer" and g.kind == "outer":
        return pairs * (d[1] + d[2] + MEMORY)
    width = d[2] if f.kind == "onehot" else e[2]  # the embedding's row width (the head's d_in)
    return pairs * (width + 1 + MEMORY)
