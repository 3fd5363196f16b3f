"""A generic-rule module whose parameters are the weights and biases of F.linear calls in its forward: their rows
from one rerun of the batch, as a Linear's factors.

Attention blocks often call F.linear themselves with a child's weight and a bias made of parameters of their own
(timm's EvaAttention and BEiT's: `F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))`,
k_bias a zero buffer), so no Linear module is called and no exact spec answers; the vmap rule reruns the whole block
per sample. Here the forward is rerun once on the whole batch under a TorchFunctionMode that notes each F.linear
whose weight or bias is one of the module's parameters (a bias also as one piece of a torch.cat along its only
dimension); the gradient arriving at each such call's output gives, per sample, weight.grad_b = Σ_t δ_t x_tᵀ (an
outer factor over the tokens) and bias.grad_b = Σ_t δ_t (a sum factor, sliced where the bias is a piece). Every
parameter must be used so exactly once, else NotApplicable and the vmap rule answers. Checked as every fast rule is
(analysis/generic.py): the rows add up to the step's gradient, and one sample's rows equal its own vjp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hookwidget._torch.modules import own_parameters
from hookwidget.layers import generic
from hookwidget.layers.base import Factor


class _Linears(TorchFunctionMode):
    """Active around one rerun of the forward: the (input, weight, bias, output) of each F.linear call, and the
    pieces of each 1-d torch.cat (output -> its input tensors) that a bias may be made of."""

    def __init__(self):
        super().__init__()
        self.calls, self.cats = [], {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.linear:
            given = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
            self.calls.append((given.get("input"), given.get("weight"), given.get("bias"), out))
        elif func is torch.cat and isinstance(out, torch.Tensor) and out.dim() == 1:  # out kept: its id names it
            self.cats[id(out)] = (out, list(args[0] if args else kwargs.get("tensors", ())))
        return out


def applies(module) -> bool:
    """No parameters of its own but vectors (biases), and a Linear child whose weight it may pass to F.linear: the
    pattern above, and not the tables of positions or attention biases that other generic-rule modules hold."""
    own = [p for p in own_parameters(module).values() if p is not None]
    return all(p.dim() == 1 for p in own) and any(isinstance(c, nn.Linear) for c in module.children())


def linear_call_factors(module, call, names: list, B: int) -> tuple:
    """(name -> Factor, the code path's key) of one call; raises generic.NotApplicable (see the module docstring)."""
    prep = generic._prepare(module, call, list(names), B)
    xs = [prep.leaves[i] for i in prep.batched]
    train = {n: call.params[n].detach().requires_grad_() for n in names}
    by_id = {id(t): n for n, t in train.items()}
    mode = _Linears()
    with generic.batch_rerun(module, call, prep, train, xs, mode) as outs:
        uses = _uses(mode, by_id, B)
        grads = torch.autograd.grad(outs, [out for out, _ in uses], prep.cots, allow_unused=True)
    found = {}
    for (out, (x, weight, pieces)), g in zip(uses, grads):
        D = (torch.zeros_like(out) if g is None else g).reshape(B, -1, out.shape[-1])
        if weight is not None:
            found[weight] = Factor(weight, "outer", D, x.detach().reshape(B, -1, x.shape[-1]),
                                   tuple(train[weight].shape))
        for name, lo, hi in pieces:
            found[name] = Factor(name, "sum", D[..., lo:hi], None, tuple(train[name].shape))
    if set(found) != set(names):
        raise generic.NotApplicable("parameters used otherwise than as an F.linear's weight or bias")
    key = ("linear-calls", tuple(names), tuple(tuple(x.shape) for x in xs), tuple(tuple(c.shape) for c in prep.cots))
    return found, key


def _uses(mode: _Linears, by_id: dict, B: int) -> list:
    """(output, (input, the weight's name or None, [(bias name, start, end)])) of each F.linear call that uses a
    parameter; NotApplicable where a parameter is used twice or an input does not lead with the batch."""
    uses, seen = [], set()
    for x, weight, bias, out in mode.calls:
        w = by_id.get(id(weight))
        pieces = []
        if bias is not None and id(bias) in by_id:
            pieces = [(by_id[id(bias)], 0, bias.shape[0])]
        elif bias is not None and id(bias) in mode.cats:
            at = 0
            for t in mode.cats[id(bias)][1]:
                if id(t) in by_id:
                    pieces.append((by_id[id(t)], at, at + t.shape[0]))
                at += t.shape[0]
        if w is None and not pieces:
            continue
        named = [w] if w is not None else []
        named += [n for n, _, _ in pieces]
        if seen & set(named) or len(set(named)) != len(named):
            raise generic.NotApplicable("a parameter used by two F.linear calls")
        seen.update(named)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] != B:
            raise generic.NotApplicable("an F.linear input without the batch first")
        uses.append((out, (x, w, pieces)))
    if not uses:
        raise generic.NotApplicable("no F.linear call uses its parameters")
    return uses


generic.LAST_RULES.append((applies, linear_call_factors))
