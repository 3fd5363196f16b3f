"""Where each call's samples are: the batch dimension of its input, proven (rows.py), for per_sample's rules.

A forward pass starts at an outermost call. Its tensor inputs hold the samples along the batch dimension: the one
the user declared (hw.trace(batch_dim=...)), else the one the module declares (batch_first=False: 1), else 0 (the
convention of torch's layers); they are the pass's roots. Every call's input is then placed, never by its sizes
alone: a root itself, a view of the batch's data (same storage, the batch's stride: view_dim), or proven through
the autograd graph back to the roots (rows.sample_dim: call.sample_dim); its rows may hold the samples folded
sample-major instead (rows.sample_major: call.folded_from). A placed call's output becomes a root too: proven
through the graph where its input reaches it, else by what the layer declares (a token layer, Linear or Embedding,
keeps its input's leading dims; a convolution its batch; an RNN or attention its batch_first). Proofs share one
memo per forward pass (the graph does not change under them), so each node is visited once per dimension.

A call whose input states its samples (a PackedSequence: batch_sizes[0] sequences; an EmbeddingBag's 1-d input with
offsets: one sample per bag; layers/batch_first.stated_samples) is a proven source: call.stated. Its count is the
pass's batch where no tensor root gave one (a model called on a PackedSequence), or where the pass's batch rested on
the convention alone and the bag reads that very input as its bags (model(text, offsets)); otherwise it must equal
the pass's batch (per_sample refuses it else, saying so). Where it does, its outputs whose layout is known for sure
become roots: an RNN's h_n and c_n (dim 1, torch's own forward, in the user's order), an EmbeddingBag's bags (dim 0).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from hookwidget._torch.autograd import output_shape
from hookwidget._torch.layers import is_conv
from hookwidget.capture import rows
from hookwidget.layers.batch_first import (
    declared_batch_dim,
    elementwise,
    feature_dims,
    generic_rule,
    stated_outputs,
    states_own,
)
from hookwidget.layers.generic import call_nodes
from hookwidget.record.calls import Call
from hookwidget.record.notes import Note


class Samples:
    """What one forward pass has shown of where its samples are: its batch, its roots, rows.py's memo."""

    def __init__(self, batch_dim: int | None = None):
        self.declared = batch_dim  # hw.trace(batch_dim=...): the model inputs' batch dimension, or None
        self.batch = None  # the batch size of the running forward pass (its outermost call's input)
        self.roots = rows.Roots()
        self._proofs: dict = {}
        self.contradicted: list = []  # (module, the dim its input's samples were proven in, the dim it declares)
        self.dim = None  # the model input's batch dim in the running pass
        self.moved = None  # (old, new) batch size where a module's batch_first moved the pass's batch dim (_reroot)
        self._start = None  # the outermost call as it started: (call, args, kwargs, a)
        self._pass = None  # [module, call, input, output] of the pass's calls, where a module may move the batch dim
        self._outer = None  # the running pass's outermost call
        self._how = None  # where the pass's batch came from: "declared", "convention" (dim 0, batch_first), "stated"
        self._placed = None  # the pass's placed calls, while its batch rests on the convention alone and the model
        # holds an EmbeddingBag (_restate), else None
        self._late = None  # (outermost call, its calls' placements and outputs so far) while that call's tensors,
        # keywords only, wait for its forward hook (keywords)

    def clear(self) -> None:
        """A new forward pass, or the trace ends: the roots and the memo hold the last pass's tensors and nodes."""
        self.roots.clear()
        self._proofs.clear()
        self._start = self._pass = self._outer = self._how = self._placed = self._late = None

    def start(self, module, call: Call, args, kwargs, a, stated: int | None = None) -> None:
        """An outermost call: its inputs are the pass's roots along the batch dimension (call.batch: its size).
        Where its input states its samples (stated: a PackedSequence, bags by offsets), that count is the pass's
        batch, and its tensors are roots only along a declared batch_dim (hx's batch is not in dim 0)."""
        self.clear()
        self.batch = None
        self._outer = call
        if stated is not None:
            self._stated_start(module, call, args, kwargs, stated)
            return
        if a is None and not args:  # keywords only, which no global pre-hook sees: they come with its forward hook
            self._late = (call, [])
        if a is None or not a.dim():
            return
        own = declared_batch_dim(module)
        d = self.declared if self.declared is not None else own or 0
        self._pass = None
        if d >= a.dim():
            return  # no batch dimension in this input (an unbatched call): nothing is placed
        self._seed(call, args, kwargs, a, d)
        self._how = "declared" if self.declared is not None else "convention"
        if self._how == "convention" and _holds_bags(module):
            self._placed = []
        if self.declared is None and own is None and _declares(module):
            self._start, self._pass = (call, args, kwargs, a), []

    @property
    def waiting(self) -> bool:
        """Whether the pass waits for its outermost call's keywords (keywords): its calls' outputs are kept."""
        return self._late is not None and self.batch is None

    def keywords(self, module, call: Call, kwargs, stated: int | None) -> bool:
        """The forward hook of an outermost call that took its tensors as keywords only (`model(**batch)`, as
        Hugging Face's Trainer calls a model): the pass starts from them now, as start() would have, and the calls
        it made meanwhile are placed again in the order they were met. False where `call` is no such call."""
        if self._late is None or self._late[0] is not call:
            return False
        events = self._late[1]
        a = next(iter(_tensors((), kwargs)), None)
        self.start(module, call, (), kwargs, a, stated)
        for module_i, c, x, out in events:
            if out is None:
                self.place(module_i, c, x)
            else:
                self.output(module_i, c, x, out)
        return True

    def _stated_start(self, module, call: Call, args, kwargs, n: int) -> None:
        self.batch, self.dim, self._how = n, None, "stated"
        call.stated = n
        if not states_own(module):  # the model's batch; a stating layer called alone keeps its count to itself
            call.batch = n
        d = self.declared
        if d is not None:
            for t in _tensors(args, kwargs):
                if t.dim() > d and t.shape[d] == n:
                    self.roots.add(t, d)

    def stated(self, module, call: Call, args, kwargs, n: int) -> None:
        """A call inside the pass whose input states its n samples (a PackedSequence, bags by offsets): a proven
        count. Where the pass has no batch yet (its model input had no tensor to follow), n is the pass's batch;
        where the pass's batch rests on the convention alone (dim 0 of a model input, no declaration) and this call
        reads that very input as its bags (model(text, offsets): the 1-d text has no batch dim), n replaces it and
        the calls placed under it are placed no more; otherwise n must be the pass's batch, else its outputs are
        no roots (per_sample refuses the call, saying so: analysis/generic._stated)."""
        call.stated = n
        if self.batch is None:
            self._restate(n)
        elif n != self.batch and self._how == "convention" and isinstance(module, nn.EmbeddingBag) and \
                self._reads_root(args, kwargs):
            self._restate(n)

    def _reads_root(self, args, kwargs) -> bool:
        x = args[0] if args else (kwargs or {}).get("input")
        return isinstance(x, torch.Tensor) and x.dim() == 1 and self.dim_of(x) == 0

    def _restate(self, n: int) -> None:
        old = self.batch
        self.roots.clear()
        self._proofs.clear()
        for c in self._placed or ():
            c.sample_dim = c.folded_from = None
        self._placed = self._pass = self._start = None
        self.batch, self.dim, self._how = n, None, "stated"
        outer = self._outer
        if outer is not None:
            outer.sample_dim, outer.batch = None, n
            self.moved = (old, n)

    def stated_output(self, module, call: Call, args, kwargs, output) -> None:
        """The outputs of a stating call whose layout is known for sure (stated_outputs) become roots, where its
        count is the pass's batch; for an EmbeddingBag with a forward of its own, the embedding_bag op it ran on the
        call's own indices and offsets (_bag_nodes): its output holds the bags along dim 0, whatever that forward
        does after it (rows.py follows that)."""
        if call.stated is None or call.stated != self.batch:
            return
        found = stated_outputs(module, output)
        for t, d in found:
            if (t.grad_fn is not None or not t.requires_grad) and t.shape[d] == self.batch:
                self.roots.add(t, d)
        if not found and isinstance(module, nn.EmbeddingBag):
            for node in _bag_nodes(call, args, kwargs, output):
                if (output_shape(node, 0) or ())[:1] == (self.batch,):
                    self.roots.nodes[(node, 0)] = 0
                    self.roots._node_set.add(node)

    def _seed(self, call: Call, args, kwargs, a, d: int) -> None:
        self.batch, self.dim = a.shape[d], d
        call.batch, call.sample_dim = self.batch, d
        for t in _tensors(args, kwargs):
            if t.dim() > d and t.shape[d] == self.batch:
                self.roots.add(t, d)

    def root(self, a, d: int = 0) -> int | None:
        """A new pass whose samples are a's along d (the watch: its first watched call reads the model's input);
        its batch size, or None where a has no dim d."""
        self.clear()
        self.batch = a.shape[d] if a.dim() > d else None
        if self.batch is not None:
            self.roots.add(a, d)
        return self.batch

    def place(self, module, call: Call, a) -> None:
        """call.sample_dim: the proven dim of the call's input that holds the samples; else call.folded_from."""
        B = self.batch
        if B is None and self._late is not None and a is not None:
            self._late[1].append((module, call, a, None))  # placed once the outermost call's keywords are seen
        if B is None or a is None or not a.dim():
            return
        call.in_shape = tuple(a.shape)
        if self._pass is not None:
            self._pass.append([module, call, a, None])
        d = self.dim_of(a)
        if d is not None:
            call.sample_dim = d
            if self._placed is not None:
                self._placed.append(call)
            declared = declared_batch_dim(module)
            if declared is not None and declared != d and B > 1 and not self._reroot(a, declared):
                self.contradicted.append((module, d, declared))
            if declared is not None:
                self._pass = None  # the first module to declare its batch dim settled the pass's: no more kept
            return
        self._fold(call, a)
        if call.folded_from is not None and self._placed is not None:
            self._placed.append(call)

    def _fold(self, call: Call, a) -> None:
        B = self.batch
        if a.grad_fn is not None and a.shape[0] != B and a.shape[0] % B == 0 and \
                rows.sample_major(a.grad_fn, a.output_nr, B, self.roots, self._proofs):
            call.folded_from = B

    def _reroot(self, a, declared: int) -> bool:
        """Without a declaration (the user's, the outermost module's), the model input's batch dim is the one under
        which every module's own batch_first holds: 0 first; where a module's input has its samples elsewhere, the
        one other dim of the model's input that puts them in the module's declared dim, every call of the pass
        placed again under it. False (a contradiction) where no dim, or more than one, does."""
        if self._pass is None:
            return False
        outer, args, kwargs, a0 = self._start
        found = []
        for r in range(a0.dim()):
            if r == self.dim or a0.shape[r] < 2:
                continue
            trial = Samples(r)
            trial._seed(Call(0), args, kwargs, a0, r)
            for module, _, x, out in self._pass:
                probe = Call(0)
                trial.place(module, probe, x)
                if out is not None:
                    trial.output(module, probe, x, out)
            if trial.dim_of(a) == declared:
                found.append(trial)
        if len(found) != 1:
            return False
        trial, old, calls = found[0], self.batch, self._pass
        self._pass = None  # placed again below without a second look
        self.roots, self._proofs, self.batch, self.dim = trial.roots, trial._proofs, trial.batch, trial.dim
        outer.batch, outer.sample_dim = trial.batch, trial.dim
        for module, call, x, _ in calls:
            call.sample_dim = call.folded_from = None
            self.place(module, call, x)
        self.moved = (old, self.batch)
        return True

    def dim_of(self, t) -> int | None:
        """The proven dim of t whose index i holds sample i alone, or None."""
        B = self.batch
        d = self.roots.tensor_dim(t)
        if d is not None:
            pass
        elif t.grad_fn is not None:
            d = self.roots.node_dim(t.grad_fn, t.output_nr)
            d = d if d is not None else rows.sample_dim(t.grad_fn, t.output_nr, B, self.roots, self._proofs)
        elif not t.requires_grad:
            d = next((v for r, dd in self.roots.data_roots() if (v := view_dim(t, r, dd)) is not None), None)
        if d is None and B == 1 and t.shape[0] == 1:
            return 0  # one sample: every row is its own, and dim 0 holds it whatever it is
        return d if d is not None and t.shape[d] == B else None

    def contradiction(self):
        """The note where a module's own batch_first contradicts the dim the samples reached it in, or None."""
        if not self.contradicted:
            return None
        module, proven, declared = self.contradicted[0]
        return Note("batch_dim_contradicted", {"modules": (module,), "proven": proven, "declared": declared,
                                               "batch_dim": self.declared, "calls": len(self.contradicted)})

    def output(self, module, call: Call, a, out) -> None:
        """A placed call's output becomes a root: where its samples are, as the layer declares it (what its rule
        assumes: leading dims kept by a token layer, dim 0 by a convolution), else proven through the graph."""
        if self.batch is None and self._late is not None:
            self._late[1].append((module, call, a, out))
            return
        if self.batch is None or (call.sample_dim is None and call.folded_from is None):
            return
        if out.grad_fn is None and out.requires_grad:
            return
        if self._pass is not None:
            entry = next((e for e in reversed(self._pass) if e[1] is call), None)
            if entry is not None:
                entry[3] = out
        if call.folded_from is not None:  # a row-keeping layer (the registry's keeps_rows) on folded rows
            if out.grad_fn is not None:
                self.roots.nodes[(out.grad_fn, out.output_nr)] = 0
            return
        d = _declared_output_dim(module, call.sample_dim, a, out)  # a layer's own: no walk (the hot path)
        if d is None:
            d = self.dim_of(out)
        if d is not None and out.shape[d] == self.batch:
            self.roots.add(out, d)


def _declared_output_dim(module, d: int, a, out) -> int | None:
    """The dim of the output holding the samples where the input's d does, from what the layer declares."""
    kind, value = _layout(module)
    if kind == "declared":
        return value if d == value and out.dim() > value else None
    if kind == "elementwise":
        return d if out.shape == a.shape else None
    if kind == "batch0":  # a conv's batch; the generic rule's rows are along dim 0 of input and output
        return 0 if d == 0 else None
    if kind == "tokens":  # value: its feature dims on float input; ids (an embedding's) have none
        features = value if a.is_floating_point() or a.is_complex() else 0
        return d if d < a.dim() - features and d < out.dim() - 1 else None
    return None


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layout(module) -> tuple:
    """How the layer keeps its samples (declared_output_dim's cases), asked once per module: its calls are the
    hot path."""
    found = _LAYOUTS.get(module)
    if found is None:
        declared = declared_batch_dim(module)
        found = (("declared", declared) if declared is not None else ("elementwise", None) if elementwise(module)
                 else ("batch0", None) if is_conv(module) or generic_rule(module)
                 else ("tokens", feature_dims(module, _FLOAT)) if feature_dims(module, _FLOAT) is not None
                 else ("none", None))
        _LAYOUTS[module] = found
    return found


_FLOAT = torch.empty(0)


def view_dim(t, root, d: int) -> int | None:
    """The dim of t, a tensor without grad, that holds root's samples where t is a view of root (the batch's
    data): same storage; each dim of t of size > 1 has the stride of a distinct dim of root; the one with root's
    batch stride has all B samples, and t starts at sample 0. A copy (a new storage) or a view that merges the
    batch with another dim proves nothing."""
    if t.device != root.device or not _same_storage(t, root):
        return None
    rstrides = [s for s, n in zip(root.stride(), root.shape) if n > 1]
    if len(set(rstrides)) != len(rstrides) or root.shape[d] <= 1:
        return None  # an expanded or overlapping root: strides do not tell its dims apart
    by_stride = {s: i for i, (s, n) in enumerate(zip(root.stride(), root.shape)) if n > 1}
    found, used = None, set()
    for j, (s, n) in enumerate(zip(t.stride(), t.shape)):
        if n <= 1:
            continue
        i = by_stride.get(s)
        if i is None or i in used or n > root.shape[i]:
            return None
        used.add(i)
        if i == d:
            found = j if n == root.shape[d] else None
            if found is None:
                return None
    if found is None:
        return None
    offset = t.storage_offset() - root.storage_offset()
    if offset < 0:
        return None
    # the offset's coordinate along root's batch dim: 0 (t starts at sample 0; dims with larger strides come first)
    for s in sorted(by_stride, reverse=True):
        i = by_stride[s]
        coord, offset = divmod(offset, s)
        if i == d and coord != 0:
            return None
    return found


_DECLARES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _declares(module) -> bool:
    """Whether some module inside declares its own batch dim (batch_first): then the pass keeps its calls until
    the first of them is met (_reroot). Asked once per model."""
    found = _DECLARES.get(module)
    if found is None:
        found = _DECLARES[module] = any(declared_batch_dim(m) is not None for m in module.modules())
    return found


_BAGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _holds_bags(module) -> bool:
    """Whether the model holds an nn.EmbeddingBag, which may read its 1-d input as bags (_restate). Asked once per
    model."""
    found = _BAGS.get(module)
    if found is None:
        found = _BAGS[module] = any(isinstance(m, nn.EmbeddingBag) for m in module.modules())
    return found


def _bag_nodes(call: Call, args, kwargs, output) -> list:
    """The embedding_bag ops among the call's own (autograd sequence numbers from its start on, found from its
    output's node down) whose saved indices and offsets are the call's own tensors (by identity)."""
    out = output if isinstance(output, torch.Tensor) else None
    if out is None or out.grad_fn is None:
        return []
    ids = args[0] if args else (kwargs or {}).get("input")
    offsets = args[1] if args and len(args) > 1 else (kwargs or {}).get("offsets")
    nodes = call_nodes(out.grad_fn, call.seq_start, _BAG_NODES) or ()
    return [n for n in nodes if type(n).__name__ == "EmbeddingBagBackward0"
            and getattr(n, "_saved_indices", None) is ids and getattr(n, "_saved_offsets", None) is offsets]


_BAG_NODES = 64  # nodes of a bag's own forward looked through


def _tensors(args, kwargs):
    for v in [*(args or ()), *((kwargs or {}).values())]:
        if isinstance(v, torch.Tensor):
            yield v


def _same_storage(t, root) -> bool:
    """Whether t and root share a storage; a tensor whose storage was freed or is not a plain one (FSDP2 frees an
    unsharded parameter's between uses; a DTensor, a fake tensor) shares none that can be told."""
    try:
        return t.untyped_storage().data_ptr() == root.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
