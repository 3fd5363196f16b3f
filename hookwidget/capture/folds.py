"""Samples folded into rows ((B, T, d) viewed as (B·T, d), MobileViT's patches), for per_sample's rules.

A call whose input's leading dimension is a multiple of the forward pass's batch B, other than B, may hold the B
samples folded sample-major into more rows: it does where its input is the output of a row-keeping layer whose
input was so, or where the graph proves it (rows.sample_major: views, elementwise ops, attention, ... back to the
samples). Such a call gets call.folded_from = B (per_sample then sums its rows per sample).
"""

from __future__ import annotations

import weakref

import torch

from hookwidget.capture import rows
from hookwidget.record.calls import Call


class Folds:
    """What one forward pass has shown of folded rows: its batch, the outputs on folded rows, rows.py's memo."""

    def __init__(self):
        self.batch = None  # the batch size of the running forward pass (its outermost call's input)
        self._outputs: dict = {}  # id(output) -> (weakref, B): outputs of row-keeping layers on folded samples
        self._proofs: dict = {}  # rows.sample_major's memo for the running forward pass (its graph's nodes)

    def new_pass(self) -> None:
        """An outermost call starts a new forward pass (its batch is set by the caller)."""
        self._outputs.clear()
        self._proofs.clear()

    def clear(self) -> None:
        """The trace ends: the memo holds the last forward pass's graph nodes."""
        self._proofs.clear()

    def may_be_folded(self, a: torch.Tensor) -> bool:
        """Whether an input's leading dimension is a multiple of this forward pass's batch, other than the batch."""
        B = self.batch
        return bool(B) and a.dim() > 0 and a.shape[0] != B and a.shape[0] % B == 0

    def note(self, call: Call, a: torch.Tensor, node) -> None:
        """call.folded_from = B where the call's input holds the B samples folded sample-major into more rows."""
        if self._outputs:
            fold = self._outputs.get(id(a))
            if fold is not None and fold[0]() is a:
                call.folded_from = fold[1]
                return
        B = self.batch
        if rows.sample_major(node, a.output_nr, B, self._proofs):
            call.folded_from = B

    def output(self, call: Call, out: torch.Tensor) -> None:
        """A row-keeping layer on folded rows: its output's rows are folded the same way."""
        self._outputs[id(out)] = (weakref.ref(out), call.folded_from)
