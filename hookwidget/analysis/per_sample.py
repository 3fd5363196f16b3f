"""Factor queries on a Trace: W.grad rebuilt from (a, δ), per-sample gradients and their norms.

A layer's calls are grouped by the backward pass (step) that brought them their δ. Calls of one
step see the same samples (a layer reused inside one forward adds tokens); calls of different
steps see different samples (micro-batches), so per-sample rows are stacked step after step.
Calls that got no δ (a forward-only call) belong to no step and take part in nothing.

A layer without an exact (a, δ) rule gets the generic torch.func rule (layers/generic.py): its per-sample
gradients are used only after they add up to the gradient the step made (generic_rows); coverage_gap is
the one place that decides whether a parameter's per-sample gradients are whole, for the norms and for
the note that names what they leave out.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hookwidget.analysis.batches import (
    _fold,
    batched_call,
    check_batched,
    check_samples,
    unbatched,
    unbatched_by_step,
    unplaced_reason,
)
from hookwidget.analysis.facts import (
    Refusal,
    answering_holders,
    owned_params,
    param_holders,
    step_grad,
    step_indices,
)
from hookwidget.analysis.generic import factors_add_up, generic_rows, projectable
from hookwidget.layers import factors as fx
from hookwidget.layers import generic
from hookwidget.record.notes import refusal


def call_groups(trace, name: str, step: int | None) -> list[list]:
    """The layer's calls per selected step, steps in order, checked for what its rule needs."""
    layer = trace.layer(name)
    reason = fx.unsupported_reason(layer.module)
    if reason:
        types = fx.supported_types()  # a few of them: the line stays short
        few = [t for t in ("Linear", "Conv2d", "Embedding", "LayerNorm") if t in types] or types[:4]
        raise ValueError(f"layer {name!r}: {reason}; supported types: {', '.join(few)} and {len(types) - len(few)} "
                         "more (and, with capture='full', the generic torch.func rule for other modules with "
                         "parameters)")
    if trace.record.no_factors:
        raise ValueError(f"layer {name!r}: {trace.record.no_factors}")
    is_generic = fx.is_generic(layer.module)
    groups = []
    for k in step_indices(trace, step):
        calls = [c for c in layer.calls if c.step == k]
        if is_generic:
            missing = [c.index for c in calls if generic.missing(c)]
        else:
            missing = [c.index for c in calls if c.a is None or c.delta is None]
        if missing:
            why = "; ".join(trace.notes) or "not kept"
            what = "inputs, parameters or output gradients" if is_generic else "a or δ"
            raise ValueError(f"layer {name!r}: {what} not kept for call(s) {missing} ({why})")
        if calls:
            groups.append(calls)
    if not groups:
        which = f"step {step}" if step is not None else "any backward pass"
        raise ValueError(f"layer {name!r}: no backward reached it in {which} (forward-only calls have no δ)")
    return groups


def param_factors(trace, name: str, param: str, step: int | None) -> list[fx.Factor]:
    """One Factor of `param` per selected step."""
    out = []
    for calls in call_groups(trace, name, step):
        f = next((f for f in layer_factors(trace, name, calls) if f.param == param), None)
        if f is None:
            have = ", ".join(owned_params(trace, name)) or "none"
            raise ValueError(f"layer {name!r} has no trainable {param} (its trainable parameters: {have})")
        out.append(f)
    return out


def layer_factors(trace, name: str, calls: list) -> list[fx.Factor]:
    """The factors of every parameter the layer answers for, from its calls of one step: its exact (a, δ)
    rule's, or the generic rule's per-sample gradients (kind "dense"), once they passed the check."""
    module = trace.layers[name].module
    if not fx.is_generic(module):
        spec = fx.spec_for(module)
        grouped = [_fold(trace, c, module) if not spec.tokens else None for c in calls]
        if not any(grouped):
            return fx.factors(module, [batched_call(trace, c, module) for c in calls])
        per_call = [fx.factors(module, [batched_call(trace, c, module)]) if B is None else
                    fx.grouped_rows(fx.factors(module, [c]), B) for c, B in zip(calls, grouped)]
        return fx.merge_calls(per_call)
    rows = generic_rows(trace, name, calls[0].step)
    if isinstance(rows, Refusal):
        raise ValueError(f"layer {name!r} ({type(module).__name__}, generic torch.func rule): {rows.reason}")
    owned = owned_params(trace, name)
    return [fx._in_param_dtype(g, owned[n].dtype) if isinstance(g, fx.Factor) else
            fx.Factor(n, "dense", g.to(owned[n].dtype), None, tuple(owned[n].shape)) for n, g in rows.items()]


def _param(trace, name: str, pname: str):
    return owned_params(trace, name)[pname]


def summed_grad(trace, name: str, param: str, step: int | None) -> torch.Tensor:
    return sum(fx.summed_grad(f) for f in param_factors(trace, name, param, step))


def per_sample_grad(trace, name: str, param: str, step: int | None) -> torch.Tensor:
    check_batched(trace, name, step)
    return torch.cat([fx.per_sample_grad(f) for f in param_factors(trace, name, param, step)])


def per_sample_norms(trace, name: str | None, step: int | None) -> torch.Tensor:
    """(N,) per-sample gradient norms, N the samples of every selected step, in order."""
    steps = step_indices(trace, step)
    check_samples(trace, step)
    if name is None and trace.record.norms is not None:  # capture="norms": streamed, plus the generic rule's layers
        rows = []
        for k in steps:
            sq, extra = trace.record.norms[k][0], _generic_norm_sq(trace, k)
            sq = extra if sq is None else sq if extra is None else sq + extra
            if sq is not None:
                rows.append(sq)
        if not rows:
            raise ValueError(refusal(trace.note_records, "no per-sample norms in this trace", "no backward ran"))
        return torch.cat(rows).sqrt()
    if name is not None:
        check_batched(trace, name, step)
    rows = []
    counted = False
    for k in steps:
        names = [name] if name is not None else [n for n in factor_layers(trace, k) if n not in unbatched(trace, k)]
        if names:
            sq = _norm_sq(trace, names, k)
            counted |= isinstance(sq, torch.Tensor)
            rows.append(sq)
    if rows and not counted:
        gaps = left_out(trace) if name is None else {}
        raise ValueError(f"no parameter is left for per-sample norms: {'; '.join(f'{p}: {r}' for p, r in gaps.items())}"
                         if gaps else f"no parameter of {name!r} is whole in per-sample norms (t.per_sample_left_out)")
    if not rows:
        if trace.session.options.capture == "summary":
            raise ValueError("capture='summary' keeps statistics, not (a, δ): trace with capture='norms' (or 'full') "
                             "for per-sample gradient norms")
        raise ValueError(refusal(trace.note_records, "no layer with (a, δ) factors in this trace",
                                 "run a backward inside the trace"))
    return torch.cat(rows).sqrt()


def _generic_norm_sq(trace, k: int) -> torch.Tensor | None:
    """capture="norms": squared per-sample norms of the generic-rule layers of step k (capture streamed the
    others), over the parameters each is the only layer to answer for (a weight_norm's container holds its
    parametrized conv's parameters but answers for none; left_out names the rest)."""
    sq = None
    for n, layer in trace.layers.items():
        calls = [c for c in layer.calls if c.step == k]
        if not calls or not fx.is_generic(layer.module) or not owned_params(trace, n) or trace.record.no_factors:
            continue
        if isinstance(generic_rows(trace, n, k), Refusal):
            continue
        for f in layer_factors(trace, n, calls):
            p = _param(trace, n, f.param)
            if answering_holders(trace, p) == [n] and coverage_gap(trace, p, k, {n: None}, lambda ok, f=f: [f]) is None:
                part = fx.per_sample_norm_sq(f)
                sq = part if sq is None else sq + part
    return sq


def _norm_sq(trace, names: list, k: int) -> torch.Tensor:
    """Squared norms over `names` in step k; a parameter shared by several layers counted once, and
    only where coverage_gap says its per-sample gradients are whole (else they are partial)."""
    by_param, holder_of = defaultdict(list), {}
    for n in names:
        for f in layer_factors(trace, n, [c for c in trace.layers[n].calls if c.step == k]):
            p = _param(trace, n, f.param)
            by_param[id(p)].append(f)
            holder_of[id(p)] = p
    asked = set(names)
    holders = param_holders(trace)
    sq = 0
    for pid, fs in by_param.items():
        reasons = {h: None if h in asked else "not among the layers asked" for h in holders.get(pid, ())}
        if coverage_gap(trace, holder_of[pid], k, reasons, lambda ok, fs=fs: fs) is not None:
            continue
        sq = sq + fx.shared_norm_sq(fs)  # one contribution, or tied weights' ghost terms and cross terms
    return sq


def coverage_gap(trace, p, k: int, reasons: dict, factors_of) -> str | None:
    """The one decision of whether per-sample gradients of parameter p in step k are whole (None) or why not.

    reasons: holder layer -> why it is not covered, or None. Whole: every holder is covered by an exact (a, δ)
    rule; or the covered holders' factors (factors_of(covered names)) rebuild all of the .grad step k made
    (a holder that only holds p, as BERT's prediction head holds its decoder's bias; a generic-rule holder,
    whose parameter may also be used outside its calls)."""
    bad = [f"{h}: {r}" for h, r in reasons.items() if r is not None]
    ok = [h for h, r in reasons.items() if r is None]
    if not ok:
        return "; ".join(bad) or "no layer holds it"
    exact = not bad and not any(fx.is_generic(trace.layers[h].module) for h in ok)
    # under DDP the step's .grad is averaged over ranks: not the rank's factors' sum, so not what they are checked by
    averaged = any(n.id == "ddp" for n in trace.note_records)
    key = ("factors complete", id(p), k, tuple(ok))  # the record does not change: decided once per trace
    if key not in trace.facts:
        try:
            fs = factors_of(ok)
        except ValueError:  # a covered holder's a or δ was not kept in that step
            fs = []
        made = step_grad(trace, p, k) if fs else None
        if exact and (averaged or made is None or not projectable(fs, made)):
            trace.facts[key] = True  # exact rules on every holder; checked below only where the check is cheap
        else:  # a parameter also used outside its holders' calls (F.linear(x, emb.weight) in a parent) fails here
            trace.facts[key] = bool(fs) and _complete(trace, p, fs, k)
            trace.facts[("factors checked", id(p), k, tuple(ok))] = trace.facts[key]  # proved, not assumed
    if trace.facts[key]:
        return None
    return "; ".join(bad) or (f"its .grad in step {k} is more than what {', '.join(ok)} give: its gradient also "
                              "comes from outside their recorded calls (read directly, as F.linear(x, emb.weight) in "
                              "a parent's forward; a tied layer left out of the trace; a second backward through a "
                              "retained graph); use it through traced modules, one backward per forward, to count it")


def _complete(trace, p, fs: list, k: int) -> bool:
    """Whether the factors of a parameter rebuild all of the .grad step k made (where they do not, say a tied
    embedding that scales its rows, the parameter is left out)."""
    made = step_grad(trace, p, k)
    if made is None:
        return False
    if len(fs) == 1 and trace.facts.get(("complete", id(p), k, (id(fs[0].D),))):
        return True  # the generic rule's check (generic_rows) found the same rows add up to this .grad
    return factors_add_up(fs, made)


# -- who answers for which parameter -----------------------------------------------------------------


def supports(trace, name: str) -> bool:
    """Whether the layer's parameter gradients rebuild: an exact (a, δ) rule, or the generic rule passing its
    check in the last step that reached the layer."""
    module = trace.layer(name).module
    if fx.unsupported_reason(module) is not None:
        return False
    if not fx.is_generic(module):
        return True
    steps = [c.step for c in trace.layers[name].calls if c.step is not None]
    return bool(steps) and not trace.record.no_factors and not isinstance(generic_rows(trace, name, max(steps)),
                                                                           Refusal)


def left_out(trace) -> dict:
    """Parameters with a gradient that per-sample norms over the whole model leave out -> why: nothing
    is dropped without a note that names it."""
    holders = param_holders(trace)
    norms_mode = trace.record.norms is not None
    if norms_mode:
        odd = {m for _, modules in trace.record.norms for m in modules}
        unbatched_names = {n for n, layer in trace.layers.items() if layer.module in odd}
    else:
        unbatched_names = {n for per_step in unbatched_by_step(trace).values() for n in per_step}
    out = {}
    for name, p in trace.params.items():
        if trace.param_grads.get(name) is None:
            continue
        hs = holders.get(id(p), [])
        if trace.record.no_factors:
            why = trace.record.no_factors
        elif not hs:
            why = ("no layer called as a module holds it (used as a plain function, or a parameter of a module "
                   "that was not called)")
        else:
            k = max(c.step for h in hs for c in trace.layers[h].calls if c.step is not None)
            answering = answering_holders(trace, p)
            reasons = {h: _layer_reason(trace, h, k, unbatched_names, norms_mode) if h in answering else _ONLY_HOLDS
                       for h in hs}
            generic_holders = [h for h in answering if fx.is_generic(trace.layers[h].module)]
            if norms_mode and generic_holders and len(answering) > 1:
                why = "; ".join(f"{h}: {r}" for h, r in reasons.items() if r is not None) or (
                    f"shared by {', '.join(hs)}: with capture='norms' a parameter that a generic-rule layer shares "
                    "is left out; capture='full' counts it")
            elif norms_mode and not generic_holders:  # capture="norms" counted it as it streamed: all holders or none
                why = "; ".join(f"{h}: {r}" for h, r in reasons.items() if r not in (None, _ONLY_HOLDS)) or None
            else:
                why = coverage_gap(trace, p, k, reasons, lambda ok, p=p, k=k: _factors_of(trace, p, ok, k))
        if why:
            out[name] = why
    return out


_ONLY_HOLDS = "it only holds it (a layer inside it uses it and answers for it)"


def _layer_reason(trace, name: str, k: int, unbatched_names, norms_mode: bool) -> str | None:
    """Why the layer's per-sample gradients in step k are not counted, or None."""
    module = trace.layers[name].module
    reason = fx.unsupported_reason(module)
    if reason:
        return reason
    if norms_mode:  # why capture left it out, where it said (a loaded trace keeps the decision, not the reasons)
        said = next((left[module] for _, left in trace.record.norms if isinstance(left, dict) and left.get(module)),
                    None)
        if said:
            return said
    if name in unbatched_names:
        return unplaced_reason(trace, name, k)
    if not fx.is_generic(module):
        if not norms_mode and any(c.a is None or c.delta is None for c in trace.layers[name].calls if c.step == k):
            return "its a or δ was not kept (capture='summary', or over budget_mb)"
    elif any(c.step == k for c in trace.layers[name].calls):
        rows = generic_rows(trace, name, k)
        if isinstance(rows, Refusal):
            exact = fx.exact_reason(module) or ""
            why = "" if exact.startswith("no factor rule for") else f" (no exact rule: {exact})"
            return f"{type(module).__name__}, generic torch.func rule: {rows.reason}{why}"
    return None


def _factors_of(trace, p, names: list, k: int) -> list:
    fs = []
    for h in names:
        calls = [c for c in trace.layers[h].calls if c.step == k]
        if calls and not fx.is_generic(trace.layers[h].module) and any(c.a is None or c.delta is None for c in calls):
            raise ValueError(f"layer {h!r}: a or δ not kept")  # capture="summary", or over the memory budget
        if calls:
            fs += [f for f in layer_factors(trace, h, calls) if _param(trace, h, f.param) is p]
    return fs


def factor_layers(trace, k: int | None = None) -> list[str]:
    """Layers whose parameter gradients rebuild in step k (or in any step): an exact (a, δ) rule with a and δ
    kept, or the generic rule passing its check (in step k, or in the last step that reached the layer)."""
    if trace.record.no_factors:
        return []
    out = []
    for n, layer in trace.layers.items():
        module = layer.module
        if fx.unsupported_reason(module) or not owned_params(trace, n):
            continue
        calls = [c for c in layer.calls if c.step is not None and (k is None or c.step == k)]
        if not calls:
            continue
        if fx.is_generic(module):
            if not isinstance(generic_rows(trace, n, k if k is not None else max(c.step for c in calls)), Refusal):
                out.append(n)
        elif all(c.a is not None and c.delta is not None for c in calls):
            out.append(n)
    return out


