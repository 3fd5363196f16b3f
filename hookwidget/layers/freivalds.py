"""Whether factors add up to a gradient, checked along random directions (Freivalds) instead of rebuilt whole.

Σ_bt δ_bt x_btᵀ (an outer factor) or δ_bt added to row x_bt of a table (a one-hot factor, an embedding's) is
compared with a gradient W as uᵀ(Σ …)v against uᵀ W v for two random u and v: O(BT(o + i)) for the factors and one
pass over W, where rebuilding Σ … costs O(BT·o·i) and a full-size comparison (GPT-2's tied head is 38M floats).
A missing contribution (a weight also read outside its layers' calls) changes uᵀ W v but for a measure-zero set
of directions. δ and x are projected in their own dtype (a float32 product's rounding, ~1e-6 of the scale, is far
inside the 3e-5 tolerance) and everything after in float64. Used by analysis (a finished trace's factors against
the step's .grad), by capture="norms" (factors projected as they stream, before they are freed) and by the explorer's
detail of a large weight (views/payload/grads.py: the differences shown, not only a verdict).
"""

from __future__ import annotations

import functools

import torch

from hookwidget.layers.float64_sums import squared_norm

TOLERANCE = 3e-5  # of the magnitudes that enter the products


def projectable(f, shape: tuple, dtype: torch.dtype) -> bool:
    """Whether factor f of a gradient of this shape and dtype can be checked along directions."""
    if not (f.D.dim() == 3 and f._X is not None and f.D.dtype == dtype and len(shape) == 2
            and dtype in (torch.float32, torch.float64)):
        return False
    if f.kind == "outer":
        return f.X.dtype == dtype and tuple(shape) == (f.D.shape[-1], f.X.shape[-1])
    if f.kind == "onehot":
        return f.X.dim() == 2 and not f.X.is_floating_point() and tuple(shape) == (f.rows, f.D.shape[-1])
    return False


def directions(shape: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V): two float64 directions per side of a gradient of this shape, the same for the same shape (made once
    per shape and device: capture="norms" asks for them every step, for every parameter)."""
    return _directions(tuple(shape), torch.device(device))


@functools.lru_cache(maxsize=512)
def _directions(shape: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    U = torch.randn(shape[0], 2, generator=gen, device=device, dtype=torch.float64)
    V = torch.randn(shape[1], 2, generator=gen, device=device, dtype=torch.float64)
    return U, V


def of_factor(f, U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uᵀ(Σ f)v for the two directions, the sum of the magnitudes that entered it)."""
    if f.kind == "outer":  # rows of δ times rows of x
        du, xv = (f.D @ U.to(f.D.dtype)).double(), (f.X @ V.to(f.X.dtype)).double()  # (B, T, 2)
    else:  # one-hot: δ_bt added to row x_bt of the table
        du, xv = U[f.X], (f.D @ V.to(f.D.dtype)).double()
    return (du * xv).sum((0, 1)), (du.abs() * xv.abs()).sum((0, 1))


def of_grad(W: torch.Tensor, U: torch.Tensor, V: torch.Tensor,
            norm: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uᵀ W v for the two directions, a bound of the magnitudes that entered it: ‖u‖‖W‖_F‖v‖). `norm`: ‖W‖_F where
    the caller has it (else float64_sums' piecewise float64 sum: no full-size float64 copy)."""
    got = ((U.T.to(W.dtype) @ W).double() * V.T).sum(1)
    if norm is None:
        norm = squared_norm(W) ** 0.5
    return got, U.norm(dim=0) * V.norm(dim=0) * norm


def agree(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> bool:
    return bool(((got - ref).abs() <= allowed(scale)).all())


def adds_up(fs: list, W: torch.Tensor) -> bool:
    """Whether the factors fs add up to W along both directions (compare's numbers, decided)."""
    got, ref, tol = compare(fs, W)
    return bool(((got - ref).abs() <= tol).all())


def allowed(scale: torch.Tensor) -> torch.Tensor:
    """The largest |uᵀ(Σ …)v − uᵀ W v| that agrees, for products whose magnitudes summed to `scale`."""
    return TOLERANCE * scale + 1e-30


def compare(fs: list, W: torch.Tensor, norm: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uᵀ(Σ fs)v, uᵀ W v, the largest |difference| that agrees) for each direction: the numbers `agree` decides
    on, for a view that shows them (every f projectable onto W's shape and dtype; `norm` as of_grad's)."""
    U, V = directions(tuple(W.shape), W.device)
    got = scale = 0
    for f in fs:
        g, s = of_factor(f, U, V)
        got, scale = got + g, scale + s
    ref, bound = of_grad(W, U, V, norm)
    return got, ref, allowed(scale + bound)
