"""What capture keeps beyond (a, δ), for the generic rule of per_sample (analysis/): `GenericCapture`.

- The generic torch.func rule (layers/generic.py): every tensor a call got (positional and keyword, copy-on-write,
  within the memory budget), the δ of every output tensor, the module's parameters and buffers as they were.
  Entry points: `keep_call` (pre-hook), `keep_kwargs` and `hook_outputs` (forward hook), `link_first_delta` (end).
- Position tables broadcast-added to a batch: `note_broadcast` (forward hook) picks the candidates, and
  `hook_step` (when backward starts) puts a pre-hook on the add that each one's output feeds; likewise a model's
  own (1, ...) parameters where they join the batch.

It shares with the tracer only what it is handed: the trace's hook state (handles.Hooks: active, lock, handle
lists, running step) and its memory budget (budget.Budget). The per-call fast path stays in tracer.py; the
methods here run only for the calls that need them.
"""

from __future__ import annotations

import sys

import torch

from hookwidget._torch.modules import own_parameters
from hookwidget._torch.pytree import tree_flatten, tree_unflatten
from hookwidget._torch.tensors import version
from hookwidget.capture.tensors import _copy, hook_output, slot_get, slot_set
from hookwidget.layers import batch_copies, generic
from hookwidget.record.calls import Call

BROADCASTS_MAX = 1024  # calls per step whose (1, ...) output may be added to a batch (see _hook_broadcasts)


class GenericCapture:
    """The generic rule's capture and the per-sample gradients of broadcast tables, for one trace."""

    def __init__(self, hooks, budget, fast_captures: bool = True):
        self.hooks = hooks  # handles.Hooks of the trace
        self.budget = budget  # budget.Budget of the trace
        self.fast_captures = fast_captures  # False: no fast rule's parts taken (their rules rerun the module)
        self._snapshots: dict = {}  # id(parameter or buffer) -> (it, its version, copy): see _snapshot
        self._broadcasts: list = []  # calls of layers with parameters whose output is (1, ...): see _hook_broadcasts
        self._joins: list = []  # (module, call) of generic modules holding (1, ...) parameters: see _hook_joins

    # -- the generic rule's capture: every input, every output's δ, parameters as they were ------------
    def keep_call(self, module, call: Call, inputs, kwargs) -> bool:
        """Keep all a generic-rule module's call needs (copy-on-write copies, within the budget) in call.inputs."""
        kept = self._kept_tree((tuple(inputs), dict(kwargs or {})))
        params = self._snapshot(module) if kept is not None else None
        if params is None:
            return False
        call.inputs, call.params = kept, params
        call.training = tuple(m.training for m in module.modules())
        if batch_copies.has_broadcast_params(module) and len(self._joins) < BROADCASTS_MAX:
            self._joins.append((module, call))
        return True

    def keep_kwargs(self, call: Call, kwargs) -> dict | None:
        """Keyword arguments only the forward hook saw, added to call.inputs; the kept copies, or None where the
        budget has no room (then the generic rule has nothing for the call)."""
        kept = self._kept_tree(dict(kwargs))
        if kept is None:
            call.inputs = None
            return None
        call.inputs = (call.inputs[0], kept)
        return kept

    def release(self) -> None:
        """The trace ends: the snapshots' originals are let go (the calls keep their copies)."""
        self._snapshots = {}

    def _kept_tree(self, tree):
        """tree with every tensor replaced by a copy-on-write copy, or None where the budget has no room. One tensor
        passed several times (self-attention's query, key and value) gets one copy, passed as many times: the rule's
        rerun then sees the call as the forward saw it, and no copy is compared with another."""
        leaves, spec = tree_flatten(tree)
        tensors = list({id(x): x for x in leaves if isinstance(x, torch.Tensor)}.values())
        if tensors and not self.budget.fits_bytes(sum(t.numel() * t.element_size() for t in tensors)):
            return None
        copies = {id(t): _copy(t) for t in tensors}
        return tree_unflatten([copies[id(x)] if isinstance(x, torch.Tensor) else x for x in leaves], spec)

    def _snapshot(self, module) -> dict | None:
        """The module's parameters and buffers by name as they are now; calls that see the same versions share one
        copy. Copy-on-write: no memory until the cell changes them (an optimizer step, a BatchNorm update), so
        they do not count against budget_mb (a model holding a parameter of its own, as ViT's class token, would
        otherwise spend the budget on a snapshot of the whole model before any layer's a and δ)."""
        cache = self._snapshots
        named = [*module.named_parameters(), *module.named_buffers()]
        new = [t for _, t in named if (hit := cache.get(id(t))) is None or hit[0] is not t or hit[1] != version(t)]
        eager = "torch.distributed.fsdp" in sys.modules  # see below
        for t in new:
            # FSDP2 frees an unsharded parameter's storage after forward (resize to 0) and writes the next all-gather
            # into it: a copy-on-write clone of it fails torch's COW assert there. Where FSDP is loaded, plain copies.
            cache[id(t)] = (t, version(t), t.detach().clone() if eager else _copy(t))
        return {name: cache[id(t)][2] for name, t in named}

    def hook_outputs(self, module, call: Call, output, out) -> None:
        """A δ hook on every output tensor besides the first (whose δ is call.delta), and what a fast rule takes
        from the call's graph."""
        flat = generic.flat_outputs(output)
        call.deltas, seen = [None] * len(flat), set()
        for i, o in enumerate(flat):
            if id(o) in seen:  # the same tensor twice: its gradient arrives once
                continue
            seen.add(id(o))
            if o is out:
                call.out_first = i
            elif o.requires_grad:
                hook_output(self.hooks.tensor, o, self._output_delta_hook(call, i))
        if self.fast_captures and out is not None and out.grad_fn is not None:
            for applies, capture in generic.FAST_CAPTURES:
                if applies(module):
                    self._keep_rule_parts(call, *capture(module, call, out))

    def _keep_rule_parts(self, call: Call, parts: dict, nodes: list) -> None:
        """A fast rule's parts of this call (generic.FAST_CAPTURES): tensors now, gradients at nodes in backward."""
        if not parts and not nodes:
            return
        call.rule_parts = dict(parts)
        for node, name in nodes:
            self.hooks.node.append(node.register_prehook(self._rule_part_hook(call, name)))

    def _rule_part_hook(self, call: Call, name: str):
        hooks = self.hooks

        def hook(grad_outputs):
            g = grad_outputs[0] if hooks.active and grad_outputs else None
            if g is not None:
                with hooks.lock:
                    self._gather(call.rule_parts, name, g)
            return None

        return hook

    def _output_delta_hook(self, call: Call, i: int):
        hooks = self.hooks

        def hook(grad):
            if not hooks.active:
                return
            with hooks.lock:
                hooks.step_index(call)
                if call.deltas is not None and not self._gather(call.deltas, i, grad):
                    call.deltas = None  # over budget: the generic rule says so
            return

        return hook

    def note_broadcast(self, call: Call, out: torch.Tensor) -> None:
        """A call of a layer with a rule and trainable parameters: its output may be a table added to a batch."""
        if len(self._broadcasts) < BROADCASTS_MAX and maybe_broadcast(call.a, out):
            self._broadcasts.append(call)

    def hook_step(self, walk) -> None:
        """A backward pass starts (its graph walked): the hooks that keep each sample's gradient of the tables
        and parameters broadcast to the batch in this step's forward passes."""
        if self._broadcasts:
            self._hook_broadcasts(walk)
        if self._joins:
            self._hook_joins(walk)

    def _hook_broadcasts(self, walk) -> None:
        """A position table called without a batch dimension gives (1, T, d) or (T, d), added to (B, T, d): each
        sample's δ is the gradient arriving at that add, which autograd then sums into the table's δ. A pre-hook
        on the add keeps it (call.bdelta; per_sample.py uses it only where it sums to δ)."""
        calls, self._broadcasts = self._broadcasts, []
        targets = {walk._index[c.out_node]: c for c in calls if c.out_node is not None and c.out_node in walk._index}
        if not targets:
            return
        parents = _consumers(walk, targets)
        for v, c in targets.items():
            ps = parents.get(v, ())
            if len(ps) == 1 and walk.names[ps[0]] == "AddBackward0":
                self.hooks.node.append(walk.nodes[ps[0]].register_prehook(self._broadcast_hook(c)))

    def _hook_joins(self, walk) -> None:
        """A model's own (1, ...) parameter (ViT's class token, position embedding) joins the batch at an expand or
        an add: the gradient arriving there has each sample's gradient of it in its rows. A pre-hook on each such
        node keeps them (call.join_rows, summed over the nodes); batch_copies.broadcast_params uses them in place of a
        rerun of the model, checked as its rows are (they must add up to .grad, and one sample to its own vjp)."""
        joins, self._joins = self._joins, []
        wanted = {id(p): (call, n, tuple(p.shape)) for module, call in joins for n, p in own_parameters(module).items()
                  if p is not None and p.requires_grad and p.dim() and p.shape[0] == 1}
        targets = {i: wanted[id(walk.nodes[i].variable)] for i, name in enumerate(walk.names)
                   if name == "AccumulateGrad" and id(walk.nodes[i].variable) in wanted}
        parents = _consumers(walk, targets)
        for v, (call, n, shape) in targets.items():
            ps = parents.get(v, ())
            if ps and all(walk.names[u] in JOINS for u in ps):
                for u in ps:
                    self.hooks.node.append(walk.nodes[u].register_prehook(self._join_hook(call, n, shape)))

    def _join_hook(self, call: Call, name: str, shape: tuple):
        hooks = self.hooks

        def hook(grad_outputs):
            g = grad_outputs[0] if hooks.active and grad_outputs else None
            if g is not None and g.dim() == len(shape) and g.shape[0] > 1 and tuple(g.shape[1:]) == shape[1:]:
                with hooks.lock:
                    call.join_rows = call.join_rows or {}
                    self._gather(call.join_rows, name, g)
            return None

        return hook

    def _broadcast_hook(self, call: Call):
        hooks = self.hooks

        def hook(grad_outputs):
            g = grad_outputs[0] if hooks.active and grad_outputs else None
            shape = call.output_shape
            if g is not None and (g.dim() == len(shape) and tuple(g.shape[1:]) == shape[1:] and g.shape[0] > 1
                                  or g.dim() == len(shape) + 1 and tuple(g.shape[1:]) == shape):
                with hooks.lock:
                    self._gather(call, "bdelta", g)
            return None

        return hook

    def _gather(self, obj, key, g: torch.Tensor) -> bool:
        """Keep gradient g in the slot (obj, key) (an item of a dict or list, else an attribute): added to what it
        holds (another backward through the same graph: summed, as .grad is), or kept within the memory budget.
        False where over it (nothing kept). The caller holds the lock."""
        have = obj.get(key) if isinstance(obj, dict) else slot_get(obj, key)
        if have is not None:
            slot_set(obj, key, have + g.detach())
        elif self.budget.fits(g):
            slot_set(obj, key, g.detach())
        else:
            return False
        return True


def link_first_delta(call: Call) -> None:
    """The generic rule's δ per output: the first one is call.delta; one kept as a summary makes them unusable."""
    if call.out_first >= 0:
        if call.delta is None and call.delta_summary is not None:
            call.deltas = None
            return
        call.deltas[call.out_first] = call.delta


def _consumers(walk, targets) -> dict:
    """Node index -> the indices of the nodes that take its output (edges point from consumer to input)."""
    out: dict = {}
    for u, v in walk.edges:
        if v in targets:
            out.setdefault(v, []).append(u)
    return out


def maybe_broadcast(a, out: torch.Tensor) -> bool:
    """Whether a layer's output may be a table added to a batch (see GenericCapture.note_broadcast): (1, T, d), or
    (T, d) whose leading dimension its input does not have (positions (T,) or ids (B, T))."""
    if out.dim() < 2:
        return False
    if out.shape[0] == 1:
        return True
    return a is not None and a.dim() >= 1 and (a.dim() == 1 or a.shape[0] != out.shape[0])


JOINS = ("AddBackward0", "ExpandBackward0")  # where a (1, ...) parameter meets the batch, its gradient per sample
