"""A generic-rule module whose parameters act as an affine pair, a scale or a shift: its rows from its own graph.

Modules whose forward is not their base class's (so no exact spec answers for them) but whose one or two parameters
reach the output in one of two ways, found in the backward nodes the call made:
- the weight and bias of one F.layer_norm, F.batch_norm or F.group_norm call (timm's LayerNorm and LayerNorm2d,
  BatchNormAct2d, GroupNormAct, torchvision's LayerNorm2d). The norm's node holds the input it normalised and the
  statistics it used (mean and 1/σ, or the running ones); per sample b, weight.grad_b = Σ δ ⊙ x̂ and
  bias.grad_b = Σ δ over the positions of the parameter's axis: norm.py's factors (affine_factors);
- each parameter one factor of an elementwise product or one term of a sum, as it is, viewed, or plus a constant
  (w ⊙ x̂ of an RMSNorm class of another package, Llama's, Qwen's, T5's, Gemma's x̂ ⊙ (1 + w); a layer scale,
  timm's LayerScale, ConvNeXt's gamma).
  The product's node holds the other factor; per sample, p.grad_b = Σ δ ⊙ other (a scale) or Σ δ (a shift) over
  the dimensions p is broadcast along.
δ is the gradient arriving at that node (before an activation that may follow), kept by a hook. That replaces
batch_copies.vector_params' rerun of the forward and its backward by a product and a sum.

affine_capture takes the parts at the end of the call (nothing where the graph shows neither way); affine_rows turns
them into rows, or raises NotApplicable and vector_params answers. Checked as every fast rule is (analysis/generic.py:
rows add up to the step's gradient, and one sample's rows against its own rerun, once per code path): batch
statistics mix samples, and the check of one sample refuses those rows, as it refuses vector_params'.

Floor: layers. Reads backward nodes through _torch (saved values, shapes, sequence numbers).
"""

from __future__ import annotations

import torch

from hookwidget._torch.autograd import output_shape, saved
from hookwidget._torch.modules import own_parameters
from hookwidget.layers import generic
from hookwidget.layers.base import Factor
from hookwidget.layers.norm import affine_factors

NotApplicable = generic.NotApplicable

# backward node type -> the norm it is (torch 2.13; cuDNN's batch norm saves other names: vector_params answers there)
_NORMS = {"NativeLayerNormBackward0": "layer", "NativeBatchNormBackward0": "batch", "NativeGroupNormBackward0": "group"}
_VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
          "SqueezeBackward1"}  # a parameter seen in another shape, its values in the same order


def applies(module) -> bool:
    """One or two trainable parameters of its own: an affine pair may be all it holds (the capture checks)."""
    return 1 <= sum(p is not None and p.requires_grad for p in own_parameters(module).values()) <= 2


def affine_capture(module, call, out: torch.Tensor) -> tuple:
    """(parts, hooks) of one call (generic.FAST_CAPTURES), or nothing where its graph shows neither way."""
    own = {id(p): n for n, p in own_parameters(module).items() if p is not None and p.requires_grad}
    found = _walk(out.grad_fn, call.seq_start, own)
    if found is None:
        return {}, []
    norms, uses = found
    if any(len(u) != 1 for u in uses.values()) or len(uses) != len(own):
        return {}, []  # a parameter used twice, or not reached
    if len(norms) == 1 and all(u[0][0] is norms[0] and u[0][2] is None for u in uses.values()):
        return _norm_parts(norms[0], uses)
    parts, hooks = {}, []
    for name, [(node, i, view)] in uses.items():
        op = type(node).__name__
        if op == "MulBackward0" and i in (0, 1):
            other = saved(node, "other" if i == 0 else "self")
        elif op == "AddBackward0" and saved(node, "alpha") == 1:
            other = None
        else:
            return {}, []
        shape = output_shape(view) if view is not None else tuple(module.get_parameter(name).shape)
        if shape is None:
            return {}, []
        parts[f"affine:{name}"] = ("scale" if other is not None else "shift", shape)
        if other is not None:
            parts[f"other:{name}"] = other.detach()
        hooks.append((node, f"delta:{name}"))
    return parts, hooks


def affine_rows(module, call, names: list, B: int) -> tuple:
    """(name -> Factor, the code path's key) from what affine_capture took; raises NotApplicable where it took
    nothing, or the shapes do not give the batch first."""
    parts = call.rule_parts or {}
    if "norm" in parts:
        return _norm_rows(parts, call, names, B)
    rows, key = {}, []
    for name in names:
        how, delta = parts.get(f"affine:{name}"), parts.get(f"delta:{name}")
        if how is None or delta is None or not delta.dim() or delta.shape[0] != B:
            raise NotApplicable("no scale or shift captured")
        kind, shape = how
        shape = (1,) * (delta.dim() - len(shape)) + tuple(shape)  # as broadcast against the output
        if len(shape) != delta.dim() or shape[0] != 1:
            raise NotApplicable("a parameter laid out along the batch")
        g = delta * parts[f"other:{name}"] if kind == "scale" else delta
        summed = [d for d in range(1, g.dim()) if shape[d] == 1 and g.shape[d] != 1]
        g = g.sum(summed, keepdim=True) if summed else g
        p = call.params[name]
        if g[0].numel() != p.numel():
            raise NotApplicable("shapes")
        rows[name] = Factor(name, "dense", g.reshape(B, *p.shape), None, tuple(p.shape))
        key.append((name, kind, shape, tuple(delta.shape)))
    return rows, ("affine-node", *key)


def _norm_parts(node, uses: dict) -> tuple:
    """The norm node's input and statistics, which parameter is its weight and which its bias, and its δ hook."""
    roles = {i: name for name, [(_, i, _)] in uses.items()}
    if set(roles) - {1, 2}:
        return {}, []
    kind = _NORMS[type(node).__name__]
    if kind == "batch" and not saved(node, "training"):
        mean = saved(node, "running_mean")
        rstd = (saved(node, "running_var") + saved(node, "eps")).rsqrt()
    else:
        mean, rstd = saved(node, "result1"), saved(node, "result2")
    if mean is None or rstd is None or not mean.numel():
        return {}, []
    parts = {"norm": (kind, roles.get(1), roles.get(2)), "norm_x": saved(node, "input").detach(),
             "norm_mean": mean.detach(), "norm_rstd": rstd.detach()}
    return parts, [(node, "norm_delta")]


def _norm_rows(parts: dict, call, names: list, B: int) -> tuple:
    (kind, weight, bias), x, delta = parts["norm"], parts.get("norm_x"), parts.get("norm_delta")
    if x is None or delta is None or tuple(delta.shape) != tuple(x.shape):
        raise NotApplicable("no gradient reached the norm")
    if x.dim() < 2 or x.shape[0] != B or set(names) != {n for n in (weight, bias) if n is not None}:
        raise NotApplicable("batch dimension, or other parameters")
    xhat = _normalised(kind, x, parts["norm_mean"], parts["norm_rstd"])
    fs = affine_factors(xhat, delta, (weight, call.params[weight]) if weight is not None else None,
                        (bias, call.params[bias]) if bias is not None else None,
                        None if kind == "layer" else 1)  # a layer norm's parameters cover the trailing dimensions
    return {f.param: f for f in fs}, ("norm-node", kind, tuple(x.shape), weight, bias)


def _normalised(kind: str, x, mean, rstd) -> torch.Tensor:
    """The input normalised by the statistics the norm's forward used."""
    if kind == "layer":  # mean, rstd: (*leading, 1, ..., 1)
        return (x - mean) * rstd
    if kind == "batch":  # (C,)
        shape = (1, -1, *[1] * (x.dim() - 2))
        return (x - mean.reshape(shape)) * rstd.reshape(shape)
    N, G = mean.shape[0], mean.numel() // mean.shape[0]  # group: (N, G)
    g = x.reshape(N, G, -1)
    return ((g - mean.reshape(N, G, 1)) * rstd.reshape(N, G, 1)).reshape(x.shape)


WALKED_MAX = 96  # nodes: a norm, a scale or a block around one makes far fewer; a whole model holding a position
# table (timm's VisionTransformer) makes hundreds, walked at every call for nothing: vector_params answers there


def _walk(root, seq_start: int, own: dict) -> tuple | None:
    """The norm nodes among the nodes the call made, and for each of the module's parameters (own: id -> name) the
    nodes that take it: name -> [(node, input index, the view it is taken through or None)]; None past WALKED_MAX
    nodes."""
    nodes = generic.call_nodes(root, seq_start, WALKED_MAX)
    if nodes is None:
        return None
    uses = {}
    for node in nodes:
        if type(node).__name__ in _VIEWS or _behind_views(node)[0] is not None:  # counted where it is used
            continue
        for i, (child, _) in enumerate(node.next_functions):
            leaf, view = _behind_views(child)
            name = own.get(id(getattr(leaf, "variable", None))) if leaf is not None else None
            if name is not None:
                uses.setdefault(name, []).append((node, i, view))
    return [n for n in nodes if type(n).__name__ in _NORMS], uses


def _behind_views(node) -> tuple:
    """(the AccumulateGrad node behind a chain of views and constant shifts, the top one or None), or (None, None).
    A constant added to the parameter (Gemma's x̂ ⊙ (1 + w)) passes its gradient on unchanged, as a view does."""
    top = None
    while node is not None and type(node).__name__ != "AccumulateGrad":
        name = type(node).__name__
        if name in _VIEWS:
            below = node.next_functions[0][0]
        elif name in ("AddBackward0", "SubBackward0") and saved(node, "alpha") == 1:
            inputs = [fn for fn, _ in node.next_functions]
            if sum(fn is not None for fn in inputs) != 1 or name == "SubBackward0" and inputs[0] is None:
                return None, None  # not one parameter and a constant (c - w flips the sign)
            below = next(fn for fn in inputs if fn is not None)
            if output_shape(node) != _shape(below):  # the constant is a batch the parameter is added to: a shift
                return None, None
        else:
            return None, None
        top = top or node
        node = below
    return (node, top) if node is not None else (None, None)


def _shape(node) -> tuple | None:
    """The shape of what the node's forward made (a leaf's, for an AccumulateGrad node)."""
    leaf = getattr(node, "variable", None)
    return tuple(leaf.shape) if leaf is not None else output_shape(node)


generic.FAST_RULES.insert(0, (applies, affine_rows))  # before vector_params, which answers where this does not
generic.FAST_CAPTURES.append((applies, affine_capture))
