"""Fast rules of the generic one for a module's own small parameters: each replaced, for one rerun of the forward on
the whole batch, by per-sample copies whose gradients are the per-sample rows (one backward of the batch instead of
vmap of the module's vjp). A model's own (1, ...) parameters (ViT's class token and position embedding:
broadcast_params) and a scale or shift of the output along one axis (an RMSNorm class of another package, a layer
scale: vector_params). Checked as every fast rule is (analysis/generic.py): the rows add up to the step's gradient,
and one sample's rows equal its own vjp; where they do not, the vmap rule answers.
"""

from __future__ import annotations

import functools
import warnings

import torch

from hookwidget._torch.modules import own_parameters
from hookwidget.layers import generic
from hookwidget.layers.affine import SplitAffine
from hookwidget.layers.base import Factor


def _leading_one(p) -> bool:
    return p.dim() >= 2 and p.shape[0] == 1


def has_broadcast_params(module) -> bool:
    """Whether the module holds parameters of its own shaped (1, ...) (a class token, a position embedding)."""
    return any(p is not None and p.requires_grad and _leading_one(p) for p in own_parameters(module).values())


def broadcast_params(module, call, names: list, B: int) -> tuple:
    """A model's own (1, ...) parameters concatenated with or added to the batch (ViT's class token and position
    embedding): each replaced, for one rerun of the forward on the whole batch, by B copies of itself (B, ...),
    the batch dimension its (1, ...) was broadcast along. Where the forward uses them only so, it computes the
    same outputs and the gradient of copy b is sample b's: one backward of the batch instead of vmap of the
    module's vjp over it (not a per-sample rerun). analysis/per_sample.py checks the rows as the vmap rule's and,
    once per module and code path (key: shapes), one sample's rows against its own vjp: a forward that indexes or
    reduces the parameter over its first dimension (p[0], p.sum(0)) gives other rows, or other outputs: refused.
    Raises NotApplicable where a parameter is not (1, ...), the outputs differ in shape, or the forward draws
    random numbers."""
    if not names or any("." in n for n in names):
        raise generic.NotApplicable("parameters of submodules")
    params = {n: call.params[n] for n in names}
    if not all(_leading_one(p) for p in params.values()) or B < 2:
        raise generic.NotApplicable("not (1, ...) parameters")
    joined = call.join_rows or {}
    if all(n in joined and joined[n].shape[0] == B for n in names):  # capture kept them where they met the batch
        rows = {n: Factor(n, "dense", joined[n].reshape(B, *params[n].shape), None, tuple(params[n].shape))
                for n in names}
        return rows, ("joined", tuple(names), tuple(tuple(joined[n].shape) for n in names))
    return _batch_copies(module, call, params, B, "broadcast", lambda p, rank: (B, *p.shape[1:]))


def _along_one_axis(p) -> bool:
    return p.dim() >= 1 and sum(n != 1 for n in p.shape) <= 1 and not _leading_one(p)


def has_vector_params(module) -> bool:
    """Whether every parameter the module holds itself is a vector along one axis ((C,), (C, 1, 1)): the shape of a
    scale or shift of the output (an RMSNorm class of another package, Gemma's (1 + w), a layer scale)."""
    own = [p for p in own_parameters(module).values() if p is not None and p.requires_grad]
    return bool(own) and all(_along_one_axis(p) for p in own)


def vector_params(module, call, names: list, B: int) -> tuple:
    """A module's own vector parameters that scale or shift its output elementwise (y = w ⊙ x̂ of an RMSNorm, a layer
    scale): each replaced, for one rerun of the forward on the whole batch, by B copies (B, 1, ..., *shape), its
    shape broadcast against the output's trailing dimensions with the batch first. Where the forward uses it only
    elementwise, the outputs are the same and the gradient of copy b is sample b's: one backward of the batch
    instead of vmap of the module's vjp (2-3x less on an RMSNorm). Checked as broadcast_params is; a forward that
    reshapes or reduces the parameter (F.layer_norm's weight, w.reshape(1, -1, 1, 1)) fails or gives other rows,
    and the vmap rule answers. Raises NotApplicable as broadcast_params does."""
    if not names or any("." in n for n in names):
        raise generic.NotApplicable("parameters of submodules")
    params = {n: call.params[n] for n in names}
    if not all(_along_one_axis(p) for p in params.values()) or B < 2:
        raise generic.NotApplicable("not vector parameters")
    try:
        return _batch_copies(module, call, params, B, "vector", functools.partial(_vector_copies, B))
    except Exception:  # noqa: BLE001  (the forward takes the parameter as it is: F.layer_norm's weight, a reshape)
        return _vmapped_copies(module, call, params, B)


def _vmapped_copies(module, call, params: dict, B: int) -> tuple:
    """Where the forward needs the parameter in its own shape (LayerNorm2d's F.layer_norm, w.reshape(1, -1, 1, 1)):
    B copies (B, *shape), the forward vmapped over the samples and their copies, one backward of the batch through
    it (vmap of the forward only, not of its vjp: about 30% less on a LayerNorm2d). Checked as vector_params is."""
    prep = generic._prepare(module, call, list(params), B)
    xs = [prep.leaves[i] for i in prep.batched]
    copies = {n: p.detach().expand(B, *p.shape).clone().requires_grad_() for n, p in params.items()}

    def one(xs_b, copies_b):
        return generic._forward(module, prep, copies_b, xs_b, True)

    devices = generic._cuda_devices(call)
    with generic._modes(module, call.training), torch.random.fork_rng(devices=devices), torch.enable_grad():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There is a performance drop")
            outs = torch.func.vmap(one, in_dims=(prep.in_dims, 0), out_dims=tuple(prep.out_dims),
                                   randomness="error")(xs, copies)
        if any(o.shape != c.shape for o, c in zip(outs, prep.cots)):
            raise generic.NotApplicable("other outputs with the parameters vmapped per sample")
        grads = torch.autograd.grad(outs, list(copies.values()), prep.cots, allow_unused=True)
    rows = {n: Factor(n, "dense", torch.zeros_like(c) if g is None else g, None, tuple(params[n].shape))
            for (n, c), g in zip(copies.items(), grads)}
    key = ("vector-vmap", tuple(params), tuple(tuple(x.shape) for x in xs), tuple(tuple(c.shape) for c in prep.cots))
    return rows, key


def _vector_copies(B: int, p, rank: int) -> tuple:
    if rank - 1 < p.dim():
        raise generic.NotApplicable("an output of lower rank than the parameter")
    return (B, *[1] * (rank - 1 - p.dim()), *p.shape)


def _batch_copies(module, call, params: dict, B: int, kind: str, shape_of) -> tuple:
    """(name -> Factor of per-sample rows, key): the forward rerun on the whole batch with each parameter p replaced
    by copies of shape shape_of(p, rank of the first output's δ), whose gradients are the per-sample rows."""
    prep = generic._prepare(module, call, list(params), B)
    rank = prep.cots[0].dim()
    xs = [prep.leaves[i] for i in prep.batched]
    copies = {n: p.detach().expand(shape_of(p, rank)).clone().requires_grad_() for n, p in params.items()}
    # a norm that takes its affine parameters in their own shape: see affine.py
    split = SplitAffine({c: params[n].numel() for n, c in copies.items()}, B) if kind == "vector" else None
    with generic.batch_rerun(module, call, prep, copies, xs, split) as outs:
        grads = torch.autograd.grad(outs, list(copies.values()), prep.cots, allow_unused=True)
    rows = {n: Factor(n, "dense", (torch.zeros_like(c) if g is None else g).reshape(B, *params[n].shape), None,
                      tuple(params[n].shape)) for (n, c), g in zip(copies.items(), grads)}
    key = (kind, tuple(params), tuple(tuple(x.shape) for x in xs), tuple(tuple(c.shape) for c in prep.cots))
    return rows, key


generic.FAST_RULES.append((has_broadcast_params, broadcast_params))
generic.FAST_RULES.append((has_vector_params, vector_params))
