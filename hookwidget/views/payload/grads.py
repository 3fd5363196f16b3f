"""A layer's W.grad beside what its (a, δ) make of it, for the detail: the picture of Σ δ⊗a, and whether the
factors of every layer that reads the weight add up to the step's .grad.

Up to WHOLE_LIMIT floats the sum is rebuilt whole: its picture, its statistics and max |W.grad − Σ δ⊗a| taken
entry by entry cost a few milliseconds. Above it a click does not rebuild it. GPT-2's tied head is 50257 × 768:
rebuilding it is a 40-GFLOP product of the batch's 512 rows, and its statistics and the difference are more passes
over 38M floats, 0.5 s of a 0.8 s click on a 2-core CPU. Instead:

- the picture is made from the factors: a block mean of Σ_t δ_t a_tᵀ is Σ_t (block mean of δ_t)(block mean of
  a_t)ᵀ, exactly, over the same windows `downsample` pools the whole tensor with, so the cells are the same, computed
  from (B·T) × 200 numbers. Its whole-tensor statistics are not computed (the picture says so: `stats` is null);
- the factors are checked against .grad along random directions (layers/freivalds.py: uᵀ(Σ δ⊗a)v against
  uᵀ W.grad v), which costs one pass over .grad. The detail shows each direction's |uᵀ(W.grad − Σ δ⊗a)v| and the
  tolerance it is held to, not an entry-wise maximum it did not take.

Factors that cannot be checked along directions (a convolution's, a half-precision weight's) are rebuilt whole at
any size. A tied weight (GPT-2's head and token table) has one .grad for every layer that reads it: the picture is
this layer's share, the comparison is of every reader's factors summed, and where a reader's factors were not kept
the comparison is left out with a note naming it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hookwidget.layers import freivalds
from hookwidget.views.payload.numbers import _norm, _num, max_abs_diff
from hookwidget.views.payload.tensors import _Buffers, describe

WHOLE_LIMIT = 4_000_000  # floats of W: above this, no whole rebuild on a click where the factors allow it


def weight_grads(trace, name: str, w: torch.Tensor, autograd: torch.Tensor | None, out: _Buffers,
                 meta: dict) -> bool:
    """Adds the picture "grad_rebuilt" and meta["max_abs_diff"] (whole) or meta["grad_check"] (along directions),
    with notes for what was left out. Returns whether this layer's own factors were there."""
    readers = _readers(trace, name, w)
    try:
        own = _factors(trace, name)
    except ValueError as e:
        meta["notes"].append(_first_clause(e))
        return False
    every, missing = list(own), []
    for other in readers[1:]:
        try:
            every += _factors(trace, other)
        except ValueError as e:
            missing.append(f"{other} ({_first_clause(e)})")
    shape = tuple(w.shape)
    directions = w.numel() > WHOLE_LIMIT and all(freivalds.projectable(f, shape, w.dtype) for f in every)
    if directions:
        out.add_picture("grad_rebuilt", *factor_picture(own, shape, out.max_side))
    else:
        rebuilt = _summed(own)
        out.add("grad_rebuilt", rebuilt, "param")
    if len(readers) > 1:
        meta["notes"].append(f"{name}'s weight is also read by {', '.join(readers[1:])}: Σ δ⊗a is {name}'s share "
                             f"of W.grad, which is compared with every reader's Σ δ⊗a summed")
    if missing:
        meta["notes"].append(f"W.grad not compared with the factors: {'; '.join(missing)}")
    elif autograd is not None and tuple(autograd.shape) == shape:
        if directions:
            meta["grad_check"] = along_directions(every, autograd, readers)
        else:
            others = every[len(own):]
            meta["max_abs_diff"] = _num(max_abs_diff(autograd, rebuilt + _summed(others) if others else rebuilt))
    return True



def along_directions(fs: list, grad: torch.Tensor, readers: list[str]) -> dict:
    """For each random direction (u, v): uᵀ W.grad v, |uᵀ(W.grad − Σ δ⊗a)v| and the tolerance it is held to
    (freivalds.compare); whether every direction agrees."""
    got, ref, allowed = freivalds.compare(fs, grad, _norm(grad))  # the norm the view shows: no float64 copy
    diff = (got - ref).abs()
    return {"directions": int(diff.numel()), "values": [_num(float(v)) for v in ref],
            "differences": [_num(float(d)) for d in diff], "tolerances": [_num(float(a)) for a in allowed],
            "agree": bool((diff <= allowed).all()), "layers": list(readers)}



def factor_picture(fs: list, shape: tuple, max_side: int) -> tuple[np.ndarray, dict]:
    """The block means `downsample(Σ fs, "param")` shows, from the factors: Σ_t (P_r δ_t)(P_c a_t)ᵀ where P pools
    a side to at most max_side windows (an outer factor), or Σ_t P_r[:, i_t](P_c δ_t)ᵀ (a one-hot factor, δ_t added
    to row i_t). In float64; sent as float32, as every picture."""
    rows, cols = shape
    m_r, m_c = min(rows, max_side), min(cols, max_side)
    pic = torch.zeros(m_r, m_c, dtype=torch.float64)
    for f in fs:
        if f.kind == "outer":
            left, right = _pooled(f.D, m_r), _pooled(f.X, m_c)
        else:  # one-hot: token t adds δ_t to row X_t
            left, right = _pooling_columns(f.X.reshape(-1), rows, m_r), _pooled(f.D, m_c)
        pic += left.T @ right
    arr = np.ascontiguousarray(pic.numpy(), dtype="<f4")
    return arr, describe(arr, [m_r, m_c], list(shape), "matrix")



def _pooled(x: torch.Tensor, m: int) -> torch.Tensor:
    """(tokens, m) float64: each token's last dim averaged over the m adaptive windows (none when it fits)."""
    x = x.detach().reshape(-1, x.shape[-1])
    if x.shape[-1] > m:
        x = F.adaptive_avg_pool1d(x.unsqueeze(0), m)[0]
    return x.to("cpu", torch.float64)



def _pooling_columns(index: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """(tokens, m) float64: column index[t] of the matrix that averages n entries over m adaptive windows
    (torch's: window i spans [⌊i·n/m⌋, ⌈(i+1)·n/m⌉), windows may overlap by one)."""
    i = torch.arange(m)
    start, end = (i * n) // m, ((i + 1) * n + m - 1) // m
    r = index.detach().to("cpu").reshape(-1, 1)
    inside = (start <= r) & (r < end)
    return inside.to(torch.float64) / (end - start).to(torch.float64)



def _readers(trace, name: str, w: torch.Tensor) -> list[str]:
    """`name`, then every other traced layer whose weight is `w` (a tied weight)."""
    return [name] + [n for n, layer in trace.layers.items()
                     if n != name and getattr(layer.module, "weight", None) is w]



def _factors(trace, name: str) -> list:
    """The weight's factors of one layer, one per backward pass (ValueError: not kept, no rule)."""
    from hookwidget.analysis import per_sample as ps
    from hookwidget.layers import registry

    with registry.memo():
        return ps.param_factors(trace, name, "weight", None)



def _summed(fs: list) -> torch.Tensor:
    from hookwidget.layers import factors as fx

    return sum(fx.summed_grad(f) for f in fs)



def _first_clause(e: Exception) -> str:
    """The error's first line up to its parenthesised reasons (a trace's every note, for a factor not kept)."""
    text = str(e).strip().splitlines()
    return text[0].split(" (")[0][:300] if text else f"failed: {type(e).__name__}"
