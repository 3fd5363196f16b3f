"""Where a layer keeps its samples, as the layer declares it: capture (capture/samples.py) takes an output's batch
dimension from here where the graph cannot show it (a layer on the batch's data, which autograd does not see),
and per_sample's rules move that dimension to the front only where the layer's rule allows it (feature_dims).

Floor: layers."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from hookwidget.layers import registry

# modules whose batch dimension is a constructor argument (batch_first: 0, else 1; torch's default is 1)
_BATCH_FIRST = (nn.RNNBase, nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
                nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def declared_batch_dim(module: nn.Module) -> int | None:
    """The dim of its input (and first output) that the module declares holds the batch: 0 or 1 for the modules
    taking batch_first; None for any other, or where it cannot be read (its batch is where its input's is)."""
    if not isinstance(module, _BATCH_FIRST):
        return None
    first = _batch_first(module)
    return None if first is None else 0 if first else 1


def _batch_first(module: nn.Module):
    """batch_first as the module keeps it: its own (RNN, attention, Transformer), its attention's (a Transformer
    layer), its first layer's (a Transformer stack); None where none is found."""
    first = getattr(module, "batch_first", None)
    if first is None and isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        first = getattr(getattr(module, "self_attn", None), "batch_first", None)
    if first is None and isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(module.layers):
        first = _batch_first(module.layers[0])
    return first if isinstance(first, bool) else None


def feature_dims(module: nn.Module, a) -> int | None:
    """How many trailing dims of the input a token layer's rule treats as features (every other dim is a token
    or the batch): 1 for Linear, 0 for Embedding's ids, the normalized dims of a layer norm; None for a layer
    whose rule is not over tokens (its batch must lead)."""
    spec = registry.spec_for(module)
    if spec is None or not spec.tokens:
        return None
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return len(shape) if isinstance(shape, (tuple, list)) else 1
    return 0 if not a.is_floating_point() and not a.is_complex() else 1


def elementwise(module: nn.Module) -> bool:
    """Whether the module is an elementwise activation (or Dropout, Identity): its output is laid out as its input."""
    return registry.spec_for(module) is None and registry.keeps_rows(module)


def movable(module: nn.Module, d: int, a) -> bool:
    """Whether the layer's rule takes its samples from dim d of its input a once moved to the front: d is 0, or
    the rule is over tokens and d is none of its feature dims."""
    if d == 0:
        return True
    features = feature_dims(module, a)
    return features is not None and d < a.dim() - features


def samples_first(call, module: nn.Module):
    """The call as its rule takes it: samples in dim 0 of a and δ. A call whose samples capture proved in another
    dim (call.sample_dim, capture/samples.py) gets a copy with that dim moved to the front, where the rule is over
    tokens and the dim is not a feature dim; None where it cannot be (a convolution's batch must lead). A call
    already so, or without a or δ, as it is."""
    d = call.sample_dim
    if not d or call.a is None or call.delta is None:
        return call
    if not movable(module, d, call.a) or d >= call.delta.dim():
        return None
    out = copy.copy(call)
    out.a, out.delta = call.a.movedim(d, 0), call.delta.movedim(d, 0)
    out.sample_dim = 0
    return out


def generic_rule(module: nn.Module) -> bool:
    """Whether the generic torch.func rule serves the module: it takes each sample as dim 0 of its input and output."""
    return registry.is_generic(module)


def stated_samples(module: nn.Module, args, kwargs) -> int | None:
    """How many samples the call's input states itself, or None: a PackedSequence (its first argument, to any
    module) holds batch_sizes[0] sequences; an nn.EmbeddingBag called on a 1-d input with 1-d offsets, one bag per
    offset (one fewer with include_last_offset). A count read from what the arguments mean, never from a size that
    matches. A few isinstance checks per call: the hot path."""
    x = args[0] if args else kwargs.get("input") if kwargs else None
    if isinstance(x, PackedSequence):
        return int(x.batch_sizes[0]) if len(x.batch_sizes) else 0
    if isinstance(module, nn.EmbeddingBag) and isinstance(x, torch.Tensor) and x.dim() == 1:
        offsets = args[1] if args and len(args) > 1 else kwargs.get("offsets") if kwargs else None
        if isinstance(offsets, torch.Tensor) and offsets.dim() == 1:
            return max(len(offsets) - bool(module.include_last_offset), 0)
    return None


_RNN_FORWARDS = (nn.LSTM.forward, nn.GRU.forward, nn.RNN.forward)


def stated_outputs(module: nn.Module, output) -> list:
    """(tensor, dim) of a stating call's outputs whose samples' place is known for sure (torch's own forward, not a
    subclass's): an EmbeddingBag's (n_bags, d), samples along dim 0; an RNN's h_n (and c_n) on a PackedSequence,
    (layers·dirs, n, H), samples along dim 1 in the user's order (torch's forward puts them back in it by
    unsorted_indices). Its output PackedSequence is no tensor: what pad_packed_sequence makes of it is not followed
    (rows.py knows none of its ops), so a layer on it is left out, with a note."""
    if isinstance(module, nn.EmbeddingBag):
        if type(module).forward is nn.EmbeddingBag.forward and isinstance(output, torch.Tensor) and output.dim() == 2:
            return [(output, 0)]
        return []
    if isinstance(module, nn.RNNBase) and type(module).forward in _RNN_FORWARDS and isinstance(output, tuple) and \
            len(output) == 2 and isinstance(output[0], PackedSequence):
        states = output[1] if isinstance(output[1], tuple) else (output[1],)
        return [(h, 1) for h in states if isinstance(h, torch.Tensor) and h.dim() == 3]
    return []


def states_own(module: nn.Module) -> bool:
    """Whether the module is itself a layer whose arguments state its samples (a recurrent layer, an EmbeddingBag):
    called outermost, its count is its own, for per_sample's check against the step's batch, not the model's."""
    return isinstance(module, (nn.RNNBase, nn.EmbeddingBag))
