"""The watch's statistics inside torch.compile: a forward hook Dynamo can trace into the graph.

Dynamo traces a module's forward hooks into the compiled graph, but the body of a tensor hook
registered there must be free of Python side effects (torch 2.13 traces it as a subgraph), so the
eager δ hook, which writes into the step's dict, would break the graph. Inside compiled code the
layer's output goes through `_Probe` instead: an identity (a copy, which Inductor fuses away) whose
backward hands back the gradient unchanged and leaves the statistics of δ and of the layer's input
in the .grad of a small per-layer "sink" leaf. AccumulateGrad sums them over the layer's calls;
the keep strategy "stats" (step_stats.py) reads and clears the sinks when backward ends. No Python runs
inside the compiled code.
"""

from __future__ import annotations

import torch

from hookwidget.capture.stat_rows import F64, NAN
from hookwidget.capture.tensors import first_tensor
from hookwidget.stats import l2

SINK = 9  # ‖δ‖², max|δ|, δ NaN, δ Inf, Σa², zeros of a, non-finite of a, entries of a, calls


def pure_stats(t: torch.Tensor, kind: str) -> torch.Tensor:
    """δ: [‖t‖², max|t|, NaN, Inf]; a: [Σt², zeros, non-finite, entries]; float64, no host sync."""
    t = t.detach()
    t = t if t.is_floating_point() else t.float()
    if t.numel() == 0:
        return torch.zeros(4, dtype=F64, device=t.device)
    sq = l2(t).double().square()
    if kind == "delta":
        return torch.stack([sq, t.abs().amax().double(), torch.isnan(t).sum(dtype=F64), torch.isinf(t).sum(dtype=F64)])
    n = torch.full((), float(t.numel()), dtype=F64, device=t.device)
    return torch.stack([sq, n - torch.count_nonzero(t).double(), n - torch.isfinite(t).sum(dtype=F64), n])


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, sink, a_stats):
        ctx.save_for_backward(a_stats)
        return out.clone()  # not a view: an in-place op after the layer (ReLU(inplace=True)) stays legal

    @staticmethod
    def backward(ctx, grad):
        (a_stats,) = ctx.saved_tensors
        one = torch.ones(1, dtype=F64, device=a_stats.device)
        return grad, torch.cat([pure_stats(grad, "delta").to(a_stats.device), a_stats, one]), None


def probe(sink: torch.Tensor, inputs, output):
    """The hook's return value inside compiled code: `output` routed through _Probe (None: left alone)."""
    out = output if isinstance(output, torch.Tensor) else None
    if out is None and type(output) in (tuple, list) and output and isinstance(output[0], torch.Tensor):
        out = output[0]
    if out is None or not out.requires_grad or not out.is_floating_point():
        return None
    a = first_tensor(inputs)  # as the eager hook reads it
    a_stats = pure_stats(a, "a").to(sink.device) if a is not None else torch.full((4,), NAN, dtype=F64,
                                                                                   device=sink.device)
    new = _Probe.apply(out, sink, a_stats)
    return new if out is output else type(output)([new, *output[1:]])


def sinks(layers: list) -> list:
    """One (SINK,) float64 leaf per layer, on the device of the layer's first parameter."""
    return [torch.zeros(SINK, dtype=F64, device=next(m.parameters(recurse=False)).device, requires_grad=True)
            for m in layers]


def take(sink_list: list, step) -> None:
    """Move what backward left in the sinks into the step's δ and a statistics (if recorded); clear them.
    A layer called more than once in the step: max|δ| is not known (the sink sums), so it is NaN."""
    L = len(sink_list)
    for li, s in enumerate(sink_list):
        g, s.grad = s.grad, None
        if g is None or not step.recorded:
            continue
        d = torch.cat([g[:1], torch.where(g[8] > 1, NAN, g[1]).reshape(1), g[2:4]])
        step.delta[li] = step.delta[li] + d if li in step.delta else d
        step.a[li] = step.a[li] + g[4:8] if li in step.a else g[4:8]
        step.order.setdefault(li, L + (L - li))  # compiled: backward order taken as reverse layer order
        step.a_order.setdefault(li, li)
        step.compiled = True
