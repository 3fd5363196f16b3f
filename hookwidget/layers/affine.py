"""A norm's affine parameters as per-sample copies, for the generic rule's rerun (batch_copies.vector_params).

F.layer_norm, F.group_norm, F.batch_norm and F.instance_norm take their weight and bias in the parameter's own
shape, so the copies that vector_params passes instead, one per sample ((B, 1, ..., *shape), broadcast against the
output), cannot go through them: such a forward (timm's LayerNorm, torchvision's and timm's LayerNorm2d,
GroupNormAct, BatchNormAct2d) fell back to a vmap of the forward, 2-3x the cost. Inside the rerun, `SplitAffine`
splits a call that gets a copy into the norm without its affine part and the affine part after it,
y = norm(x) ⊙ w + b, each copy broadcast to its sample's rows. That is the same function of w and b (the fused
kernel differs by rounding only), and the affine part mixes no samples: the gradient of copy b is sample b's (where
the norm itself mixes samples, batch statistics, the generic rule's check of one sample run alone refuses the rows).
A layer scale that views its parameter for broadcasting (p.view(1, -1, 1, 1): timm's LayerScale2d, ConvNeXt's
gamma, GRN) gets its copy in the same layout, the samples first. A call it cannot split (a batch that is not the
copies', a weight cast first, so no longer the copy itself) runs as written, and fails as before, where vmap
answers.

Floor: layers. Uses torch's public TorchFunctionMode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class SplitAffine(TorchFunctionMode):
    """Active around one rerun of a forward with per-sample copies: `copies` maps each copy tensor (batch `B`
    first) to the number of entries of the parameter it stands for."""

    def __init__(self, copies: dict, B: int):
        super().__init__()
        self.copies, self.B = {id(c): numel for c, numel in copies.items()}, B

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        split = _SPLIT.get(func)
        if split is not None:
            out = split(self, *args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _holds(self, x: torch.Tensor, *affine) -> bool:
        return x.dim() > 0 and x.shape[0] == self.B and any(t is not None and id(t) in self.copies for t in affine)

    def _affine(self, y: torch.Tensor, weight, bias, shape: tuple, lead: int) -> torch.Tensor:
        """y ⊙ w + b, a copy (B, ..., *shape) laid out as (B, 1 × (lead - 1), *shape), a parameter as (*shape)
        followed by `trailing` ones (the dims after the parameter's: a channel's spatial dims)."""
        trailing = y.dim() - lead - len(shape)
        for t, apply in ((weight, torch.mul), (bias, torch.add)):
            if t is None:
                continue
            if id(t) in self.copies:
                t = t.reshape(self.B, *[1] * (lead - 1), *shape, *[1] * trailing)
            else:
                t = t.reshape(*shape, *[1] * trailing)
            y = apply(y, t)
        return y


def _layer_norm(mode: SplitAffine, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    if not mode._holds(input, weight, bias):
        return None
    shape = tuple(normalized_shape) if not isinstance(normalized_shape, int) else (normalized_shape,)
    if input.dim() <= len(shape):  # no batch dimension before the normalised ones
        return None
    y = F.layer_norm(input, shape, None, None, eps)
    return mode._affine(y, weight, bias, shape, input.dim() - len(shape))


def _group_norm(mode: SplitAffine, input, num_groups, weight=None, bias=None, eps=1e-5):
    if not mode._holds(input, weight, bias) or input.dim() < 2:
        return None
    y = F.group_norm(input, num_groups, None, None, eps)
    return mode._affine(y, weight, bias, (input.shape[1],), 1)


def _batch_norm(mode: SplitAffine, input, running_mean, running_var, weight=None, bias=None, training=False,
                momentum=0.1, eps=1e-5):
    """Eval mode normalises each sample alone; train mode mixes samples through the batch statistics, so its rows
    are contributions, which the generic rule's check of one sample run alone refuses (as the vmap rule does)."""
    if not mode._holds(input, weight, bias) or input.dim() < 2:
        return None
    y = F.batch_norm(input, running_mean, running_var, None, None, training, momentum, eps)
    return mode._affine(y, weight, bias, (input.shape[1],), 1)


def _instance_norm(mode: SplitAffine, input, running_mean=None, running_var=None, weight=None, bias=None,
                   use_input_stats=True, momentum=0.1, eps=1e-5):
    if not mode._holds(input, weight, bias) or input.dim() < 2:
        return None
    y = F.instance_norm(input, running_mean, running_var, None, None, use_input_stats, momentum, eps)
    return mode._affine(y, weight, bias, (input.shape[1],), 1)


def _view(mode: SplitAffine, t, *shape):
    """A copy viewed as its parameter laid out for broadcasting, p.view(1, -1, 1, 1) of a layer scale or of GRN
    (timm's LayerScale2d, ConvNeXt's gamma, GlobalResponseNorm): the same layout with each sample's copy in the
    leading dimension, (B, C, 1, 1). Any other view of a copy runs as written."""
    numel = mode.copies.get(id(t)) if isinstance(t, torch.Tensor) else None
    if numel is None:
        return None
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if not shape or not all(isinstance(n, int) for n in shape) or shape[0] != 1 or list(shape).count(-1) > 1:
        return None
    known = math.prod(n for n in shape[1:] if n != -1)
    rest = [numel // known if n == -1 and known else n for n in shape[1:]]
    if math.prod(rest) != numel:
        return None
    return t.reshape(mode.B, *rest)


_SPLIT = {torch.Tensor.view: _view, torch.Tensor.reshape: _view, torch.reshape: _view,
          F.layer_norm: _layer_norm, F.group_norm: _group_norm, F.batch_norm: _batch_norm,
          F.instance_norm: _instance_norm}
