"""Which rows of a call are samples: the batch size of each step, inputs folded from the batch, (1, ...) outputs
added to a batch, calls whose samples capture proved in another dim than the first (moved to the front for the
rule), and layers whose samples no proof places (left out, and named with what they received and the fix).

Floor: analysis. Imports layers/ and analysis.facts.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict

from hookwidget._torch.layers import is_conv
from hookwidget.analysis.facts import allclose_grad, own_trainable, owned_params, step_indices
from hookwidget.layers import factors as fx
from hookwidget.layers.batch_first import samples_first, states_own
from hookwidget.record.notes import refusal


def batched_call(trace, call, module=None):
    """The call as its samples saw it: a position table's (1, ...) output added to a batch gets each sample's δ
    (call.bdelta) and its input repeated per sample; samples folded into rows are unfolded; samples proven in
    another dim are moved to the front (time-major (T, B, d) as (B, T, d)); any other call as it is."""
    bd = broadcast_delta(trace, call)
    if bd is None:
        B = _fold(trace, call, module)
        if B is None and call.sample_dim and module is not None:
            return samples_first(call, module) or call
        if B is None or not fx.spec_for(module).tokens:  # other folded layers: their factors' rows are grouped
            return call
        return fx.unfolded(call, B) or call
    out = copy.copy(call)
    out.delta = bd
    if call.a is not None and bd.dim() > call.delta.dim():  # (T, d) added to (B, T, d): a new leading dimension
        out.a = call.a.expand(bd.shape[0], *call.a.shape)
    elif call.a is not None and call.a.dim() and call.a.shape[0] == 1:
        out.a = call.a.expand(bd.shape[0], *call.a.shape[1:])
    if call.deltas is not None and call.out_first >= 0:
        out.deltas = list(call.deltas)
        out.deltas[call.out_first] = bd
    return out


def broadcast_delta(trace, call):
    """Each sample's δ of a call whose output (1, ...) was added to a batch, where autograd's sum of it over
    the samples is the call's δ (so the rows are exact), else None."""
    if call.bdelta is None or call.delta is None:
        return None
    cache = trace.facts
    key = ("bdelta", id(call))
    if key not in cache:
        summed = call.bdelta.sum(0, keepdim=call.bdelta.dim() == call.delta.dim())
        cache[key] = call.bdelta if allclose_grad(summed, call.delta) else None
    return cache[key]


def _fold(trace, call, module) -> int | None:
    """The batch size B where the call's input holds the model's batch folded into rows sample-major ((B, T, d)
    viewed as (B·T, d), as OPT does; MobileViT's patches; capture proves it: rows.py), so that sample b owns rows
    b·n/B … (b+1)·n/B − 1, and the layer's rule can be unfolded: it treats rows as tokens (its a and δ are
    unfolded, batched_call), or its factors are token sums that its rows' can be grouped into (fx.grouped_rows:
    BatchNorm1d over LeViT's tokens). Else None."""
    B = call.folded_from
    if B is None or module is None or call.a is None or call.delta is None or not call.a.dim():
        return None
    n = call.a.shape[0]
    if n % B or call.delta.shape[:1] != (n,) or B != model_batches(trace).get(call.step):
        return None
    spec = fx.spec_for(module)
    return B if spec is not None and (spec.tokens or not is_conv(module)) else None  # a conv's are not token sums


def _lead(trace, call, module=None) -> int | None:
    """How many samples the call's input holds as its rule will see them (see batched_call): the size of the dim
    capture proved to hold them, or of the rows they are folded into; None where no proof places them (a size
    that matches the batch is not a proof)."""
    bd = broadcast_delta(trace, call) if call.bdelta is not None else None
    if bd is not None:
        return bd.shape[0]
    B = _fold(trace, call, module) if call.folded_from is not None else None
    if B is not None:
        return B
    d = call.sample_dim
    if d is None or call.a is None or d and samples_first(call, module) is None:
        return None
    return call.a.shape[d]


def step_batch_size(trace, k: int) -> int | None:
    """The batch size the exact-rule layers of step k agree on (the most common leading dimension; with
    capture="norms", the one the streamed norms have)."""
    if trace.record.norms is not None:
        sq = trace.record.norms[k][0] if k < len(trace.record.norms) else None
        return None if sq is None else sq.shape[0]
    return _batch_of(_leads(trace, k), model_batches(trace).get(k))


def _exact_layers(trace, k: int) -> list[str]:
    """factor_layers(trace, k) of exact (a, δ) rules only (no generic check runs)."""
    if trace.record.no_factors:
        return []
    out = []
    for n, layer in trace.layers.items():
        module = layer.module
        if fx.unsupported_reason(module) or fx.is_generic(module) or not owned_params(trace, n):
            continue
        calls = [c for c in layer.calls if c.step == k]
        if calls and all(c.a is not None and c.delta is not None for c in calls):
            out.append(n)
    return out


def _leads(trace, k: int) -> dict:
    """Exact-rule layer -> the leading dimension of its first input in step k."""
    lead = {}
    for n in _exact_layers(trace, k):
        lead[n] = _lead(trace, next(c for c in trace.layers[n].calls if c.step == k), trace.layers[n].module)
    return lead


def unbatched(trace, k: int) -> dict:
    """Layers whose input's leading dimension in step k is not the batch size most layers agree on,
    e.g. a positional embedding called on arange(T): their gradient is already summed over the batch."""
    return _odd_ones(_leads(trace, k), model_batches(trace).get(k))


def unbatched_by_step(trace, eligible=None) -> dict:
    """unbatched(trace, k) of every step k, in one pass over the calls (a loop of many steps
    would otherwise walk every call once per step). `eligible`: the names of the layers with own
    trainable parameters and a factor rule, where the caller knows them already."""
    if trace.record.no_factors:
        return {}
    layers = trace.layers
    if eligible is None:
        eligible = [n for n, layer in layers.items() if own_trainable(trace, n)
                    and not fx.unsupported_reason(layer.module) and not fx.is_generic(layer.module)]
    lead: dict = defaultdict(dict)  # step -> layer -> leading dimension of its first call's input
    for n in eligible:
        calls = layers[n].calls
        if len(calls) == 1:
            by_step = {calls[0].step: calls} if calls[0].step is not None else {}
        else:
            by_step = {}
            for c in calls:
                if c.step is not None:
                    by_step.setdefault(c.step, []).append(c)
        for k, cs in by_step.items():
            if all(c.a is not None and c.delta is not None for c in cs):
                lead[k][n] = _lead(trace, cs[0], layers[n].module)
    model = model_batches(trace)
    out = {k: _odd_ones(ls, model.get(k)) for k, ls in lead.items()}
    return {k: v for k, v in out.items() if v}


def model_batches(trace) -> dict:
    """Step -> the batch size the model was called with: the leading dimension of the first input of the
    outermost module calls that step reached (most common, where the cell calls several)."""
    cache = trace.facts
    if "model_batches" not in cache:
        counts: dict = defaultdict(Counter)
        for layer in trace.layers.values():
            for c in layer.calls:
                if c.batch is not None and c.step is not None:
                    counts[c.step][c.batch] += 1
        cache["model_batches"] = {k: cs.most_common(1)[0][0] for k, cs in counts.items()}
    return cache["model_batches"]


def _batch_of(lead: dict, model_batch: int | None) -> int | None:
    """The batch size: the model's input's along its batch dim (the one every proof starts from)."""
    return model_batch


def _odd_ones(lead: dict, model_batch: int | None = None) -> dict:
    return {n: (b, model_batch) for n, b in lead.items() if b is None or b != model_batch}


def check_batched(trace, name: str, step: int | None) -> None:
    """One line where the layer's samples are not placed in a selected step: what it received, and the fix."""
    check_samples(trace, step)
    for k in step_indices(trace, step):
        if name in unbatched(trace, k):
            raise ValueError(f"layer {name!r}: {unplaced_reason(trace, name, k)}")


def unplaced_reason(trace, name: str, k: int) -> str:
    """Why no per-sample result of the layer in step k: what it received, and how to make its samples provable."""
    layer = trace.layers[name]
    call = next((c for c in layer.calls if c.step == k), None)
    B = model_batches(trace).get(k)
    shape = None if call is None else tuple(call.a.shape) if call.a is not None else call.in_shape
    got = f"its input {shape}" if shape is not None else "its input"
    if B is None:
        return (f"{got}: the model's input has no batch dim to follow (an unbatched call); trace the model on a "
                "batch, or name its batch dim: hw.trace(..., batch_dim=N)")
    if call is not None and call.sample_dim is not None:
        return (f"{got} holds the {B} samples in dim {call.sample_dim}, where its {type(layer.module).__name__} "
                "rule needs them first; call it with the batch first")
    stating = _stating(trace, k)
    if stating:
        return (f"{got} holds none of the {B} samples of the model's input in a proven dim (a matching size is no "
                f"proof): the samples that {', '.join(stating[:3])} state (sequences of a PackedSequence, bags given "
                "by offsets) are followed from an nn.EmbeddingBag's bags (dim 0) and a recurrent layer's h_n and c_n "
                "(dim 1, torch's own forward) only, not through a recurrent forward of a module's own nor "
                "pad_packed_sequence's output; to make it provable, compute its input from those (the final state "
                "h_n, say), or give the recurrent layer torch's own forward")
    return (f"{got} holds none of the {B} samples of the model's input in a proven dim (a matching size is no "
            "proof): a table called on positions has its gradient summed over the batch already; to make it "
            "provable, feed it the model's input through views or graph ops, or declare the input's batch dim: "
            "hw.trace(..., batch_dim=N)")


def _stating(trace, k: int) -> list[str]:
    """The layers of step k called on arguments that state their samples (call.stated: capture/samples.py)."""
    return [n for n, layer in trace.layers.items() if states_own(layer.module)
            and any(c.step == k and c.stated is not None for c in layer.calls)]


def check_samples(trace, step: int | None) -> None:
    """One line where per-sample results have no meaning: a module's own batch_first contradicts the dim the
    model input's samples reached it in (capture's note), or a selected step's batch holds no sample."""
    bad = [n for n in trace.record.notes if n.id == "batch_dim_contradicted"]
    if bad:
        raise ValueError(refusal(bad, "per-sample gradients", ""))
    batches = model_batches(trace)
    for k in step_indices(trace, step):
        if batches.get(k) == 0:
            raise ValueError(f"step {k}: the model's batch is empty (0 samples along its batch dim): no per-sample "
                             "gradient to give; trace a batch of at least one sample")
