"""nn.MultiheadAttention: exact token factors from one full-batch backward, instead of vmap of its vjp.

In-projection and out-projection are linear maps inside the module's own forward (F.multi_head_attention_forward):
in_proj_weight.grad = Σ_t δ(q|k|v)_t x_tᵀ over the query/key/value inputs, out_proj.weight.grad = Σ_t δ_t o_tᵀ over
the attention output o. Attention mixes tokens, never samples, so one backward of the whole batch gives every
sample's δ(q|k|v) and o at once: the per-sample gradients are outer factors (B, T, ·) whose norms take the Gram
form. For self-attention capture takes o and δ(q|k|v) from the call's own graph (mha_capture: the attention output
out_proj's matmul saved, the gradient arriving at in_proj's matmul), at no cost beyond keeping them; otherwise the
projections and the attention are rerun from the call's kept inputs and parameters (F.linear,
F.scaled_dot_product_attention with the module's masks made additive), about the module's own forward and
backward. It serves exactly nn.MultiheadAttention (no subclass, forward not replaced) with packed in_proj_weight,
no bias_k/bias_v or add_zero_attn, no dropout in train mode, batched inputs, no gradient on the attention weights;
anything else falls back to the vmap rule. analysis/per_sample.py checks it as it checks that rule's (rows sum to
the step's gradient) and, once per code path, one sample's rows against the module's own forward rerun on that
sample alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hookwidget._torch.autograd import saved
from hookwidget._torch.layers import packed_qkv
from hookwidget.layers import generic
from hookwidget.layers.base import Factor

NotApplicable = generic.NotApplicable


def applies(module) -> bool:
    return type(module) is nn.MultiheadAttention and "forward" not in vars(module)


def mha_factors(module: nn.MultiheadAttention, call, names: list, B: int) -> tuple:
    """(name -> Factor (outer / sum), the code path's key) of one call of an nn.MultiheadAttention; raises
    NotApplicable."""
    training = call.training[0] if call.training else module.training
    if module.dropout > 0 and training:
        raise NotApplicable("dropout in train mode")
    if not packed_qkv(module) or module.bias_k is not None or module.add_zero_attn:
        raise NotApplicable("separate q/k/v weights, bias_k/bias_v or add_zero_attn")
    if not set(names) <= {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}:
        raise NotApplicable("other parameters")
    prep = generic._prepare(module, call, names, B)
    if prep.outs != [0]:
        raise NotApplicable("a gradient reached the attention weights")
    args, kwargs = generic.rebuild(prep, _same_inputs(prep))
    bound = _bind(*args, **kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        raise NotApplicable("unbatched input")
    same = q is k and k is v
    if not module.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if same:
            k = v = q
    if q.shape[0] != B or k.shape[0] != B or prep.out_dims[0] != (0 if module.batch_first else 1):
        raise NotApplicable("batch dimension")
    P = {n: call.params[n].detach() for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
         if call.params.get(n) is not None}
    W, b = P["in_proj_weight"], P.get("in_proj_bias")
    E, H = W.shape[1], module.num_heads
    parts = call.rule_parts or {}
    L = q.shape[1]
    if same and _captured(parts, L, B, W.shape):  # the call's own backward gave δ(q|k|v) and o: no rerun
        cot = prep.cots[0] if module.batch_first else prep.cots[0].transpose(0, 1)
        D_in, X_in = parts["d_in"].view(L, B, -1).transpose(0, 1), q
        o = parts["o"].view(L, B, -1).transpose(0, 1)
        key = (*_key(module, bound, same, q, k, W, names, b), True)
        return _factors(module, names, P, D_in, X_in, cot, o), key
    mask = _mask(bound, q, k, H)
    with torch.enable_grad():
        if same:  # self-attention: one packed projection, one token factor
            projs = [F.linear(q, W, b).detach().requires_grad_()]
            pq, pk, pv = projs[0].chunk(3, -1)
        else:
            bs = b.chunk(3) if b is not None else (None,) * 3
            projs = [F.linear(x, w, bb).detach().requires_grad_() for x, w, bb in zip((q, k, v), W.chunk(3), bs)]
            pq, pk, pv = projs
        heads = [t.reshape(B, t.shape[1], H, E // H).transpose(1, 2) for t in (pq, pk, pv)]
        o = F.scaled_dot_product_attention(*heads, attn_mask=mask).transpose(1, 2).reshape(B, L, E)
        cot = prep.cots[0] if module.batch_first else prep.cots[0].transpose(0, 1)
        gproj = torch.autograd.grad(o, projs, cot @ P["out_proj.weight"])  # δ_o = δ Wo, then attention's backward
    if same:
        D_in, X_in = gproj[0], q
    else:
        rows = W.shape[0] // 3
        Ds = []
        for j, g in enumerate(gproj):
            full = g.new_zeros(B, g.shape[1], W.shape[0])
            full[..., j * rows:(j + 1) * rows] = g
            Ds.append(full)
        D_in, X_in = torch.cat(Ds, 1), torch.cat([q, k, v], 1)
    key = (*_key(module, bound, same, q, k, W, names, b), False)
    return _factors(module, names, P, D_in, X_in, cot, o.detach()), key


def _key(module, bound, same, q, k, W, names, b) -> tuple:
    """The code path a call took (layout, shapes, masks, which parameters): verified once per module (generic_rows)."""
    am, kpm = bound["attn_mask"], bound["key_padding_mask"]
    return (module.batch_first, same, tuple(q.shape), tuple(k.shape), W.device.type, W.dtype, tuple(names),
            b is not None, None if am is None else (am.dim(), am.dtype), None if kpm is None else kpm.dtype)


def _factors(module, names, P, D_in, X_in, cot, o) -> dict:
    out = {}
    for n in names:
        if n == "in_proj_weight":
            out[n] = Factor(n, "outer", D_in, X_in.detach(), tuple(P[n].shape))
        elif n == "in_proj_bias":
            out[n] = Factor(n, "sum", D_in, None, tuple(P[n].shape))
        elif n == "out_proj.weight":
            out[n] = Factor(n, "outer", cot, o, tuple(P[n].shape))
        else:
            out[n] = Factor(n, "sum", cot, None, tuple(P[n].shape))
    return out


def _captured(parts: dict, L: int, B: int, w_shape) -> bool:
    d, o = parts.get("d_in"), parts.get("o")
    return (d is not None and o is not None and tuple(d.shape) == (L * B, w_shape[0])
            and tuple(o.shape) == (L * B, w_shape[1]))


def mha_capture(module: nn.MultiheadAttention, call, out: torch.Tensor) -> tuple:
    """At the end of a call, from its own graph (F.multi_head_attention_forward runs both projections as matmuls of
    token rows in (position, sample) order): the attention output o that out_proj's matmul saved, and a hook on
    in_proj's matmul for the gradient of its rows, δ(q|k|v). Saves mha_factors the rerun of the projections and
    the attention. Nothing where either matmul is not found once (separate q/k/v weights, another layout)."""
    W, Wo = module.in_proj_weight, module.out_proj.weight
    if W is None or not (W.requires_grad and Wo.requires_grad):
        return {}, []
    found = _weight_consumers(out.grad_fn, call.seq_start, {id(W): "in", id(Wo): "out"})
    if len(found.get("in", ())) != 1 or len(found.get("out", ())) != 1:
        return {}, []
    o = _saved_rows(found["out"][0])
    if o is None or o.dim() != 2:
        return {}, []
    return {"o": o.detach()}, [(found["in"][0], "d_in")]


def _weight_consumers(root, seq_start: int, weights: dict) -> dict:
    """The matmul nodes created since seq_start that take a weight through its transpose: kind -> [node]."""
    found = {}
    for node in generic.call_nodes(root, seq_start):
        for child, _ in node.next_functions:
            if child is not None and type(child).__name__ == "TBackward0":
                kind = weights.get(id(getattr(child.next_functions[0][0], "variable", None)))
                if kind is not None:
                    found.setdefault(kind, []).append(node)
    return found


def _saved_rows(node):
    """The row operand a matmul node saved (addmm's mat1, mm's self)."""
    name = type(node).__name__
    if name == "AddmmBackward0":
        return saved(node, "mat1")
    if name == "MmBackward0":
        return saved(node, "self")
    return None


def _bind(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
          is_causal=False) -> dict:
    return dict(query=query, key=key, value=value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                is_causal=is_causal)


def _mask(bound, q, k, H: int):
    """The additive float mask (B or 1, H or 1, L, S) the module's forward applies, or None."""
    B, L, S = q.shape[0], q.shape[1], k.shape[1]
    m = None
    am, kpm = bound["attn_mask"], bound["key_padding_mask"]
    if am is not None:
        if am.dim() == 2 and am.shape == (L, S):
            am = am.view(1, 1, L, S)
        elif am.dim() == 3 and am.shape == (B * H, L, S):
            am = am.view(B, H, L, S)
        else:
            raise NotApplicable("attn_mask shape")
        m = _additive(am, q.dtype)
    elif bound["is_causal"]:
        raise NotApplicable("is_causal without attn_mask")
    if kpm is not None:
        if kpm.shape != (B, S):
            raise NotApplicable("key_padding_mask shape")
        k2 = _additive(kpm.view(B, 1, 1, S), q.dtype)
        m = k2 if m is None else m + k2
    return m


def _additive(m: torch.Tensor, dtype):
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m, float("-inf"))
    if not m.is_floating_point():
        raise NotApplicable("mask dtype")
    return m.to(dtype)


def _same_inputs(prep) -> list:
    """The call's argument leaves, with query/key/value that hold the same values made one object, so torch's forward
    takes the same packed path it took (capture keeps one copy of a tensor passed three times; a call given three
    tensors of equal values, or its keywords kept apart, is made one here)."""
    leaves = list(prep.leaves)
    first = [i for i in range(min(3, len(leaves))) if isinstance(leaves[i], torch.Tensor)]
    for i in first[1:]:
        a, b = leaves[first[0]], leaves[i]
        if a is b or a.shape == b.shape and (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
                                           or torch.equal(a, b)):
            leaves[i] = a
    return leaves


generic.FAST_RULES.append((applies, mha_factors))
generic.FAST_CAPTURES.append((applies, mha_capture))
