"""What a trace saw, as plain dataclasses: module calls, backward passes (steps), and the whole run.

The Tracer (capture/tracer.py) fills them in; record/assemble.py names them into the record a Trace holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookwidget.record.graph import GraphWalk
from hookwidget.stats import TensorSummary


@dataclass
class Call:
    """One forward call of a module: what went in, what came out, what came back."""

    index: int
    a: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    output_shape: tuple | None = None
    a_summary: TensorSummary | None = None
    delta_summary: TensorSummary | None = None
    grad_input: torch.Tensor | None = None  # backward_hooks=True: what a full backward hook sees
    step: int | None = None  # the backward pass (step) that brought this call its δ; None: no gradient reached it
    join_rows: dict | None = field(default=None, repr=False)  # a model's own (1, ...) parameter -> per-sample rows
    folded_from: int | None = None  # its input is a view of a tensor of this leading dimension ((B, T, d) as (B·T, d))
    batch: int | None = None  # an outermost call (the model's): its first input's size along the batch dim
    sample_dim: int | None = None  # the dim of `a` proven to hold the samples, one each (capture/samples.py)
    stated: int | None = None  # the samples its arguments state (a PackedSequence's, bags by offsets: samples.py)
    in_shape: tuple | None = field(default=None, repr=False)  # a's shape, for a note where a is not kept
    seq_start: int = field(default=0, repr=False)  # autograd sequence numbers created during the call
    seq_end: int = field(default=0, repr=False)
    out_node: Any = field(default=None, repr=False)  # the output's grad_fn, until the trace ends
    recomputed: bool = field(default=False, repr=False)  # run again by backward (torch.utils.checkpoint)
    state: Any = field(default=None, repr=False)  # what the layer's rule needs from forward time (fx.forward_state)
    _a_version: int = field(default=-1, repr=False)  # a kept by reference: its version then (an in-place change shows)
    # modules the generic torch.func rule serves (layers/generic.py), capture "full" and "norms":
    inputs: Any = field(default=None, repr=False)  # (args, kwargs), tensors copied (copy-on-write)
    params: dict | None = field(default=None, repr=False)  # its parameters and buffers by name, as they were
    training: tuple | None = field(default=None, repr=False)  # .training of the module and its submodules
    deltas: list | None = field(default=None, repr=False)  # δ per output tensor (generic.flat_outputs), None: none
    out_first: int = field(default=-1, repr=False)  # the output whose δ is `delta` (the first tensor)
    # an output (1, ...) added to a batch (a position table): the gradient arriving at that add, per sample
    bdelta: torch.Tensor | None = field(default=None, repr=False)
    # what a fast rule (layers/generic.FAST_CAPTURES) took from this call's own graph: saved inputs, gradients
    rule_parts: dict | None = field(default=None, repr=False)


@dataclass
class ModuleRecord:
    module: nn.Module
    calls: list = field(default_factory=list)
    open_calls: list = field(default_factory=list, repr=False)  # calls whose forward is running
    awaiting_backward: list = field(default_factory=list, repr=False)  # backward_hooks=True only
    needs_input: bool = field(default=False, repr=False)  # its weight's backward saves its input (no copy needed)
    norms: bool = field(default=False, repr=False)  # capture="norms": its factors are wanted
    keeps_rows: bool = field(default=False, repr=False)  # row i of its output comes from row i of its input alone
    stateful: bool = field(default=False, repr=False)  # its rule needs forward-time state (BatchNorm's mode)
    generic: bool = field(default=False, repr=False)  # served by the generic rule: keep every input, output δ
    broadcast: bool = field(default=False, repr=False)  # a rule answers for it: an output (1, ...) may be broadcast


PREVIOUS = "previous"  # a step's .grad started where the previous step's ended (gradient accumulation)


@dataclass
class StepRecord:
    """One backward pass (a `backward` or `autograd.grad` call), keyed by leaf tensor.

    `after`: each leaf's .grad when the pass ended, copied (or a TensorSummary where the memory
    budget forced it out; None where .grad stayed None). `before`: .grad when it started: None
    (nothing), PREVIOUS (as the previous step left it), or a copy."""

    index: int
    kind: str  # "backward" or "grad"
    roots: list  # detached copies of its scalar roots (the losses), on their device until the trace ends
    after: dict = field(default_factory=dict)
    before: dict = field(default_factory=dict)


@dataclass
class Records:
    """Everything a trace saw, before names are given (record/assemble.py)."""

    modules: dict  # nn.Module -> ModuleRecord, in first-call order
    walk: GraphWalk  # the graph of the last step (or of the forward pass, when no backward ran)
    steps: list  # StepRecord per backward pass
    grads_at_end: dict  # leaf -> whether its .grad was still as the last step left it when the trace ended
    notes: list  # record.notes.Note, in the order they were met
    used_autograd_grad: bool
    no_factors: Any = None  # the Note saying why (a, δ) cannot rebuild .grad in this run (double backward), or None
    answers: dict = field(default_factory=dict, repr=False)  # the registry's answer per module at its first call
