"""The Trace users hold: the immutable record of one run of their code, with thin query methods.

How to run it again (the code, options, hooks, what-if reruns) lives in the Session (session.py)
that every Trace points to; `t.add_hook`, `t.rerun()` and `t.interventions` go through it, so a
trace, its reruns and the explorer agree on which hooks are on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import torch
from torch import nn

from hookwidget.analysis import facts
from hookwidget.analysis import per_sample as ps
from hookwidget.layers import factors as fx
from hookwidget.layers import registry
from hookwidget.record import graph as graph_mod
from hookwidget.record.calls import PREVIOUS
from hookwidget.record.naming import name_filter, qualified_names
from hookwidget.stats import TensorSummary


@dataclass
class Layer:
    """One module that was called: its qualified name and one Call per forward call, in order."""

    name: str
    module: nn.Module = field(repr=False)
    calls: list

    @property
    def a(self) -> torch.Tensor | None:
        """Input activation of the first call (detached)."""
        return self.calls[0].a if self.calls else None

    @property
    def delta(self) -> torch.Tensor | None:
        """Gradient with respect to the output of the first call (detached)."""
        return self.calls[0].delta if self.calls else None

    @property
    def type(self) -> str:
        return type(self.module).__name__


@dataclass(frozen=True)
class Step:
    """One backward pass of the traced code: a `backward` or `torch.autograd.grad` call.

    `grads`: each parameter's .grad when the pass ended (a copy; a TensorSummary where the memory
    budget kept no copy; None where .grad stayed None). `before`: .grad when it started."""

    index: int
    kind: str  # "backward" or "grad"
    losses: tuple  # the values of its scalar roots
    calls: dict  # layer name -> indices of the calls whose δ this pass brought
    grads: dict = field(repr=False)
    before: dict = field(repr=False)

    @property
    def loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def accumulated(self) -> bool:
        """Whether this pass added to gradients already in .grad (gradient accumulation)."""
        return any(g is not None for g in self.before.values())

    def grad(self, name: str) -> torch.Tensor | None:
        """What this pass added to the parameter's .grad."""
        if name not in self.grads:
            raise KeyError(f"step {self.index} did not reach {name!r}; it reached: {', '.join(list(self.grads)[:8])}")
        after, before = self.grads[name], self.before.get(name)
        if isinstance(after, TensorSummary) or isinstance(before, TensorSummary):
            raise ValueError(f"step {self.index}: the .grad of {name!r} was kept as a summary only (memory budget); "
                             "raise budget_mb to keep it")
        if after is None or before is None:
            return after
        return after - before


class Trace:
    """What one run showed: layers and their calls, steps, the graph, gradients, notes. Displays as its widget."""

    def __init__(self, session, applied=()):
        self.session = session
        self.applied = tuple(applied)  # the interventions that were on in this run
        self.layers: dict[str, Layer] = {}
        self.steps: list[Step] = []
        self.param_grads: dict[str, torch.Tensor | None] = {}  # .grad as the last backward pass left it (copies)
        self.params: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []
        self._notes: list[str] = []
        self.user_hooks: dict[str, list[str]] = {}
        self.accumulates = False  # backward passes summed into .grad with no reset between them
        self._left_out: dict[str, str] = {}  # see per_sample_left_out
        self._deferred = None  # (where in the notes, the registry's answers): factor notes not decided yet
        self._graph: nx.DiGraph | None = None  # built on first access (an empty one before the run ends)
        self._graph_inputs = None  # what graph.build needs
        self._norms = None  # capture="norms": per step (squared norms, modules left out)
        self._no_factors = ""
        self._generic: dict = {}  # per_sample.py's cache: parameters each layer answers for, generic-rule results

    @property
    def options(self) -> dict:
        return self.session.options.as_dict()

    @property
    def notes(self) -> list[str]:
        """What the trace could not show or keep, and why, one line each."""
        if self._deferred is not None:
            self._decide_factor_notes()
        return self._notes

    @property
    def per_sample_left_out(self) -> dict[str, str]:
        """Parameter with a .grad -> why per-sample norms over the whole model leave it out."""
        if self._deferred is not None:
            self._decide_factor_notes()
        return self._left_out

    @property
    def interventions(self) -> list:
        """The hooks on now, for the next rerun (shared by this trace, its reruns and the explorer)."""
        return self.session.interventions

    # -- filling the record (once, when the run ends) ------------------------------------------
    def _attach(self, rec, targets, namespace=None) -> None:
        # The notes ask the registry about each layer many times: the answers it gave at each module's first call.
        with registry.memo(rec.answers):
            self._attach_records(rec, targets, namespace, rec.answers)

    def _attach_records(self, rec, targets, namespace, answers: dict) -> None:
        names, self.params = qualified_names(list(rec.modules), targets, self.session.names)
        notes = self._notes = list(rec.notes)
        self._no_factors = rec.no_factors
        keep = name_filter(self.session.options.include, self.session.options.exclude)
        for module, mrec in rec.modules.items():
            name = names.get(module)
            if name is not None and mrec.calls and keep(name):
                self.layers[name] = Layer(name, module, mrec.calls)
        self._graph, self._graph_inputs = None, rec.walk  # the rest of what graph.build needs: in `graph`
        leaf_name = _leaf_namer(rec, {id(p): n for n, p in self.params.items()}, namespace)
        self._attach_steps(rec, leaf_name)
        leaves = {leaf_name(leaf): leaf for s in rec.steps for leaf in s.after}
        self.user_hooks = _user_hooks(self.layers, leaves)
        changed = [leaf_name(leaf) for leaf, same in rec.grads_at_end.items() if not same]
        if changed:
            notes.append(f"the code changed .grad after its last backward pass ({_few(changed)}; e.g. "
                         "opt.zero_grad() or clip_grad_norm_): param_grads show .grad as backward left it")
        if facts.record_facts(self):  # all they read of the modules is kept now: decided when first read
            self._deferred = (len(notes), answers)
        else:
            notes += self._factor_notes()
        for iv in self.applied:
            if isinstance(iv.anchor, nn.Module) and iv.anchor not in rec.modules:
                notes.append(f"intervention {iv} did not fire: its module was not called "
                             "(was the model created anew inside the cell?)")

    def _attach_steps(self, rec, leaf_name) -> None:
        call_steps: dict = {}
        for name, layer in self.layers.items():
            for c in layer.calls:
                if c.step is not None:
                    call_steps.setdefault(c.step, {}).setdefault(name, []).append(c.index)
        last: dict = {}  # id(leaf) -> (leaf, its .grad as the latest step left it)
        chained = True
        for s in rec.steps:
            losses = [float(v) for v in s.roots]
            before = {}
            for leaf, b in s.before.items():
                key = id(leaf)
                before[leaf_name(leaf)] = last[key][1] if b is PREVIOUS and key in last else (
                    None if b is PREVIOUS else b)
                if s.index and s.kind == "backward" and b is not PREVIOUS and key in last:
                    chained = False  # .grad was reset (or changed) since the previous pass
            after = {}
            for leaf, g in s.after.items():
                after[leaf_name(leaf)] = g
                last[id(leaf)] = (leaf, g)
            self.steps.append(Step(s.index, s.kind, tuple(losses), {n: tuple(ix) for n, ix in
                                   call_steps.get(s.index, {}).items()}, after, before))
            self.losses += losses
        self.accumulates = chained
        for leaf, g in last.values():
            self.param_grads[leaf_name(leaf)] = g if not isinstance(g, TensorSummary) else None
        if len([s for s in self.steps if s.kind == "backward"]) > 1:
            self._notes.append(f"{len(self.steps)} backward passes (t.steps): " + (
                "they accumulate into .grad, so factor queries sum them" if chained else
                ".grad was reset between them, so factor queries take step=k") + "; the graph shows the last one")

    def _decide_factor_notes(self) -> None:
        """The factor notes of a trace whose attach deferred them, from what the trace kept of the modules (the
        registry's answers at their first calls, their parameters when it ended: per_sample.record_facts), so that a
        model changed since does not change them."""
        with _DECIDING:  # once, whichever thread reads first (an explorer's message handler, the user's cell)
            if self._deferred is None:
                return
            where, answers = self._deferred
            self._deferred = None  # the notes may be read while they are decided (an error message)
            try:
                with registry.memo(answers):
                    notes = self._factor_notes()
            except BaseException:
                self._deferred = where, answers
                raise
            self._notes[where:where] = notes

    def _factor_notes(self) -> list[str]:
        """Layers with no factor rule and parameters that per-sample norms leave out (sets _left_out)."""
        notes = []
        reasons = {n: fx.unsupported_reason(layer.module) for n, layer in self.layers.items()
                   if facts.owned_params(self, n)}
        unsupported = sorted({f"{n} ({why})" for n, why in reasons.items() if why})
        if unsupported:
            notes.append("no (a, δ) factor rule, so no weight_grad / per-sample gradients for: "
                         + ", ".join(unsupported))
        left = self._left_out = ps.left_out(self) if self.steps else {}
        if left and self.session.options.capture != "summary":  # summaries keep no (a, δ): no news in a note
            total = sum(g.numel() for g in self.param_grads.values() if g is not None)
            lost = sum(self.params[n].numel() for n in left)
            notes.append(f"per-sample gradient norms leave out {len(left)} parameters ({lost:,} of {total:,} "
                         "gradient elements): " + "; ".join(f"{n} ({why})" for n, why in left.items()))
        return notes

    # -- what the run showed -------------------------------------------------------------------
    @property
    def graph(self) -> nx.DiGraph:
        """The autograd graph of grad_fn nodes of the last backward pass (built on first access)."""
        if self._graph is None:
            walk = self._graph_inputs
            if walk is None:  # not filled in yet (a `with hw.tracing()` block still running)
                self._graph = nx.DiGraph()
                return self._graph
            param_names = {p: n for n, p in self.params.items()}
            calls = [(name, c.seq_start, c.seq_end) for name, layer in self.layers.items() for c in layer.calls]
            self._graph = graph_mod.build(walk, param_names, calls,
                                          show_hook_nodes=self.session.options.show_hook_nodes)
            self._graph_inputs = None
        return self._graph

    @property
    def loss(self) -> float | None:
        """The value of the last scalar that backward started from, if any."""
        return self.losses[-1] if self.losses else None

    def layer(self, name: str) -> Layer:
        if name not in self.layers:
            close = [n for n in self.layers if name.lower() in n.lower()][:5] or list(self.layers)[:8]
            raise KeyError(f"no layer {name!r} in this trace; layers include: {', '.join(close)}")
        return self.layers[name]

    def supports(self, name: str) -> bool:
        """Whether this layer's parameter gradients rebuild: an exact (a, δ) rule, or the generic torch.func
        rule where it passed its check."""
        with registry.memo():
            return ps.supports(self, name)

    def weight_grad(self, name: str, step: int | None = None) -> torch.Tensor:
        """W.grad of the layer rebuilt from its factors: what backward pass `step` added to .grad, or,
        without step=, what every pass added (one pass, or passes accumulating into .grad)."""
        with registry.memo():
            return ps.summed_grad(self, name, "weight", step)

    def bias_grad(self, name: str, step: int | None = None) -> torch.Tensor:
        with registry.memo():
            return ps.summed_grad(self, name, "bias", step)

    def per_sample_grads(self, name: str, param: str = "weight", loss_reduction: str = "sum",
                         step: int | None = None) -> torch.Tensor:
        """(N, *param.shape): each sample's contribution to the parameter's .grad; under gradient
        accumulation N counts the samples of every micro-batch, in order.

        They sum to .grad. With a mean-reduced loss pass loss_reduction="mean" to get each
        sample's own gradient (the contributions times B)."""
        with registry.memo():
            g = ps.per_sample_grad(self, name, param, step)
        return g * _reduction_scale(loss_reduction, g.shape[0])

    def per_sample_grad_norms(self, name: str | None = None, loss_reduction: str = "sum",
                              step: int | None = None) -> torch.Tensor:
        """(N,) norms of per-sample gradients over all parameters of one layer, or of every
        supported layer (name=None). A parameter shared by several layers is counted once."""
        with registry.memo():  # a query asks the registry about each layer several times
            norms = ps.per_sample_norms(self, name, step)
        return norms * _reduction_scale(loss_reduction, norms.shape[0])

    @property
    def factor_layers(self) -> list[str]:
        """Layers whose parameter gradients (a, δ) rebuild: weight_grad, per-sample gradients."""
        with registry.memo():
            return ps.factor_layers(self)

    def storage(self, name: str) -> dict:
        """Floats needed to store W.grad vs its (a, δ) factors (seed 003's figures)."""
        tokens = 0
        if name in self.factor_layers and not fx.is_generic(self.layer(name).module):
            f = ps.param_factors(self, name, "weight", self.steps[-1].index if not self.accumulates else None)[0]
            tokens = f.D.shape[0] * f.D.shape[1]
        return fx.storage(self.layer(name).module, tokens)

    # -- changing it (through the session) -----------------------------------------------------
    def add_hook(self, target: str, kind: str, **params):
        """Attach an intervention for the next rerun(); the same kind on the same target is replaced."""
        return self.session.add_hook(target, kind, **params)

    def remove_hook(self, target: str, kind: str, missing_ok: bool = False) -> None:
        self.session.remove_hook(target, kind, missing_ok=missing_ok)

    def rerun(self) -> Trace:
        """Run the same code again with the interventions on, as a what-if: parameters, buffers,
        optimizer and scheduler state, .grad and every RNG are put back first, and put back as
        they are now afterwards, so the interventions are the only change and nothing stays changed."""
        return self.session.rerun()

    def diff(self, before: Trace | None = None):
        """What changed from `before` (default: the hook-free first run) to this trace: grads per
        parameter, loss, δ per layer."""
        from hookwidget.analysis.diff import diff

        return diff(before if before is not None else self.session.baseline, self)

    def health(self, **thresholds):
        """NaN/Inf, vanishing and exploding gradients per node and per layer."""
        from hookwidget.analysis.health import health

        return health(self, **thresholds)

    # -- showing it ----------------------------------------------------------------------------
    def widget(self):
        from hookwidget.views.widget import HookWidget

        return HookWidget(self)

    def to_html(self, path) -> None:
        from hookwidget.views.export import to_html

        return to_html(self, path)

    def _repr_mimebundle_(self, **kwargs):
        """The explorer where widgets render; this trace's text summary everywhere else."""
        try:
            bundle = self.widget()._repr_mimebundle_(**kwargs)
        except ImportError:
            bundle = None
        if isinstance(bundle, tuple):
            data, meta = bundle
            return {**data, "text/plain": repr(self)}, meta
        return {**(bundle or {}), "text/plain": repr(self)}

    def __repr__(self) -> str:
        head = f"Trace: {len(self.layers)} layers, {self.graph.number_of_nodes()} graph nodes"
        if len(self.steps) > 1:
            head += f", {len(self.steps)} steps"
        lines = [head + (f", loss {self.loss:.6g}" if self.loss is not None else "")]
        for name, layer in self.layers.items():
            c = layer.calls[0]
            a = tuple(c.a.shape) if c.a is not None else (c.a_summary.shape if c.a_summary else None)
            d = tuple(c.delta.shape) if c.delta is not None else (c.delta_summary.shape if c.delta_summary else None)
            lines.append(f"  {name or '(root)'} [{layer.type}] calls={len(layer.calls)} a={a} δ={d}")
        lines += [f"  your hooks on {n}: {', '.join(hooks)}" for n, hooks in self.user_hooks.items()]
        lines += [f"  hook on: {iv}" for iv in self.applied]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- helpers -----------------------------------------------------------------------------------
_DECIDING = threading.RLock()  # re-entrant: deciding the notes may read them (an error message)


def _leaf_namer(rec, param_ids: dict, namespace) -> Callable:
    """Leaf tensor -> its name: parameter name (`param_ids`: by id), the user's variable name, or its
    graph node id. Keyed by id(): Tensor.__hash__ is a Python function, and a run of many steps asks
    for the same leaves again and again."""
    var_names = {id(v): k for k, v in (namespace or {}).items()
                 if isinstance(v, torch.Tensor) and not k.startswith("_")}
    walk = rec.walk
    node_ids = None
    cache: dict = {}

    def name(leaf) -> str:
        nonlocal node_ids
        key = id(leaf)
        found = cache.get(key)
        if found is None:
            found = param_ids.get(key) or var_names.get(key)
            if not found:
                if node_ids is None:
                    node_ids = {id(v): walk.ids[i] for i, v in enumerate(walk.variables) if v is not None}
                found = node_ids.get(key) or f"leaf{tuple(leaf.shape)}"
            cache[key] = found
        return found

    return name


def _few(names: list, k: int = 3) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def _user_hooks(layers: dict, leaves: dict) -> dict:
    """Hooks the user's code left attached (hookwidget's own are gone by now): module hooks by layer
    name, tensor hooks on the leaves backward reached (parameters, inputs) by their names. They
    change what the trace shows, so the user should see them."""
    kinds = {}
    for name, layer in layers.items():
        m = layer.module
        if m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks:
            kinds[name] = (("forward_pre", m._forward_pre_hooks), ("forward", m._forward_hooks),
                           ("backward", m._backward_hooks), ("backward_pre", m._backward_pre_hooks))
    for name, leaf in leaves.items():
        tensor_hooks = leaf._backward_hooks
        post = getattr(leaf, "_post_accumulate_grad_hooks", None)
        if tensor_hooks or post:
            kinds[name] = kinds.get(name, ()) + (("tensor", tensor_hooks or {}), ("post_accumulate_grad", post or {}))
    out = {}
    for name, dicts in kinds.items():
        found = [f"{kind}: {getattr(h, '__qualname__', type(h).__name__)}" for kind, d in dicts for h in d.values()]
        if found:
            out[name] = found
    return out


def _reduction_scale(loss_reduction: str, batch: int) -> float:
    if loss_reduction not in ("sum", "mean"):
        raise ValueError(f"loss_reduction={loss_reduction!r}: use 'sum' or 'mean' (the reduction of your loss)")
    return float(batch) if loss_reduction == "mean" else 1.0
