"""The generic rule's rows, checked: exact or absent.

A layer without an exact (a, δ) rule gets its per-sample gradients from layers/generic.py (a fast rule
where one applies: nn.MultiheadAttention's factors, a model's own (1, ...) parameters; else vmap of the
module's own vjp). They are used only after they add up to the gradient the step made; per_sample.py asks
generic_rows and gets the rows or a facts.Refusal saying why there are none.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter

import torch

from hookwidget.analysis import batches, facts
from hookwidget.analysis.facts import Refusal
from hookwidget.layers import factors as fx
from hookwidget.layers import freivalds, generic
from hookwidget.layers.batch_first import declared_batch_dim


def generic_rows(trace, name: str, k: int) -> dict | Refusal:
    """Parameter name -> (B, *shape) per-sample gradients of a generic-rule layer in step k, or why not (a
    Refusal). Used only after the check: their sum over samples and calls equals the gradient the step made
    (the step's .grad where the layer is the parameter's only holder and that matches, else a full-batch vjp
    of the same calls). Cached per (layer, step)."""
    cache = trace.facts
    key = ("rows", name, k)
    if key not in cache:
        cache[key] = _generic_rows(trace, name, k)
    return cache[key]


def _generic_rows(trace, name: str, k: int) -> dict | Refusal:
    module = trace.layers[name].module
    calls = [c for c in trace.layers[name].calls if c.step == k]
    if not calls:
        return Refusal(f"no backward reached it in step {k}")
    misplaced = _misplaced(trace, name, module, calls)
    if misplaced is not None:
        return Refusal(misplaced)
    calls = [batches.batched_call(trace, c) for c in calls]
    why = next((generic.missing(c) for c in calls if generic.missing(c)), None)
    if why:
        return Refusal(why)
    owned = facts.owned_params(trace, name)
    canonical = {id(p): n for n, p in module.named_parameters()}
    names = {pn: canonical[id(p)] for pn, p in owned.items()}
    B = _stated(trace, module, calls, k)
    if isinstance(B, Refusal):
        return B
    B = B or batches.step_batch_size(trace, k) or generic.batch_size_hint(module, calls[0].inputs)
    if not B:
        return Refusal("its inputs have no batch dimension")
    size = B * sum(p.numel() * p.element_size() for p in owned.values())
    budget = float(trace.session.options.budget_mb) * 2**20
    fast = _fast_rows(module, calls, names, B)
    if fast is not None and (size <= budget or all(f.kind != "dense" for f in fast.values())):
        why = _check_rows(trace, name, module, calls, names, owned, B, k, fast)
        if why is None:  # else the vmap rule answers (and names what is wrong where it is refused too)
            return fast
    if size > budget:
        return Refusal(f"its per-sample gradients would take {size / 2**20:.0f} MB (batch {B}), over budget_mb="
                       f"{budget / 2**20:g}; raise budget_mb to have them")
    try:
        rows = _sum_calls(generic.per_sample(module, c, list(names.values()), B) for c in calls)
        rows = {pn: rows[cn] for pn, cn in names.items()}
    except generic.Refused as e:
        return Refusal(str(e))
    except Exception as e:  # noqa: BLE001  (the module changed since the call, say: named, never raised at attach)
        return Refusal(f"the generic rule could not rerun it: {generic.first_line(e)}")
    why = _check_rows(trace, name, module, calls, names, owned, B, k, rows)
    return rows if why is None else Refusal(why)


def _stated(trace, module, calls: list, k: int) -> int | Refusal | None:
    """The number of samples the calls' arguments state themselves (bags given by offsets, a PackedSequence:
    generic.SPLITS), where they do; a Refusal where calls disagree, or disagree with the step's batch: the one its
    exact-rule layers have, else the one most layers that state theirs agree on (rows of different counts are not
    the same samples, and their norms could not be added)."""
    stated = {s.n for s in (generic.samples_of(module, c) for c in calls) if s is not None}
    if not stated:
        return None
    what = "bags given by offsets, or sequences of a PackedSequence"
    if len(stated) > 1:
        return Refusal(f"its calls hold {' and '.join(map(str, sorted(stated)))} samples ({what}): not one batch")
    n, batch = stated.pop(), batches.step_batch_size(trace, k)
    if batch is None:
        counts = _stated_counts(trace, k).most_common(2)
        if len(counts) > 1 and counts[0][1] == counts[1][1]:
            return Refusal(f"its call holds {n} samples ({what}) and as many layers of the step state another "
                           f"number ({' and '.join(str(c) for c, _ in counts)}): which rows are the samples is "
                           "not known")
        batch = counts[0][0]
    if n != batch:
        return Refusal(f"its call holds {n} samples ({what}) where the step's other layers see a batch of {batch} "
                       "(several bags or sequences per sample?): its rows are not their samples")
    return n


def _stated_counts(trace, k: int) -> Counter:
    """How many generic-rule layers of step k state each number of samples (cached per trace and step)."""
    key = ("stated", k)
    if key not in trace.facts:
        counts = Counter()
        for layer in trace.layers.values():
            if fx.is_generic(layer.module):
                for c in layer.calls:
                    if c.step == k and generic.missing(c) is None:
                        found = generic.samples_of(layer.module, c)
                        if found is not None:
                            counts[found.n] += 1
        trace.facts[key] = counts
    return trace.facts[key]


def _misplaced(trace, name: str, module, calls) -> str | None:
    """Why the generic rule cannot take these calls' samples where it takes them (dim 0 of its input, or the
    module's batch_first), or None: capture proved them elsewhere, or nowhere (a call whose (1, ...) output is
    added to the batch gets each sample's δ instead: batches.broadcast_delta). A call whose arguments state its
    samples (a PackedSequence, bags by offsets: call.stated) is not placed by a dim: _stated checks its count."""
    want = declared_batch_dim(module) or 0
    for c in calls:
        if c.stated is not None or c.sample_dim == want or c.sample_dim is None and c.in_shape is None or \
                batches.broadcast_delta(trace, c) is not None:
            continue
        if c.sample_dim is None:
            return batches.unplaced_reason(trace, name, c.step)
        return (f"its input {c.in_shape} holds the samples in dim {c.sample_dim}, where the generic rule takes them "
                f"in dim {want}")
    return None


def _check_rows(trace, name, module, calls, names, owned, B, k, rows) -> str | None:
    """None where the per-sample rows add up to the gradient the step made (the step's .grad where the layer is
    the parameter's only holder and that matches, else a full-batch vjp of the same calls), else why not."""
    try:
        full, matched = None, []
        for pn, g in rows.items():
            if _only_holder(trace, owned[pn], name):
                made = facts.step_grad(trace, owned[pn], k)
                if made is not None and _adds_up(g, made):
                    matched.append(("complete", id(owned[pn]), k, (id(g.D if isinstance(g, fx.Factor) else g),)))
                    continue
            if full is None:
                full = _sum_calls(generic.full_batch(module, c, list(names.values()), B) for c in calls)
            want = full[names[pn]]
            if not _adds_up(g, want):
                summed = _summed(g)
                rel = float((summed - want).abs().max() / want.abs().max().clamp_min(1e-30))
                return (f"{type(module).__name__} {generic.MIXES} (their sum differs from the batch's gradient of "
                        f"{pn} by {rel:.1e} relative)")
    except generic.Refused as e:
        return str(e)
    except Exception as e:  # noqa: BLE001  (the module changed since the call, say: named, never raised at attach)
        return f"the generic rule could not rerun it: {generic.first_line(e)}"
    trace.facts.update(dict.fromkeys(matched, True))  # _complete: these rows rebuild .grad (cached too)
    return None


def _only_holder(trace, p, name: str) -> bool:
    """Whether layer `name` is the one layer that holds p, parametrization containers aside: weight_norm's holds the
    conv's g and v but adds to their .grad only through the conv's forward, which the conv's rows cover."""
    holders = facts.param_holders(trace).get(id(p), ())
    return [h for h in holders if not generic.is_parametrization(trace.layers[h].module)] == [name]


# (fast rule, code-path key, id) -> weak reference to the module whose rows matched a sample rerun alone (_fast_rows):
# verified per module (its class, its configuration) and code path, never for another module at the same address
_VERIFIED: dict = {}


def _fast_rows(module, calls: list, names: dict, B: int):
    """Parameter name -> Factor from a fast rule (generic.FAST_RULES: token factors or rows from one full-batch
    backward: nn.MultiheadAttention, a model's own (1, ...) parameters) that covers this call; else None (the vmap
    rule answers). Besides the check in _generic_rows (rows add up to the step's gradient, every call), the first
    call of each module and code path the rule names (its key: layout, masks, shapes, which parameters) has one
    sample's rows (the middle one) compared with the gradient of the module's forward rerun on that sample alone: a
    sum does not see tokens of several samples mixed up by a wrong layout, and such a mix-up would be the code
    path's, the same on every call."""
    if len(calls) != 1:
        return None
    for rule in generic.fast_rules(module):
        rows = _fast_rule_rows(rule, module, calls[0], names, B)
        if rows is not None:
            return rows
    return None


def _renamed(f, param: str):
    """The fast rule's factor under the name the trace gives its parameter."""
    return fx.Factor(param, f.kind, f.D, f._X, f.shape, f.rows, f.conv, f.per_sample, back=f.back)


def _sample(f, b: int):
    """Factor f of sample b alone (a convolution's call cut to that sample too)."""
    conv = None if f.conv is None else dataclasses.replace(f.conv, a=f.conv.a[b:b + 1], delta=f.conv.delta[b:b + 1])
    return fx.Factor(f.param, f.kind, f.D[b:b + 1], None if f._X is None else f._X[b:b + 1], f.shape, f.rows, conv,
                     back=f.back)


def _fast_rule_rows(rule, module, call, names: dict, B: int):
    try:
        facs, key = rule(module, call, list(names.values()), B)
        rows = {pn: _renamed(facs[cn], pn) for pn, cn in names.items()}
        seen = _VERIFIED.get((rule, key, id(module)))
        if seen is None or seen() is not module:
            b = B // 2
            want = generic.one_sample(module, call, list(names.values()), B, b)
            for pn, cn in names.items():
                f = rows[pn]
                if not _adds_up(_sample(f, b), want[cn]):
                    return None
            if B > 1:
                if len(_VERIFIED) > 4096:  # forget modules that are gone
                    for k in [k for k, r in _VERIFIED.items() if r() is None]:
                        del _VERIFIED[k]
                _VERIFIED[(rule, key, id(module))] = weakref.ref(module)
    except generic.NotApplicable:
        return None
    except Exception:  # noqa: BLE001  (the vmap rule decides, and names the reason where it fails too)
        return None
    return rows


def _sum_calls(parts) -> dict:
    total = None
    for g in parts:
        total = dict(g) if total is None else {n: total[n] + g[n] for n in total}
    return total


def _summed(g) -> torch.Tensor:
    return fx.summed_grad(g) if isinstance(g, fx.Factor) else g.sum(0)


def _adds_up(g, want: torch.Tensor) -> bool:
    """Whether per-sample rows (a tensor, or a fast rule's Factor) add up to `want` (factors_add_up)."""
    if isinstance(g, fx.Factor):
        return factors_add_up([g], want)
    return facts.allclose_grad(_summed(g), want)


def factors_add_up(fs: list, want: torch.Tensor) -> bool:
    """Whether the factors' summed gradients add up to `want`: along random directions where every factor allows
    it (layers/freivalds.py: no rebuilt gradient, no full-size comparison), else summed and compared whole."""
    if not projectable(fs, want):
        return facts.allclose_grad(sum(_summed(f) for f in fs), want)
    return freivalds.adds_up(fs, want)


def projectable(fs: list, want: torch.Tensor) -> bool:
    """Whether factors_add_up checks these factors along random directions (cheap) rather than whole."""
    return not want.is_sparse and all(isinstance(f, fx.Factor) and freivalds.projectable(f, tuple(want.shape),
                                                                                         want.dtype) for f in fs)
