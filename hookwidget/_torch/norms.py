"""The multi-tensor (foreach) kernels: many tensors' norms, copies and differences in a few launches.

Checked on torch 2.13. Why private names: `torch._foreach_norm` / `_foreach_copy_` / `_foreach_sub_` are the
kernels torch's optimizers and clip_grad_norm_ run; one launch for a list of tensors instead of one per tensor
(hundreds of parameters per step). The public torch.linalg.vector_norm takes one tensor, and
torch.nn.utils.get_total_norm gives only the total, not each tensor's norm.
"""

from __future__ import annotations

import torch


def foreach_norm(tensors: list, ord: float = 2, dtype: torch.dtype | None = None) -> tuple:
    """The `ord`-norm of each tensor (2 or float("inf")), as 0-d tensors, in a few kernels for the whole list.
    Reduced and returned in `dtype` where given (the tensors must share one), else each in its own dtype; empty
    tensors have no ∞-norm."""
    return torch._foreach_norm(tensors, ord) if dtype is None else torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_copy_(dst: list, src: list) -> None:
    """dst[i].copy_(src[i]) for every i, in place."""
    torch._foreach_copy_(dst, src)


def foreach_sub_(a: list, b: list) -> None:
    """a[i] -= b[i] for every i, in place."""
    torch._foreach_sub_(a, b)
