"""The Trace users hold: a handle on the immutable record of one run of their code (record/), with thin query
methods that delegate to analysis/ and a display (views/, imported when first shown).

How to run it again (the code, options, hooks, what-if reruns) lives in the Session (session.py)
that every Trace points to; `t.add_hook`, `t.rerun()` and `t.interventions` go through it, so a
trace, its reruns and the explorer agree on which hooks are on.

Beside it: arguments.py checks a method's arguments (one line from the method the user called), shares.py holds
the attribution queries (`t.shares` and its family, a base class of Trace), keeping.py turns a Trace into data
and back (`t.save`, `hw.load`).
"""

from __future__ import annotations

import os

import networkx as nx
import torch

from hookwidget.analysis import coverage
from hookwidget.analysis import per_sample as ps
from hookwidget.analysis.facts import Facts
from hookwidget.layers import factors as fx
from hookwidget.layers import registry
from hookwidget.options import check_name, check_path, shown
from hookwidget.record.notes import Note, render
from hookwidget.record.run import Layer, Pending, RunRecord, Step
from hookwidget.trace import keeping
from hookwidget.trace.arguments import (
    boundary,
    check_step,
    parameterised,
    positive,
    reduction_scale,
    trainable,
    with_weight,
)
from hookwidget.trace.shares import ShareQueries
from hookwidget.trace.tokens import TokenQueries

__all__ = ["Layer", "Step", "Trace"]


class Trace(ShareQueries, TokenQueries):
    """What one run of your code showed: layers and their calls, steps, the graph, gradients, notes.

    `hw.trace`, `hw.tracing` and `hw.load` make one, and so does a watch's `w.trace(k)`; you do not construct it.
    In a notebook it displays as its explorer, elsewhere as a text summary.

    Attributes:

    - `applied`: the interventions that were on in this run (`t.interventions`: those on now, for the next rerun).

    Raises:

    A wrong argument of a method raises one line naming it, its value and a valid example:

    - `TypeError`: an argument of the wrong type (not a string, not a Trace).
    - `KeyError`: no such layer or target (the message names close ones first).
    - `ValueError`: a bad value, or a query this trace cannot answer.
    - `RuntimeError`: what the trace cannot do at all (rerun a `hw.tracing` block, or a step `hw.watch` kept).
    """

    # `record`: the RunRecord (record/run.py), given as it is or as the Pending one of a run still going (`with
    # hw.tracing() as t:`: empty until its block ends). `facts`: analysis's one cache for this trace, made with it
    # (analysis/facts.py).
    def __init__(self, session, record: RunRecord | Pending, applied=(), baseline: Trace | None = None):
        self.session = session
        self._baseline = baseline  # a rerun's: the first run it is compared with, alive as long as the rerun is
        self.applied = tuple(applied)  # the interventions that were on in this run
        self._pending = record if isinstance(record, Pending) else Pending(record)
        self.facts = Facts()

    @property
    def record(self) -> RunRecord:
        """The run as data: layers, steps, .grad copies, parameters, losses, notes (empty until a `hw.tracing`
        block ends). The properties below read from it."""
        return self._pending.record

    @property
    def options(self) -> dict:
        """The options this trace ran with that differ from their defaults, by name (e.g. `{"capture": "norms"}`)."""
        return self.session.options.as_dict()

    @property
    def layers(self) -> dict[str, Layer]:
        """Each hooked module's `Layer`, by qualified name: `t.layers["fc1"]` (a missing name's KeyError lists close
        ones)."""
        return self._pending.record.layers

    @property
    def steps(self) -> list[Step]:
        """Each backward pass the code ran (a `backward()` or `torch.autograd.grad` call), as a `Step`, in order."""
        return self._pending.record.steps

    @property
    def param_grads(self) -> dict[str, torch.Tensor | None]:
        """.grad as the last backward pass left it (copies)."""
        return self._pending.record.param_grads

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The parameters of the hooked modules (and the leaf tensors backward reached), by qualified name."""
        return self._pending.record.params

    @property
    def losses(self) -> list[float]:
        """The value of each scalar backward started from, over every step, in order (`t.loss` is the last)."""
        return self._pending.record.losses

    @property
    def accumulates(self) -> bool:
        """Whether backward passes summed into .grad with no reset between them."""
        return self._pending.record.accumulates

    @property
    def user_hooks(self) -> dict[str, list[str]]:
        """Hooks the user's code left on the layers and leaves, by name (hookwidget's own are never listed)."""
        return self.record.user_hooks

    @property
    def note_records(self) -> tuple[Note, ...]:
        """The notes as data: each a `Note` with a stable `id` and the `fields` its text is made of (`t.notes`
        is their text)."""
        r = self.record
        return r.notes[:r.factor_notes_at] + coverage.decide(self).notes + r.notes[r.factor_notes_at:]

    @property
    def notes(self) -> list[str]:
        """What the trace could not show or keep, and why, one line each."""
        return [render(n) for n in self.note_records]

    @property
    def per_sample_left_out(self) -> dict[str, str]:
        """Parameter with a .grad -> why per-sample norms over the whole model leave it out."""
        return coverage.decide(self).left_out

    @property
    def interventions(self) -> list:
        """The hooks on now, for the next rerun (shared by this trace, its reruns and the explorer)."""
        return self.session.interventions

    # -- what the run showed -------------------------------------------------------------------
    @property
    def graph(self) -> nx.DiGraph:
        """The autograd graph of grad_fn nodes of the last backward pass (built on first access)."""
        return self.record.graph.get()

    @property
    def loss(self) -> float | None:
        """The value of the last scalar that backward started from, if any."""
        return self.losses[-1] if self.losses else None

    @boundary
    def layer(self, name: str) -> Layer:
        """The `Layer` named `name`, as `t.layers[name]`; a missing name raises KeyError naming close ones."""
        return self.layers[check_name("name", name)]  # a missing one: KeyError listing close names (record/run.py)

    @boundary
    def supports(self, name: str) -> bool:
        """Whether this layer's parameter gradients rebuild from what the trace kept (`weight_grad`, per-sample
        gradients and norms, shares).

        True where an exact (a, δ) rule covers the layer, or where the generic torch.func rule passed its check
        (its per-sample gradients add up to the gradient the step made) in the last step that reached the layer.
        False for a layer without parameters, a module that mixes samples (BatchNorm in train mode), or a rule that
        failed its check: `t.notes` says why.

        Args:

        - `name`: a layer name (`t.layers`).

        Returns:

        True or False.

        Raises:

        - `TypeError`: `name` is not a string.
        - `KeyError`: no such layer (the message names close ones).

        Example:

        ```python
        t.supports("fc1"), t.supports("act")   # (True, False): a ReLU has no parameters
        ```
        """
        with registry.memo():
            return ps.supports(self, name)

    @boundary
    def weight_grad(self, name: str, step: int | None = None) -> torch.Tensor:
        """W.grad of the layer rebuilt from its factors a and δ.

        Args:

        - `name`: a layer name (`t.layers`) whose module has a weight.
        - `step`: the index of one of `t.steps` (negative from the end): what that backward pass added to .grad;
          None (default): what every pass added (one pass, or passes accumulating into .grad).

        Returns:

        A tensor of the weight's shape.

        Raises:

        - `KeyError`: no such layer (the message names close ones).
        - `ValueError`: the layer has no parameters, no factor rule, or `step` is out of range.

        Example:

        ```python
        torch.allclose(t.weight_grad("fc1"), model.fc1.weight.grad)
        ```
        """
        parameterised(self, name)
        with registry.memo():
            return ps.summed_grad(self, self.layer(name).name, "weight", check_step(self, step))

    @boundary
    def bias_grad(self, name: str, step: int | None = None) -> torch.Tensor:
        """b.grad of the layer rebuilt from its factors, as `weight_grad` does for W.grad: what backward pass
        `step` added to .grad, or, without step=, what every pass added."""
        parameterised(self, name)
        with registry.memo():
            return ps.summed_grad(self, self.layer(name).name, "bias", check_step(self, step))

    @boundary
    def per_sample_grads(self, name: str, param: str = "weight", loss_reduction: str = "sum",
                         step: int | None = None) -> torch.Tensor:
        """Each sample's contribution to the parameter's .grad, as (N, *param.shape).

        They sum to .grad. Under gradient accumulation N counts the samples of every micro-batch, in order.

        Args:

        - `name`: a layer name (`t.layers`).
        - `param`: the layer's parameter, `"weight"` (default) or `"bias"`.
        - `loss_reduction`: `"sum"` (default): the contributions; `"mean"`: each sample's own gradient under a
          mean-reduced loss (the contributions times B).
        - `step`: as `weight_grad`'s.

        Returns:

        A tensor of shape (N, *param.shape).

        Raises:

        - `KeyError`: no such layer.
        - `ValueError`: a bad `param`, `loss_reduction` or `step`, or a layer without parameters that require grad.
        """
        reduction_scale(loss_reduction, 1)
        check_name("param", param, "'weight'")
        parameterised(self, name)
        with registry.memo():
            g = ps.per_sample_grad(self, self.layer(name).name, param, check_step(self, step))
        return g * reduction_scale(loss_reduction, g.shape[0])

    @boundary
    def per_sample_grad_norms(self, name: str | None = None, loss_reduction: str = "sum",
                              step: int | None = None) -> torch.Tensor:
        """The norm of each sample's gradient, as (N,), over one layer's parameters or the whole model's.

        A parameter shared by several layers is counted once.

        Args:

        - `name`: a layer name, or None (default): every supported layer (`t.factor_layers`).
        - `loss_reduction`, `step`: as `per_sample_grads`'.

        Returns:

        A tensor of shape (N,).
        """
        reduction_scale(loss_reduction, 1)
        if name is not None:
            trainable(self, self.layer(name).name)
        with registry.memo():  # a query asks the registry about each layer several times
            norms = ps.per_sample_norms(self, name, check_step(self, step))
        return norms * reduction_scale(loss_reduction, norms.shape[0])

    @property
    def factor_layers(self) -> list[str]:
        """Layers whose parameter gradients (a, δ) rebuild: weight_grad, per-sample gradients."""
        with registry.memo():
            return ps.factor_layers(self)

    @boundary
    def storage(self, name: str) -> dict:
        """The floats needed to store W.grad against those of its (a, δ) factors (seed 003's figures).

        W.grad holds d_out·d_in floats whatever the batch; its factors hold d_in + d_out per token (a sample, or a
        position of a sequence), so they are the smaller store while tokens < d_out·d_in / (d_in + d_out), and a
        gradient per token (what per-sample methods materialise) costs W.grad's size each.

        Args:

        - `name`: a layer name (`t.layers`) whose module has a weight matrix.

        Returns:

        A dict: `weight_shape`; `weight_grad_floats` (W.grad's); `factor_floats_per_token` (d_in + d_out);
        `tokens` (the rows of a and δ in the last step, or in every pass under accumulation; 0 for a layer the
        generic rule serves); `factor_floats` (the factors' floats); `per_token_grad_floats` (a gradient per token).

        Raises:

        - `TypeError`: `name` is not a string.
        - `KeyError`: no such layer (the message names close ones).
        - `ValueError`: the layer has no weight matrix (the message names layers with one).

        Example:

        ```python
        s = t.storage("fc1")
        s["tokens"], s["factor_floats"], s["per_token_grad_floats"]   # 8 samples x 5 positions: (40, 480, 1280)
        ```
        """
        module = with_weight(self, name)
        tokens = 0
        if name in self.factor_layers and not fx.is_generic(self.layer(name).module):
            f = ps.param_factors(self, name, "weight", self.steps[-1].index if not self.accumulates else None)[0]
            tokens = f.D.shape[0] * f.D.shape[1]
        return fx.storage(module, tokens)

    # -- changing it (through the session) -----------------------------------------------------
    @boundary
    def add_hook(self, target: str, kind: str, **params):
        """Attach an intervention for the next rerun(); the same kind on the same target is replaced.

        Args:

        - `target`: a layer name (`t.layers`), or a graph node (`"PowBackward0#0"`) for a `grad_*` kind.
        - `kind`: one of `hw.KINDS` (see Interventions).
        - `**params`: the kind's parameters, e.g. `factor=0.5` for `"grad_scale"`.

        Returns:

        The intervention attached (it is in `t.interventions`).

        Raises:

        - `TypeError`: a target or kind that is not a string.
        - `KeyError`: no such target (the message names close ones).
        - `ValueError`: an unknown kind, a parameter the kind does not take or a bad value of one, or a trace
          that cannot rerun (a step `hw.watch` kept).

        Example:

        ```python
        t.add_hook("fc1", "grad_scale", factor=0.5)
        t.rerun().diff(t)
        ```
        """
        return self.session.add_hook(target, kind, **params)

    @boundary
    def remove_hook(self, target: str, kind: str, missing_ok: bool = False) -> None:
        """Remove the intervention `kind` on `target` that `add_hook` attached, for the next rerun(). KeyError when
        there is none, unless `missing_ok=True`."""
        self.session.remove_hook(target, kind, missing_ok=missing_ok)

    def rerun(self) -> Trace:
        """Run the same code again with the interventions on, as a what-if, and return its Trace.

        Parameters, buffers, optimizer and scheduler state, .grad and every RNG are put back first, and put back as
        they are now afterwards, so the interventions are the only change and nothing stays changed.

        Returns:

        The `Trace` of the rerun (`.diff()` compares it with the hook-free first run).

        Raises:

        - `RuntimeError`: the trace cannot rerun: a `hw.tracing` block, a step `hw.watch` kept, a loaded trace.

        Example:

        ```python
        t.add_hook("fc1", "grad_zero")
        t2 = t.rerun()
        t2.diff().changed      # the parameters whose gradient the hook changed
        ```
        """
        refused = self.session.no_rerun()
        if refused:
            raise RuntimeError(refused)  # raised here: the traceback is the user's line and this one
        return self.session.rerun()

    @boundary
    def diff(self, before: Trace | None = None):
        """What changed from `before` (default: the hook-free first run) to this trace: grads per
        parameter, loss, δ per layer.

        Args:

        - `before`: the Trace to compare with; default: the hook-free first run of this trace's code.

        Returns:

        A `Diff`: `.params` (a change per parameter: norms before and after, relative change, cosine), `.param(name)`,
        `.changed` (parameters whose gradient changed by more than float noise), `.ranked`, `.loss_before`,
        `.loss_after`, `.layers` (layer name -> δ norm before and after).

        Raises:

        - `TypeError`: `before` is not a Trace.
        - `ValueError`: no `before` and no hook-free first run (a `hw.tracing` block), or traces of unrelated runs.
        """
        from hookwidget.analysis.diff import diff

        if before is None and self.session.baseline is None:
            raise ValueError("this trace has no hook-free first run to compare with (`with hw.tracing()` runs once): "
                             "pass one, e.g. t2.diff(t1)")
        if before is not None and not isinstance(before, Trace):
            raise TypeError(f"diff(before) takes a Trace, got {type(before).__name__} {shown(before)}; "
                            "e.g. t.rerun().diff(t)")
        return diff(before if before is not None else self.session.baseline, self)

    @boundary
    def health(self, **thresholds):
        """NaN/Inf, vanishing and exploding gradients per node and per layer.

        Args:

        - `vanishing`: a layer is vanishing when ‖grad‖ < vanishing·‖W‖ (default 1e-7).
        - `exploding`: a layer is exploding when ‖grad‖ > exploding·‖W‖ (default 1e3).

        Returns:

        A `Health`: `.layers` (name -> its figures and flags), `.flagged` (name -> flags), `.nonfinite_nodes`
        (graph nodes with a NaN or Inf gradient, in backward order), `.first_nonfinite_node`.

        Raises:

        - `TypeError`: a threshold other than vanishing= and exploding=.
        - `ValueError`: a threshold that is not a number > 0.
        """
        from hookwidget.analysis.health import health

        for key, value in thresholds.items():
            if key not in ("vanishing", "exploding"):
                raise TypeError(f"health() takes vanishing= and exploding=, got {shown(key)}; "
                                "e.g. t.health(exploding=1e4)")
            if not positive(value):
                raise ValueError(f"health: {key}={shown(value)} must be a number > 0, e.g. {key}=1e-7")
        return health(self, **thresholds)

    # -- showing it ----------------------------------------------------------------------------
    def widget(self):
        """The explorer of this trace as a widget: what a notebook shows for `t` (graph, layers, a and δ, hooks)."""
        from hookwidget.views.widget import HookWidget

        return HookWidget(self)

    @boundary
    def to_html(self, path) -> None:
        """Write the explorer of this trace to `path` as one standalone HTML page (it opens without a kernel).

        Raises:

        - `TypeError`: `path` is not a file path.
        """
        from hookwidget.views.export import to_html

        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"to_html(path) takes a file path, got {type(path).__name__} {shown(path)}; "
                            "e.g. t.to_html('trace.html')")
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

    # -- keeping it (record/saved.py) ------------------------------------------------------------
    def save(self, path, activations: bool = True) -> None:
        """Write this trace to `path` as data (tensors, the graph, notes, layers, steps; no code), for `hw.load`.

        `hw.load(path)` gives a read-only Trace that answers the same queries, without rerun or hooks.

        Args:

        - `path`: the file to write (a str or os.PathLike).
        - `activations`: True (default) keeps each layer's a and δ; False keeps their statistics, not their
          values: for a large model (GPT-2 124M at batch 4 × 128, a and δ are about a sixth of the file; its
          parameters and .grad the rest). The loaded trace then shows the graph, every layer's statistics, the
          steps, .grad, health and the whole model's per-sample gradient norms (taken now); the other factor
          queries say in one line that it was saved without.

        Raises:

        - `TypeError`: `path` is not a path, or `activations` is not a bool.
        - `RuntimeError`: the run is still going (save a `hw.tracing` trace after its block).

        Example:

        ```python
        t.save("step.pt")
        hw.load("step.pt").weight_grad("fc1")
        ```
        """
        from hookwidget.record import saved

        check_path(path, "t.save(path)", "t.save('step.pt')")
        if not isinstance(activations, bool):
            raise TypeError(f"t.save(path, activations=...) takes True or False, got {shown(activations, 40)}")
        saved.write(path, "trace", keeping.to_tree(self, activations))

    def to_data(self) -> dict:
        """What `save` writes, as nested dicts and lists of plain values and tensors: the record, with the answers
        that would need the code to work out again (`Trace.from_data` reads it back). A file that holds several
        traces (a watch's) nests these."""
        return keeping.to_tree(self)  # the format: record/saved.py

    @classmethod
    def from_data(cls, tree: dict, source) -> Trace:
        """The read-only Trace of what `to_data` gave, read back from the file `source` (`hw.load` reads it)."""
        return keeping.from_tree(cls, tree, source)

    def __reduce__(self):
        raise keeping.not_copied(self)
