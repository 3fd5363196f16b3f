"""nn.LSTM, nn.GRU and nn.RNN through the generic rule's fast path: their weights' per-sample gradients as
factors over time steps, from one rerun of the recurrence on the whole batch.

Each layer and direction computes, at every step t, gi_t = W_ih x_t + b_ih and gh_t = W_hh h_{t-1} + b_hh and
mixes them in its gates (LSTM: i, f, g, o of gi + gh; GRU: r, z from gi + gh, n from gi_n + r ⊙ gh_n; RNN:
tanh or relu of gi + gh). So W_ih.grad = Σ_t (∂L/∂gi_t) x_tᵀ, b_ih.grad = Σ_t ∂L/∂gi_t, W_hh.grad =
Σ_t (∂L/∂gh_t) h_{t-1}ᵀ, b_hh.grad = Σ_t ∂L/∂gh_t (∂L/∂gh_t is ∂L/∂gi_t but in a GRU): a Linear's outer and
sum factors with the time steps as tokens, whose per-sample norms the Gram form gives without a per-sample copy
of the weights. The rule reruns the recurrence (torch's documented equations, as tensors with the batch intact),
pulls the call's output gradients back to every gi_t (and a GRU's gh_t) in one backward, and is checked as every
fast rule is (analysis/generic.py: the rows add up to the step's gradient, one sample's rows equal its own vjp); a
call it does not cover (an unbatched input, LSTM's proj_size, dropout between layers in training) goes to the vmap
rule.

A PackedSequence (variable lengths) states its samples itself: batch_sizes[0] sequences, sorted by length for the
kernel, unsorted_indices giving the user's order. The rule pads it (pad_packed_sequence: the user's order, as h_0 and
h_n are) and reruns the recurrence with each sequence's state held once it ended (reversed: until it begins), so its
padded steps get no gradient; _packed_split gives each sequence's own call, for the check and for the loop over the
sequences that answers where the rule does not (vmap needs samples of one length).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

from hookwidget.layers import generic
from hookwidget.layers.base import Factor


def _plain_recurrent(module) -> bool:
    return type(module) in (nn.LSTM, nn.GRU, nn.RNN)  # the classes themselves: a subclass may change the cell


def _cell(module, gi, gh, state):
    """One step of one layer and direction: (h, the state to carry) from gi_t, gh_t and the carried state."""
    if isinstance(module, nn.LSTM):
        h, c = state
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, (h, c)
    if isinstance(module, nn.GRU):
        (h,) = state
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        h = (1 - z) * n + z * h
        return h, (h,)
    (h,) = state
    h = torch.tanh(gi + gh) if module.nonlinearity == "tanh" else torch.relu(gi + gh)
    return h, (h,)


def _or_zeros(g, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g  # no gradient reached it: it added nothing


def _tracked(t: torch.Tensor) -> torch.Tensor:
    """t, made to require grad where nothing it came from does (the first step's gh from h_0): its gradient is asked."""
    return t if t.requires_grad else t.requires_grad_()


def _given(call) -> tuple:
    args, kwargs = call.inputs
    given = {**dict(zip(("input", "hx"), args)), **kwargs}
    return given.get("input"), given.get("hx")


def _arguments(module, call, B: int):
    """(input (B, T, I), initial states per layer and direction: tuples of (B, H), each sequence's length or None)
    of a call, or NotApplicable. A PackedSequence is padded, its sequences in the user's order (as h_0 and h_n are)."""
    x, hx = _given(call)
    lengths = None
    if isinstance(x, PackedSequence):
        x, lengths = pad_packed_sequence(x, batch_first=True)
        lengths = lengths.to(x.device)
    elif not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise generic.NotApplicable("an unbatched input")
    else:
        x = x if module.batch_first else x.transpose(0, 1)
    if x.shape[0] != B:
        raise generic.NotApplicable("the input's batch is not the step's")
    slots = module.num_layers * (2 if module.bidirectional else 1)
    if hx is None:
        zeros = x.new_zeros(slots, B, module.hidden_size)
        hx = (zeros, zeros) if isinstance(module, nn.LSTM) else zeros
    states = hx if isinstance(hx, (tuple, list)) else (hx,)
    if any(not isinstance(s, torch.Tensor) or s.dim() != 3 or s.shape[1] != B for s in states):
        raise generic.NotApplicable("an initial state without the batch")
    return x, [tuple(s[k] for s in states) for k in range(slots)], lengths


def _packed_targets(module, call) -> tuple:
    """(indices into [output, h_n, c_n], their δ) of a call on a PackedSequence: the output's δ (packed rows, the
    batch sorted by length) padded to (B, T, ·) in the user's order, as the rule's output is."""
    x, _ = _given(call)
    deltas, k = call.deltas, 2 if isinstance(module, nn.LSTM) else 1
    found = []
    if deltas[0] is not None:
        rows = PackedSequence(deltas[0], x.batch_sizes, x.sorted_indices, x.unsorted_indices)
        found.append((0, pad_packed_sequence(rows, batch_first=True, total_length=len(x.batch_sizes))[0]))
    found += [(1 + i, d) for i, d in enumerate(deltas[-k:]) if d is not None]
    if not found:
        raise generic.NotApplicable("no gradient reached its outputs")
    return [i for i, _ in found], [d for _, d in found]


def _packed_split(module, call):
    """A call on a PackedSequence holds one sample per sequence (batch_sizes[0] of them, in the order of
    unsorted_indices: the user's); sample b's call is its sequence packed alone with its h_0 (and c_0), its δ the
    rows of the output's that are its time steps and its h_n's (and c_n's)."""
    x, hx = _given(call)
    if not isinstance(x, PackedSequence) or call.deltas is None:
        return None
    sizes = x.batch_sizes.tolist()
    n = sizes[0]
    order = list(range(n)) if x.unsorted_indices is None else x.unsorted_indices.tolist()
    starts = [0, *itertools.accumulate(sizes[:-1])]  # where each time step's rows begin in the packed data
    deltas, k = call.deltas, 2 if isinstance(module, nn.LSTM) else 1

    def one(b: int):
        s = order[b]  # its place in the batch sorted by length
        rows = torch.tensor([at + s for at, size in zip(starts, sizes) if size > s], device=x.data.device)
        h = hx if hx is None else tuple(t[:, b:b + 1] for t in hx) if isinstance(hx, (tuple, list)) else hx[:, b:b + 1]
        out = None if deltas[0] is None else deltas[0][rows]
        return (pack_sequence([x.data[rows]]), h), {}, [out, None, *(None if d is None else d[:, b:b + 1]
                                                                      for d in deltas[-k:])]

    return generic.Samples(n, one)


def recurrent_factors(module, call, names: list, B: int) -> tuple:
    """(name -> Factor, the code path's key) of one call of a plain nn.LSTM / nn.GRU / nn.RNN; raises
    generic.NotApplicable for what it does not cover (see the module docstring)."""
    if getattr(module, "proj_size", 0):
        raise generic.NotApplicable("an LSTM with proj_size")
    if module.training and module.dropout and module.num_layers > 1:
        raise generic.NotApplicable("dropout between layers in training")
    x, initial, lengths = _arguments(module, call, B)
    if lengths is None:
        prep = generic._prepare(module, call, list(names), B)
        picked, cots = prep.outs, prep.cots
    else:
        picked, cots = _packed_targets(module, call)
        active = [(t < lengths).unsqueeze(-1) for t in range(x.shape[1])]  # (B, 1) per time step
    p = call.params
    dirs = 2 if module.bidirectional else 1
    T, gru = x.shape[1], isinstance(module, nn.GRU)
    parts = {}  # the parameters' suffix (layer, direction) -> (gi, [gh_t], its input, [h_{t-1}]), by time step
    finals: list = []
    with torch.enable_grad():
        layer_in = x.detach()
        for layer in range(module.num_layers):
            seqs = []
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                gi = _tracked(F.linear(layer_in, p["weight_ih" + sfx], p.get("bias_ih" + sfx)))
                state = tuple(s.detach() for s in initial[layer * dirs + d])
                hs, ghs, prev = [None] * T, [None] * T, [None] * T
                for t in range(T - 1, -1, -1) if d else range(T):
                    prev[t] = state[0]
                    ghs[t] = F.linear(state[0], p["weight_hh" + sfx], p.get("bias_hh" + sfx))
                    if gru:  # else gh_t only adds to gi_t: the same gradient reaches both
                        ghs[t] = _tracked(ghs[t])
                    h, new = _cell(module, gi[:, t], ghs[t], state)
                    if lengths is not None:  # a sequence that ended (or, reversed, has not begun) keeps its state
                        new = tuple(torch.where(active[t], a, b) for a, b in zip(new, state))
                        h = torch.where(active[t], h, 0)
                    hs[t], state = h, new
                parts[sfx] = (gi, ghs, layer_in, prev)
                finals.append(state)
                seqs.append(torch.stack(hs, 1))
            layer_in = torch.cat(seqs, -1) if dirs == 2 else seqs[0]
        output = layer_in if module.batch_first or lengths is not None else layer_in.transpose(0, 1)
        flat = [output, torch.stack([s[0] for s in finals])]
        if isinstance(module, nn.LSTM):
            flat.append(torch.stack([s[1] for s in finals]))
        outs = [flat[i] for i in picked]
        if any(o.shape != c.shape for o, c in zip(outs, cots)):
            raise generic.NotApplicable("other outputs than at the call")
        leaves = [t for gi, ghs, *_ in parts.values() for t in ((gi, *ghs) if gru else (gi,))]
        grads = iter(torch.autograd.grad(outs, leaves, cots, allow_unused=True))
    found = {}
    for sfx, (gi, ghs, layer_in, prev) in parts.items():
        dgi = _or_zeros(next(grads), gi)
        dgh = torch.stack([_or_zeros(next(grads), gh) for gh in ghs], 1) if gru else dgi
        for side, D, X in (("ih", dgi, layer_in.detach()), ("hh", dgh, torch.stack(prev, 1).detach())):
            w, b = f"weight_{side}{sfx}", f"bias_{side}{sfx}"
            found[w] = Factor(w, "outer", D, X, tuple(p[w].shape))
            if module.bias:
                found[b] = Factor(b, "sum", D, None, tuple(p[b].shape))
    if not set(names) <= set(found):
        raise generic.NotApplicable("parameters other than the recurrence's")
    packed = None if lengths is None else _given(call)[0].sorted_indices is not None
    key = ("recurrent", type(module).__name__, tuple(x.shape), tuple(picked), packed)
    return {n: found[n] for n in names}, key


generic.FAST_RULES.append((_plain_recurrent, recurrent_factors))


def _torch_forward(module) -> bool:
    """A recurrent layer whose forward is torch's own (a subclass may change its cell, not what a call returns): the
    loop over its sequences reruns that forward, so it needs no more."""
    return isinstance(module, nn.RNNBase) and type(module).forward in (nn.LSTM.forward, nn.GRU.forward, nn.RNN.forward)


generic.SPLITS.append((_torch_forward, _packed_split))
