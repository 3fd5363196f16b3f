"""The record of one run as the Trace holds it: named layers and their calls, steps, .grad, the graph, notes.

Only record/assemble.py builds a RunRecord, once, when the run ends; nothing changes it afterwards. A run that
is still going (`with hw.tracing() as t:`) has a Pending record: the empty one until its block ends, then the
assembled one (set once).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import networkx as nx
import torch
from torch import nn

from hookwidget.options import check_name, shown, suggest
from hookwidget.record import graph as graph_mod
from hookwidget.stats import TensorSummary


@dataclass
class Layer:
    """One module that was called: its qualified name and one Call per forward call, in order.

    Attributes:

    - `name`: the module's qualified name in the model, e.g. `"blocks.0.attn"`.
    - `module`: the `nn.Module` itself.
    - `calls`: one `Call` per forward call, in order: its input activation `a`, the gradient `delta` (δ) with
      respect to its output, `output_shape`, their statistics `a_summary` and `delta_summary` where the memory
      budget kept no copy, `grad_input` (backward_hooks=True), and the `step` (backward pass) that brought its δ.

    Example:

    ```python
    layer = t.layers["fc1"]
    layer.a.shape, layer.delta.shape, len(layer.calls)   # (8, 5, 4), (8, 5, 8), 1: a and δ of its one call
    ```
    """

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
        """The module's class name, e.g. `"Linear"`."""
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


class Layers(dict):
    """Layer name -> Layer; a missing name is a KeyError of one line that lists the close names ("did you mean"),
    a name that is not a string (a list) a TypeError of one line."""

    def __getitem__(self, name):
        try:
            return super().__getitem__(name)
        except (KeyError, TypeError):  # missing, or unhashable (a list)
            pass
        check_name("layer name", name)
        raise KeyError(f"no layer {shown(name)} in this trace; {suggest(name, self, 'layers')}")


class LazyGraph:
    """The networkx graph of a walk, built on first use (many traces are never drawn); the walk, which holds
    autograd's nodes, is let go once it is built."""

    def __init__(self, walk=None, param_names=None, calls=(), show_hook_nodes: bool = False):
        self._inputs = (walk, param_names, calls, show_hook_nodes) if walk is not None else None
        self._graph = None if walk is not None else nx.DiGraph()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, graph: nx.DiGraph) -> LazyGraph:
        """A graph built already (a record read back from disk: record/saved.py)."""
        lazy = cls()
        lazy._graph = graph
        return lazy

    def get(self) -> nx.DiGraph:
        with self._lock:
            if self._graph is None:
                walk, param_names, calls, show = self._inputs
                self._graph = graph_mod.build(walk, param_names, calls, show_hook_nodes=show)
                self._inputs = None
            return self._graph


@dataclass(frozen=True)
class RunRecord:
    """What one run showed, named. `notes` are capture's and the record's own (record/notes.py); the notes that
    analysis decides (which layers have no factor rule, what per-sample norms leave out) go at `factor_notes_at`
    among them. `no_factors`: why (a, δ) cannot rebuild .grad in this run, or "". `norms`: capture="norms"'s
    per-step (squared per-sample norms, modules left out), else None. `answers`: the layer registry's answers
    at each module's first call (registry.memo)."""

    layers: dict = field(default_factory=Layers)  # a Layers: a missing name's KeyError lists close ones
    steps: list = field(default_factory=list)
    param_grads: dict = field(default_factory=dict)  # .grad as the last backward pass left it (copies)
    params: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    user_hooks: dict = field(default_factory=dict)
    accumulates: bool = False  # backward passes summed into .grad with no reset between them
    notes: tuple = ()
    factor_notes_at: int = 0
    no_factors: str = ""
    norms: list | None = None
    answers: dict = field(default_factory=dict, repr=False)
    graph: LazyGraph = field(default_factory=LazyGraph, repr=False)
    done: bool = False  # False: the empty record of a run still going

    def __post_init__(self):
        if type(self.layers) is not Layers:
            object.__setattr__(self, "layers", Layers(self.layers))


class Pending:
    """The record of a run that may still be going: empty until `fill` (once, when the run ends)."""

    def __init__(self, record: RunRecord | None = None):
        self.record = RunRecord() if record is None else record

    def fill(self, record: RunRecord) -> None:
        if self.record.done:
            raise RuntimeError("this run's record is assembled already")
        self.record = record
