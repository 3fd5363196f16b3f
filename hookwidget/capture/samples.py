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
"""

from __future__ import annotations

import torch

from hookwidget._torch.layers import is_conv
from hookwidget.capture import rows
from hookwidget.layers.batch_first import declared_batch_dim, elementwise, feature_dims
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

    def clear(self) -> None:
        """A new forward pass, or the trace ends: the roots and the memo hold the last pass's tensors and nodes."""
        self.roots.clear()
        self._proofs.clear()

    def start(self, module, call: Call, args, kwargs, a) -> None:
        """An outermost call: its inputs are the pass's roots along the batch dimension (call.batch: its size)."""
        self.clear()
        self.batch = None
        if a is None or not a.dim():
            return
        d = self.declared if self.declared is not None else declared_batch_dim(module) or 0
        if d >= a.dim():
            return  # no batch dimension in this input (an unbatched call): nothing is placed
        self.batch = call.batch = a.shape[d]
        for t in _tensors(args, kwargs):
            if t.dim() > d and t.shape[d] == self.batch:
                self.roots.add(t, d)
        call.sample_dim = d

    def place(self, module, call: Call, a) -> None:
        """call.sample_dim: the proven dim of the call's input that holds the samples; else call.folded_from."""
        B = self.batch
        if B is None or a is None or not a.dim():
            return
        call.in_shape = tuple(a.shape)
        d = self.dim_of(a)
        if d is not None:
            call.sample_dim = d
            declared = declared_batch_dim(module)
            if declared is not None and declared != d and B > 1:
                self.contradicted.append((module, d, declared))
        elif a.grad_fn is not None and a.shape[0] != B and a.shape[0] % B == 0 and \
                rows.sample_major(a.grad_fn, a.output_nr, B, self.roots, self._proofs):
            call.folded_from = B

    def dim_of(self, t) -> int | None:
        """The proven dim of t whose index i holds sample i alone, or None."""
        B = self.batch
        if t.grad_fn is not None:
            d = self.roots.node_dim(t.grad_fn, t.output_nr)
            d = d if d is not None else rows.sample_dim(t.grad_fn, t.output_nr, B, self.roots, self._proofs)
        elif t.requires_grad:
            leaf = self.roots.leaves.get(id(t))
            d = leaf[1] if leaf is not None and leaf[0] is t else None
        else:
            d = next((dd for r, dd in self.roots.data if r is t), None)
            if d is None:
                d = next((v for r, dd in self.roots.data if (v := view_dim(t, r, dd)) is not None), None)
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
        """A placed call's output becomes a root: where its samples are, proven through the graph, or declared
        by the layer (what its rule assumes: leading dims kept by a token layer, dim 0 by a convolution)."""
        if self.batch is None or (call.sample_dim is None and call.folded_from is None):
            return
        if out.grad_fn is None and out.requires_grad:
            return
        if call.folded_from is not None:  # a row-keeping layer (the registry's keeps_rows) on folded rows
            if out.grad_fn is not None:
                self.roots.nodes[(out.grad_fn, out.output_nr)] = 0
            return
        d = self.dim_of(out)
        if d is None:
            d = _declared_output_dim(module, call.sample_dim, a, out)
        if d is not None and out.shape[d] == self.batch:
            self.roots.add(out, d)


def _declared_output_dim(module, d: int, a, out) -> int | None:
    """The dim of the output holding the samples where the input's d does, from what the layer declares."""
    declared = declared_batch_dim(module)
    if declared is not None:
        return declared if d == declared and out.dim() > declared else None
    if elementwise(module):
        return d if out.shape == a.shape else None
    if is_conv(module):
        return 0 if d == 0 else None
    features = feature_dims(module, a)
    if features is not None and d < a.dim() - features and d < out.dim() - 1:
        return d
    return None


def view_dim(t, root, d: int) -> int | None:
    """The dim of t, a tensor without grad, that holds root's samples where t is a view of root (the batch's
    data): same storage; each dim of t of size > 1 has the stride of a distinct dim of root; the one with root's
    batch stride has all B samples, and t starts at sample 0. A copy (a new storage) or a view that merges the
    batch with another dim proves nothing."""
    if t.device != root.device or t.untyped_storage().data_ptr() != root.untyped_storage().data_ptr():
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


def _tensors(args, kwargs):
    for v in [*(args or ()), *((kwargs or {}).values())]:
        if isinstance(v, torch.Tensor):
            yield v
