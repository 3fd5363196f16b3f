"""The Tracer: runs code with hooks on and records what every module saw.

Forward: each module call's input activation `a` and output. Backward: δ, the gradient
with respect to the module's output, through a tensor hook registered on the output
inside the forward hook (exact, and it survives a later in-place op, where full module
backward hooks raise). Each backward pass is a step: when it starts, its autograd graph
is walked from its roots (nodes.py, where pre-hooks record the gradient norm arriving at
nodes); when it ends, the .grad it left is copied, so nothing done later changes the record.

What a call keeps is its keep strategy's choice (keep.py: full, summary, norms; the watch's "stats",
step_stats.py, streams and records nothing), within the trace's memory budget (budget.py); what the
generic rule needs beyond (a, δ) is generic.py's, folded rows folds.py's, the .grad copies grads.py's,
and what is done to the record when the trace ends finish.py's. The tracer hooks every call the same
way and asks them.

Module hooks belong to one ExitStack, tensor and node hooks to the lists of handles.Hooks, all
emptied in `finally`, and a last sweep removes anything an interrupt left half-registered. Each
hook also checks `hooks.active`, because a hook baked into a graph that outlives the trace can
still fire.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from contextlib import ExitStack
from functools import partial

import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hookwidget._torch.autograd import current_node as _current_node
from hookwidget._torch.autograd import in_transform
from hookwidget._torch.autograd import next_sequence_nr as _next_sequence_nr
from hookwidget._torch.autograd import peek_transform as _peek_transform
from hookwidget._torch.compile import is_compiled
from hookwidget._torch.modules import (
    drop_global_kwargs_flag,
    full_backward_flag_kept,
    hook_flags,
    module_hooks,
    optimizer_hooks,
)
from hookwidget.capture import backward as autograd_calls
from hookwidget.capture import finish
from hookwidget.capture import keep as keep_mod
from hookwidget.capture.budget import Budget
from hookwidget.capture.folds import Folds
from hookwidget.capture.generic import GenericCapture
from hookwidget.capture.grads import GradCopies
from hookwidget.capture.handles import Hooks, Removing, every_module, module_list
from hookwidget.capture.nodes import NodeNorms
from hookwidget.capture.tensors import first_tensor, hook_output, intervene
from hookwidget.layers import factors as fx
from hookwidget.layers import registry
from hookwidget.options import DEFAULT_BUDGET_MB
from hookwidget.record.calls import Call, ModuleRecord, Records, StepRecord

OUTER_CALLS_KEPT = 4  # forward passes whose graph a trace may hold before a backward (an eval loop holds none more)


class Tracer:
    """Context manager that owns every hook of one trace; `records` is filled on exit.

    capture: the keep strategy's name (keep.py); norms_rule: the object that strategy streams into (None: its
    own); budget_mb: megabytes for kept tensors and .grad copies (options.py)."""

    def __init__(self, modules=None, capture: str = keep_mod.FULL, budget_mb: float = DEFAULT_BUDGET_MB,
                 layer_interventions=None, node_interventions=None, node_grads: bool | None = None, norms_rule=None,
                 backward_hooks: bool = False, state=None):
        self._options = capture, budget_mb, norms_rule, node_grads, node_interventions or {}
        self.targets = module_list(modules)
        self.layer_interventions = layer_interventions or {}
        # Full module backward hooks show grad_input too, but raise when an in-place op follows a
        # module and add nodes to the graph: opt-in only.
        self.backward_hooks = backward_hooks
        self.state = state  # a RunState to tell what the code changes (state.py), or None
        self.thread = threading.get_ident()  # the thread whose code this trace records
        self._stack = ExitStack()
        self._answers: dict = {}  # the registry's answers, asked at each module's first call (registry.memo)
        self._start_run()

    def _start_run(self) -> None:
        """What one recording fills, from nothing: made at __init__, and again by `cut` (hooks staying on)."""
        capture, budget_mb, norms_rule, node_grads, node_interventions = self._options
        self.budget = Budget(budget_mb)
        self.keep = keep_mod.make(capture, self.budget, norms_rule)
        self.norms_rule = self.keep.rule  # what the strategy streamed (capture="norms": per-sample norms)
        self.hooks = Hooks()
        self._handles = self.hooks.tensor  # tensor hook handles on module outputs
        self._notes: list = []
        # A pre-hook on every node costs a Python call and a reduction per node: on by default only
        # for small graphs (None: decided when backward starts); module outputs and leaves get
        # their norms from δ and .grad anyway (see nodes.py).
        self.graph = NodeNorms(node_grads if self.keep.node_grads else False, node_interventions, self.hooks,
                               self._notes)
        self._generic = GenericCapture(self.hooks, self.budget)
        self._folds = Folds()
        self._batches = Counter()  # this step's outermost calls: their inputs' leading dimensions (Call.batch)
        self.records: Records | None = None
        self._module_records: dict = {}
        self._steps: list[StepRecord] = []
        self._depth = 0  # nested backward calls inside one pass (reentrant checkpoint)
        self._grads = GradCopies(self.budget)  # the .grad each step leaves
        self._open = 0  # forward calls running now
        self._outer: deque = deque()  # calls of the latest outermost forward passes (their out_node is kept)
        self._used_grad = False
        self._create_graph = False
        self._passes_summed = 0
        self._unseen = False  # δ arrived outside every backward pass seen (torch.autograd.grad bound before)
        self._seen: dict = {}  # what hooks cannot see, by kind -> class names (see finish.unseen_notes)
        self._live: list = []  # calls whose out_node is set (since the last step ended)
        self._ddp = False  # a DistributedDataParallel module ran (it averages .grad after backward)

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        if in_transform():
            raise RuntimeError("hookwidget cannot trace inside a torch.func transform (vmap, grad, jacrev, ...): "
                               "hooks would see wrapped tensors; call hw.trace outside the transform")
        for m in self.targets or ():
            if is_compiled(m):
                self._saw("compiled", m)
        try:
            self._install()
        except BaseException:
            self._close()
            raise
        self.hooks.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.active = False
        self._close()
        try:
            self.records = self._finish()
        except Exception:
            if exc[0] is None:
                raise  # otherwise the cell's own exception propagates, not hookwidget's

    def _close(self) -> None:
        try:
            for h in self.hooks.tensor + self.hooks.node:
                h.remove()
            self.hooks.tensor.clear()
            self.hooks.node.clear()
        finally:
            self._stack.close()

    def cut(self) -> Records | None:
        """The records so far, as `records` would be at exit, while the hooks stay on: from now on this tracer
        records from nothing, with the same options (the flight recorder's one tracer per watch, cut at each
        step's end, instead of hooks put on and off every step). The registry's answers are kept: the modules
        are the same."""
        records = self._finish()
        for h in self.hooks.tensor + self.hooks.node:
            h.remove()
        self.hooks.active = False  # a δ hook left on a graph that outlives the step stays quiet: it holds these hooks
        self._start_run()
        self.hooks.active = True
        return records

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
            s.callback(drop_global_kwargs_flag, handle.id)
            if self.backward_hooks:  # the global flag it sets outlives the hook: put it back
                s.enter_context(full_backward_flag_kept())
                s.enter_context(Removing(module_mod.register_module_full_backward_hook(self._backward_hook)))
        elif not self.keep.records:  # a streaming strategy: the targets themselves, one forward hook each
            for m in self.targets:
                s.enter_context(Removing(m.register_forward_hook(self._stream_hook)))
        else:
            for m in every_module(self.targets):
                s.enter_context(Removing(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True)))
                s.enter_context(Removing(m.register_forward_hook(self._forward_hook, with_kwargs=True)))
                if self.backward_hooks:
                    s.enter_context(Removing(m.register_full_backward_hook(self._backward_hook)))
        if self.state is not None or self.keep.updates:
            s.enter_context(Removing(register_optimizer_step_pre_hook(self._optimizer_hook)))
        if self.keep.updates:
            s.enter_context(Removing(register_optimizer_step_post_hook(self._optimizer_post_hook)))
        autograd_calls.listen(self)

    def _optimizer_hook(self, opt, args, kwargs):
        if self.hooks.active and threading.get_ident() == self.thread:
            if self.state is not None:
                self.state.on_optimizer_step(opt)
            self.keep.before_update(opt)

    def _optimizer_post_hook(self, opt, args, kwargs):
        if self.hooks.active:
            self.keep.after_update(opt)

    def _hooked(self) -> list:
        """The modules whose own hooks this tracer registers (targets given)."""
        return every_module(self.targets) if self.keep.records else self.targets

    def _sweep(self) -> None:
        """Remove any hook of this tracer still registered: one an interrupt left between its
        registration and its handle reaching the ExitStack."""
        for owner in [None] if self.targets is None else self._hooked():  # None: the global hooks
            hooks, flags = module_hooks(owner), hook_flags(owner)  # a hook's flags, under the same key
            for d in (hooks["forward_pre"], hooks["forward"], hooks["backward"]):
                for key, fn in list(d.items()):
                    if getattr(fn, "__self__", None) is self:
                        del d[key]
                        for e in flags:
                            e.pop(key, None)
        for hooks in optimizer_hooks():
            for key, fn in list(hooks.items()):
                if getattr(fn, "__self__", None) is self:
                    del hooks[key]

    # -- forward and δ of a streaming strategy (records = False) --------------------------------------
    def _stream_hook(self, module, inputs, output):
        if _is_compiling():  # Dynamo traces this branch into the compiled graph
            return self.keep.compiled_call(module, inputs, output) if self.hooks.active else None
        if not self.hooks.active:
            return None
        if _current_node() is not None:  # rerun by backward: gradient checkpointing
            self.keep.on_rerun(module)
            return None
        if _get_ident() != self.thread:
            return None
        out = first_tensor(output)
        if out is None or not out.requires_grad:
            return None
        token = self.keep.on_call(module, inputs, out)
        if token is not None:
            hook_output(self.hooks.tensor, out, self._delta_hook(module, token, streaming=True))
        return None

    # -- forward -------------------------------------------------------------------------------
    def _pre_hook(self, module, inputs, kwargs=None):
        if _is_compiling() or not self.hooks.active or _get_ident() != self.thread and _current_node() is None:
            return
        if _peek_transform() is not None:  # inside a torch.func transform: hooks would see wrapped tensors
            self._saw("func", module)
            return
        rec = self._module_records.get(module)
        if rec is None:
            rec = self._new_record(module)
        rec.open_calls.append(self._open_call(module, rec, inputs, kwargs))
        self._open += 1
        if _current_node() is not None:  # forward rerun by backward: checkpoint
            rec.calls[-1].recomputed = True

    def _new_record(self, module) -> ModuleRecord:
        """A module's first call: what does not change between its calls is decided once, and so is the
        registry's answer for it, which the trace's factor queries and notes take from the record."""
        rec = self._module_records[module] = ModuleRecord(module)
        spec, rec.needs_input, rec.stateful, rec.keeps_rows = registry.capture_facts(module, self._answers)
        rec.compiled = is_compiled(module)
        self.keep.decide(rec, module, spec, self._answers)
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
            self._folds.new_pass()
            outer.append([])
            if len(outer) > OUTER_CALLS_KEPT:  # no backward came for the oldest: let its graph go
                for c in outer.popleft():
                    c.out_node = None
        if outer:
            outer[-1].append(call)
        a = first_tensor(inputs) if inputs else first_tensor(kwargs)
        folds = self._folds
        if self._open == 0:
            folds.batch = a.shape[0] if a is not None and a.dim() else None
            if folds.batch is not None:
                call.batch = folds.batch
                self._batches[call.batch] += 1
        if rec.generic and torch.is_grad_enabled() and self._generic.keep_call(module, call, inputs, kwargs):
            kept = call.inputs
            self.keep.on_generic_inputs(call, kept[0] if kept[0] else kept[1])
            return call
        if a is not None:
            node = a.grad_fn
            if node is not None and folds.may_be_folded(a):  # samples may be folded into rows: see per_sample
                folds.note(call, a, node)
            self._keep_input(rec, call, a)
        return call

    def _forward_hook(self, module, inputs, kwargs, output):
        if _is_compiling() or not self.hooks.active or _get_ident() != self.thread and _current_node() is None:
            return None
        if _peek_transform() is not None:
            return None
        rec = self._module_records.get(module)
        if rec is None:  # hooks installed mid-call: the pre-hook did not see this call start
            rec = self._new_record(module)
        call = self._close_call(module, rec, inputs, kwargs)
        if self.backward_hooks:
            rec.awaiting_backward.append(call)
        out = first_tensor(output)
        ivs = self.layer_interventions
        replaced = intervene(self.hooks, ivs[module], module, inputs, output, out) if module in ivs else None
        call.seq_end = _next_sequence_nr()
        if out is not None:
            self._on_output(module, rec, call, out)
        if rec.generic and call.inputs is not None:
            self._generic.hook_outputs(module, call, output, out)
        return replaced

    def _close_call(self, module, rec: ModuleRecord, inputs, kwargs) -> Call:
        """The call the pre-hook opened, its keywords kept where only the forward hook sees them (no global
        pre-hook does); or a call opened now, where the pre-hook did not see it start."""
        if not rec.open_calls:
            return self._open_call(module, rec, inputs, kwargs)
        call = rec.open_calls.pop()
        if self._open > 0:
            self._open -= 1
        if rec.generic and call.inputs is not None:
            if kwargs and not call.inputs[1] and self.targets is None:  # no global pre-hook sees keywords
                kept = self._generic.keep_kwargs(call, kwargs)
                if kept is not None:
                    self.keep.on_generic_inputs(call, kept)
        elif not inputs and kwargs and self.targets is None:  # keywords only, which no global pre-hook sees
            a = first_tensor(kwargs)
            if a is not None:
                self._keep_input(rec, call, a)
        return call

    def _on_output(self, module, rec: ModuleRecord, call: Call, out: torch.Tensor) -> None:
        call.output_shape = tuple(out.shape)
        if call.folded_from is not None and rec.keeps_rows:
            self._folds.output(call, out)
        node = call.out_node = out.grad_fn
        if node is not None:
            self._live.append(call)
        if out.requires_grad:
            hook_output(self.hooks.tensor, out, self._delta_hook(module, call))
            if rec.broadcast:
                self._generic.note_broadcast(call, out)

    def _backward_hook(self, module, grad_input, grad_output):
        rec = self._module_records.get(module)
        if not self.hooks.active or rec is None or not rec.awaiting_backward:
            return None
        g = first_tensor(grad_input)
        with self.hooks.lock:
            rec.awaiting_backward.pop().grad_input = None if g is None else g.detach()
        return None

    def _keep_input(self, rec: ModuleRecord, call: Call, a: torch.Tensor) -> None:
        if rec.stateful:  # e.g. BatchNorm's train/eval mode at this call, for its factor rule later
            call.state = fx.forward_state(rec.module)
        self.keep.on_input(rec, call, a)

    def _delta_hook(self, module, call, streaming: bool = False):
        """The δ hook of one call (streaming: `call` is the strategy's token). It holds this run's Hooks, so
        that a hook left on a graph that outlives the run (or a cut) stays quiet; a partial is two objects
        per call where a closure is eight."""
        return partial(self._stream_delta if streaming else self._record_delta, self.hooks, module, call)

    def _stream_delta(self, hooks: Hooks, module, token, grad) -> None:
        if hooks.active:  # the strategy takes its own lock, after reducing δ
            self.keep.on_delta(module, token, grad, self._module_records)

    def _record_delta(self, hooks: Hooks, module, call: Call, grad) -> None:
        if not hooks.active:
            return
        with hooks.lock:
            if hooks.step is None:  # δ of a pass the stand-in did not see start (an imported grad)
                self._unseen = True
            hooks.step_index(call)
            if self.keep.on_delta(module, call, grad, self._module_records):
                self._passes_summed += 1

    # -- backward (called by autograd_calls for every backward / autograd.grad of this thread) ---
    def on_backward(self, tensors: list, kind: str, create_graph: bool) -> None:
        if not self.hooks.active:
            return
        if not self.keep.records:
            self._depth += 1
            if self._depth == 1:
                self.keep.begin_pass(kind, tensors)
            return
        self._create_graph |= create_graph
        self._used_grad |= kind == "grad"
        self._depth += 1
        if self._depth == 1:  # a new step; a nested call (reentrant checkpoint) belongs to the running one
            step = self.hooks.step = StepRecord(len(self._steps), kind,
                                                [r.detach().clone() for r in tensors if r.numel() == 1])
            self._steps.append(step)
            self.graph.new_step()
            self.keep.begin_step(step)
        self.graph.extend(tensors, self.hooks.step, self._depth, self._live, self._ddp, self._grads.before)
        if self._depth == 1:
            self._generic.hook_step(self.graph.walk)

    def on_backward_end(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and self.hooks.active:
            if self.keep.records:
                self._end_step()
            else:
                self.hooks.tensor[:] = [h for h in self.hooks.tensor if h.hooks_dict_ref() is not None]
                self.keep.end_pass()

    def _end_step(self) -> None:
        hooks = self.hooks
        step = hooks.step
        self._grads.after(step, self._steps)
        self.budget.stats.flush()  # the tensors it holds may go with the step
        hooks.remove_node_hooks()  # a parameter's AccumulateGrad node lives on: its hooks must not pile up
        hooks.tensor[:] = [h for h in hooks.tensor if h.hooks_dict_ref() is not None]  # outputs still alive
        self.graph.note_output_nodes(step, self._live)
        self.keep.end_step(self._module_records, self._batches)
        self._batches = Counter()
        hooks.step = None
        self._outer.clear()
        for c in self._live:
            c.out_node = None  # the graph of this step may go when the user lets it go
        self._live = []
        self.graph.walk.freeze()

    # -- end of the trace ----------------------------------------------------------------------
    def _finish(self) -> Records | None:
        if not self.keep.records:
            return None
        self._folds.clear()  # it holds the last forward pass's graph nodes
        walk = self.graph.walk
        if not self._steps:  # forward only: show the graph that backward would have walked
            walk.extend(finish.outermost_outputs(self._module_records.values()))
            walk.freeze()
        self.budget.finish()
        notes = self._notes
        finish.drop_recomputed_calls(self._module_records, notes)
        self.graph.finish(self._steps, self._passes_summed)
        finish.own_what_is_kept(self._module_records, self.keep.shares_inputs, notes)
        self._generic.release()
        budget_note = self.budget.note()
        if budget_note:
            notes.append(budget_note)
        more, no_factors = finish.closing_notes(self._module_records, self._seen, self._ddp, stepped=bool(self._steps),
                                                used_grad=self._used_grad, create_graph=self._create_graph,
                                                passes_summed=self._passes_summed, unseen=self._unseen)
        notes += more
        for c in self._live:
            c.out_node = None
        self._live = []
        return Records(self._module_records, walk, self._steps, self._grads.unchanged(), notes,
                       self._used_grad, no_factors, self._answers)


_DDP = nn.parallel.DistributedDataParallel
_get_ident = threading.get_ident
_is_compiling = torch.compiler.is_compiling
