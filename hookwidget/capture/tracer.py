"""The Tracer: runs code with hooks on and records what every module saw.

Forward: each module call's input activation `a` and output. Backward: δ, the gradient
with respect to the module's output, through a tensor hook registered on the output
inside the forward hook (exact, and it survives a later in-place op, where full module
backward hooks raise). Each backward pass is a step: when it starts, its autograd graph
is walked from its roots (nodes.py, where pre-hooks record the gradient norm arriving at
nodes); when it ends, the .grad it left is copied, so nothing done later changes the record.

What a call keeps is its keep strategy's choice (keep.py: full, summary, norms; the watch's "stats",
step_stats.py, streams and records nothing), within the trace's memory budget (budget.py); what the
generic rule needs beyond (a, δ) is generic.py's, where the samples are samples.py's, the .grad copies grads.py's,
and what is done to the record when the trace ends finish.py's. What the hooks fill belongs to a
Recording (recording.py): one per trace, or one per step where the flight recorder cuts the tracer. The
tracer hooks every call the same way and asks them.

Module hooks belong to one ExitStack, tensor and node hooks to the lists of handles.Hooks, all
emptied in `finally`, and a last sweep removes anything an interrupt left half-registered. Each
hook also checks `hooks.active`, because a hook baked into a graph that outlives the trace can
still fire.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from functools import partial

import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hookwidget._torch.autograd import checkpoint_frame, in_transform
from hookwidget._torch.autograd import current_node as _current_node
from hookwidget._torch.autograd import next_sequence_nr as _next_sequence_nr
from hookwidget._torch.autograd import peek_transform as _peek_transform
from hookwidget._torch.compile import can_run_eagerly, eagerly, is_compiled, uncompiled
from hookwidget._torch.modules import (
    drop_global_kwargs_flag,
    full_backward_flag_kept,
    hook_flags,
    module_hooks,
    optimizer_hooks,
)
from hookwidget.capture import backward as autograd_calls
from hookwidget.capture import keep as keep_mod
from hookwidget.capture.handles import Hooks, Removing, every_module, module_list
from hookwidget.capture.recording import Recording
from hookwidget.capture.tensors import first_tensor, hook_output, intervene
from hookwidget.layers import factors as fx
from hookwidget.layers import registry
from hookwidget.layers.batch_first import stated_samples
from hookwidget.options import DEFAULT_BUDGET_MB
from hookwidget.record.calls import Call, ModuleRecord, Records, StepRecord

OUTER_CALLS_KEPT = 4  # forward passes whose graph a trace may hold before a backward (an eval loop holds none more)


class Tracer:
    """Context manager that owns every hook of one trace; `records` is filled on exit.

    capture: the keep strategy's name (keep.py); norms_rule: the object that strategy streams into (None: its
    own); budget_mb: megabytes for kept tensors and .grad copies (options.py); fast_captures: whether the generic
    rule's modules give their fast rules the parts of their own graph (layers/generic.FAST_CAPTURES) as they run;
    eager: compiled code runs eagerly while the tracer is on, so that every layer's hooks fire (_torch/compile.py;
    the watch keeps it compiled). A torch.compile wrapper is never a layer: a target is the model it wraps, and a
    wrapper's own call is skipped (its model's call is the layer), so layers are named as in the eager model.
    wrappers: torch.compile wrappers the code reads by name; with targets given no hook sees their calls, so
    their note (ran eagerly, or could not) is written from this list.
    batch_dim: the dim of the model's inputs holding the samples, as the user declared it (None: the module's
    batch_first, else 0; samples.py)."""

    def __init__(self, modules=None, capture: str = keep_mod.FULL, budget_mb: float = DEFAULT_BUDGET_MB,
                 layer_interventions=None, node_interventions=None, node_grads: bool | None = None, norms_rule=None,
                 backward_hooks: bool = False, state=None, fast_captures: bool = True, eager: bool = False,
                 wrappers=(), batch_dim: int | None = None):
        self._options = (capture, budget_mb, norms_rule, node_grads, node_interventions or {}, fast_captures,
                         batch_dim)
        given = module_list(modules)
        self._compiled_targets = [m for m in [*(given or ()), *(wrappers if given else ())] if is_compiled(m)]
        self.targets = None if given is None else [uncompiled(m) for m in given]
        self.eager = eager
        # what a compiled model's note says (finish.py): it ran eagerly, or this torch cannot run it so
        self._compiled_kind = "compiled_eager" if eager and can_run_eagerly() else "compiled"
        self.layer_interventions = layer_interventions or {}
        # Full module backward hooks show grad_input too, but raise when an in-place op follows a
        # module and add nodes to the graph: opt-in only.
        self.backward_hooks = backward_hooks
        self.state = state  # a RunState to tell what the code changes (state.py), or None
        self.thread = threading.get_ident()  # the thread whose code this trace records
        self._stack = ExitStack()
        self._answers: dict = {}  # the registry's answers, asked at each module's first call (registry.memo)
        self.run = Recording(self._options)  # what the hooks fill: a new one at each cut
        self.records: Records | None = None

    @property
    def hooks(self):
        """The running recording's hooks state (handles.Hooks: `active`, the tensor and node handles)."""
        return self.run.hooks

    @property
    def keep(self):
        """The running recording's keep strategy (keep.py)."""
        return self.run.keep

    @property
    def norms_rule(self):
        """What the strategy streamed into (capture="norms": per-sample norms), or None."""
        return self.run.keep.rule

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        if in_transform():
            raise RuntimeError("hookwidget cannot trace inside a torch.func transform (vmap, grad, jacrev, ...): "
                               "hooks would see wrapped tensors; call hw.trace outside the transform")
        for m in self._compiled_targets:
            self.run.saw(self._compiled_kind, uncompiled(m))
        try:
            self._install()
        except BaseException:
            self._close()
            raise
        self.run.hooks.active = True
        return self

    def __exit__(self, *exc) -> None:
        self._close()
        try:
            self.records = self.run.finish(self._answers)
        except Exception:
            if exc[0] is None:
                raise  # otherwise the cell's own exception propagates, not hookwidget's

    def _close(self) -> None:
        try:
            self.run.quiet()
        finally:
            self._stack.close()

    def cut(self) -> Recording:
        """End the running recording while the hooks stay on, and start a new one with the same options (the
        flight recorder's one tracer per watch, cut at each step's end, instead of hooks put on and off every
        step). The recording is returned settled (recording.py): `finish(tracer.answers)` makes its Records when
        they are wanted, and a recording dropped unfinished costs no copy."""
        run = self.run
        run.quiet()
        run.settle()
        self.run = Recording(self._options)
        self.run.hooks.active = True
        return run

    @property
    def answers(self) -> dict:
        """The registry's answers for the modules seen (kept across cuts: the modules are the same)."""
        return self._answers

    def _install(self) -> None:
        s = self._stack
        # First on the stack, so last to run: whatever an interrupt left half-registered is swept away.
        s.callback(self._sweep)
        s.callback(autograd_calls.unlisten, self)
        if self.eager:
            s.enter_context(eagerly())
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
        elif not self.run.keep.records:  # a streaming strategy: the targets themselves, one forward hook each
            for m in self.targets:
                s.enter_context(Removing(m.register_forward_hook(self._stream_hook)))
                if self.run.keep.rerun_inputs:  # and a pre-hook, for the input of a rerun (_stream_pre_hook)
                    s.enter_context(Removing(m.register_forward_pre_hook(self._stream_pre_hook)))
            for p, fn in self.run.keep.param_hooks():  # each backward's gradient of a parameter (sample_shares.py)
                s.enter_context(Removing(p.register_hook(fn)))
        else:
            for m in every_module(self.targets):
                s.enter_context(Removing(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True)))
                s.enter_context(Removing(m.register_forward_hook(self._forward_hook, with_kwargs=True)))
                if self.backward_hooks:
                    s.enter_context(Removing(m.register_full_backward_hook(self._backward_hook)))
        if self.state is not None or self.run.keep.updates:
            s.enter_context(Removing(register_optimizer_step_pre_hook(self._optimizer_hook)))
        if self.run.keep.updates:
            s.enter_context(Removing(register_optimizer_step_post_hook(self._optimizer_post_hook)))
        autograd_calls.listen(self)

    def _optimizer_hook(self, opt, args, kwargs):
        if self.run.hooks.active and threading.get_ident() == self.thread:
            if self.state is not None:
                self.state.on_optimizer_step(opt)
            self.run.keep.before_update(opt)

    def _optimizer_post_hook(self, opt, args, kwargs):
        if self.run.hooks.active:
            self.run.keep.after_update(opt)

    def _hooked(self) -> list:
        """The modules whose own hooks this tracer registers (targets given)."""
        return every_module(self.targets) if self.run.keep.records else self.targets

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
            return self.run.keep.compiled_call(module, inputs, output) if self.run.hooks.active else None
        if not self.run.hooks.active:
            return None
        recomputed = _current_node() is not None  # rerun by backward: gradient checkpointing
        if not recomputed and _get_ident() != self.thread:
            return None
        out = first_tensor(output)
        if out is None or not out.requires_grad:
            return None
        keep = self.run.keep
        token = keep.on_recompute(module, inputs, out) if recomputed else keep.on_call(module, inputs, out)
        if token is not None:
            hook_output(self.run.hooks.tensor, out, self._delta_hook(module, token, streaming=True))
        return None

    def _stream_pre_hook(self, module, inputs):
        """A call's input before it runs, for a forward that backward reruns (checkpointing): its rerun stops as soon
        as every tensor backward needs is saved again, which may be before the call's forward hook."""
        if _is_compiling() or _current_node() is None or not self.run.hooks.active:
            return None
        self.run.keep.on_rerun_input(module, inputs)
        return None

    # -- forward -------------------------------------------------------------------------------
    def _pre_hook(self, module, inputs, kwargs=None):
        if _is_compiling() or not self.run.hooks.active or _get_ident() != self.thread and _current_node() is None:
            return
        if _peek_transform() is not None:  # inside a torch.func transform: hooks would see wrapped tensors
            self.run.saw("func", module)
            return
        rec = self.run.modules.get(module)
        if rec is None:
            if is_compiled(module):  # a torch.compile wrapper: the model it wraps is the layer (its call is next)
                self.run.saw(self._compiled_kind, uncompiled(module))
                return
            rec = self._new_record(module)
        rec.open_calls.append(self._open_call(module, rec, inputs, kwargs))
        self.run.open += 1

    def _new_record(self, module) -> ModuleRecord:
        """A module's first call: what does not change between its calls is decided once, and so is the
        registry's answer for it, which the trace's factor queries and notes take from the record."""
        rec = self.run.modules[module] = ModuleRecord(module)
        spec, rec.needs_input, rec.stateful, rec.keeps_rows = registry.capture_facts(module, self._answers)
        self.run.keep.decide(rec, module, spec, self._answers)
        if self.state is not None:
            self.state.on_call(module)
        if isinstance(module, _DDP):
            self.run.ddp = True
        return rec

    def _open_call(self, module, rec: ModuleRecord, inputs, kwargs=None) -> Call:
        # `a` is taken before forward runs: an in-place module (ReLU(inplace=True)) rewrites its input.
        run = self.run
        call = Call(len(rec.calls), seq_start=_next_sequence_nr())
        call.recomputed = _current_node() is not None  # forward rerun by backward: checkpointing
        rec.calls.append(call)
        outer, samples = run.outer, run.samples
        if run.open == 0:  # an outermost call: a new forward pass
            outer.append([])
            if len(outer) > OUTER_CALLS_KEPT:  # no backward came for the oldest: let its graph go
                for c in outer.popleft():
                    c.out_node = None
        if outer:
            outer[-1].append(call)
        a = first_tensor(inputs) if inputs else first_tensor(kwargs)
        if call.recomputed:
            pass  # a forward that backward reruns (checkpointing): its calls take the first forward's places (finish)
        elif run.open == 0:
            samples.start(module, call, inputs, kwargs, a, stated_samples(module, inputs, kwargs))
            if call.batch is not None:
                run.batches[call.batch] += 1
        else:
            stated = stated_samples(module, inputs, kwargs)  # a PackedSequence, bags by offsets: their count
            if stated is not None:
                samples.stated(module, call, inputs, kwargs, stated)
            elif a is not None:
                samples.place(module, call, a)  # where its samples are: see per_sample
            if samples.moved is not None:  # a module's batch_first moved the pass's batch dim: its size with it
                old, new = samples.moved
                samples.moved = None
                if old is not None:
                    run.batches[old] -= 1
                run.batches[new] += 1
        if rec.generic and torch.is_grad_enabled() and run.generic.keep_call(module, call, inputs, kwargs):
            kept = call.inputs
            run.keep.on_generic_inputs(call, kept[0] if kept[0] else kept[1])
            return call
        if a is not None:
            self._keep_input(rec, call, a)
        return call

    def _forward_hook(self, module, inputs, kwargs, output):
        if _is_compiling() or not self.run.hooks.active or _get_ident() != self.thread and _current_node() is None:
            return None
        if _peek_transform() is not None:
            return None
        rec = self.run.modules.get(module)
        if rec is None:  # hooks installed mid-call: the pre-hook did not see this call start
            if is_compiled(module):
                return None
            rec = self._new_record(module)
        call = self._close_call(module, rec, inputs, kwargs)
        if call.stated is not None and not call.recomputed:  # its outputs whose samples' place is known: roots
            self.run.samples.stated_output(module, call, inputs, kwargs, output)
        if self.backward_hooks:
            rec.awaiting_backward.append(call)
        out = first_tensor(output)
        ivs = self.layer_interventions
        replaced = intervene(self.run.hooks, ivs[module], module, inputs, output, out) if module in ivs else None
        call.seq_end = _next_sequence_nr()
        if out is not None:
            self._on_output(module, rec, call, out, inputs, kwargs)
        if out is None or not out.requires_grad:
            self.run.keep.on_no_delta(rec, call)
        if rec.generic and call.inputs is not None:
            self.run.generic.hook_outputs(module, call, output, out)
        return replaced

    def _close_call(self, module, rec: ModuleRecord, inputs, kwargs) -> Call:
        """The call the pre-hook opened, its keywords kept where only the forward hook sees them (no global
        pre-hook does); or a call opened now, where the pre-hook did not see it start."""
        if not rec.open_calls:
            return self._open_call(module, rec, inputs, kwargs)
        call = rec.open_calls.pop()
        if self.run.open > 0:
            self.run.open -= 1
        if rec.generic and call.inputs is not None:
            if kwargs and not call.inputs[1] and self.targets is None:  # no global pre-hook sees keywords
                kept = self.run.generic.keep_kwargs(call, kwargs)
                if kept is not None:
                    self.run.keep.on_generic_inputs(call, kept)
        elif not inputs and kwargs and self.targets is None:  # keywords only, which no global pre-hook sees
            a = first_tensor(kwargs)
            if a is not None and not call.recomputed:
                stated = stated_samples(module, inputs, kwargs)
                if self.run.samples.keywords(module, call, kwargs, stated):  # the outermost call: the pass starts
                    if call.batch is not None:
                        self.run.batches[call.batch] += 1
                elif stated is not None:
                    self.run.samples.stated(module, call, inputs, kwargs, stated)
                else:
                    self.run.samples.place(module, call, a)
                self._keep_input(rec, call, a)
        return call

    def _on_output(self, module, rec: ModuleRecord, call: Call, out: torch.Tensor, inputs, kwargs) -> None:
        call.output_shape = tuple(out.shape)
        if not call.recomputed and (call.sample_dim is not None or call.folded_from is not None and rec.keeps_rows
                                    or self.run.samples.waiting):
            self.run.samples.output(module, call, first_tensor(inputs) if inputs else first_tensor(kwargs), out)
        # A rerun of non-reentrant checkpointing builds a graph backward never runs: a reference to its output's
        # node would keep that graph's saved tensors (the activations checkpointing frees) until the step ends.
        node = call.out_node = None if call.recomputed and checkpoint_frame() is not None else out.grad_fn
        if node is not None:
            self.run.live.append(call)
        if out.requires_grad:
            hook_output(self.run.hooks.tensor, out, self._delta_hook(module, call))
            if rec.broadcast:
                self.run.generic.note_broadcast(call, out)

    def _backward_hook(self, module, grad_input, grad_output):
        rec = self.run.modules.get(module)
        if not self.run.hooks.active or rec is None or not rec.awaiting_backward:
            return None
        g = first_tensor(grad_input)
        with self.run.hooks.lock:
            rec.awaiting_backward.pop().grad_input = None if g is None else g.detach()
        return None

    def _keep_input(self, rec: ModuleRecord, call: Call, a: torch.Tensor) -> None:
        if rec.stateful:  # e.g. BatchNorm's train/eval mode at this call, for its factor rule later
            call.state = fx.forward_state(rec.module)
        self.run.keep.on_input(rec, call, a)

    def _delta_hook(self, module, call, streaming: bool = False):
        """The δ hook of one call (streaming: `call` is the strategy's token). It holds this run's Hooks, so
        that a hook left on a graph that outlives the run (or a cut) stays quiet; a partial is two objects
        per call where a closure is eight."""
        return partial(self._stream_delta if streaming else self._record_delta, self.run.hooks, module, call)

    def _stream_delta(self, hooks: Hooks, module, token, grad) -> None:
        if hooks.active:  # the strategy takes its own lock, after reducing δ
            self.run.keep.on_delta(module, token, grad, self.run.modules)

    def _record_delta(self, hooks: Hooks, module, call: Call, grad) -> None:
        if not hooks.active:
            return
        with hooks.lock:
            if hooks.step is None:  # δ of a pass the stand-in did not see start (an imported grad)
                self.run.unseen = True
            hooks.step_index(call)
            if self.run.keep.on_delta(module, call, grad, self.run.modules):
                self.run.passes_summed += 1

    # -- backward (called by autograd_calls for every backward / autograd.grad of this thread) ---
    def on_backward(self, tensors: list, kind: str, create_graph: bool) -> None:
        run = self.run
        if not run.hooks.active:
            return
        run.depth += 1
        if not run.keep.records:
            if run.depth == 1:
                run.keep.begin_pass(kind, tensors)
            return
        run.create_graph |= create_graph
        run.used_grad |= kind == "grad"
        if run.depth == 1:  # a new step; a nested call (reentrant checkpoint) belongs to the running one
            step = run.hooks.step = StepRecord(len(run.steps), kind,
                                               [r.detach().clone() for r in tensors if r.numel() == 1])
            run.steps.append(step)
            run.graph.new_step()
            run.keep.begin_step(step)
        run.graph.extend(tensors, run.hooks.step, run.depth, run.live, run.ddp, run.grads.before)
        if run.depth == 1:
            run.generic.hook_step(run.graph.walk)

    def on_backward_end(self) -> None:
        run = self.run
        if run.depth == 0:
            return
        run.depth -= 1
        if run.depth == 0 and run.hooks.active:
            if run.keep.records:
                run.end_step()
            else:
                run.hooks.tensor[:] = [h for h in run.hooks.tensor if h.hooks_dict_ref() is not None]
                run.keep.end_pass()


_DDP = nn.parallel.DistributedDataParallel
_get_ident = threading.get_ident
_is_compiling = torch.compiler.is_compiling
