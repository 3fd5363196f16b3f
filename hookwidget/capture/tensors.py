"""Hooks on and copies of single tensors, for the Tracer (capture.py) and what it keeps for the generic rule
(capture_generic.py): a copy-on-write copy, a tensor hook with a light handle, a hook on a module's output that
survives a later in-place op (`hook_output`), the first tensor of a module's inputs or output (`first_tensor`), sole
ownership of memory. `hook_output` and `first_tensor` are public: hw.watch's hooks use them too."""

from __future__ import annotations

import dataclasses
import weakref
from functools import partial

import torch
from torch.utils.hooks import RemovableHandle

from hookwidget._torch.tensors import hook_dict, lazy_clone, storage_key, storage_users, view_base

# A copy-on-write clone: it shares the .grad's memory until either is written to (the user's
# zero_grad(set_to_none=False), clip_grad_norm_, the next backward accumulating into .grad), and only
# then is the memory copied. A training step that sets .grad to None copies nothing at all.


_NO_LAZY: set = set()  # device types where lazy_clone failed once: plain copies there


def _copy(g: torch.Tensor) -> torch.Tensor:
    g = g.detach()
    if lazy_clone is not None and g.layout == torch.strided and g.device.type not in _NO_LAZY:
        try:
            return lazy_clone(g)
        except Exception:  # a device or tensor subclass whose storage cannot be shared copy-on-write
            if type(g) is torch.Tensor:
                _NO_LAZY.add(g.device.type)
    return g.clone()


class _Handle:
    """Removes one tensor hook: a RemovableHandle without its Python-level overhead (one per module call)."""

    __slots__ = ("hooks_dict_ref", "id")

    def __init__(self, hooks_dict, key):
        self.hooks_dict_ref = weakref.ref(hooks_dict)
        self.id = key

    def remove(self) -> None:
        hooks_dict = self.hooks_dict_ref()
        if hooks_dict is not None and self.id in hooks_dict:
            del hooks_dict[self.id]


def _register_hook(t: torch.Tensor, fn):
    """t.register_hook(fn), the same dict entry Tensor.register_hook makes, with a lighter handle."""
    if type(t) is not torch.Tensor:  # a subclass may route register_hook through __torch_function__
        return t.register_hook(fn)
    hooks = hook_dict(t)
    key = RemovableHandle.next_id  # the ids RemovableHandle uses: no clash with the user's hooks in that dict
    RemovableHandle.next_id = key + 1
    hooks[key] = fn
    return _Handle(hooks, key)


def hook_output(handles: list, out: torch.Tensor, fn) -> None:
    """A tensor hook fn(grad) -> new grad or None on a module's output, that fires even when a later
    in-place op rewrites the output. A hook on a plain tensor survives that; one on a view does not
    (a 3-D Linear's output is a view of a 2-D matmul result, and ReLU(inplace=True) replaces the
    view's grad_fn). Then a hook on the view's base, which stays in the graph, stands in for it.
    fn sees gradients only: autograd passes None to a tensor hook where it leaves the gradient of one of a
    node's several outputs undefined (one the loss does not use: cuDNN's LSTM's h_n and c_n, a custom
    Function's second output), and then no gradient arrived there, as where the hook never fires."""
    fn = partial(_defined, fn)
    base = view_base(out)
    if (base is None or not base.requires_grad or base.numel() != out.numel() or not out.is_contiguous()
            or not base.is_contiguous() or base.data_ptr() != out.data_ptr()):
        handles.append(_register_hook(out, fn))
        return
    fired = [False]

    def on_out(grad):
        fired[0] = True
        return fn(grad)

    handles.append(_register_hook(out, on_out))
    shape = out.shape

    def on_base(grad):
        if fired[0]:  # the view's own hook ran in this backward pass
            fired[0] = False
            return None
        if grad is None:  # reshaped before fn sees it
            return None
        new = fn(grad.reshape(shape))
        return None if new is None else new.reshape(grad.shape)

    handles.append(_register_hook(base, on_base))


def _defined(fn, grad):
    return None if grad is None else fn(grad)


def own(slots: list) -> None:
    """Make every tensor in `slots` ((container, key): an object's attribute where the container is not a list
    or dict, else its item) the trace's alone: a tensor sharing memory with anything outside these slots (a
    live tensor, a .grad autograd stole a gradient for) is copied, once per distinct view of that memory, and
    every slot holding that view gets the one copy. Memory the slots alone share (one δ kept by a model and its
    last layer, one input kept by q, k and v) is not copied at all."""
    tensors = [slot_get(obj, key) for obj, key in slots]
    storages = [_storage_key(t) for t in tensors]
    groups: dict = {}  # storage -> {id(tensor): tensor}
    for t, storage in zip(tensors, storages):
        groups.setdefault(storage, {})[id(t)] = t
    copies: dict = {}  # (storage, view) -> the copy
    for storage, group in groups.items():
        if isinstance(storage, int) and storage_users(next(iter(group.values()))) <= len(group):
            continue  # held by these slots alone
        for t in group.values():
            copies.setdefault((storage, _view(t)), None)
    if not copies:
        return
    for (obj, key), t, storage in zip(slots, tensors, storages):
        k = (storage, _view(t))
        if k in copies:
            if copies[k] is None:
                copies[k] = t.clone()
            slot_set(obj, key, copies[k])


def slot_get(obj, key):
    """What slot (obj, key) holds: an item where obj is a list or dict, else an attribute."""
    return obj[key] if isinstance(obj, (list, dict)) else getattr(obj, key)


def slot_set(obj, key, value) -> None:
    if isinstance(obj, (list, dict)):
        obj[key] = value
    else:
        setattr(obj, key, value)


def _storage_key(t: torch.Tensor):
    """Its storage's address; for a tensor subclass without plain storage, its own id (never shared: copied)."""
    try:
        return storage_key(t)
    except Exception:
        return ("own", id(t))


def _view(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether no other tensor shares t's memory."""
    try:
        return storage_users(t) <= 1
    except Exception:  # a tensor subclass without plain storage: assume shared
        return False


def first_tensor(obj) -> torch.Tensor | None:
    """The tensor itself, or the first tensor of a tuple, list, dict, Hugging Face ModelOutput or
    dataclass (the one out_* interventions replace; runs twice per module call: no generator)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        values = obj
    elif isinstance(obj, dict):  # ModelOutput is an OrderedDict of its non-None fields
        values = obj.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = (getattr(obj, f.name) for f in dataclasses.fields(obj))
    else:
        return None
    for x in values:
        if isinstance(x, torch.Tensor):
            return x
    return None


def intervene(hooks, ivs, module, inputs, output, out):
    """A module's layer interventions `ivs` at one call: δ hooks on its output `out` (guarded by `hooks`, the
    trace's handles.Hooks), or the output replaced (returned; None: kept)."""
    replaced = None
    for iv in ivs:
        if iv.kind.attach == "grad" and out is not None and out.requires_grad:
            hook_output(hooks.tensor, out, hooks.guarded(iv.on_grad))
        elif iv.kind.attach == "out":
            new = iv.on_output(module, inputs, output if replaced is None else replaced)
            if new is not None:
                replaced = new
    return replaced
