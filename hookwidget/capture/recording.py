"""One recording: what a tracer fills from its entry (or its latest cut) to its exit (or its next cut).

The tracer (tracer.py) owns the hooks, which stay on; a Recording owns what they fill: the keep strategy and its
budget, the module records, the steps, the graph walk, the .grad copies and the notes. `settle()` ends it cheaply
(its hooks quiet, the graph's nodes let go, what it holds by reference listed with the versions those tensors
had) and `finish()` makes its Records. A trace does both at its end; the flight recorder (watch/flight.py) cuts
a recording at each step's end and finishes only the steps it keeps: a dropped step's detail is let go without
a copy being made or a record assembled. A tensor held by reference that is written in place between the two
(a .grad clipped in place, a batch buffer reused) is left out of the record, with a note that names its layer.
"""

from __future__ import annotations

from collections import Counter, deque

from hookwidget._torch.tensors import versions
from hookwidget.capture import finish
from hookwidget.capture import keep as keep_mod
from hookwidget.capture.budget import Budget
from hookwidget.capture.generic import GenericCapture
from hookwidget.capture.grads import GradCopies
from hookwidget.capture.handles import Hooks
from hookwidget.capture.nodes import NodeNorms
from hookwidget.capture.samples import Samples
from hookwidget.capture.tensors import own, slot_get
from hookwidget.record.calls import Records, StepRecord


class Recording:
    """The state one recording fills (the tracer's hooks read and write it; see tracer.py).

    options: (capture, budget_mb, norms_rule, node_grads, node_interventions, fast_captures, batch_dim) as the
    tracer was given them."""

    def __init__(self, options: tuple):
        capture, budget_mb, norms_rule, node_grads, node_interventions, fast_captures, batch_dim = options
        self.budget = Budget(budget_mb)
        self.keep = keep_mod.make(capture, self.budget, norms_rule)
        self.hooks = Hooks()
        self.notes: list = []
        # A pre-hook on every node costs a Python call and a reduction per node: on by default only
        # for small graphs (None: decided when backward starts); module outputs and leaves get
        # their norms from δ and .grad anyway (see nodes.py).
        self.graph = NodeNorms(node_grads if self.keep.node_grads else False, node_interventions, self.hooks,
                               self.notes)
        self.generic = GenericCapture(self.hooks, self.budget, fast_captures)
        self.samples = Samples(batch_dim)  # where each call's samples are (proven, or declared)
        self.batches = Counter()  # this step's outermost calls: their inputs' leading dimensions (Call.batch)
        self.modules: dict = {}  # module -> ModuleRecord
        self.steps: list[StepRecord] = []
        self.depth = 0  # nested backward calls inside one pass (reentrant checkpoint)
        self.grads = GradCopies(self.budget)  # the .grad each step leaves
        self.open = 0  # forward calls running now
        self.outer: deque = deque()  # calls of the latest outermost forward passes (their out_node is kept)
        self.used_grad = False
        self.create_graph = False
        self.passes_summed = 0
        self.unseen = False  # δ arrived outside every backward pass seen (torch.autograd.grad bound before)
        self.seen: dict = {}  # what hooks cannot see, by kind -> class names (see finish.unseen_notes)
        self.live: list = []  # calls whose out_node is set (since the last step ended)
        self.ddp = False  # a DistributedDataParallel module ran (it averages .grad after backward)
        self._held = None  # (slots, their modules, their versions) from settle(): what finish() makes its own
        self._grads_unchanged: dict = {}

    def saw(self, what: str, module) -> None:
        self.seen.setdefault(what, {}).setdefault(type(module).__name__, None)

    def end_step(self) -> None:
        """A backward pass ended (the outermost one): .grad copied, its graph let go once the user lets it go."""
        hooks = self.hooks
        step = hooks.step
        self.grads.after(step, self.steps)
        self.budget.stats.flush()  # the tensors it holds may go with the step
        hooks.remove_node_hooks()  # a parameter's AccumulateGrad node lives on: its hooks must not pile up
        hooks.tensor[:] = [h for h in hooks.tensor if h.hooks_dict_ref() is not None]  # outputs still alive
        self.graph.note_output_nodes(step, self.live)
        self.keep.end_step(self.modules, self.batches)
        self.batches = Counter()
        hooks.step = None
        self.outer.clear()
        self._let_graph_go()
        self.graph.walk.freeze()

    def quiet(self) -> None:
        """Its hooks do nothing from now on, and the tensor and node hooks it put on come off."""
        self.hooks.active = False  # a δ hook left on a graph that outlives the recording stays quiet
        for h in self.hooks.tensor + self.hooks.node:
            h.remove()
        self.hooks.tensor.clear()
        self.hooks.node.clear()

    def settle(self) -> None:
        """The recording ends: no reference to the graph is left, calls that checkpointing reran are dropped,
        pending summaries are made, and what is held by reference is listed with its versions (no copy: finish()
        makes it the record's own, then derives the node norms: a step the flight recorder drops needs neither)."""
        if self._held is not None or not self.keep.records:
            return
        self.samples.clear()  # it holds the last forward pass's tensors and graph nodes
        walk = self.graph.walk
        if not self.steps:  # forward only: show the graph that backward would have walked
            walk.extend(finish.outermost_outputs(self.modules.values()))
            walk.freeze()
        self._let_graph_go()
        self.budget.finish()
        finish.drop_recomputed_calls(self.modules, self.notes)
        slots, owners = finish.held_by_reference(self.modules, self.keep.shares_inputs, self.notes)
        self._held = slots, owners, versions([slot_get(*s) for s in slots])
        self._grads_unchanged = self.grads.unchanged()  # as the recording ends, not as it is finished
        self.generic.release()

    def finish(self, answers: dict) -> Records | None:
        """The Records of this recording (settled first where it is not yet); `answers`: the registry's answers
        the tracer kept (registry.memo)."""
        if not self.keep.records:
            return None
        settled_now = self._held is None  # then nothing can have written what it holds since: no second look
        self.settle()
        slots, owners, held = self._held
        now = held if settled_now else versions([slot_get(*s) for s in slots])
        written = [k for k, (v, w) in enumerate(zip(held, now)) if v != w]
        if written:
            self.notes.append(finish.drop_written([slots[k] for k in written], [owners[k] for k in written]))
        own([s for s, v, w in zip(slots, held, now) if v == w])
        self.graph.finish(self.steps, self.passes_summed)  # the node norms it derives read what is owned now
        budget_note = self.budget.note()
        if budget_note:
            self.notes.append(budget_note)
        more, no_factors = finish.closing_notes(self.modules, self.seen, self.ddp, stepped=bool(self.steps),
                                                used_grad=self.used_grad, create_graph=self.create_graph,
                                                passes_summed=self.passes_summed, unseen=self.unseen)
        self.notes += more
        contradicted = self.samples.contradiction()
        if contradicted is not None:
            self.notes.append(contradicted)
        return Records(self.modules, self.graph.walk, self.steps, self._grads_unchanged, self.notes, self.used_grad,
                       no_factors, answers)

    def _let_graph_go(self) -> None:
        for c in self.live:
            c.out_node = None  # the graph of this step may go when the user lets it go
        self.live = []

