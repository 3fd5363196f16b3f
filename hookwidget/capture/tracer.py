"""The Tracer: runs code with hooks on and records what every module saw.

Forward: each module call's input activation `a` and output. Backward: δ, the gradient
with respect to the module's output, through a tensor hook registered on the output
inside the forward hook (exact, and it survives a later in-place op, where full module
backward hooks raise). Each backward pass is a step: when it starts, its autograd graph
is walked from its roots and a pre-hook on every node records the gradient norm arriving
there; when it ends, the .grad it left is copied, so nothing done later changes the record.

Module hooks belong to one ExitStack, tensor and node hooks to one list, both emptied in
`finally`, and a last sweep removes anything an interrupt left half-registered. Each hook also
checks an `active` flag, because a hook baked into a graph that outlives the trace can still fire.

What capture keeps for per_sample's rules beyond (a, δ) (the generic rule's inputs and outputs, broadcast
position tables, rows folded by a view) is in capture_generic.py, a mixin of the Tracer; hooks on and copies
of single tensors are in capture_tensors.py.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, deque
from contextlib import ExitStack

import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optimizer_mod
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hookwidget.capture import backward as autograd_calls
from hookwidget.capture.generic import BROADCASTS_MAX, GenericCapture, link_first_delta, maybe_broadcast
from hookwidget.capture.handles import Removing, Restoring
from hookwidget.capture.tensors import _NO_LAZY, _copy, _lazy_clone, _sole_owner, own
from hookwidget.capture.tensors import first_tensor as _first_tensor
from hookwidget.capture.tensors import hook_output as _hook_output
from hookwidget.layers import factors as fx
from hookwidget.layers import registry
from hookwidget.record import graph as graph_mod
from hookwidget.record.calls import PREVIOUS, Call, ModuleRecord, Records, StepRecord
from hookwidget.stats import StatsBatch, abs_max, fused_norms, stats_on_device, to_summaries

CAPTURE_MODES = ("full", "summary", "norms")
AUTO_NODE_GRADS_MAX = 256  # graphs up to this size get a gradient norm at every node by default
DEFAULT_BUDGET_MB = 512
# Backward nodes that pass on what arrives at them with its values unchanged (reshaped, permuted)
VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0",
                        "TransposeBackward0", "TransposeBackward1", "PermuteBackward0", "SqueezeBackward0",
                        "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "AliasBackward0",
                        "CloneBackward0"})
LAZY_NODE_NUMEL = 4096  # node gradients up to this size are kept until the graph is built (it may never be)
LAZY_NODE_TOTAL = 1 << 18  # elements kept so at most per trace; larger ones are reduced when the trace ends
OUTER_CALLS_KEPT = 4  # forward passes whose graph a trace may hold before a backward (an eval loop holds none more)


class Tracer(GenericCapture):
    """Context manager that owns every hook of one trace; `records` is filled on exit."""

    def __init__(self, modules=None, capture: str = "full", budget_mb: float = DEFAULT_BUDGET_MB,
                 layer_interventions=None, node_interventions=None, node_grads: bool | None = None, norms_rule=None,
                 backward_hooks: bool = False, state=None):
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture={capture!r} is not a capture mode; choose one of {', '.join(CAPTURE_MODES)}")
        self.targets = _as_module_list(modules)
        self.capture = capture
        self.budget_bytes = budget_mb * 2**20  # float("inf"): no limit
        self.layer_interventions = layer_interventions or {}
        self.node_interventions = node_interventions or {}
        # A pre-hook on every node costs a Python call and a reduction per node: on by default only
        # for small graphs (None: decided when backward starts); module outputs and leaves get
        # their norms from δ and .grad anyway (see _derive_node_norms).
        self.node_grads = False if capture == "norms" else node_grads
        self.norms_rule = norms_rule  # capture == "norms": per-sample norms as δ arrives (norms.py)
        self._folds: dict = {}  # id(output) -> (weakref, B): outputs of row-keeping layers on folded samples
        self._pass_batch = None  # the batch size of the running forward pass (its outermost call's input)
        self._row_proofs: dict = {}  # rows.sample_major's memo for the running forward pass (its graph's nodes)
        self._batches = Counter()  # this step's outermost calls: their inputs' leading dimensions (Call.batch)
        # Full module backward hooks show grad_input too, but raise when an in-place op follows a
        # module and add nodes to the graph: opt-in only.
        self.backward_hooks = backward_hooks
        self.state = state  # a RunState to tell what the code changes (state.py), or None
        self.thread = threading.get_ident()  # the thread whose code this trace records
        self.active = False
        self.records: Records | None = None
        self._lock = threading.Lock()
        self._stack = ExitStack()
        self._handles: list = []  # tensor hook handles on module outputs (many per step: a list, not stack entries)
        self._node_handles: list = []  # node pre-hooks of the running step's graph, removed when it ends
        self._modules: dict = {}
        self._answers: dict = {}  # the registry's answers, asked at each module's first call (registry.memo)
        self._pending: list = []  # (call, attr, shape, dtype, stats)
        self._stats = StatsBatch()  # statistics of small tensors, reduced in batches (summary.py)
        self._kept_bytes = 0
        self._dropped = 0
        self._dropped_grads = 0
        self._walk = graph_mod.GraphWalk()
        self._steps: list[StepRecord] = []
        self._step: StepRecord | None = None  # the backward pass running now
        self._trimmed = 0  # steps whose .grad copies are summaries already
        self._depth = 0  # nested backward calls inside one pass (reentrant checkpoint)
        self._grad_state: dict = {}  # leaf -> (weakref to its .grad, version) as the last step left it
        self._open = 0  # forward calls running now
        self._outer: deque = deque()  # calls of the latest outermost forward passes (their out_node is kept)
        self._used_grad = False
        self._notes: list = []
        self._create_graph = False
        self._passes_summed = 0
        self._seen: dict = {}  # what hooks cannot see, by kind -> class names (see _unseen_notes)
        self._unhooked: list = []  # nodes whose gradient norms are derived rather than hooked
        self._out_index: dict = {}  # last step's graph: node index -> the call whose output it made
        self._live: list = []  # calls whose out_node is set (since the last step ended)
        self._node_refs: dict = {}  # this step's graph: node index -> the gradient that arrived there
        self._ddp = False  # a DistributedDataParallel module ran (it averages .grad after backward)
        self._snapshots: dict = {}  # id(parameter or buffer) -> (it, its version, copy): generic rule (_keep_call)
        self._broadcasts: list = []  # calls of layers with parameters whose output is (1, ...): see _hook_broadcasts
        self._joins: list = []  # (module, call) of generic modules holding (1, ...) parameters: see _hook_joins

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
            self._close()
            raise
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self._close()
        try:
            self.records = self._finish()
        except Exception:
            if exc[0] is None:
                raise  # otherwise the cell's own exception propagates, not hookwidget's

    def _close(self) -> None:
        try:
            for h in self._handles + self._node_handles:
                h.remove()
            self._handles, self._node_handles = [], []
        finally:
            self._stack.close()

    def _install(self) -> None:
        s = self._stack
        # First on the stack, so last to run: whatever an interrupt left half-registered is swept away.
        s.callback(self._sweep)
        s.callback(autograd_calls.unlisten, self)
        if self.targets is None:
            s.enter_context(Removing(module_mod.register_module_forward_pre_hook(self._pre_hook)))
            # No global pre-hook sees keyword arguments: a call that gets its tensors only as keywords
            # (how Hugging Face calls its models) has its input read by the forward hook, after forward.
            handle = s.enter_context(Removing(module_mod.register_module_forward_hook(self._forward_hook,
                                                                                      with_kwargs=True)))
            # torch's handle does not remove the global with_kwargs flag (torch 2.13): a later hook given the
            # same id would be called with kwargs
            s.callback(module_mod._global_forward_hooks_with_kwargs.pop, handle.id, None)
            if self.backward_hooks:  # the global flag it sets outlives the hook: put it back
                s.enter_context(Restoring(module_mod, "_global_is_full_backward_hook"))
                s.enter_context(Removing(module_mod.register_module_full_backward_hook(self._backward_hook)))
        else:
            for m in self._target_modules():
                s.enter_context(Removing(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True)))
                s.enter_context(Removing(m.register_forward_hook(self._forward_hook, with_kwargs=True)))
                if self.backward_hooks:
                    s.enter_context(Removing(m.register_full_backward_hook(self._backward_hook)))
        if self.state is not None:
            s.enter_context(Removing(register_optimizer_step_pre_hook(self._optimizer_hook)))
        autograd_calls.listen(self)

    def _optimizer_hook(self, opt, args, kwargs):
        if self.active and threading.get_ident() == self.thread:
            self.state.on_optimizer_step(opt)
    def _target_modules(self) -> list:
        seen, out = set(), []
        for root in self.targets:
            for m in root.modules():
                if id(m) not in seen:
                    seen.add(id(m))
                    out.append(m)
        return out

    def _sweep(self) -> None:
        """Remove any hook of this tracer still registered: one an interrupt left between its
        registration and its handle reaching the ExitStack."""
        if self.targets is None:
            owners = [(module_mod, "_global_")]
        else:
            owners = [(m, "_") for m in self._target_modules()]
        flags = ("forward_hooks_with_kwargs", "forward_pre_hooks_with_kwargs", "forward_hooks_always_called")
        for owner, prefix in owners:
            dicts = [getattr(owner, prefix + n, None) for n in ("forward_pre_hooks", "forward_hooks", "backward_hooks")]
            extra = [getattr(owner, prefix + n, None) for n in flags]  # a hook's flags, under the same key
            for d in dicts:
                for key, fn in list((d or {}).items()):
                    if getattr(fn, "__self__", None) is self:
                        del d[key]
                        for e in extra:
                            (e or {}).pop(key, None)
        hooks = optimizer_mod._global_optimizer_pre_hooks
        for key, fn in list(hooks.items()):
            if getattr(fn, "__self__", None) is self:
                del hooks[key]

    # -- forward -------------------------------------------------------------------------------
    def _pre_hook(self, module, inputs, kwargs=None):
        if _is_compiling() or not self.active or _get_ident() != self.thread and _current_node() is None:
            return
        if _peek_transform() is not None:  # inside a torch.func transform: hooks would see wrapped tensors
            self._saw("func", module)
            return
        rec = self._modules.get(module)
        if rec is None:
            rec = self._new_record(module)
        rec.open_calls.append(self._open_call(module, rec, inputs, kwargs))
        self._open += 1
        if _current_node() is not None:  # forward rerun by backward: checkpoint
            rec.calls[-1].recomputed = True

    def _new_record(self, module) -> ModuleRecord:
        """A module's first call: what does not change between its calls is decided once, and so is the
        registry's answer for it, which the trace's factor queries and notes take from the record."""
        if self.norms_rule is None:
            return self._decide(module)
        with registry.memo(self._answers):  # norms_rule.wants asks the registry again
            return self._decide(module)

    def _decide(self, module) -> ModuleRecord:
        rec = self._modules[module] = ModuleRecord(module)
        spec, rec.needs_input, rec.stateful, rec.keeps_rows = registry.capture_facts(module, self._answers)
        rec.compiled = "_orig_mod" in module._modules
        rec.generic = self.capture != "summary" and spec is registry.GENERIC
        rec.broadcast = self.capture in ("full", "norms") and spec is not None and _trainable(module)
        if self.capture == "norms":
            rec.norms = self.norms_rule is not None and self.norms_rule.wants(module)
        if self.state is not None:
            self.state.on_call(module)
        if isinstance(module, _DDP):
            self._ddp = True
        return rec

    def _saw(self, what: str, module) -> None:
        self._seen.setdefault(what, {}).setdefault(type(module).__name__, None)

    def _open_call(self, module, rec: ModuleRecord, inputs, kwargs=None) -> Call:
        # `a` is taken before forward runs: an in-place module (ReLU(inplace=True)) rewrites its input.
        if rec.compiled:
            self._saw("compiled", module)
        call = Call(len(rec.calls), seq_start=_next_sequence_nr())
        rec.calls.append(call)
        outer = self._outer
        if self._open == 0:  # an outermost call: a new forward pass
            self._folds.clear()
            self._row_proofs.clear()
            outer.append([])
            if len(outer) > OUTER_CALLS_KEPT:  # no backward came for the oldest: let its graph go
                for c in outer.popleft():
                    c.out_node = None
        if outer:
            outer[-1].append(call)
        a = _first_tensor(inputs) if inputs else _first_tensor(kwargs)
        if self._open == 0:
            self._pass_batch = a.shape[0] if a is not None and a.dim() else None
            if self._pass_batch is not None:
                call.batch = self._pass_batch
                self._batches[call.batch] += 1
        if rec.generic and torch.is_grad_enabled() and self._keep_call(module, call, inputs, kwargs):
            return call  # `a` is the kept copy of its first tensor
        if a is not None:
            node = a.grad_fn
            if node is not None and self._may_be_folded(a):  # samples may be folded into rows: see per_sample
                self._note_fold(call, a, node)
            self._keep_input(rec, call, a)
        return call

    def _forward_hook(self, module, inputs, kwargs, output):
        if _is_compiling() or not self.active or _get_ident() != self.thread and _current_node() is None:
            return None
        if _peek_transform() is not None:
            return None
        rec = self._modules.get(module)
        if rec is None:  # hooks installed mid-call: the pre-hook did not see this call start
            rec = self._new_record(module)
        if rec.open_calls:
            call = rec.open_calls.pop()
            if self._open > 0:
                self._open -= 1
            if rec.generic and call.inputs is not None:
                if kwargs and not call.inputs[1] and self.targets is None:  # no global pre-hook sees keywords
                    self._keep_kwargs(call, kwargs)
            elif not inputs and kwargs and self.targets is None:  # keywords only, which no global pre-hook sees
                a = _first_tensor(kwargs)
                if a is not None:
                    self._keep_input(rec, call, a)
        else:
            call = self._open_call(module, rec, inputs, kwargs)
        if self.backward_hooks:
            rec.awaiting_backward.append(call)
        out = _first_tensor(output)
        replaced = None
        if self.layer_interventions:
            for iv in self.layer_interventions.get(module, ()):
                if iv.kind.attach == "grad" and out is not None and out.requires_grad:
                    _hook_output(self._handles, out, self._guarded(iv.on_grad))
                elif iv.kind.attach == "out":
                    new = iv.on_output(module, inputs, output if replaced is None else replaced)
                    if new is not None:
                        replaced = new
        call.seq_end = _next_sequence_nr()
        if out is not None:
            call.output_shape = tuple(out.shape)
            if call.folded_from is not None and rec.keeps_rows:
                self._fold_output(call, out)
            node = call.out_node = out.grad_fn
            if node is not None:
                self._live.append(call)
            if out.requires_grad:
                _hook_output(self._handles, out, self._delta_hook(module, call))
                if rec.broadcast and len(self._broadcasts) < BROADCASTS_MAX and maybe_broadcast(call.a, out):
                    self._broadcasts.append(call)
        if rec.generic and call.inputs is not None:
            self._hook_outputs(module, call, output, out)
        return replaced

    def _backward_hook(self, module, grad_input, grad_output):
        rec = self._modules.get(module)
        if not self.active or rec is None or not rec.awaiting_backward:
            return None
        g = _first_tensor(grad_input)
        with self._lock:
            rec.awaiting_backward.pop().grad_input = None if g is None else g.detach()
        return None

    def _keep_input(self, rec: ModuleRecord, call: Call, a: torch.Tensor) -> None:
        capture = self.capture
        if rec.stateful:  # e.g. BatchNorm's train/eval mode at this call, for its factor rule later
            call.state = fx.forward_state(rec.module)
        if capture == "full":
            if self._fits(a):
                # Layers whose backward needs their input: autograd's version check guards it,
                # so no copy is needed; `_a_version` catches forward-only cells that mutate it.
                if rec.needs_input and not a.is_inference():
                    call.a = a.detach()  # shares a's version counter: no reference to a (and its graph) is held
                    call._a_version = a._version
                else:  # copy-on-write: memory is copied only if the input is later written in place
                    call.a = a.detach().clone() if a.is_inference() else _copy(a)
                return
        elif capture == "norms":
            if rec.norms:
                call.a = a.detach()
                self.norms_rule.on_input(rec.module, call)
            return
        self._pending.append((call, "a_summary", tuple(a.shape), a.dtype, self._stats.stats(a, copy=True)))

    def _delta_hook(self, module, call: Call):
        def hook(grad):
            if not self.active:
                return
            with self._lock:
                if call.step is None and self._step is not None:
                    call.step = self._step.index
                if self.capture == "norms":
                    call.delta = grad.detach()
                    self.norms_rule.on_delta(module, self._modules)
                elif call.delta is not None:  # another backward through the same graph: sum, as .grad does
                    call.delta = call.delta + grad.detach()
                    self._passes_summed += 1
                elif self.capture == "full" and self._fits(grad):
                    call.delta = grad.detach()
                else:  # a copy: a hook that runs after this one may change grad in place
                    self._pending.append(
                        (call, "delta_summary", tuple(grad.shape), grad.dtype, self._stats.stats(grad, copy=True)))
            return

        return hook

    def _fits(self, t: torch.Tensor) -> bool:
        return self._fits_bytes(t.numel() * t.element_size())

    # -- backward (called by autograd_calls for every backward / autograd.grad of this thread) ---
    def on_backward(self, tensors: list, kind: str, create_graph: bool) -> None:
        if not self.active:
            return
        self._create_graph |= create_graph
        self._used_grad |= kind == "grad"
        self._depth += 1
        if self._depth == 1:  # a new step; a nested call (reentrant checkpoint) belongs to the running one
            self._step = StepRecord(len(self._steps), kind, [r.detach().clone() for r in tensors if r.numel() == 1])
            self._steps.append(self._step)
            self._walk = graph_mod.GraphWalk()
            self._unhooked = []
            self._node_refs = {}  # the previous step's node gradients go: only the last step's graph is shown
        self._extend_walk(tensors)
        if self._broadcasts and self._depth == 1:
            self._hook_broadcasts()
        if self._joins and self._depth == 1:
            self._hook_joins()

    def on_backward_end(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and self.active:
            self._end_step()

    def _extend_walk(self, tensors: list) -> None:
        walk, step = self._walk, self._step
        new_nodes = walk.extend([r.grad_fn for r in tensors if r.grad_fn is not None])
        if self.node_grads is None:
            self.node_grads = len(walk.nodes) <= AUTO_NODE_GRADS_MAX
            if not self.node_grads:
                self._notes.append(f"the graph has {len(walk.nodes)} nodes: gradient norms are shown for layer "
                                   "outputs and parameters only; trace with node_grads=True for every node")
        node_grads = self.node_grads
        if node_grads and self._depth > 1:  # norms derived after nested passes would be inexact
            for i in self._unhooked:
                self._node_handles.append(walk.nodes[i].register_prehook(self._node_hook(i)))
            self._unhooked = []
        out_nodes = self._output_nodes() if node_grads and self._depth == 1 else ()
        backward = step.kind == "backward"
        # A leaf whose .grad was None before this pass: what arrives at its AccumulateGrad node is the
        # .grad copied when the pass ends (see _derive_node_norms), unless DDP averages .grad in between.
        derive_leaves = node_grads and backward and self._depth == 1 and not self._ddp
        interventions = self.node_interventions
        nodes, names, before = walk.nodes, walk.names, step.before
        derived, hooked = set(), []  # nodes whose norms come from δ or .grad / that need a hook, so far
        for i in new_nodes:
            node = nodes[i]
            variable = node.variable if names[i] == "AccumulateGrad" else None
            if variable is not None and backward and variable not in before:
                before[variable] = None if variable.grad is None else self._grad_before(variable)
            ivs = interventions.get(walk.ids[i], ()) if interventions else ()
            for iv in ivs:
                self._node_handles.append(node.register_prehook(self._guarded(iv.on_node_grads)))
            if not node_grads:
                continue
            if not ivs and (node in out_nodes or derive_leaves and variable is not None
                            and before.get(variable, PREVIOUS) is None):
                derived.add(i)  # what arrives there is the layer's δ or the new .grad: derived at the end
                self._unhooked.append(i)
            else:
                hooked.append(i)
        if hooked and self._depth == 1:
            hooked = self._alias_views(new_nodes, derived, hooked, out_nodes)
        for i in hooked:
            self._node_handles.append(nodes[i].register_prehook(self._node_hook(i)))

    def _alias_views(self, new_nodes: list, derived: set, hooked: list, out_nodes) -> list:
        """Nodes that the same gradient arrives at, reshaped, need one reduction between them.

        A view-like node (view, reshape, transpose, permute, squeeze, clone) passes on what arrives
        there with its values unchanged; when its only input is a node that nothing else feeds, that
        node receives the very same values. Along such a chain the norms are one: taken from a member
        whose norms are derived (a layer's δ, a parameter's .grad) or else from one hook at the top.
        Returns the nodes that still need a hook; the others get their shape from autograd's metadata."""
        walk = self._walk
        nodes, names, index = walk.nodes, walk.names, walk._index
        views = [i for i in new_nodes if names[i] in VIEW_NODES]
        if not views:
            return hooked
        interventions = self.node_interventions
        new = set(new_nodes)
        parents = Counter(v for _, v in walk.edges)
        link = {}  # parent -> child, both new, equal norms
        for i in views:
            nxt = [f for f, _ in nodes[i].next_functions if f is not None]
            if len(nxt) != 1:
                continue
            j = index.get(nxt[0])
            if (j is None or j not in new or parents[j] != 1 or nodes[j] in out_nodes
                    or interventions and (walk.ids[i] in interventions or walk.ids[j] in interventions)):
                continue  # a module output's own hooks (interventions) may change what arrives at it
            link[i] = j
        if not link:
            return hooked
        linked = set(link.values())
        same = {}
        for top in link:
            if top in linked:
                continue  # not the top of its chain
            chain = [top]
            while chain[-1] in link:
                chain.append(link[chain[-1]])
            source = next((m for m in chain if m in derived), chain[0])
            for m in chain:
                if m != source and m not in derived:
                    same[m] = source
        shapes = {}
        for m in same:
            try:
                shapes[m] = tuple(nodes[m]._input_metadata[0].shape)
            except Exception:  # no metadata (another torch): keep its hook
                continue
        walk.same_norm.update((m, same[m]) for m in shapes)
        walk.shape.update(shapes)
        self._unhooked += list(shapes)
        return [i for i in hooked if i not in shapes]

    def _grad_before(self, leaf: torch.Tensor):
        g = leaf.grad
        if g is None:
            return None
        state = self._grad_state.get(leaf)
        if state is not None and state[0]() is g and state[1] == g._version:
            return PREVIOUS
        return self._keep_grad(g)

    def _keep_grad(self, g: torch.Tensor) -> torch.Tensor:
        """A copy of a .grad: the record must not change when the user's code changes .grad later.
        It counts against the budget; older steps' copies give way first (see _trim_grad_copies)."""
        self._kept_bytes += g.numel() * g.element_size()
        return _copy(g)

    def _copy_grads(self, grads: list) -> list:
        """_keep_grad of many .grads."""
        for g in grads:
            self._kept_bytes += g.numel() * g.element_size()
        if _lazy_clone is None or _NO_LAZY:
            return [_copy(g) for g in grads]
        with torch.no_grad():
            try:
                return [_lazy_clone(g) for g in grads]
            except Exception:  # a layout without plain storage (sparse): copies, one by one
                return [_copy(g) for g in grads]

    def _trim_grad_copies(self) -> None:
        """Over budget: the .grad copies of older steps become summaries, oldest first. The latest
        step's copies stay: they are what the trace reports as .grad."""
        while self._kept_bytes > self.budget_bytes and self._trimmed < len(self._steps) - 1:
            step = self._steps[self._trimmed]
            self._trimmed += 1
            kept = [(d, leaf, g) for d in (step.before, step.after) for leaf, g in d.items()
                    if isinstance(g, torch.Tensor)]
            summaries = to_summaries([(tuple(g.shape), g.dtype, stats_on_device(g)) for _, _, g in kept])
            for (d, leaf, g), summary in zip(kept, summaries):  # one host transfer per step
                d[leaf] = summary
                self._kept_bytes -= g.numel() * g.element_size()
                self._dropped_grads += 1

    def _end_step(self) -> None:
        step = self._step
        leaves = list(step.before)
        grads = [leaf.grad for leaf in leaves]
        copies = iter(self._copy_grads([g for g in grads if g is not None]))
        step.after.update(zip(leaves, [None if g is None else next(copies) for g in grads]))
        self._grad_state.update(zip(leaves, [None if g is None else (weakref.ref(g), g._version) for g in grads]))
        self._trim_grad_copies()
        self._stats.flush()  # the tensors it holds may go with the step
        for h in self._node_handles:  # a parameter's AccumulateGrad node lives on: its hooks must not pile up
            h.remove()
        self._node_handles = []
        self._handles = [h for h in self._handles if h.hooks_dict_ref() is not None]  # outputs still alive
        self._note_output_nodes(step)
        if self.norms_rule is not None:
            common = self._batches.most_common(1)
            self.norms_rule.end_step(self._modules, common[0][0] if common else None)
        self._batches = Counter()
        self._step = None
        self._outer.clear()
        for c in self._live:
            c.out_node = None  # the graph of this step may go when the user lets it go
        self._live = []
        self._walk.freeze()

    def _output_nodes(self) -> set:
        """grad_fn of every recorded call's output, where a δ hook will see what arrives there."""
        return {c.out_node for c in self._live if c.out_node is not None}

    def _node_hook(self, i: int):
        """Keeps the gradient arriving at node i by reference: only the last step's are reduced (in
        _finish, all at once); a new step lets the previous step's go."""
        refs = self._node_refs

        def hook(grad_outputs):
            if self.active and grad_outputs:
                g = grad_outputs[0]
                if g is not None:
                    refs[i] = g
            return None

        return hook

    def _guarded(self, fn):
        def hook(*args):
            if not self.active:
                return None
            return fn(*args)

        return hook

    # -- end of a step and of the trace --------------------------------------------------------
    def _note_output_nodes(self, step: StepRecord) -> None:
        """Before the step's graph is let go: which node each call of this step produced."""
        index = self._walk._index
        self._out_index = {index[c.out_node]: c for c in self._live
                           if c.out_node is not None and c.step == step.index and c.out_node in index}

    def _reduce_node_refs(self) -> None:
        """Norms of what arrived at the hooked nodes of the last step: a few multi-tensor reductions for
        them all, on their device (read when the graph is built)."""
        refs, self._node_refs = self._node_refs, {}
        if not refs or not self._steps:
            return
        walk = self._walk
        now, held = {}, 0
        for k, (i, g) in enumerate(refs.items()):  # insertion order: the order backward reached them
            walk.shape.setdefault(i, tuple(g.shape))
            walk.order.setdefault(i, k)
            n = g.numel()
            if n <= LAZY_NODE_NUMEL and held + n <= LAZY_NODE_TOTAL and _sole_owner(g):  # nothing else can change it
                held += n
                walk.pending_norms[i] = g  # small: reduced if and when the graph is built
            else:
                now[i] = g
        if now:
            walk.grad_norm.update(fused_norms(now))

    def _derive_node_norms(self) -> None:
        """Norms of the gradient arriving at layer-output nodes (δ) and leaf nodes (.grad) of the last
        step's graph, where no node hook recorded them. Exact for one pass through the graph and a
        .grad that started as None."""
        walk, step = self._walk, self._steps[-1] if self._steps else None
        if self._passes_summed or step is None:
            return
        pending = {}
        for i, c in self._out_index.items():
            if i in walk.grad_norm:
                continue
            walk.shape.setdefault(i, c.output_shape)
            if c.delta is not None:
                pending[i] = c.delta
            elif c.delta_summary is not None:
                d = c.delta_summary
                walk.grad_norm[i] = (d.norm, abs_max(d.min, d.max))
        for i, leaf in enumerate(walk.variables):
            if leaf is None or i in walk.grad_norm or step.before.get(leaf, 0) is not None:
                continue
            g = step.after.get(leaf)
            if isinstance(g, torch.Tensor):
                pending[i] = g
            elif g is not None:
                walk.grad_norm[i] = (g.norm, abs_max(g.min, g.max))
        walk.pending_norms.update(pending)  # reduced when the graph is built (graph.build)

    def _finish(self) -> Records:
        self._row_proofs.clear()  # it holds the last forward pass's graph nodes
        if not self._steps:  # forward only: show the graph that backward would have walked
            self._walk.extend(_outermost_outputs(self._modules.values()))
            self._walk.freeze()
        self._stats.flush()
        pending, self._pending = self._pending, []
        for (call, attr, *_), s in zip(pending, to_summaries([p[2:] for p in pending])):
            setattr(call, attr, s)
        self._drop_recomputed_calls()
        self._reduce_node_refs()
        self._derive_node_norms()
        self._own_what_is_kept()
        if self._dropped or self._dropped_grads:
            self._notes.append(f"memory budget {self.budget_bytes / 2**20:g} MB reached: "
                               + ", ".join(part for part in (
                                   f"{self._dropped} activations or gradients" if self._dropped else "",
                                   f"{self._dropped_grads} .grad copies of earlier steps" if self._dropped_grads
                                   else "") if part)
                               + " kept as summaries only (shape, norm, min/max/mean, NaN/Inf); "
                               "raise budget_mb to keep them")
        if not self._steps:
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
        for c in self._live:
            c.out_node = None
        self._live = []
        unchanged = {leaf: state is None and leaf.grad is None or state is not None and state[0]() is leaf.grad
                     and leaf.grad is not None and state[1] == leaf.grad._version
                     for leaf, state in self._grad_state.items()}
        return Records(self._modules, self._walk, self._steps, unchanged, self._notes, self._used_grad, no_factors,
                       self._answers)

    def _own_what_is_kept(self) -> None:
        """Make the record immune to what the user does next: an input kept by reference (it was
        guarded by autograd's version check while the trace ran) or a δ that shares memory with a
        live tensor (a .grad that autograd stole it for) is copied, unless the trace alone holds it
        (capture_tensors.own: memory several calls keep is one copy at most)."""
        slots = []
        for rec in self._modules.values():
            for call in rec.calls:
                if call._a_version >= 0 and call.a is not None and call.a._version != call._a_version:
                    call.a = None
                    self._notes.append(f"{type(rec.module).__name__}: an input was modified in place after "
                                       "the call; its activation was not kept")
                if call.a is not None and (call._a_version >= 0 or self.capture == "norms"):
                    slots.append((call, "a"))  # (else a copy, the trace's own already)
                call._a_version = -1
                if call.deltas is not None:
                    link_first_delta(call)
                slots += [(call, k) for k in ("delta", "bdelta") if getattr(call, k) is not None]
                for parts in (call.deltas, call.rule_parts):
                    if parts:
                        slots += [(parts, k) for k, v in (enumerate(parts) if isinstance(parts, list) else
                                                          parts.items()) if v is not None]
        own(slots)
        self._snapshots = {}

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
        }
        notes = [text[k] for k in text if k in seen]
        if scripted:
            notes.append(f"ScriptModule ({', '.join(scripted)}): hooks do not fire inside TorchScript, so its "
                         "layers are not shown; trace the module before torch.jit.script")
        if self._ddp:  # a DistributedDataParallel module's record was made (see _decide)
            notes.append("DistributedDataParallel: .grad is averaged over ranks after backward; a, δ, weight_grad "
                         "and per-sample gradients are this rank's own (its samples, before the all-reduce)")
        return notes


_next_sequence_nr = torch._C._autograd._get_sequence_nr
_DDP = nn.parallel.DistributedDataParallel
_get_ident = threading.get_ident
_current_node = torch._C._current_autograd_node
_peek_transform = torch._C._functorch.peek_interpreter_stack
_is_compiling = torch.compiler.is_compiling


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


def _trainable(module: nn.Module) -> bool:
    """Whether any parameter of the module (its submodules' included) requires grad; its own are asked first
    (module.parameters() walks every submodule through generators: ~8 µs for a Linear)."""
    for p in module._parameters.values():
        if p is not None and p.requires_grad:
            return True
    return bool(module._modules) and any(p.requires_grad for p in module.parameters())


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
