"""Private base classes and fields of torch's own layers that the exact layer rules read.

Checked on torch 2.13. Why private names:
- `_ConvNd` / `_ConvTransposeNd` are the only classes every Conv1d-3d (and their transposes) share.
- `_conv_forward` is the method a convolution's forward calls: a subclass that overrides it computes something
  else than the rule rebuilds.
- `_reversed_padding_repeated_twice` is the padding a convolution with padding="same" or a padding_mode other
  than zeros applies itself (F.pad's argument order, the extra element on the right).
- InstanceNorm's `_get_no_batch_dim()` is the rank of an unbatched input; MultiheadAttention's
  `_qkv_same_embed_dim` says whether q, k and v share one packed in_proj_weight.
- `parametrizations._WeightNorm` is what `nn.utils.parametrizations.weight_norm` registers: w = g · v / ‖v‖.
- `torch.embedding_bag` (undocumented; F.embedding_bag returns only its first output) gives, in mode "max", the row
  each bag's maximum took per feature: the rows its backward sends the bag's gradient to.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import conv as _conv
from torch.nn.utils import parametrizations as _parametrizations
from torch.nn.utils import parametrize

CONV_FORWARD_METHODS = ("forward", "_conv_forward")  # what a convolution's subclass must not override


def is_conv(module: nn.Module) -> bool:
    """Whether the module is a convolution of torch's (1-d to 3-d, plain or transposed, or a subclass)."""
    return isinstance(module, _conv._ConvNd)


def is_transposed_conv(module: nn.Module) -> bool:
    """Whether the module is one of torch's transposed convolutions (or a subclass)."""
    return isinstance(module, _conv._ConvTransposeNd)


def conv_self_padding(module: nn.Module) -> tuple:
    """The padding the convolution applies to its input itself, as F.pad takes it (last dimension first, left
    then right of each); all zeros where it leaves padding to the kernel."""
    return tuple(module._reversed_padding_repeated_twice)


def unbatched_rank(module: nn.Module) -> int:
    """The number of dimensions of an unbatched input of an InstanceNorm layer ((C, *S))."""
    return module._get_no_batch_dim()


def packed_qkv(module: nn.MultiheadAttention) -> bool:
    """Whether a MultiheadAttention holds q, k and v in one packed in_proj_weight (same embedding sizes)."""
    return module._qkv_same_embed_dim


def weight_norm_dim(module: nn.Module) -> int | None:
    """The `dim` of torch's weight_norm where it is the one parametrization of the module's weight and nothing
    else of the module is parametrized (-1: the norm of the whole tensor); else None."""
    if not parametrize.is_parametrized(module, "weight") or len(module.parametrizations) != 1:
        return None
    chain = module.parametrizations["weight"]
    if len(chain) != 1 or type(chain[0]) is not _parametrizations._WeightNorm:
        return None
    return chain[0].dim


def bag_max_rows(weight, indices, offsets, include_last_offset: bool, padding_idx) -> torch.Tensor:
    """(bags, d): for EmbeddingBag(mode="max") called on 1-d `indices` with `offsets`, the row of `weight` whose value
    each bag's maximum took per feature (ties resolved as torch resolves them), which its backward adds the bag's
    gradient to; an empty bag's entries match no row's index. Computed by the kernel F.embedding_bag calls."""
    with torch.no_grad():
        return torch.embedding_bag(weight, indices, offsets, False, 2, False, None, include_last_offset,
                                   padding_idx)[3]
