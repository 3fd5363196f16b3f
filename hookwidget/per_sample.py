"""Factor queries on a Trace: W.grad rebuilt from (a, δ), per-sample gradients and their norms.

A layer's calls are grouped by the backward pass (step) that brought them their δ. Calls of one
step see the same samples (a layer reused inside one forward adds tokens); calls of different
steps see different samples (micro-batches), so per-sample rows are stacked step after step.
Calls that got no δ (a forward-only call) belong to no step and take part in nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from . import factors as fx


def step_indices(trace, step: int | None) -> list[int]:
    """The steps a query answers for: the one asked for, or every backward pass when they
    accumulate into .grad (or there is only one); otherwise one line asking for step=."""
    steps = trace.steps
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or not -len(steps) <= step < len(steps):
            raise ValueError(f"step={step!r}: this trace has {len(steps)} step(s); pass step=0..{len(steps) - 1} "
                             "(t.steps lists them)")
        return [step % len(steps)]
    backward = [s.index for s in steps if s.kind == "backward"] or [s.index for s in steps]
    if len(backward) > 1 and not trace.accumulates:
        raise ValueError(f"this trace has {len(backward)} backward passes and .grad was reset between them (e.g. "
                         f"opt.zero_grad() every step): pass step=k for one of them (0..{len(steps) - 1}; "
                         "t.steps lists them)")
    return backward


def call_groups(trace, name: str, step: int | None) -> list[list]:
    """The layer's calls per selected step, steps in order, checked for a and δ."""
    layer = trace.layer(name)
    reason = fx.unsupported_reason(layer.module)
    if reason:
        supported = ", ".join(fx.supported_types())
        raise ValueError(f"layer {name!r}: {reason}; supported types: {supported}")
    if trace._no_factors:
        raise ValueError(f"layer {name!r}: {trace._no_factors}")
    groups = []
    for k in step_indices(trace, step):
        calls = [c for c in layer.calls if c.step == k]
        missing = [c.index for c in calls if c.a is None or c.delta is None]
        if missing:
            why = "; ".join(trace.notes) or "not kept"
            raise ValueError(f"layer {name!r}: a or δ not kept for call(s) {missing} ({why})")
        if calls:
            groups.append(calls)
    if not groups:
        which = f"step {step}" if step is not None else "any backward pass"
        raise ValueError(f"layer {name!r}: no backward reached it in {which} (forward-only calls have no δ)")
    return groups


def param_factors(trace, name: str, param: str, step: int | None) -> list[fx.Factor]:
    """One Factor of `param` per selected step."""
    module = trace.layer(name).module
    out = []
    for calls in call_groups(trace, name, step):
        f = next((f for f in fx.factors(module, calls) if f.param == param), None)
        if f is None:
            raise ValueError(f"layer {name!r} has no trainable {param}")
        out.append(f)
    return out


def summed_grad(trace, name: str, param: str, step: int | None) -> torch.Tensor:
    return sum(fx.summed_grad(f) for f in param_factors(trace, name, param, step))


def per_sample_grad(trace, name: str, param: str, step: int | None) -> torch.Tensor:
    check_batched(trace, name, step)
    return torch.cat([fx.per_sample_grad(f) for f in param_factors(trace, name, param, step)])


def per_sample_norms(trace, name: str | None, step: int | None) -> torch.Tensor:
    """(N,) per-sample gradient norms, N the samples of every selected step, in order."""
    steps = step_indices(trace, step)
    if name is None and trace._norms is not None:
        rows = [trace._norms[k][0] for k in steps if trace._norms[k][0] is not None]
        if not rows:
            raise ValueError("no per-sample norms in this trace: " + ("; ".join(trace.notes) or "no backward ran"))
        return torch.cat(rows).sqrt()
    if name is not None:
        check_batched(trace, name, step)
    rows = []
    for k in steps:
        names = [name] if name is not None else [n for n in factor_layers(trace, k) if n not in unbatched(trace, k)]
        if names:
            rows.append(_norm_sq(trace, names, k))
    if not rows:
        raise ValueError("no layer with (a, δ) factors in this trace: " + ("; ".join(trace.notes) or
                         "run a backward inside the trace"))
    return torch.cat(rows).sqrt()


def _norm_sq(trace, names: list, k: int) -> torch.Tensor:
    """Squared norms over `names` in step k; a parameter shared by several layers counted once, and
    only when every layer that holds it is among `names` (else its per-sample gradient is partial)."""
    by_param = defaultdict(list)
    for n in names:
        module = trace.layers[n].module
        for f in fx.factors(module, [c for c in trace.layers[n].calls if c.step == k]):
            by_param[getattr(module, f.param)].append(f)
    covered = set(names)
    holders = _holders(trace)
    by_param = {p: fs for p, fs in by_param.items()
                if all(h in covered for h in holders.get(id(p), ())) or _complete(trace, p, fs, k)}
    sq = 0
    for fs in by_param.values():
        if len(fs) == 1:
            sq = sq + fx.per_sample_norm_sq(fs[0])
        else:
            sq = sq + sum(fx.per_sample_grad(f) for f in fs).flatten(1).pow(2).sum(1)
    return sq


def _complete(trace, p, fs: list, k: int) -> bool:
    """Whether the factors of a parameter also held by a layer without a rule still rebuild all of the
    .grad step k made (that layer may only hold it, as BERT's prediction head holds its decoder's
    bias); where they do not (a tied embedding that scales its rows), the parameter is left out."""
    name = next((n for n, q in trace.params.items() if q is p), None)
    try:
        made = trace.steps[k].grad(name)
    except (KeyError, ValueError):
        return False
    if made is None:
        return False
    rebuilt = sum(fx.summed_grad(f) for f in fs)
    return bool(torch.allclose(rebuilt, made, rtol=1e-4, atol=1e-6 * float(made.abs().max()) + 1e-12))


def _holders(trace) -> dict:
    """id(parameter) -> names of the called layers that hold it as their own (tied weights: several)."""
    out = defaultdict(list)
    for n, layer in trace.layers.items():
        if layer.calls and any(c.step is not None for c in layer.calls):
            for p in layer.module._parameters.values():
                if p is not None and p.requires_grad:
                    out[id(p)].append(n)
    return out


def left_out(trace) -> dict:
    """Parameters with a gradient that per-sample norms over the whole model leave out -> why: nothing
    is dropped without a note that names it."""
    holders = _holders(trace)
    if trace._norms is not None:
        odd = {m for _, modules in trace._norms for m in modules}
        unbatched_names = {n for n, layer in trace.layers.items() if layer.module in odd}
    else:
        unbatched_names = {n for per_step in unbatched_by_step(trace).values() for n in per_step}
    out = {}
    for name, p in trace.params.items():
        if trace.param_grads.get(name) is None:
            continue
        hs = holders.get(id(p), [])
        why = [f"{h}: {fx.unsupported_reason(trace.layers[h].module)}" for h in hs
               if fx.unsupported_reason(trace.layers[h].module)]
        why += [f"{h}: its input has no batch dimension (its gradient is already summed over the batch)"
                for h in hs if h in unbatched_names]
        if trace._no_factors:
            why = [trace._no_factors]
        elif not hs:
            why = ["no layer called as a module holds it (used as a plain function, e.g. MultiheadAttention's "
                   "out_proj, or a parameter of a module that was not called)"]
        elif why and len(why) < len(hs) and trace._norms is None and _complete_in_last_step(trace, p, hs, why):
            why = []  # the covered holders' factors rebuild all of its .grad: the others only hold it
        if why:
            out[name] = "; ".join(why)
    return out


def _complete_in_last_step(trace, p, holders: list, why: list) -> bool:
    covered = [h for h in holders if not any(w.startswith(f"{h}: ") for w in why)]
    k = max((c.step for h in covered for c in trace.layers[h].calls if c.step is not None), default=None)
    if k is None:
        return False
    fs = []
    for h in covered:
        module = trace.layers[h].module
        calls = [c for c in trace.layers[h].calls if c.step == k]
        if not calls or any(c.a is None or c.delta is None for c in calls):
            return False
        fs += [f for f in fx.factors(module, calls) if getattr(module, f.param) is p]
    return bool(fs) and _complete(trace, p, fs, k)


def factor_layers(trace, k: int | None = None) -> list[str]:
    """Layers whose parameter gradients (a, δ) rebuild in step k (or in any step)."""
    out = []
    for n, layer in trace.layers.items():
        if not _has_own_params(layer.module) or fx.unsupported_reason(layer.module) or trace._no_factors:
            continue
        calls = [c for c in layer.calls if c.step is not None and (k is None or c.step == k)]
        if calls and all(c.a is not None and c.delta is not None for c in calls):
            out.append(n)
    return out


def unbatched(trace, k: int) -> dict:
    """Layers whose input's leading dimension in step k is not the batch size most layers agree on,
    e.g. a positional embedding called on arange(T): their gradient is already summed over the batch."""
    lead = {}
    for n in factor_layers(trace, k):
        a = next(c.a for c in trace.layers[n].calls if c.step == k)
        lead[n] = a.shape[0] if a.dim() else None
    return _odd_ones(lead)


def unbatched_by_step(trace, eligible=None) -> dict:
    """unbatched(trace, k) of every step k, in one pass over the calls (a loop of many steps
    would otherwise walk every call once per step). `eligible`: the names of the layers with own
    trainable parameters and a factor rule, where the caller knows them already."""
    if trace._no_factors:
        return {}
    layers = trace.layers
    if eligible is None:
        eligible = [n for n, layer in layers.items()
                    if _has_own_params(layer.module) and not fx.unsupported_reason(layer.module)]
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
                shape = cs[0].a.shape
                lead[k][n] = shape[0] if shape else None
    out = {k: _odd_ones(ls) for k, ls in lead.items()}
    return {k: v for k, v in out.items() if v}


def _odd_ones(lead: dict) -> dict:
    counts = Counter(v for v in lead.values() if v is not None)
    if not counts:
        return {}
    batch = counts.most_common(1)[0][0]
    return {n: (b, batch) for n, b in lead.items() if b != batch}


def check_batched(trace, name: str, step: int | None) -> None:
    for k in step_indices(trace, step):
        bad = unbatched(trace, k).get(name)
        if bad:
            raise ValueError(f"layer {name!r}: its input's leading dimension is {bad[0]}, not the batch size {bad[1]} "
                             "of the other layers (e.g. an embedding called on arange(T)): its gradient is already "
                             "summed over the batch, so per-sample gradients cannot be separated")


def _has_own_params(m) -> bool:
    return any(p is not None and p.requires_grad for p in m._parameters.values())
