"""A module's own parameters, buffers and children; the hook registries of modules and optimizers; a module's
parameters swapped for one rerun of its forward.

Checked on torch 2.13. Why private names:
- `module._parameters` / `_buffers` / `_modules` are the dicts nn.Module itself reads. The public
  `named_parameters(recurse=False)` and kin walk generators through `named_modules` (~µs per module, asked at
  every module's first call) and hide the entries set to None; the dicts answer at once, in registration order.
- The hook dicts (`_forward_hooks`, `_global_forward_hooks`, `_global_optimizer_pre_hooks`, ...) have no public
  reader: a trace lists the hooks the user's code left on a layer, and sweeps away its own hooks that an
  interrupt left registered before their handles reached its ExitStack.
- `_global_forward_hooks_with_kwargs` and `_global_is_full_backward_hook` outlive the hooks that set them (their
  handles do not undo them, torch 2.13): a later hook given the same id would be called with kwargs, and the
  flag would stay set.
- `stateless._reparametrize_module` is what torch.func.functional_call runs inside, without calling the module:
  the generic rule reruns `module.forward` so the module's own hooks (the user's, another trace's) do not run.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.modules import module as _module
from torch.nn.utils import stateless as _stateless
from torch.optim import optimizer as _optimizer

_KINDS = ("forward_pre", "forward", "backward", "backward_pre")
_FLAGS = ("forward_hooks_with_kwargs", "forward_pre_hooks_with_kwargs", "forward_hooks_always_called")


def own_parameters(module: nn.Module) -> dict:
    """name -> Parameter (or None where the module set it so) of the module itself, not its children: the live
    dict, in registration order. Do not write to it."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict:
    """name -> buffer (or None) of the module itself: the live dict, as the module holds it now."""
    return module._buffers


def children(module: nn.Module) -> dict:
    """name -> child module (or None) of the module: the live dict (no generator walk)."""
    return module._modules


def has_module_hooks(module: nn.Module) -> bool:
    """Whether any of the module's own hook dicts holds a hook (asked of every layer when a trace ends: no dicts
    built)."""
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def module_hooks(module: nn.Module | None = None) -> dict:
    """kind -> the dict torch calls that kind of hook from (handle id -> hook), kinds "forward_pre", "forward",
    "backward", "backward_pre": the module's own, or (module None) the global ones every module runs."""
    if module is None:
        return {kind: getattr(_module, f"_global_{kind}_hooks") for kind in _KINDS}
    # spelled out: asked for every layer of every trace (the user's hooks it shows)
    return {"forward_pre": module._forward_pre_hooks, "forward": module._forward_hooks,
            "backward": module._backward_hooks, "backward_pre": module._backward_pre_hooks}


def hook_flags(module: nn.Module | None = None) -> list:
    """The dicts in which torch keeps a hook's flags (with_kwargs, always_called) under its handle id, of the
    module or (module None) the global hooks: removing a hook by hand removes its flags too."""
    owner, prefix = (_module, "_global_") if module is None else (module, "_")
    found = (getattr(owner, prefix + name, None) for name in _FLAGS)  # the global hooks have no pre-hook kwargs
    return [d for d in found if d is not None]


def drop_global_kwargs_flag(handle_id: int) -> None:
    """Forget the with_kwargs flag of a removed global forward hook (its handle leaves it, torch 2.13)."""
    _module._global_forward_hooks_with_kwargs.pop(handle_id, None)


@contextlib.contextmanager
def full_backward_flag_kept():
    """Put torch's global 'full backward hook' flag back on exit: registering a global full backward hook sets it
    for good."""
    before = _module._global_is_full_backward_hook
    try:
        yield
    finally:
        _module._global_is_full_backward_hook = before


def optimizer_hooks() -> list:
    """The dicts of global optimizer step hooks (handle id -> hook): [pre-step, post-step]."""
    return [_optimizer._global_optimizer_pre_hooks, _optimizer._global_optimizer_post_hooks]


def parameters_swapped(module: nn.Module, tensors: dict):
    """Context manager: the module (and its submodules, by dotted names) holds `tensors` in place of its parameters
    and buffers; tied weights stay tied; names it does not have are ignored. Call `module.forward` inside."""
    return _stateless._reparametrize_module(module, tensors, tie_weights=True, strict=False)
