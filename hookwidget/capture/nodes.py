"""The gradient norm at every node of a step's autograd graph: the walk, the node pre-hooks, the norms derived.

When a backward pass starts, its graph is walked from its roots (record/graph.GraphWalk) and a pre-hook on a node
keeps the gradient arriving there by reference; the last step's are reduced when the trace ends, a few
multi-tensor reductions for them all. A pre-hook on every node costs a Python call and a reduction per node, so
most are spared: what arrives at a layer's output is its δ and at a leaf the new .grad (derived at the end, see
`NodeNorms.derive`), and along a chain of view-like nodes the same values arrive reshaped (`alias_views`).
Node interventions (interventions.py) get their pre-hooks here too: they belong to the walk of each step.
"""

from __future__ import annotations

from collections import Counter

import torch

from hookwidget._torch.autograd import output_shape
from hookwidget.capture.tensors import _sole_owner
from hookwidget.record import graph as graph_mod
from hookwidget.record.calls import PREVIOUS, StepRecord
from hookwidget.record.notes import Note
from hookwidget.stats import abs_max, fused_norms

AUTO_NODE_GRADS_MAX = 256  # graphs up to this size get a gradient norm at every node by default
# Backward nodes that pass on what arrives at them with its values unchanged (reshaped, permuted)
VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0",
                        "TransposeBackward0", "TransposeBackward1", "PermuteBackward0", "SqueezeBackward0",
                        "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "AliasBackward0",
                        "CloneBackward0"})
LAZY_NODE_NUMEL = 4096  # node gradients up to this size are kept until the graph is built (it may never be)
LAZY_NODE_TOTAL = 1 << 18  # elements kept so at most per trace; larger ones are reduced when the trace ends


class NodeNorms:
    """The graph walk of the running (then the last) step, and the gradient norms at its nodes.

    `enabled`: node_grads (None: decided at the first walk from the graph's size); `hooks`: the trace's shared
    hook state (handles.Hooks); `notes`: the trace's notes, where the automatic choice is explained."""

    def __init__(self, enabled: bool | None, interventions: dict, hooks, notes: list):
        self.enabled = enabled
        self.interventions = interventions
        self.hooks = hooks
        self.notes = notes
        self.walk = graph_mod.GraphWalk()
        self.unhooked: list = []  # nodes whose gradient norms are derived rather than hooked
        self.out_index: dict = {}  # last step's graph: node index -> the call whose output it made
        self.refs: dict = {}  # this step's graph: node index -> the gradient that arrived there

    def new_step(self) -> None:
        """A new backward pass: only the last step's graph is shown, the previous step's node gradients go."""
        self.walk = graph_mod.GraphWalk()
        self.unhooked = []
        self.refs = {}

    def extend(self, tensors: list, step: StepRecord, depth: int, live: list, ddp: bool, grad_before) -> None:
        """Walk what backward from `tensors` adds to the step's graph; record each new leaf's .grad as it was
        (grad_before) in step.before; hook the nodes whose norms are wanted and cannot be derived. `depth`:
        nested backward calls inside the pass (reentrant checkpoint); `live`: the calls whose out_node is set."""
        walk = self.walk
        new_nodes = walk.extend([r.grad_fn for r in tensors if r.grad_fn is not None])
        if self.enabled is None:
            self.enabled = len(walk.nodes) <= AUTO_NODE_GRADS_MAX
            if not self.enabled:
                self.notes.append(Note("graph_large", {"nodes": len(walk.nodes)}))
        node_grads = self.enabled
        handles = self.hooks.node
        if node_grads and depth > 1:  # norms derived after nested passes would be inexact
            for i in self.unhooked:
                handles.append(walk.nodes[i].register_prehook(self._node_hook(i)))
            self.unhooked = []
        out_nodes = {c.out_node for c in live if c.out_node is not None} if node_grads and depth == 1 else ()
        backward = step.kind == "backward"
        # A leaf whose .grad was None before this pass: what arrives at its AccumulateGrad node is the
        # .grad copied when the pass ends (see derive), unless DDP averages .grad in between.
        derive_leaves = node_grads and backward and depth == 1 and not ddp
        interventions = self.interventions
        nodes, names, before = walk.nodes, walk.names, step.before
        derived, hooked = set(), []  # nodes whose norms come from δ or .grad / that need a hook, so far
        for i in new_nodes:
            node = nodes[i]
            variable = node.variable if names[i] == "AccumulateGrad" else None
            if variable is not None and backward and variable not in before:
                before[variable] = None if variable.grad is None else grad_before(variable)
            ivs = interventions.get(walk.ids[i], ()) if interventions else ()
            for iv in ivs:
                handles.append(node.register_prehook(self.hooks.guarded(iv.on_node_grads)))
            if not node_grads:
                continue
            if not ivs and (node in out_nodes or derive_leaves and variable is not None
                            and before.get(variable, PREVIOUS) is None):
                derived.add(i)  # what arrives there is the layer's δ or the new .grad: derived at the end
                self.unhooked.append(i)
            else:
                hooked.append(i)
        if hooked and depth == 1:
            hooked = self.alias_views(new_nodes, derived, hooked, out_nodes)
        for i in hooked:
            handles.append(nodes[i].register_prehook(self._node_hook(i)))

    def alias_views(self, new_nodes: list, derived: set, hooked: list, out_nodes) -> list:
        """Nodes that the same gradient arrives at, reshaped, need one reduction between them.

        A view-like node (view, reshape, transpose, permute, squeeze, clone) passes on what arrives
        there with its values unchanged; when its only input is a node that nothing else feeds, that
        node receives the very same values. Along such a chain the norms are one: taken from a member
        whose norms are derived (a layer's δ, a parameter's .grad) or else from one hook at the top.
        Returns the nodes that still need a hook; the others get their shape from autograd's metadata."""
        walk = self.walk
        nodes, names, index = walk.nodes, walk.names, walk._index
        views = [i for i in new_nodes if names[i] in VIEW_NODES]
        if not views:
            return hooked
        interventions = self.interventions
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
            shape = output_shape(nodes[m])
            if shape is not None:  # else no metadata (another torch): keep its hook
                shapes[m] = shape
        walk.same_norm.update((m, same[m]) for m in shapes)
        walk.shape.update(shapes)
        self.unhooked += list(shapes)
        return [i for i in hooked if i not in shapes]

    def _node_hook(self, i: int):
        """Keeps the gradient arriving at node i by reference: only the last step's are reduced (in
        finish, all at once); a new step lets the previous step's go."""
        refs, hooks = self.refs, self.hooks

        def hook(grad_outputs):
            if hooks.active and grad_outputs:
                g = grad_outputs[0]
                if g is not None:
                    refs[i] = g
            return None

        return hook

    def note_output_nodes(self, step: StepRecord, live: list) -> None:
        """Before the step's graph is let go: which node each call of this step produced."""
        index = self.walk._index
        self.out_index = {index[c.out_node]: c for c in live
                          if c.out_node is not None and c.step == step.index and c.out_node in index}

    # -- end of the trace ----------------------------------------------------------------------------------
    def finish(self, steps: list, passes_summed: int) -> None:
        self._reduce_refs(steps)
        self._derive(steps, passes_summed)

    def _reduce_refs(self, steps: list) -> None:
        """Norms of what arrived at the hooked nodes of the last step: a few multi-tensor reductions for
        them all, on their device (read when the graph is built)."""
        refs, self.refs = self.refs, {}
        if not refs or not steps:
            return
        walk = self.walk
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

    def _derive(self, steps: list, passes_summed: int) -> None:
        """Norms of the gradient arriving at layer-output nodes (δ) and leaf nodes (.grad) of the last
        step's graph, where no node hook recorded them. Exact for one pass through the graph and a
        .grad that started as None."""
        walk, step = self.walk, steps[-1] if steps else None
        if passes_summed or step is None:
            return
        pending = {}
        for i, c in self.out_index.items():
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
