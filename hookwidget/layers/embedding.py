"""nn.Embedding: row idx_t of W.grad gets δ_t (padding_idx rows get nothing); a scaled word embedding (the lookup
times a number: BART's, Gemma's and 22 more of transformers' classes, recognised by their forward's code) the same
with δ_t times that number; nn.EmbeddingBag (one bag per row of a 2-d input, or bags given by offsets: one sample per
bag), and any other Embedding subclass with a forward of its own, through the generic rule's fast path (below).

With scale_grad_by_freq, backward divides δ_t by how often idx_t occurs in the whole call's input, so samples
share a statistic (as BatchNorm on batch statistics does): a row is the sample's *contribution* to .grad
(its δ_t over the batch's counts; the rows still sum to .grad exactly), not the gradient of its loss alone."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hookwidget._torch.layers import bag_max_rows
from hookwidget.layers import generic
from hookwidget.layers.base import Factor
from hookwidget.layers.registry import register


def _refuse(m: nn.Embedding) -> str | None:
    if m.sparse:
        return "Embedding(sparse=True): .grad is a sparse tensor"
    return None


def _per_sample(m: nn.Embedding, state=None) -> str:
    return "contribution" if m.scale_grad_by_freq else "exact"


@register(nn.Embedding, refuse=_refuse, params=("weight",), tokens=True, per_sample=_per_sample)
def embedding(m: nn.Embedding, idx, delta, state=None):
    B = idx.shape[0]
    idx, D = idx.reshape(B, -1), delta.reshape(B, -1, delta.shape[-1])
    if m.padding_idx is not None:
        D = D * (idx != m.padding_idx).unsqueeze(-1).to(D.dtype)
    if m.scale_grad_by_freq:
        counts = torch.bincount(idx.reshape(-1), minlength=m.num_embeddings)
        D = D / counts[idx].unsqueeze(-1).to(D.dtype)
        return [Factor("weight", "onehot", D, idx, tuple(m.weight.shape), rows=m.num_embeddings,
                       per_sample="contribution")]
    return [Factor("weight", "onehot", D, idx, tuple(m.weight.shape), rows=m.num_embeddings)]


# -- scaled word embeddings: the lookup times a number ----------------------------------------------------------
# transformers defines this forward in 24 classes (BartScaledWordEmbedding, GemmaTextScaledWordEmbedding, ...), each a
# copy of one of the two below: the registry gives a class the rule of the reference whose forward's code its forward
# has (registry.same_code), so a changed copy (T5Gemma2's adds tokens of its own) gets no exact rule.
class ScaledLookup(nn.Embedding):
    """Reference: the lookup times embed_scale, a number (BART, M2M100, MBart, XGLM, ...)."""

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


class CastScaledLookup(nn.Embedding):
    """Reference: the lookup times embed_scale, a 0-d tensor, in the weight's dtype (Gemma 1 to 4, VaultGemma, ...)."""

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


def _scalar(s, numbers_too: bool) -> bool:
    return isinstance(s, torch.Tensor) and s.dim() == 0 or numbers_too and isinstance(s, numbers.Real) and \
        not isinstance(s, bool)


def _scaled_refusal(numbers_too: bool):
    def refuse(m) -> str | None:
        if not _scalar(getattr(m, "embed_scale", None), numbers_too):
            return f"{type(m).__name__}.embed_scale is not {'a number or ' if numbers_too else ''}a 0-d tensor"
        return _refuse(m)

    return refuse


@register(ScaledLookup, by_code=True, refuse=_scaled_refusal(True), params=("weight",), tokens=True,
          per_sample=_per_sample)
def scaled_lookup(m, idx, delta, state=None):
    return embedding(m, idx, delta * m.embed_scale)  # the gradient its forward's product passes to the lookup


@register(CastScaledLookup, by_code=True, refuse=_scaled_refusal(False), params=("weight",), tokens=True,
          per_sample=_per_sample)
def cast_scaled_lookup(m, idx, delta, state=None):
    return embedding(m, idx, delta * m.embed_scale.to(m.weight.dtype))


# -- nn.EmbeddingBag: through the generic rule's fast path ------------------------------------------------------
# No exact rule is registered for it: a bag's offsets and per_sample_weights are arguments that the factor rules do
# not see. The generic rule sees every argument, and checks what this fast rule gives (the rows add up to the step's
# gradient; one sample's rows equal its own vjp on the first call of each code path), so a call it does not cover
# falls back to the vmap rule (or, for bags given by offsets, a loop over the bags: _bag_split).
def _plain_bag(module) -> bool:
    return isinstance(module, nn.EmbeddingBag) and type(module).forward is nn.EmbeddingBag.forward


def _bag_given(call) -> dict:
    args, kwargs = call.inputs
    return {**dict(zip(("input", "offsets", "per_sample_weights"), args)), **kwargs}


def _bounds(module, idx: torch.Tensor, offsets: torch.Tensor) -> tuple:
    """(starts, ends) of the bags of a 1-d input: bag b is idx[starts[b]:ends[b]] (empty where they are equal)."""
    if module.include_last_offset:
        return offsets[:-1], offsets[1:]
    return offsets, torch.cat([offsets[1:], offsets.new_tensor([idx.numel()])])


def _offset_bags(module, call):
    """(indices, offsets, per_sample_weights) of a call with bags given by offsets (a 1-d input), else None."""
    given = _bag_given(call)
    idx, offsets = given.get("input"), given.get("offsets")
    if isinstance(idx, torch.Tensor) and idx.dim() == 1 and isinstance(offsets, torch.Tensor) and offsets.dim() == 1:
        return idx, offsets, given.get("per_sample_weights")
    return None


def _bag_split(module, call):
    """A call with bags given by offsets holds one sample per bag: len(offsets) of them (one fewer with
    include_last_offset); sample b's call is its bag alone (offsets [0]), its per_sample_weights, its output row."""
    found = _offset_bags(module, call)
    if found is None:
        return None
    idx, offsets, psw = found
    starts, ends = (t.tolist() for t in _bounds(module, idx, offsets))
    delta = call.deltas[0] if call.deltas else None

    def one(b: int):
        s, e = starts[b], ends[b]
        kwargs = {"offsets": offsets.new_tensor([0, e - s] if module.include_last_offset else [0])}
        if psw is not None:
            kwargs["per_sample_weights"] = psw[s:e]
        return (idx[s:e],), kwargs, [None if delta is None else delta[b:b + 1]]

    return generic.Samples(len(starts), one)


def _padded_bags(module, call, B: int) -> tuple:
    """(bags (B, L) of indices, which entries are in a bag (B, L), per_sample_weights (B, L) or None, and the call's
    indices, offsets and include_last_offset as F.embedding_bag passes them to its kernel (1-d; a 2-d input's
    include_last_offset is ignored)): a 2-d input's rows, or bags given by offsets padded to the longest (an empty bag
    has no entry). Raises generic.NotApplicable for another call."""
    given = _bag_given(call)
    idx, psw = given.get("input"), given.get("per_sample_weights")
    if isinstance(idx, torch.Tensor) and idx.dim() == 2 and given.get("offsets") is None:
        L = idx.shape[1]
        offsets = torch.arange(0, idx.numel(), L, dtype=idx.dtype, device=idx.device)
        return idx, torch.ones(idx.shape, dtype=torch.bool, device=idx.device), psw, (idx.reshape(-1), offsets, False)
    found = _offset_bags(module, call)
    if found is None:
        raise generic.NotApplicable("not a 2-d input nor bags given by offsets")
    idx, offsets, psw = found
    starts, ends = _bounds(module, idx, offsets)
    lengths = ends - starts
    L = max(int(lengths.max()), 1) if len(lengths) else 1
    pos = torch.arange(L, device=idx.device)
    inside = pos < lengths.unsqueeze(1)
    at = (starts.unsqueeze(1) + pos).clamp(max=max(idx.numel() - 1, 0))
    bags = torch.where(inside, idx[at], 0) if idx.numel() else torch.zeros(inside.shape, dtype=idx.dtype)
    if psw is not None:
        psw = torch.where(inside, psw[at], 0) if idx.numel() else torch.zeros(inside.shape, dtype=psw.dtype)
    return bags, inside, psw, (idx, offsets, module.include_last_offset)


def bag_factors(module: nn.EmbeddingBag, call, names: list, B: int) -> tuple:
    """(name -> Factor, the code path's key) of one call with one bag per sample (a 2-D input's rows, or bags given
    by offsets, include_last_offset and empty bags too), one token per entry of a bag. Modes "sum"
    (per_sample_weights too) and "mean": row idx_i of W.grad gets c_i δ_b for each entry i of bag b, with c_i the
    entry's weight (1, or its per_sample_weight), 0 at padding_idx, over the bag's non-padding count in mean mode.
    Mode "max": per feature f, the row the bag's maximum took (the kernel's own choice, ties included:
    _torch.layers.bag_max_rows) gets δ_bf, at the first entry of the bag that holds that row. Raises
    generic.NotApplicable for any other call (scale_grad_by_freq, max_norm, other parameters)."""
    if module.scale_grad_by_freq or module.max_norm is not None:
        raise generic.NotApplicable("scale_grad_by_freq or max_norm")
    if list(names) != ["weight"]:
        raise generic.NotApplicable("other parameters")
    bags, kept, psw, flat = _padded_bags(module, call, B)
    delta = call.deltas[0] if call.deltas else None
    if bags.shape[0] != B or delta is None or tuple(delta.shape) != (B, module.embedding_dim):
        raise generic.NotApplicable("not one bag per sample, or another output gradient")
    if module.padding_idx is not None:
        kept = kept & (bags != module.padding_idx)
    if module.mode == "max":
        rows = bag_max_rows(call.params["weight"], *flat, module.padding_idx)
        L = bags.shape[1]
        earlier = torch.ones(L, L, dtype=torch.bool, device=bags.device).tril(-1)  # t' < t
        repeat = ((bags.unsqueeze(2) == bags.unsqueeze(1)) & earlier & kept.unsqueeze(1)).any(2)
        first = kept & ~repeat  # the first entry of each row in its bag: a row the max took gets δ once
        took = (bags.unsqueeze(2) == rows.unsqueeze(1)) & first.unsqueeze(2)  # (B, L, d)
        D = took.to(delta.dtype) * delta.unsqueeze(1)
    else:
        c = kept.to(delta.dtype) if psw is None else psw.to(delta.dtype) * kept
        if module.mode == "mean":
            c = c / kept.sum(1, keepdim=True).clamp_min(1)
        D = c.unsqueeze(-1) * delta.unsqueeze(1)
    f = Factor("weight", "onehot", D, bags, tuple(module.weight.shape), rows=module.num_embeddings)
    key = ("bag", module.mode, psw is not None, module.padding_idx is not None, flat[2],
           _bag_given(call)["input"].dim(), tuple(bags.shape))
    return {"weight": f}, key


generic.FAST_RULES.append((_plain_bag, bag_factors))
generic.SPLITS.append((_plain_bag, _bag_split))


# -- any other nn.Embedding subclass with a forward of its own (T5Gemma2's word embedding, BART's positions) -------
# The generic rule serves it (its forward is not nn.Embedding's), by vmap of its vjp: per-sample gradients of the
# whole (vocabulary, d) table, B of them, over the memory budget for a real vocabulary. Where its forward looks its
# weight up once (F.embedding), the gradient that arrives at that lookup gives its rows as nn.Embedding's rule does:
# row idx_t of W.grad gets that gradient at t. One backward of the batch; checked as every fast rule is.
class _Lookups(TorchFunctionMode):
    """Active around one rerun of the forward: the (indices, output) of each F.embedding call on `weight`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight, self.found = weight, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.embedding:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is self.weight:
                self.found.append((args[0] if args else kwargs.get("input"), out))
        return out


def _own_forward_embedding(module) -> bool:
    return isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward


def lookup_factors(module: nn.Embedding, call, names: list, B: int) -> tuple:
    """(name -> Factor (onehot), the code path's key) from the gradient arriving at the forward's one lookup of the
    weight; raises generic.NotApplicable (scale_grad_by_freq, max_norm, other parameters, no single lookup)."""
    if module.scale_grad_by_freq or module.max_norm is not None or list(names) != ["weight"]:
        raise generic.NotApplicable("scale_grad_by_freq, max_norm or other parameters")
    prep = generic._prepare(module, call, list(names), B)
    xs = [prep.leaves[i] for i in prep.batched]
    weight = call.params["weight"].detach().requires_grad_()
    lookups = _Lookups(weight)
    with generic.batch_rerun(module, call, prep, {"weight": weight}, xs, lookups) as outs:
        if len(lookups.found) != 1:
            raise generic.NotApplicable("not one lookup of the weight")
        idx, looked = lookups.found[0]
        if not idx.dim() or idx.shape[0] != B:
            raise generic.NotApplicable("indices without the batch first")
        (arrived,) = torch.autograd.grad(outs, [looked], prep.cots, allow_unused=True)
    if arrived is None:
        raise generic.NotApplicable("no gradient reached the lookup")
    f = embedding(module, idx, arrived)[0]  # nn.Embedding's rule: padding rows get nothing
    return {"weight": f}, ("lookup", tuple(idx.shape), tuple(tuple(c.shape) for c in prep.cots))


generic.FAST_RULES.append((_own_forward_embedding, lookup_factors))
