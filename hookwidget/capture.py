"""The Tracer: runs code with hooks on and records what every module saw.

Forward: each module call's input activation `a` and output. Backward: δ, the gradient
with respect to the module's output, through a tensor hook registered on the output
inside the forward hook (exact, and it survives a later in-place op, where full module
backward hooks raise). When backward starts, the autograd graph is walked from its
roots and a pre-hook on every node records the gradient norm arriving there.

Every hook belongs to one ExitStack, closed in `finally`; each hook also checks an
`active` flag, because a hook baked into a graph that outlives the trace can still fire.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import graph as graph_mod
from .handles import Patched, Removing, Restoring
from .summary import TensorSummary, abs_max, grad_norms_on_device, stats_on_device, to_summaries

CAPTURE_MODES = ("full", "summary", "norms")
AUTO_NODE_GRADS_MAX = 256  # graphs up to this size get a gradient norm at every node by default
DEFAULT_BUDGET_MB = 512


@dataclass
class Call:
    """One forward call of a module: what went in, what came out, what came back."""

    index: int
    a: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    output_shape: tuple | None = None
    a_summary: TensorSummary | None = None
    delta_summary: TensorSummary | None = None
    grad_input: torch.Tensor | None = None  # backward_hooks=True: what a full backward hook sees
    seq_start: int = field(default=0, repr=False)  # autograd sequence numbers created during the call
    seq_end: int = field(default=0, repr=False)
    out_node: Any = field(default=None, repr=False)
    recomputed: bool = field(default=False, repr=False)  # run again by backward (torch.utils.checkpoint)
    _a_version: int = field(default=-1, repr=False)
    _a_source: Any = field(default=None, repr=False)


@dataclass
class ModuleRecord:
    module: nn.Module
    calls: list = field(default_factory=list)
    open_calls: list = field(default_factory=list, repr=False)  # calls whose forward is running
    awaiting_backward: list = field(default_factory=list, repr=False)  # backward_hooks=True only


@dataclass
class Records:
    """Everything a trace saw, before names and the graph are attached (see trace.py)."""

    modules: dict  # nn.Module -> ModuleRecord, in first-call order
    walk: graph_mod.GraphWalk
    roots: list  # root tensors' values (detached), one per backward root
    leaf_grads_before: dict  # leaf tensor -> its .grad before the first backward (clone or None)
    notes: list
    backward_calls: int
    used_autograd_grad: bool
    no_factors: str = ""  # why (a, δ) cannot rebuild .grad in this run (e.g. double backward), or ""
    leaf_index: dict = field(default_factory=dict)  # leaf tensor -> its AccumulateGrad node's index in walk


class Tracer:
    """Context manager that owns every hook of one trace; `records` is filled on exit."""

    def __init__(self, modules=None, capture: str = "full", budget_mb: float = DEFAULT_BUDGET_MB,
                 layer_interventions=None, node_interventions=None, node_grads: bool | None = None, norms_rule=None,
                 backward_hooks: bool = False):
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture={capture!r} is not a capture mode; choose one of {', '.join(CAPTURE_MODES)}")
        if budget_mb is None or budget_mb < 0:
            raise ValueError(f"budget_mb={budget_mb!r} must be a number of megabytes >= 0, e.g. budget_mb=512")
        self.targets = _as_module_list(modules)
        self.capture = capture
        self.budget_bytes = int(budget_mb * 2**20)
        self.layer_interventions = layer_interventions or {}
        self.node_interventions = node_interventions or {}
        # A pre-hook on every node costs a Python call and a reduction per node: on by default only
        # for small graphs (None: decided when backward starts); module outputs and leaves get
        # their norms from δ and .grad anyway (see _derive_node_norms).
        self.node_grads = False if capture == "norms" else node_grads
        self.norms_rule = norms_rule  # (module, call) -> None, used when capture == "norms"
        # Full module backward hooks show grad_input too, but raise when an in-place op follows a
        # module and add nodes to the graph: opt-in only.
        self.backward_hooks = backward_hooks
        self.active = False
        self.records: Records | None = None
        self._lock = threading.Lock()
        self._stack = ExitStack()
        self._modules: dict = {}
        self._pending: list = []  # (call, attr, shape, dtype, stats)
        self._kept_bytes = 0
        self._dropped = 0
        self._walk = graph_mod.GraphWalk()
        self._roots: list = []
        self._leaf_grads_before: dict = {}
        self._leaf_index: dict = {}  # leaf tensor -> index of its AccumulateGrad node in the walk
        self._backward_calls = 0
        self._used_grad = False
        self._notes: list = []
        self._create_graph = False
        self._passes_summed = 0
        self._seen: dict = {}  # what hooks cannot see, by kind -> class names (see _unseen_notes)
        self._unhooked: list = []  # nodes whose gradient norms are derived rather than hooked

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        if _in_functorch():
            raise RuntimeError("hookwidget cannot trace inside a torch.func transform (vmap, grad, jacrev, ...): "
                               "hooks would see wrapped tensors; call hw.trace outside the transform")
        for m in self.targets or ():
            if "_orig_mod" in m._modules:
                self._saw("compiled", m)
        try:
            self._install()
        except BaseException:
            self._stack.close()
            raise
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self._stack.close()
        try:
            self.records = self._finish()
        except Exception:
            if exc[0] is None:
                raise  # otherwise the cell's own exception propagates, not hookwidget's

    def _install(self) -> None:
        s = self._stack
        if self.targets is None:
            from torch.nn.modules import module as module_mod

            s.enter_context(Removing(module_mod.register_module_forward_pre_hook(self._pre_hook)))
            s.enter_context(Removing(module_mod.register_module_forward_hook(self._forward_hook)))
            if self.backward_hooks:  # the global flag it sets outlives the hook: put it back
                s.enter_context(Restoring(module_mod, "_global_is_full_backward_hook"))
                s.enter_context(Removing(module_mod.register_module_full_backward_hook(self._backward_hook)))
        else:
            seen = set()
            for root in self.targets:
                for m in root.modules():
                    if id(m) in seen:
                        continue
                    seen.add(id(m))
                    s.enter_context(Removing(m.register_forward_pre_hook(self._pre_hook)))
                    s.enter_context(Removing(m.register_forward_hook(self._forward_hook)))
                    if self.backward_hooks:
                        s.enter_context(Removing(m.register_full_backward_hook(self._backward_hook)))
        s.enter_context(Patched(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward)))
        s.enter_context(Patched(torch.autograd, "grad", self._wrap_backward(torch.autograd.grad, grad=True)))

    # -- forward -------------------------------------------------------------------------------
    def _pre_hook(self, module, inputs):
        if torch.compiler.is_compiling() or not self.active or self._unseen(module):
            return
        rec = self._modules.get(module)
        if rec is None:
            rec = self._modules[module] = ModuleRecord(module)
        rec.open_calls.append(self._open_call(module, rec, inputs))
        if torch._C._current_autograd_node() is not None:  # forward rerun by backward: checkpoint
            rec.calls[-1].recomputed = True

    def _unseen(self, module) -> bool:
        """Calls whose tensors hooks must not touch: inside torch.func transforms and compiled models."""
        if _in_functorch():
            self._saw("func", module)
            return True
        if "_orig_mod" in module._modules:
            self._saw("compiled", module)
        return False

    def _saw(self, what: str, module) -> None:
        self._seen.setdefault(what, {}).setdefault(type(module).__name__, None)

    def _open_call(self, module, rec: ModuleRecord, inputs) -> Call:
        # `a` is taken before forward runs: an in-place module (ReLU(inplace=True)) rewrites its input.
        call = Call(index=len(rec.calls), seq_start=_next_sequence_nr())
        rec.calls.append(call)
        a = _first_tensor(inputs)
        if a is not None:
            self._keep_input(module, call, a)
        elif not inputs:
            self._saw("kwargs", module)
        return call

    def _forward_hook(self, module, inputs, output):
        if torch.compiler.is_compiling() or not self.active or _in_functorch():
            return None
        rec = self._modules.get(module)
        if rec is None:  # hooks installed mid-call: the pre-hook did not see this call start
            rec = self._modules[module] = ModuleRecord(module)
        call = rec.open_calls.pop() if rec.open_calls else self._open_call(module, rec, inputs)
        if self.backward_hooks:
            rec.awaiting_backward.append(call)
        out = _first_tensor(output)
        if out is None and isinstance(output, dict) and any(isinstance(v, torch.Tensor) for v in output.values()):
            self._saw("dict", module)
        replaced = None
        for iv in self.layer_interventions.get(module, ()):
            if iv.kind.attach == "grad" and out is not None and out.requires_grad:
                _hook_output(self._stack, out, self._guarded(iv.on_grad))
            elif iv.kind.attach == "out":
                new = iv.on_output(module, inputs, output if replaced is None else replaced)
                if new is not None:
                    replaced = new
        call.seq_end = _next_sequence_nr()
        if out is not None:
            call.output_shape = tuple(out.shape)
            call.out_node = out.grad_fn
            if out.requires_grad:
                _hook_output(self._stack, out, self._delta_hook(module, call))
        return replaced

    def _backward_hook(self, module, grad_input, grad_output):
        rec = self._modules.get(module)
        if not self.active or rec is None or not rec.awaiting_backward:
            return None
        g = _first_tensor(grad_input)
        with self._lock:
            rec.awaiting_backward.pop().grad_input = None if g is None else g.detach()
        return None

    def _keep_input(self, module, call: Call, a: torch.Tensor) -> None:
        if self.capture == "norms":
            if self.norms_rule is not None and self.norms_rule.wants(module):
                call.a = a.detach()
            return
        if self.capture == "full" and self._fits(a):
            # Layers whose backward needs their input: autograd's version check guards it,
            # so no copy is needed; `_a_version` catches forward-only cells that mutate it.
            if _weight_needs_input(module) and not a.is_inference():
                call.a = a.detach()
                call._a_source, call._a_version = a, a._version
            else:
                call.a = a.detach().clone()
            return
        self._pending.append((call, "a_summary", tuple(a.shape), a.dtype, stats_on_device(a)))

    def _delta_hook(self, module, call: Call):
        def hook(grad):
            if not self.active:
                return
            with self._lock:
                if self.capture == "norms":
                    call.delta = grad.detach()
                    self.norms_rule.on_delta(module, self._modules[module].calls, self._modules)
                elif call.delta is not None:  # another backward through the same graph: sum, as .grad does
                    call.delta = call.delta + grad.detach()
                    self._passes_summed += 1
                elif self.capture == "full" and self._fits(grad):
                    call.delta = grad.detach()
                else:
                    self._pending.append(
                        (call, "delta_summary", tuple(grad.shape), grad.dtype, stats_on_device(grad)))
            return

        return hook

    def _fits(self, t: torch.Tensor) -> bool:
        size = t.numel() * t.element_size()
        if self._kept_bytes + size > self.budget_bytes:
            self._dropped += 1
            return False
        self._kept_bytes += size
        return True

    # -- backward ------------------------------------------------------------------------------
    def _wrap_backward(self, original, grad: bool = False):
        create_graph_at = 3 if grad else 2  # positional index of create_graph after `tensors`

        def wrapper(tensors, *args, **kwargs):
            if self.active and not _in_functorch():
                self._create_graph |= bool(kwargs.get("create_graph", len(args) > create_graph_at
                                                      and args[create_graph_at]))
                self._on_backward(tensors, grad)
            return original(tensors, *args, **kwargs)

        wrapper.__wrapped__ = original
        return wrapper

    def _on_backward(self, tensors, grad: bool) -> None:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else [t for t in tensors if isinstance(t, torch.Tensor)]
        self._backward_calls += 1
        self._used_grad |= grad
        for r in roots:
            if r.numel() == 1:
                self._roots.append(r.detach().clone())
        new_nodes = self._walk.extend([r.grad_fn for r in roots if r.grad_fn is not None])
        if self.node_grads is None:
            self.node_grads = len(self._walk.nodes) <= AUTO_NODE_GRADS_MAX
            if not self.node_grads:
                self._notes.append(f"the graph has {len(self._walk.nodes)} nodes: gradient norms are shown for layer "
                                   "outputs and parameters only; trace with node_grads=True for every node")
        if self.node_grads and self._backward_calls > 1:  # norms derived after one pass would be inexact
            for i in self._unhooked:
                self._stack.enter_context(Removing(self._walk.nodes[i].register_prehook(self._node_hook(i))))
            self._unhooked = []
        out_nodes = self._output_nodes() if self.node_grads and self._backward_calls == 1 else ()
        for i in new_nodes:
            node = self._walk.nodes[i]
            variable = getattr(node, "variable", None)
            if variable is not None and variable not in self._leaf_grads_before:
                self._leaf_index[variable] = i
                g = variable.grad
                self._leaf_grads_before[variable] = None if g is None else g.detach().clone()
            ivs = self.node_interventions.get(self._walk.ids[i], ())
            for iv in ivs:
                self._stack.enter_context(Removing(node.register_prehook(self._guarded(iv.on_node_grads))))
            if not self.node_grads:
                continue
            if node in out_nodes and not ivs:  # what arrives there is the layer's δ: norms derived at the end
                self._unhooked.append(i)
            else:
                self._stack.enter_context(Removing(node.register_prehook(self._node_hook(i))))

    def _output_nodes(self) -> set:
        """grad_fn of every recorded call's output, where a δ hook will see what arrives there."""
        return {c.out_node for rec in self._modules.values() for c in rec.calls if c.out_node is not None}

    def _node_hook(self, i: int):
        walk = self._walk

        def hook(grad_outputs):
            if not self.active:
                return
            g = grad_outputs[0] if grad_outputs else None
            if g is not None:
                with self._lock:
                    walk.grad_norm[i] = grad_norms_on_device(g)
                    walk.shape.setdefault(i, tuple(g.shape))
                    walk.order.setdefault(i, len(walk.order))
            return

        return hook

    def _guarded(self, fn):
        def hook(*args):
            if not self.active:
                return None
            return fn(*args)

        return hook

    # -- end -----------------------------------------------------------------------------------
    def _derive_node_norms(self) -> None:
        """Norms of the gradient arriving at layer-output nodes (δ) and leaf nodes (.grad), where no
        node hook recorded them. Exact only for one backward pass and a .grad that started as None."""
        walk, index = self._walk, self._walk._index
        if self._backward_calls != 1 or self._passes_summed:
            return
        pending = {}
        for rec in self._modules.values():
            for c in rec.calls:
                i = index.get(c.out_node) if c.out_node is not None else None
                if i is None or i in walk.grad_norm:
                    continue
                walk.shape.setdefault(i, c.output_shape)
                if c.delta is not None:
                    pending[i] = c.delta
                elif c.delta_summary is not None:
                    d = c.delta_summary
                    walk.grad_norm[i] = (d.norm, abs_max(d.min, d.max))
        changed = 0
        for leaf, before in self._leaf_grads_before.items():
            i = self._leaf_index.get(leaf)
            if i is None or i in walk.grad_norm or before is not None or leaf.grad is None:
                continue
            # A .grad that backward created and nothing changed since is at version 0; clip_grad_norm_ or
            # zero_grad(set_to_none=False) in the cell would make the norm shown not the one that arrived.
            if leaf.grad._version == 0:
                pending[i] = leaf.grad.detach()
            else:
                changed += 1
        if changed:
            self._notes.append(f"{changed} parameter .grad tensors were changed in place after backward (e.g. by "
                               "clip_grad_norm_): their graph nodes show no gradient norm; trace with node_grads=True "
                               "to see them")
        walk.pending_norms.update(pending)  # reduced when the graph is built (graph.build)

    def _finish(self) -> Records:
        if not self._walk.nodes:  # forward only: show the graph that backward would have walked
            self._walk.extend(_outermost_outputs(self._modules.values()))
        pending, self._pending = self._pending, []
        for (call, attr, *_), s in zip(pending, to_summaries([p[2:] for p in pending])):
            setattr(call, attr, s)
        self._drop_recomputed_calls()
        self._derive_node_norms()
        for rec in self._modules.values():
            for call in rec.calls:
                if call._a_source is not None and call._a_source._version != call._a_version:
                    call.a = None
                    self._notes.append(f"{type(rec.module).__name__}: an input was modified in place after "
                                       "the call; its activation was not kept")
                call._a_source = None
        if self._dropped:
            self._notes.append(f"memory budget {self.budget_bytes / 2**20:g} MB reached: {self._dropped} tensors "
                               "kept as summaries only (shape, norm, min/max/mean, NaN/Inf); "
                               "raise budget_mb to keep them")
        if self._backward_calls == 0:
            self._notes.append("no gradients captured: the code ran no backward (activations only)")
        if self._used_grad:
            self._notes.append("torch.autograd.grad was used: parameters reached only by it keep .grad None")
        self._notes += self._unseen_notes()
        no_factors = ""
        if self._create_graph:
            no_factors = ("create_graph=True (double backward): .grad then holds terms that (a, δ) do not, and δ "
                          "sums every backward pass; weight_grad and per-sample gradients are refused")
            self._notes.append(no_factors)
        elif self._passes_summed:
            self._notes.append("backward ran through the same graph more than once (retain_graph=True): δ and "
                               "weight_grad are summed over those passes, as .grad is")
        return Records(self._modules, self._walk, self._roots, self._leaf_grads_before, self._notes,
                       self._backward_calls, self._used_grad, no_factors, self._leaf_index)

    def _drop_recomputed_calls(self) -> None:
        """torch.utils.checkpoint reruns forward during backward. Of a layer's calls, the ones that
        got a gradient are the real ones (the first call without reentrant checkpoint, the rerun with)."""
        names = []
        for rec in self._modules.values():
            if any(c.recomputed for c in rec.calls):
                kept = [c for c in rec.calls if c.delta is not None or c.delta_summary is not None]
                if kept and len(kept) < len(rec.calls):
                    names.append(type(rec.module).__name__)
                    rec.calls[:] = kept
                    for i, c in enumerate(kept):
                        c.index = i
        if names:
            self._notes.append("torch.utils.checkpoint reran forward during backward for: " + ", ".join(names)
                               + "; only their calls that received a gradient are kept")

    def _unseen_notes(self) -> list:
        scripted = sorted({type(r.module).__name__ for r in self._modules.values()
                           if isinstance(r.module, torch.jit.ScriptModule)})
        seen = {k: ", ".join(v) for k, v in self._seen.items()}
        text = {
            "compiled": f"torch.compile: hooks added after compilation are not honoured, so the layers inside "
                        f"{seen.get('compiled')} are not shown; trace the uncompiled model (model._orig_mod), "
                        "or call torch.compile after tracing",
            "func": f"torch.func transforms (vmap, grad, ...) ran {seen.get('func')}: calls inside a transform "
                    "are not captured (hooks see wrapped tensors); trace a plain forward and backward instead",
            "kwargs": f"{seen.get('kwargs')} got their tensors as keyword arguments only: their input activation "
                      "is not captured; pass the input positionally",
            "dict": f"{seen.get('dict')} returned a dict: δ is not captured for dict outputs (layers inside are); "
                    "return a tensor or a tuple to see it",
        }
        notes = [text[k] for k in text if k in seen]
        if scripted:
            notes.append(f"ScriptModule ({', '.join(scripted)}): hooks do not fire inside TorchScript, so its "
                         "layers are not shown; trace the module before torch.jit.script")
        if any(isinstance(r.module, nn.parallel.DistributedDataParallel) for r in self._modules.values()):
            notes.append("DistributedDataParallel: .grad is averaged over ranks after backward; a, δ, weight_grad "
                         "and per-sample gradients are this rank's own (its samples, before the all-reduce)")
        return notes


_next_sequence_nr = torch._C._autograd._get_sequence_nr


def _hook_output(stack: ExitStack, out: torch.Tensor, fn) -> None:
    """A tensor hook fn(grad) -> new grad or None on a module's output, that fires even when a later
    in-place op rewrites the output. A hook on a plain tensor survives that; one on a view does not
    (a 3-D Linear's output is a view of a 2-D matmul result, and ReLU(inplace=True) replaces the
    view's grad_fn). Then a hook on the view's base, which stays in the graph, stands in for it."""
    fired = [False]

    def on_out(grad):
        fired[0] = True
        return fn(grad)

    stack.enter_context(Removing(out.register_hook(on_out)))
    base = out._base
    if (base is None or not base.requires_grad or base.numel() != out.numel() or not out.is_contiguous()
            or not base.is_contiguous() or base.data_ptr() != out.data_ptr()):
        return
    shape = out.shape

    def on_base(grad):
        if fired[0]:  # the view's own hook ran in this backward pass
            fired[0] = False
            return None
        new = fn(grad.reshape(shape))
        return None if new is None else new.reshape(grad.shape)

    stack.enter_context(Removing(base.register_hook(on_base)))


def _in_functorch() -> bool:
    """Whether a torch.func transform (vmap, grad, ...) is running."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _outermost_outputs(records) -> list:
    """grad_fn of the outputs of calls that no other recorded call encloses, in call order."""
    calls = sorted((c for r in records for c in r.calls), key=lambda c: (c.seq_start, -c.seq_end))
    out, end = [], -1
    for c in calls:
        if c.seq_start >= end:
            end = c.seq_end
            if c.out_node is not None:
                out.append(c.out_node)
    return out


def _weight_needs_input(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.requires_grad and isinstance(
        module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm))


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                yield x


def _first_tensor(obj) -> torch.Tensor | None:
    return next(iter(_tensors(obj)), None)


def _as_module_list(modules):
    if modules is None:
        return None
    if isinstance(modules, nn.Module):
        return [modules]
    out = list(modules)
    bad = [type(m).__name__ for m in out if not isinstance(m, nn.Module)]
    if bad or not out:
        raise TypeError(f"modules= takes an nn.Module or a list of them; got {', '.join(bad) or 'an empty list'}")
    return out
