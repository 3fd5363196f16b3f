"""A generic-rule module whose parameters are one norm's affine pair: its rows from its own graph, without a rerun.

timm's LayerNorm and LayerNorm2d, BatchNormAct2d and GroupNormAct, torchvision's LayerNorm2d: modules whose forward is
not their base class's (so no exact spec answers for them) but whose parameters reach the output only as the weight and
bias of one F.layer_norm, F.batch_norm or F.group_norm call. The norm's own backward node holds what the exact rules of
norm.py need: the input it normalised, the statistics it used (mean and 1/σ, or the running ones), and, through a hook,
the gradient that arrives at its output (δ before the activation that may follow). Per sample b, weight.grad_b =
Σ δ ⊙ x̂ and bias.grad_b = Σ δ over the positions of the parameter's axis. That replaces generic.vector_params'
rerun of the forward and its backward (a forward with per-sample affine copies) by one product and two sums.

norm_capture takes the parts at the end of the call (nothing where the graph holds no such single node whose affine
inputs are exactly the module's trainable parameters); norm_rows turns them into factors, or raises NotApplicable
and vector_params answers. Checked as every fast rule is (analysis/generic.py: rows add up to the step's gradient,
and one sample's rows against its own rerun, once per code path): batch statistics mix samples, and the check of one
sample refuses those rows, as it refuses vector_params'.

Floor: layers. Reads backward nodes through _torch (saved values, sequence numbers).
"""

from __future__ import annotations

import torch

from hookwidget._torch.autograd import saved, sequence_nr
from hookwidget._torch.modules import own_parameters
from hookwidget.layers import generic
from hookwidget.layers.base import Factor

NotApplicable = generic.NotApplicable

# backward node type -> the norm it is (torch 2.13; cuDNN's batch norm saves other names: vector_params answers there)
_NODES = {"NativeLayerNormBackward0": "layer", "NativeBatchNormBackward0": "batch", "NativeGroupNormBackward0": "group"}


def applies(module) -> bool:
    """One or two trainable parameters of its own: an affine pair may be all it holds (the capture checks)."""
    return 1 <= sum(p is not None and p.requires_grad for p in own_parameters(module).values()) <= 2


def norm_capture(module, call, out: torch.Tensor) -> tuple:
    """(parts, hooks) of one call (generic.FAST_CAPTURES): the norm node's input and statistics, the names of the
    module's weight and bias in it, and a hook for the gradient arriving at it; nothing where the call's graph holds
    no single norm node that takes exactly the module's trainable parameters as its affine pair."""
    own = {id(p): n for n, p in own_parameters(module).items() if p is not None and p.requires_grad}
    nodes = _norm_nodes(out.grad_fn, call.seq_start)
    if len(nodes) != 1:
        return {}, []
    node = nodes[0]
    affine = [getattr(fn, "variable", None) for fn, _ in node.next_functions[1:3]]
    names = [own.get(id(p)) if p is not None else None for p in affine]
    if sorted(n for n in names if n is not None) != sorted(own.values()) or len(own) != sum(map(bool, names)):
        return {}, []
    kind = _NODES[type(node).__name__]
    x = saved(node, "input")
    if kind == "batch":
        if saved(node, "training"):
            mean, rstd = saved(node, "result1"), saved(node, "result2")
        else:
            mean = saved(node, "running_mean")
            rstd = (saved(node, "running_var") + saved(node, "eps")).rsqrt()
    else:
        mean, rstd = saved(node, "result1"), saved(node, "result2")
    if mean is None or rstd is None or not mean.numel():
        return {}, []
    parts = {"norm": (kind, names[0], names[1]), "norm_x": x.detach(), "norm_mean": mean.detach(),
             "norm_rstd": rstd.detach()}
    return parts, [(node, "norm_delta")]


def norm_rows(module, call, names: list, B: int) -> tuple:
    """(name -> Factor (diag for the weight, sum for the bias), the code path's key) from what norm_capture took;
    raises NotApplicable where it took nothing or the shapes do not give the batch first."""
    parts = call.rule_parts or {}
    kind_names, x, delta = parts.get("norm"), parts.get("norm_x"), parts.get("norm_delta")
    if kind_names is None or x is None or delta is None or tuple(delta.shape) != tuple(x.shape):
        raise NotApplicable("no norm node captured")
    kind, weight, bias = kind_names
    if x.dim() < 2 or x.shape[0] != B or set(names) != {n for n in (weight, bias) if n is not None}:
        raise NotApplicable("batch dimension, or other parameters")
    xhat, C = _normalised(kind, x, parts["norm_mean"], parts["norm_rstd"], call.params[weight or bias].numel())
    if kind == "layer":  # the parameters cover the trailing dimensions
        X, D = xhat.reshape(B, -1, C), delta.reshape(B, -1, C)
    else:  # channels: dimension 1
        X, D = (t.reshape(B, C, -1).transpose(1, 2) for t in (xhat, delta))
    rows = {}
    if weight is not None:
        rows[weight] = Factor(weight, "diag", D, X, tuple(call.params[weight].shape))
    if bias is not None:
        rows[bias] = Factor(bias, "sum", D, None, tuple(call.params[bias].shape))
    return rows, ("norm-node", kind, tuple(x.shape), weight, bias)


def _normalised(kind: str, x, mean, rstd, C: int) -> tuple:
    """(x̂, the parameter's length): the input normalised by the statistics the norm's forward used."""
    if kind == "layer":  # mean, rstd: (*leading, 1, ..., 1)
        return (x - mean) * rstd, C
    if kind == "batch":  # (C,)
        shape = (1, -1, *[1] * (x.dim() - 2))
        return (x - mean.reshape(shape)) * rstd.reshape(shape), C
    N, G = mean.shape[0], mean.numel() // mean.shape[0]  # group: (N, G)
    g = x.reshape(N, G, -1)
    return ((g - mean.reshape(N, G, 1)) * rstd.reshape(N, G, 1)).reshape(x.shape), C


def _norm_nodes(root, seq_start: int) -> list:
    """The norm nodes among the nodes the call made (those since seq_start), found from its output's node."""
    found, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen or sequence_nr(node) < seq_start or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        if type(node).__name__ in _NODES:
            found.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


generic.FAST_RULES.insert(0, (applies, norm_rows))  # before vector_params, which answers where this does not
generic.FAST_CAPTURES.append((applies, norm_capture))
