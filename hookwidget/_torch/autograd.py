"""The autograd engine's state and its graph nodes: the node running now, sequence numbers, the functorch
transform stack, the shapes and values a node keeps.

Checked on torch 2.13. Why private names:
- `torch._C._current_autograd_node` tells a forward run by backward (activation checkpointing) from a plain one,
  and a hook running on an autograd worker thread from one on another thread: no public API says either.
- `torch._C._autograd._get_sequence_nr` and `node._sequence_nr()` order the nodes created during a module's call:
  how a trace finds which graph nodes a call made without a hook on each op.
- `torch._C._functorch.peek_interpreter_stack` says whether a torch.func transform (vmap, grad) is running, in
  which hooks would see wrapped tensors; torch.func has no public query.
- `node._input_metadata` (the shape of the gradient a node receives) and `node._saved_<name>` (what its forward
  saved: a transpose's dims, a matmul's operand) let capture prove rows of a folded batch and reuse what a
  matmul saved instead of rerunning it. They are the names autograd's generated nodes expose.
- `torch._C._autograd._top_saved_tensors_default_hooks` and the closures of torch.utils.checkpoint's
  `_checkpoint_hook` / `_recomputation_hook` (their `frame` / `target_frame_ref`) tell a forward that
  non-reentrant checkpointing will rerun, and which of its reruns is which: capture="norms" then takes a layer's
  input from the rerun instead of holding the first forward's (the memory checkpointing frees).
"""

from __future__ import annotations

import torch

# Called in every module hook: aliases of the C functions themselves, no Python frame in between.
current_node = torch._C._current_autograd_node  # () -> the autograd Node running now, or None (not in backward)
next_sequence_nr = torch._C._autograd._get_sequence_nr  # () -> the sequence number the next node will get
peek_transform = torch._C._functorch.peek_interpreter_stack  # () -> the innermost torch.func transform, or None


def in_transform() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) is running."""
    return peek_transform() is not None


def sequence_nrs(nodes) -> list:
    """sequence_nr of each node: one call for the hundreds of nodes a backward pass walks."""
    return [node._sequence_nr() for node in nodes]


def sequence_nr(node) -> int:
    """The node's sequence number: nodes made later in a forward get larger ones (per thread)."""
    return node._sequence_nr()


def output_shape(node, output_nr: int = 0) -> tuple | None:
    """The shape of the forward output `output_nr` of the op that made the node (the gradient the node receives
    there), or None where the node does not say (a custom or C++ node without metadata)."""
    try:
        return tuple(node._input_metadata[output_nr].shape)
    except (AttributeError, IndexError, RuntimeError):
        return None


def saved(node, name: str):
    """What the node's forward saved under `name` (TransposeBackward0: "dim0", AddmmBackward0: "mat1"); raises
    AttributeError where the node saves no such value."""
    return getattr(node, "_saved_" + name)


def checkpoint_frame() -> tuple | None:
    """("forward", frame) while a forward runs that torch.utils.checkpoint (use_reentrant=False) will rerun in
    backward, ("rerun", frame) while backward reruns it (the same frame object both times), else None; None too
    where torch's checkpoint is not laid out as understood here (capture then holds the first forward's input)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if not hooks:
        return None
    pack = hooks[0]
    pack = getattr(pack, "__wrapped__", pack)  # the rerun's hook is wrapped by torch._dynamo.disable
    qualname, code, cells = getattr(pack, "__qualname__", ""), getattr(pack, "__code__", None), pack.__closure__
    if code is None or cells is None:
        return None
    env = dict(zip(code.co_freevars, cells))
    try:
        if qualname.startswith("_checkpoint_hook.") and "frame" in env:
            return "forward", env["frame"].cell_contents
        if qualname.startswith("_recomputation_hook.") and "target_frame_ref" in env:
            frame = env["target_frame_ref"].cell_contents()
            return ("rerun", frame) if frame is not None else None
    except ValueError:  # an empty cell
        return None
    return None
