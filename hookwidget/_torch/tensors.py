"""A tensor's version counter, view base, hook dicts, copy-on-write clone, sparse values and storage identity.

Checked on torch 2.13. Why private names:
- `t._version` counts in-place writes: the only way to know a tensor kept by reference (an input autograd saved,
  a .grad) is unchanged without comparing its values.
- `t._base`: a module's output that is a view (a 3-d Linear's) loses its hook when a later in-place op replaces
  its grad_fn; a hook on the base it views stands in.
- `t._backward_hooks` (and `grad_fn._register_hook_dict`) is the dict Tensor.register_hook fills: capture adds its
  δ hook there directly (a RemovableHandle costs ~2 µs per module call) and a trace lists the user's tensor hooks;
  `t._post_accumulate_grad_hooks` holds hooks that run after .grad is accumulated.
- `torch._lazy_clone` copies a .grad copy-on-write: no memory copied until one of the two is written to.
- `t._values()` is a sparse COO tensor's values without autograd history (the public `values()` records a node
  on a tensor that requires grad): their norms are the sparse gradient's.
- `untyped_storage()._cdata` is the storage's identity (two views share it) and `torch._C._storage_Use_Count`
  how many tensors hold it: whether a kept tensor is the only holder of its memory.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

lazy_clone = getattr(torch, "_lazy_clone", None)  # (t) -> a copy-on-write clone; None where torch has none


def version(t: torch.Tensor) -> int:
    """How many in-place writes t's memory has seen; raises RuntimeError for an inference-mode tensor."""
    return t._version


def versions(ts) -> list:
    """version(t) of each tensor in `ts`, one call for the many a step or a run holds; None for None and for an
    inference-mode tensor (it has no version counter). Asked of every parameter and held tensor of a trace: the
    inference-mode check only where reading one failed."""
    try:
        return [None if t is None else t._version for t in ts]
    except RuntimeError:  # an inference-mode tensor among them
        return [None if t is None or t.is_inference() else t._version for t in ts]


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor t is a view of, or None."""
    return t._base


def backward_hooks(t: torch.Tensor) -> dict | None:
    """t's tensor hooks (handle id -> hook), or None where none was ever registered."""
    return t._backward_hooks


def hook_dict(t: torch.Tensor) -> dict:
    """The dict Tensor.register_hook adds t's hooks to (handle id -> hook), made and given to t's grad_fn as
    register_hook does where it does not exist yet. For plain torch.Tensor only (a subclass may route
    register_hook elsewhere)."""
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        node = t.grad_fn
        if node is not None:
            node._register_hook_dict(t)
    return hooks


def post_accumulate_hooks(t: torch.Tensor) -> dict | None:
    """Hooks that run after t's .grad is accumulated (handle id -> hook), or None."""
    return t._post_accumulate_grad_hooks


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The values of a coalesced sparse COO tensor (one row per stored index), detached from autograd."""
    return t._values()


def storage_key(t: torch.Tensor) -> int:
    """The identity of t's storage (shared by all views of one memory); raises for a tensor without one."""
    return t.untyped_storage()._cdata


def storage_users(t: torch.Tensor) -> int:
    """How many tensors hold t's memory (the storage object made to ask is not counted)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1
