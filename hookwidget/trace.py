"""The Trace users hold: what one run of their code showed, and how to change it and run again."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import torch
from torch import nn

from . import factors as fx
from . import graph as graph_mod
from .capture import Tracer
from .interventions import Intervention, make
from .naming import name_filter, qualified_names

_OPTIONS = {"capture", "budget_mb", "include", "exclude", "node_grads", "show_hook_nodes", "backward_hooks"}


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


def trace(fn: Callable[[], object], modules=None, **options) -> Trace:
    """Run `fn()` once with hooks on every module it calls (or on `modules`) and return the Trace.

    Options: capture ("full": keep a and δ; "summary": statistics only; "norms": per-sample
    gradient norms only), budget_mb (memory for kept tensors, default 512), include / exclude
    (glob patterns on layer names), node_grads (gradient norm at every graph node; default: for graphs
    of up to 256 nodes, else for layer outputs and parameters only),
    backward_hooks (also run full module backward hooks, to see grad_input; they raise when an
    in-place op follows a module, so off by default).
    Every hook is removed when fn returns or raises.

    `fn` takes no arguments. With capture="norms", a and δ are dropped as soon as each layer's
    norms are computed, so only per_sample_grad_norms() is available.

    Example::

        def step():
            model.zero_grad()
            loss_fn(model(x), y).backward()

        t = hw.trace(step)
        t.layers["fc1"].a, t.layers["fc1"].delta, t.weight_grad("fc1"), t.per_sample_grad_norms()
    """
    if isinstance(fn, nn.Module) or not callable(fn):
        raise TypeError(f"hw.trace takes a function to run, got {type(fn).__name__}; "
                        "for a block of code use `with hw.tracing() as t:`")
    t = Trace(fn=fn, modules=modules, options=options)
    t._run()
    return t


@contextmanager
def tracing(modules=None, **options) -> Iterator[Trace]:
    """`with hw.tracing() as t:` traces the block; `t` is filled in when the block ends."""
    t = Trace(fn=None, modules=modules, options=options)
    with t._capturing():
        yield t


class Trace:
    """Records + graph + factors + interventions of one run. Displays as its widget."""

    def __init__(self, fn, modules, options, interventions=None, names=None, namespace=None):
        self._fn = fn
        self._modules = modules
        self._names = names  # user-namespace names of `modules` (from the magic)
        self._namespace = namespace  # the notebook's variables, to name leaf tensors like `x`
        self.options = dict(options)
        self.interventions: list[Intervention] = list(interventions or [])
        self.layers: dict[str, Layer] = {}
        self._graph: nx.DiGraph | None = nx.DiGraph()
        self._graph_inputs = None  # what graph.build needs; the graph is built on first access
        self._factor_layers: list | None = None
        self._unbatched_layers: dict | None = None
        self.param_grads: dict[str, torch.Tensor | None] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []
        self.notes: list[str] = []
        self.user_hooks: dict[str, list[str]] = {}
        self._leaf_grads_before: dict = {}
        self._rng_before = None
        self._no_factors = ""

    # -- running -------------------------------------------------------------------------------
    def _run(self) -> None:
        with self._capturing():
            self._fn()

    @contextmanager
    def _capturing(self):
        opts = dict(self.options)
        unknown = set(opts) - _OPTIONS
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; options: {', '.join(sorted(_OPTIONS))}")
        include, exclude = opts.pop("include", None), opts.pop("exclude", None)
        opts.pop("show_hook_nodes", None)
        layer_ivs, node_ivs = defaultdict(list), defaultdict(list)
        for iv in self.interventions:
            (layer_ivs if isinstance(iv.anchor, nn.Module) else node_ivs)[iv.anchor].append(iv)
        tracer = Tracer(self._modules, layer_interventions=layer_ivs, node_interventions=node_ivs,
                        norms_rule=_norms_rule(opts.get("capture")), **opts)
        self._rng_before = _rng_state()
        failed = True
        try:
            with tracer:
                yield self
            failed = False
        finally:
            if tracer.records is not None:
                try:
                    self._attach(tracer, include, exclude)
                except Exception:
                    if not failed:
                        raise  # otherwise the cell's own exception propagates, not hookwidget's

    def _attach(self, tracer: Tracer, include, exclude) -> None:
        rec = tracer.records
        names, self.params = qualified_names(list(rec.modules), tracer.targets, self._names)
        self.notes = list(rec.notes)
        self._no_factors = rec.no_factors
        keep = name_filter(include, exclude)
        for module, mrec in rec.modules.items():
            name = names.get(module)
            if name is not None and mrec.calls and keep(name):
                self.layers[name] = Layer(name, module, mrec.calls)
        param_names = {p: n for n, p in self.params.items()}
        calls = [(name, c.seq_start, c.seq_end) for name, layer in self.layers.items() for c in layer.calls]
        self._graph, self._graph_inputs = None, (rec.walk, param_names, calls)
        self._leaf_grads_before = rec.leaf_grads_before
        var_names = {id(v): k for k, v in (self._namespace or {}).items()
                     if isinstance(v, torch.Tensor) and not k.startswith("_")}
        leaves = {}
        for leaf in rec.leaf_grads_before:
            node_id = rec.walk.ids[rec.leaf_index[leaf]] if leaf in rec.leaf_index else f"leaf{tuple(leaf.shape)}"
            name = param_names.get(leaf) or var_names.get(id(leaf)) or node_id
            self.param_grads[name] = leaf.grad
            leaves[name] = leaf
        self.losses = [float(v) for v in rec.roots]
        self.user_hooks = _user_hooks(self.layers, leaves)
        unsupported = sorted({f"{n} ({fx.unsupported_reason(layer.module)})" for n, layer in self.layers.items()
                              if _has_own_params(layer.module) and fx.unsupported_reason(layer.module)})
        if unsupported:
            self.notes.append("no (a, δ) factor rule, so no weight_grad / per-sample gradients for: "
                              + ", ".join(unsupported))
        self._norms = None
        left_out = [n for n in self._unbatched()]
        if tracer.norms_rule:
            self._norms, modules = tracer.norms_rule.result()
            left_out = [n for n, layer in self.layers.items() if layer.module in modules]
        if left_out:
            self.notes.append("per-sample gradients leave out " + ", ".join(left_out) + ": their input has no batch "
                              "dimension (e.g. an embedding called on arange(T)), so their gradient is already summed "
                              "over the batch")
        for iv in self.interventions:
            if isinstance(iv.anchor, nn.Module) and iv.anchor not in rec.modules:
                self.notes.append(f"intervention {iv} did not fire: its module was not called "
                                  "(was the model created anew inside the cell?)")

    # -- what the run showed -------------------------------------------------------------------
    @property
    def graph(self) -> nx.DiGraph:
        """The autograd graph of grad_fn nodes (built on first access: tracing itself stays cheap)."""
        if self._graph is None:
            walk, param_names, calls = self._graph_inputs
            self._graph = graph_mod.build(walk, param_names, calls,
                                          show_hook_nodes=self.options.get("show_hook_nodes", False))
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
        """Whether (a, δ) rebuild this layer's parameter gradients."""
        return fx.unsupported_reason(self.layer(name).module) is None

    def _factors(self, name: str) -> list[fx.Factor]:
        layer = self.layer(name)
        reason = fx.unsupported_reason(layer.module)
        if reason:
            raise ValueError(f"layer {name!r}: {reason}; supported types: "
                             + ", ".join(sorted(t.__name__ for t in fx.RULES)))
        if self._no_factors:
            raise ValueError(f"layer {name!r}: {self._no_factors}")
        missing = [c.index for c in layer.calls if c.a is None or c.delta is None]
        if missing:
            why = "; ".join(self.notes) or "no backward reached it"
            raise ValueError(f"layer {name!r}: a or δ not kept for call(s) {missing} ({why})")
        return fx.factors(layer.module, layer.calls)

    def weight_grad(self, name: str) -> torch.Tensor:
        """W.grad of the layer rebuilt from its factors, summed over all its calls."""
        return fx.summed_grad(self._factor(name, "weight"))

    def bias_grad(self, name: str) -> torch.Tensor:
        return fx.summed_grad(self._factor(name, "bias"))

    def _factor(self, name: str, param: str) -> fx.Factor:
        for f in self._factors(name):
            if f.param == param:
                return f
        raise ValueError(f"layer {name!r} has no trainable {param}")

    def per_sample_grads(self, name: str, param: str = "weight", loss_reduction: str = "sum") -> torch.Tensor:
        """(B, *param.shape): each sample's contribution to the parameter's .grad.

        They sum to .grad. With a mean-reduced loss pass loss_reduction="mean" to get each
        sample's own gradient (the contributions times B)."""
        self._check_batched(name)
        g = fx.per_sample_grad(self._factor(name, param))
        return g * _reduction_scale(loss_reduction, g.shape[0])

    def per_sample_grad_norms(self, name: str | None = None, loss_reduction: str = "sum") -> torch.Tensor:
        """(B,) norms of per-sample gradients over all parameters of one layer, or of every
        supported layer (name=None). A parameter shared by several layers is counted once."""
        if name is None and self._norms is not None:
            sq = self._norms
        else:
            if name is not None:
                self._check_batched(name)
            names = [name] if name is not None else [n for n in self.factor_layers if n not in self._unbatched()]
            if not names:
                raise ValueError("no layer with (a, δ) factors in this trace: " + ("; ".join(self.notes) or
                                 "run a backward inside the trace"))
            by_param = defaultdict(list)
            for n in names:
                for f in self._factors(n):
                    by_param[getattr(self.layers[n].module, f.param)].append(f)
            sq = 0
            for fs in by_param.values():
                if len(fs) == 1:
                    sq = sq + fx.per_sample_norm_sq(fs[0])
                else:
                    sq = sq + sum(fx.per_sample_grad(f) for f in fs).flatten(1).pow(2).sum(1)
        return sq.sqrt() * _reduction_scale(loss_reduction, sq.shape[0])

    @property
    def factor_layers(self) -> list[str]:
        """Layers whose parameter gradients (a, δ) rebuild: weight_grad, per-sample gradients."""
        if self._factor_layers is None:  # fixed once the trace has ended
            self._factor_layers = [n for n in self.layers if self._has_factors(n)]
        return self._factor_layers

    def _unbatched(self) -> dict:
        """Layers whose input's leading dimension is not the batch size most layers agree on, e.g.
        a positional embedding called on arange(T): their gradient is already summed over the batch."""
        if self._unbatched_layers is None:
            self._unbatched_layers = self._find_unbatched()
        return self._unbatched_layers

    def _find_unbatched(self) -> dict:
        lead = {n: self.layers[n].calls[0].a.shape[0] if self.layers[n].calls[0].a.dim() else None
                for n in self.factor_layers}
        if not lead:
            return {}
        counts = Counter(v for v in lead.values() if v is not None)
        batch = counts.most_common(1)[0][0] if counts else None
        return {n: (b, batch) for n, b in lead.items() if b != batch}

    def _check_batched(self, name: str) -> None:
        bad = self._unbatched().get(name)
        if bad:
            raise ValueError(f"layer {name!r}: its input's leading dimension is {bad[0]}, not the batch size {bad[1]} "
                             "of the other layers (e.g. an embedding called on arange(T)): its gradient is already "
                             "summed over the batch, so per-sample gradients cannot be separated")

    def _has_factors(self, name: str) -> bool:
        layer = self.layers[name]
        return (_has_own_params(layer.module) and fx.unsupported_reason(layer.module) is None
                and all(c.a is not None and c.delta is not None for c in layer.calls))

    def storage(self, name: str) -> dict:
        """Floats needed to store W.grad vs its (a, δ) factors (seed 003's figures)."""
        f = self._factor(name, "weight") if self._has_factors(name) else None
        tokens = f.D.shape[0] * f.D.shape[1] if f is not None else 0
        return fx.storage(self.layer(name).module, tokens)

    # -- changing it ---------------------------------------------------------------------------
    def add_hook(self, target: str, kind: str, **params) -> Intervention:
        """Attach an intervention for the next rerun(); the same kind on the same target is replaced."""
        anchor = self._resolve(target, kind)
        iv = make(target, kind, params)
        iv.anchor = anchor
        self.remove_hook(target, kind, missing_ok=True)
        self.interventions.append(iv)
        return iv

    def remove_hook(self, target: str, kind: str, missing_ok: bool = False) -> None:
        before = len(self.interventions)
        self.interventions = [iv for iv in self.interventions if not (iv.target == target and iv.kind.name == kind)]
        if len(self.interventions) == before and not missing_ok:
            on = ", ".join(f"{iv.kind.name} on {iv.target!r}" for iv in self.interventions) or "none"
            raise KeyError(f"no {kind} hook on {target!r} to remove; attached: {on}")

    def _resolve(self, target: str, kind: str):
        if target in self.layers:
            return self.layers[target].module
        if target in self.graph:
            from .interventions import KINDS

            if kind in KINDS and KINDS[kind].attach == "out":
                raise ValueError(f"{kind} replaces a layer's output: give a layer name, not node {target!r}")
            return target
        raise KeyError(f"unknown target {target!r}: give a layer name ({', '.join(list(self.layers)[:6])}) "
                       f"or a graph node id (e.g. {next(iter(self.graph.nodes), 'AddmmBackward0#0')!r})")

    def rerun(self) -> Trace:
        """Run the same code again with the interventions on. .grad of every leaf the first
        run reached and the RNG state are put back first, so the interventions are the only change."""
        if self._fn is None:
            raise RuntimeError("rerun needs the code to run again: use hw.trace(fn) or %%hooktrace, "
                               "not `with hw.tracing()`")
        for leaf, g in self._leaf_grads_before.items():
            leaf.grad = None if g is None else g.clone()
        _set_rng_state(self._rng_before)
        t = Trace(self._fn, self._modules, self.options, self.interventions, self._names, self._namespace)
        t._run()
        return t

    def diff(self, before: Trace):
        """What changed from `before` to this trace: grads per parameter, loss, δ per layer."""
        from .diff import diff

        return diff(before, self)

    def health(self, **thresholds):
        """NaN/Inf, vanishing and exploding gradients per node and per layer."""
        from .health import health

        return health(self, **thresholds)

    # -- showing it ----------------------------------------------------------------------------
    def widget(self):
        from .widget import HookWidget

        return HookWidget(self)

    def to_html(self, path) -> None:
        from .export import to_html

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
        lines = [f"Trace: {len(self.layers)} layers, {self.graph.number_of_nodes()} graph nodes"
                 + (f", loss {self.loss:.6g}" if self.loss is not None else "")]
        for name, layer in self.layers.items():
            c = layer.calls[0]
            a = tuple(c.a.shape) if c.a is not None else (c.a_summary.shape if c.a_summary else None)
            d = tuple(c.delta.shape) if c.delta is not None else (c.delta_summary.shape if c.delta_summary else None)
            lines.append(f"  {name or '(root)'} [{layer.type}] calls={len(layer.calls)} a={a} δ={d}")
        lines += [f"  your hooks on {n}: {', '.join(hooks)}" for n, hooks in self.user_hooks.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- helpers -----------------------------------------------------------------------------------
def _has_own_params(m: nn.Module) -> bool:
    return any(p is not None and p.requires_grad for p in m._parameters.values())


def _user_hooks(layers: dict, leaves: dict) -> dict:
    """Hooks the user's code left attached (hookwidget's own are gone by now): module hooks by layer
    name, tensor hooks on the leaves backward reached (parameters, inputs) by their names. They
    change what the trace shows, so the user should see them."""
    kinds = {name: (("forward_pre", layer.module._forward_pre_hooks), ("forward", layer.module._forward_hooks),
                    ("backward", layer.module._backward_hooks), ("backward_pre", layer.module._backward_pre_hooks))
             for name, layer in layers.items()}
    for name, leaf in leaves.items():
        kinds.setdefault(name, ())
        kinds[name] += (("tensor", leaf._backward_hooks or {}),
                        ("post_accumulate_grad", getattr(leaf, "_post_accumulate_grad_hooks", None) or {}))
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


def _norms_rule(capture):
    if capture != "norms":
        return None
    from .norms import StreamingNorms

    return StreamingNorms()


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
