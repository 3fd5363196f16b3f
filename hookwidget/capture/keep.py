"""Keep strategies: what a trace keeps of each module call, one whole class per capture mode, chosen by name.

The tracer (tracer.py) hooks every module call and every δ the same way whatever is kept; it asks its strategy,
and never branches on the mode's name, what to keep. The names are options.CAPTURES (the user's `capture=`):

- "full" (`FullKeep`): a and δ as tensors (copies or guarded references) within the memory budget; past it,
  summaries (shape, norm, min/max/mean, NaN/Inf);
- "summary" (`SummaryKeep`): summaries only;
- "norms" (`NormsKeep`): per-sample gradient norms streamed as each δ arrives (norms.StreamingNorms); a and δ
  are let go at the end of each step.

The interface, for a new strategy (the watch's per-step statistics, say): subclass `Keep`, override what differs,
and `register(name, cls)` it from its own module; the tracer then takes `capture=name` and needs no change (a
name outside options.CAPTURES is for code that makes its Tracer itself, as the watch: the user's options refuse it).
A strategy is made once per trace as `cls(budget, rule)`: `budget` is the trace's budget.Budget (`fits(t)`
counts a tensor against budget_mb, `summarize(call, attr, t)` keeps a summary instead), `rule` the object the
strategy streams into or None (Tracer's `norms_rule=`: StreamingNorms for "norms"; the watch's reducer for a
per-step statistics strategy). The tracer calls, in this order over a trace:

- `decide(rec, module, spec, answers)`: at a module's first call (ModuleRecord rec; spec: registry's LayerSpec,
  GENERIC or None; answers: the tracer's table of the registry's answers, for registry.memo), set rec.generic
  (the generic rule's capture: every input, every output's δ), rec.broadcast (watch for a (1, ...) output
  broadcast to the batch) and anything of the strategy's own (rec.norms);
- `on_input(rec, call, a)`: a call's first input tensor, as the call starts (a call of a generic-rule module
  whose inputs were kept gets `on_generic_inputs(call, tree)` instead, with the kept copies);
- `begin_step(step)`: a backward pass starts (record.calls.StepRecord: its index, its kind, "backward" or "grad",
  and its scalar roots, the losses); its δs follow;
- `on_delta(module, call, grad, modules)`: δ of the call's output arrived (modules: the trace's module ->
  ModuleRecord; the hook's lock is held, call.step set); return True where it was added to a δ kept from an
  earlier backward through the same graph (the tracer notes that backward ran more than once);
- `end_step(modules, batches)`: a backward pass ended (batches: a Counter of this step's outermost calls'
  leading dimensions); `result()`: what the strategy streamed, for the Trace, when the trace has ended.

Class attributes: `node_grads` (False: no node pre-hooks whatever node_grads= says) and `shares_inputs` (True:
on_input keeps `a` by reference, unguarded, so the tracer copies what is left of it when the trace ends).

A streaming strategy (`records = False`: the watch's "stats", step_stats.py) makes the tracer keep no record at
all (no Call, StepRecord, graph walk or .grad copy: it may stay installed for a million steps) and hook each of
its target modules itself, not their submodules, with one forward hook. The tracer then calls instead:

- `on_call(module, inputs, out)`: a call ended (eager code, the trace's thread, out requires grad); return a
  token, and the tracer hooks δ of `out` and hands the token to `on_delta(module, token, grad, modules)`, or None;
- `compiled_call(module, inputs, output)`: the same inside torch.compile (Dynamo traces it into the graph):
  what the forward hook returns;
- `on_recompute(module, inputs, out)`: a call that backward runs (gradient checkpointing recomputing its
  forward, on whichever thread autograd runs it; out requires grad): a token as on_call gives, or None. Under
  reentrant checkpointing its δ arrives (the recomputation is what backward differentiates); under non-reentrant
  checkpointing it never does (backward uses the first forward's graph), and the token is dropped unused;
- `begin_pass(kind, roots)` / `end_pass()`: an outermost backward / autograd.grad call starts / ends (the
  strategy decides which passes are steps).

Any strategy with `updates = True` gets `before_update(opt)` / `after_update(opt)` around each optimizer step
on the trace's thread.
"""

from __future__ import annotations

from torch import nn

from hookwidget._torch.autograd import checkpoint_frame
from hookwidget._torch.modules import children, own_parameters
from hookwidget._torch.tensors import version
from hookwidget.capture.budget import Budget
from hookwidget.capture.norms import StreamingNorms
from hookwidget.capture.tensors import _copy, first_tensor
from hookwidget.layers import registry
from hookwidget.options import CAPTURES

FULL, SUMMARY, NORMS = CAPTURES  # the names, from options.py: a new user-facing mode needs a strategy here


class Keep:
    """The interface (see the module's docstring) and what every strategy shares: it keeps no tensor."""

    node_grads = True
    shares_inputs = False
    records = True
    updates = False

    def __init__(self, budget: Budget, rule=None):
        self.budget = budget
        self.rule = rule

    def decide(self, rec, module: nn.Module, spec, answers: dict) -> None:
        rec.generic = rec.broadcast = False

    def on_input(self, rec, call, a) -> None:
        self.budget.summarize(call, "a_summary", a)

    def on_generic_inputs(self, call, tree) -> None:
        pass

    def on_delta(self, module, call, grad, modules) -> bool:
        self.budget.summarize(call, "delta_summary", grad)
        return False

    def on_no_delta(self, rec, call) -> None:
        """The call's output needs no gradient: no δ will come for it."""

    def begin_step(self, step) -> None:
        pass

    def end_step(self, modules: dict, batches) -> None:
        pass

    def result(self):
        return None

    # a streaming strategy's (records = False), and updates = True's
    def on_call(self, module, inputs, out):
        return None

    def compiled_call(self, module, inputs, output):
        return None

    def on_recompute(self, module, inputs, out):
        return None

    rerun_inputs = False  # whether on_rerun_input is wanted (a pre-hook per target)

    def param_hooks(self) -> list:
        """(parameter, fn) pairs: the tracer registers parameter.register_hook(fn) on each (a streaming strategy)."""
        return []

    def on_rerun_input(self, module, inputs) -> None:
        pass

    def begin_pass(self, kind: str, roots: list) -> None:
        pass

    def end_pass(self) -> None:
        pass

    def before_update(self, opt) -> None:
        pass

    def after_update(self, opt) -> None:
        pass


class SummaryKeep(Keep):
    """Statistics of a and δ only: cheap, and nothing is held past the trace but numbers."""


class FullKeep(Keep):
    """a and δ as tensors within the memory budget, summaries past it; the generic rule's inputs and outputs."""

    def decide(self, rec, module: nn.Module, spec, answers: dict) -> None:
        rec.generic = spec is registry.GENERIC
        rec.broadcast = spec is not None and _trainable(module)

    def on_input(self, rec, call, a) -> None:
        if self.budget.fits(a):
            # Layers whose backward needs their input: autograd's version check guards it,
            # so no copy is needed; `_a_version` catches forward-only cells that mutate it.
            if rec.needs_input and not a.is_inference():
                call.a = a.detach()  # shares a's version counter: no reference to a (and its graph) is held
                call._a_version = version(a)
            else:  # copy-on-write: memory is copied only if the input is later written in place
                call.a = a.detach().clone() if a.is_inference() else _copy(a)
            return
        self.budget.summarize(call, "a_summary", a)

    def on_generic_inputs(self, call, tree) -> None:
        if call.a is None:
            call.a = first_tensor(tree)  # `a` is the kept copy of the call's first tensor

    def on_delta(self, module, call, grad, modules) -> bool:
        if call.delta is not None:  # another backward through the same graph: sum, as .grad does
            call.delta = call.delta + grad.detach()
            return True
        if self.budget.fits(grad):
            call.delta = grad.detach()
        else:  # a copy: a hook that runs after this one may change grad in place
            self.budget.summarize(call, "delta_summary", grad)
        return False


class NormsKeep(FullKeep):
    """Per-sample gradient norms, streamed: a of the layers the rule wants, δ as it arrives, both let go at the
    end of each step; δ of a module with no norms to give (no trainable parameter, no rule) is not kept at all (the
    generic rule's modules keep theirs: per_sample.py adds their norms when asked). No per-node hooks (they would
    cost more than the norms)."""

    node_grads = False
    shares_inputs = True

    def __init__(self, budget: Budget, rule=None):
        super().__init__(budget, StreamingNorms() if rule is None else rule)

    def decide(self, rec, module: nn.Module, spec, answers: dict) -> None:
        super().decide(rec, module, spec, answers)
        with registry.memo(answers):  # rule.wants asks the registry again
            rec.norms = self.rule.wants(module)

    def on_input(self, rec, call, a) -> None:
        if not rec.norms:
            return
        where = checkpoint_frame()  # non-reentrant checkpointing: the input comes again, with the rerun
        if where is None:
            call.a = a.detach()
            self.rule.on_input(rec.module, call)
        elif where[0] == "forward":
            self.rule.await_input(rec.module, call, where[1])
        else:
            self.rule.rerun_input(rec.module, where[1], a.detach())

    def on_no_delta(self, rec, call) -> None:
        if rec.norms:
            self.rule.no_delta(rec.module, call)

    def on_generic_inputs(self, call, tree) -> None:
        pass  # the generic rule's norms are not streamed: per_sample adds them when asked

    def on_delta(self, module, call, grad, modules) -> bool:
        rec = modules[module]
        if rec.norms or rec.generic:  # a layer without either has no norms to give: its δ is let go
            call.delta = grad.detach()
            self.rule.on_delta(module, modules)
        return False

    def begin_step(self, step) -> None:
        self.rule.begin_step()

    def end_step(self, modules: dict, batches) -> None:
        common = batches.most_common(1)
        self.rule.end_step(modules, common[0][0] if common else None)

    def result(self):
        return self.rule.result()


STRATEGIES: dict = {FULL: FullKeep, SUMMARY: SummaryKeep, NORMS: NormsKeep}


def register(name: str, cls: type) -> None:
    """Make strategy `cls` (a Keep) the one `capture=name` chooses."""
    STRATEGIES[name] = cls


def make(name: str, budget: Budget, rule=None) -> Keep:
    """The strategy of capture mode `name` for one trace; ValueError naming the modes for any other name."""
    cls = STRATEGIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"capture={name!r} is not a capture mode; choose one of {', '.join(STRATEGIES)}")
    return cls(budget, rule)


def _trainable(module: nn.Module) -> bool:
    """Whether any parameter of the module (its submodules' included) requires grad; its own are asked first
    (module.parameters() walks every submodule through generators: ~8 µs for a Linear)."""
    for p in own_parameters(module).values():
        if p is not None and p.requires_grad:
            return True
    return bool(children(module)) and any(p.requires_grad for p in module.parameters())
