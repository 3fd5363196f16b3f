"""Which samples and which positions carried a step's gradient: shares s_b = ⟨G_b, G⟩ / ‖G‖².

Why shares and not per-sample norms: a norm says how hard a sample pulled, not whether it pulled with the step.
With G = Σ_b G_b, ‖G‖² = Σ_b ⟨G_b, G⟩, so the shares are exact and add up to 1, per parameter, per layer and
over all of them (s_b = Σ_p ⟨G_b,p, G_p⟩ / Σ_p ‖G_p‖²); a sample that pulled against the step has a negative one.
A layer applied per position splits its part further, exactly: ⟨G_{b,t}, G⟩ (layers/shares.py).

G is the gradient the optimizer steps on: the selected step's, or under accumulation (step=None) every
micro-batch's summed, with the samples of all micro-batches in order (as per_sample_grad_norms orders them).
A parameter counts only where per_sample.coverage_gap finds its per-sample gradients whole in every selected step
(a tied weight: every layer that uses it); the rest is named in `left_out`, never dropped silently. Layers
without a per-position form (the generic torch.func rule's dense rows, a mapped convolution) give their samples'
part from per-sample gradients; it is in the samples' shares, not on a position (`unplaced`, a note says so).

Floor: analysis. Imports layers/ and analysis (facts, per_sample, batches, coverage).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from hookwidget.analysis import coverage
from hookwidget.analysis import per_sample as ps
from hookwidget.analysis.batches import check_batched, unbatched
from hookwidget.analysis.facts import answering_holders, owned_params, step_indices
from hookwidget.layers import factors as fx
from hookwidget.layers import share_gram
from hookwidget.layers import shares as sh
from hookwidget.layers.float64_sums import squared_norm


@dataclass(frozen=True)
class Shares:
    """Each sample's (and position's) share of the step's gradient G over the parameters counted.

    samples: (N,) ⟨G_b, G⟩ / ‖G‖², N the samples of every selected step in order; they sum to 1.
    positions: (N, T) the part each position carried, summed position by position over the layers whose token
    axis has T positions (the most common length among the per-position layers asked, a tie to the longer);
    None where no layer has positions. The layers are aligned by index, not proved to share the axis: where two
    axes happen to have one length (a CNN's feature map and a sequence), read by_layer, per layer.
    unplaced: (N,) the part of each sample's share not on a position of `positions` (layers without a
    per-position form, or with another number of positions): samples = positions.sum(1) + unplaced.
    by_layer: layer -> (N, T_layer) its own positions' shares (a tied weight's layers each give theirs).
    params: the parameters counted; left_out: parameter -> why it is not; notes: one line each.
    total_sq: ‖G‖² over the parameters counted."""

    samples: torch.Tensor
    positions: torch.Tensor | None
    unplaced: torch.Tensor
    by_layer: dict
    params: tuple
    left_out: dict
    notes: tuple
    total_sq: float

    def top(self, k: int = 5) -> list[tuple[int, float]]:
        """The k samples with the largest shares, (index, share), largest first."""
        values, idx = torch.topk(self.samples, min(k, self.samples.shape[0]))
        return [(int(i), float(v)) for i, v in zip(idx.tolist(), values.tolist())]


CHECKING = 0.2  # of the progress reported: proving each parameter's factors (the rest: their products)


def shares(trace, name: str | None, step: int | None, method: str | None = None, progress=None) -> Shares:
    """The shares of the samples (and positions) in the gradient of the selected step(s): over every parameter
    with an exact per-sample rule (name None), the parameters layer `name` answers for, or parameter `name`.
    method: 'grad' (the product with G, layers/shares.py) or 'gram' (Σ over token pairs, layers/share_gram.py,
    where a parameter's factors are all plain outer products or embedding lookups of one weight; the product
    elsewhere) forces one; None chooses the cheaper per parameter (share_gram.cheaper). progress: None, or called
    with the fraction done (0 to 1, by parameter size: about where the time goes) after each parameter."""
    if method not in (None, "grad", "gram"):
        raise ValueError(f"method={method!r}: use None (the cheaper), 'grad' or 'gram'")
    steps = step_indices(trace, step)
    _check_kept(trace)
    selected, placed, asked = _select(trace, name, step, steps)
    left_out, notes = {}, []
    cache: dict = {}
    odd = {k: set(unbatched(trace, k)) for k in steps}  # once per step: it walks every call
    usable = {k: set(ps.factor_layers(trace, k)) - odd[k] for k in steps}
    counted, parts = [], {}  # parameter name -> [(k, layer, factor)]
    done = _Progress(progress, selected)
    for pname, p in selected:
        found = _contributions(trace, p, steps, usable, odd, cache)
        done.add(p, CHECKING)
        if isinstance(found, str):
            left_out[pname] = found
        elif found:
            counted.append(pname)
            parts[pname] = found
    if name is None:
        left_out = {**{n: w for n, w in coverage.decide(trace).left_out.items() if n not in parts}, **left_out}
        left_out.update(_unanswered(trace, steps, set(parts) | set(left_out)))
    if not parts:
        why = "; ".join(f"{n}: {w}" for n, w in left_out.items()) or "no backward reached them"
        raise ValueError(f"no parameter {'of ' + repr(name) + ' ' if name else ''}with exact per-sample gradients "
                         f"in this trace ({why}): trace with capture='full' and run a backward inside it")
    batch = _batch_sizes(parts, steps)
    acc = torch.float32 if next(iter(parts.values()))[0][2].D.device.type == "mps" else torch.float64
    samples = {k: None for k in steps}
    by_layer: dict = {}  # (layer, k) -> (B_k, T)
    bad_layers: dict = {}
    total = 0.0
    unpositioned = set()
    for pname, found in parts.items():
        fs = [f for _, _, f in found]
        if (method == "gram" and share_gram.applies(fs)) or (method is None and share_gram.cheaper(fs)):
            dots = share_gram.position_dots(fs)
            total += float(sum(d.sum(dtype=acc) for d in dots))
        else:
            G = _made(trace, pname, {k for k, _, _ in found})
            if G is None:
                G = sum(fx.summed_grad(f) for f in fs)
            total += squared_norm(G)  # in float64, piece by piece: no float64 copy of G
            dots = [sh.position_dots(f, G) if _positional(f) else None for f in fs]
            dots = [d if d is not None else sh.sample_dots(f, G).unsqueeze(1) for d, f in zip(dots, fs)]
            unpositioned |= {(pname, h) for (_, h, f) in found if not _positional(f)}
        done.add(trace.params[pname], 1 - CHECKING)
        for (k, h, f), d in zip(found, dots):
            d = d.to(acc)
            samples[k] = d.sum(1) if samples[k] is None else samples[k] + d.sum(1)
            if not _positional(f) or (placed is not None and h not in placed):
                continue
            key = (h, k)
            if key in by_layer and by_layer[key].shape != d.shape:
                bad_layers[h] = (f"its parameters' token axes differ ({tuple(by_layer[key].shape[1:])} and "
                                 f"{tuple(d.shape[1:])})")
            elif key in by_layer:
                by_layer[key] = by_layer[key] + d
            else:
                by_layer[key] = d
    if total == 0.0:
        raise ValueError("the step's gradient is zero over the parameters counted: no sample has a share of it")
    sample_vec = torch.cat([samples[k] if samples[k] is not None else
                            torch.zeros(batch[k], dtype=acc, device=_device(parts)) for k in steps]) / total
    layers_pos = _per_layer(by_layer, steps, batch, bad_layers, total)
    positions, unplaced, where = _place(layers_pos, sample_vec, bad_layers)
    notes += where
    for pname, h in sorted(unpositioned):
        notes.append(f"{pname} (layer {h}): no per-position form (generic rule or mapped convolution): its samples' "
                     "part comes from their per-sample gradients and is not on a position")
    contrib = sorted({pname for pname, found in parts.items() for _, _, f in found if f.per_sample == "contribution"})
    if contrib:
        notes.append(f"{', '.join(contrib)}: samples share statistics there (batch norm, scale_grad_by_freq): a "
                     "sample's part is its contribution to the gradient, not its own loss's gradient")
    notes += [f"left out: {n}: {w}" for n, w in left_out.items()]
    if asked is not None and asked not in parts and not left_out:
        notes.append(f"{asked}: no gradient reached it in the selected step(s)")
    return Shares(sample_vec, positions, unplaced, layers_pos, tuple(counted), left_out, tuple(notes), total)


def position_norms(trace, name: str, step: int | None) -> torch.Tensor:
    """(N, T) ‖G_{b,t}‖ over the parameters layer `name` answers for: each position's gradient is an outer
    product, so its norm is ‖δ_{b,t}‖·‖a_{b,t}‖ (with its bias, √(‖δ‖²(‖a‖² + 1))); no Gram product needed."""
    _check_kept(trace)
    groups = ps.call_groups(trace, name, step)
    check_batched(trace, name, step)
    rows = []
    for calls in groups:
        sq = None
        for f in ps.layer_factors(trace, name, calls):
            part = sh.position_sq_norms(f)
            if part is None:
                raise ValueError(f"layer {name!r}: {f.param} has no per-position gradient form (kind {f.kind!r}: the "
                                 "generic torch.func rule, or a grouped, transposed or 3-d convolution); per-sample "
                                 "norms: t.per_sample_grad_norms(name)")
            if sq is not None and sq.shape != part.shape:
                raise ValueError(f"layer {name!r}: its parameters' token axes differ ({tuple(sq.shape)} and "
                                 f"{tuple(part.shape)}): no common positions")
            sq = part if sq is None else sq + part
        rows.append(sq)
    if len({r.shape[1] for r in rows}) > 1:
        raise ValueError(f"layer {name!r}: its steps have different numbers of positions "
                         f"({', '.join(str(r.shape[1]) for r in rows)}): pass step=k")
    return torch.cat(rows).sqrt()


# -- helpers ---------------------------------------------------------------------------------------------------
class _Progress:
    """The fraction of the work done, by the size of the parameters done, reported to `report` (or nothing)."""

    def __init__(self, report, selected: list):
        self.report, self.done = report, 0.0
        self.total = float(sum(p.numel() for _, p in selected)) or 1.0

    def add(self, p, weight: float) -> None:
        if self.report is not None:
            self.done += weight * p.numel()
            self.report(min(1.0, self.done / self.total))


def _check_kept(trace) -> None:
    if trace.record.norms is not None:
        raise ValueError("capture='norms' streams per-sample norms and keeps no (a, δ): trace with capture='full' "
                         "for gradient shares")
    if trace.session.options.capture == "summary":
        raise ValueError("capture='summary' keeps statistics, not (a, δ): trace with capture='full' for gradient "
                         "shares")
    if trace.record.no_factors:
        raise ValueError(f"no (a, δ) factors in this trace: {trace.record.no_factors}")


def _select(trace, name, step, steps) -> tuple[list, set | None, str | None]:
    """(parameter name, parameter) pairs asked for, the layers whose positions are placed (None: all), and the
    parameter asked for by name."""
    names = {id(p): n for n, p in trace.params.items()}
    if name is None:
        seen, out = set(), []
        for k in steps:
            for n in ps.factor_layers(trace, k):
                for p in owned_params(trace, n).values():
                    if id(p) not in seen and id(p) in names:
                        seen.add(id(p))
                        out.append((names[id(p)], p))
        return out, None, None
    if not isinstance(name, str):
        raise TypeError(f"name={name!r}: pass a layer name (t.layers) or a parameter name (t.params), or None")
    if name in trace.params and name not in trace.layers:
        p = trace.params[name]
        return [(name, p)], set(answering_holders(trace, p)), name
    ps.call_groups(trace, trace.layer(name).name, step)  # one line where the layer cannot answer
    check_batched(trace, name, step)
    owned = owned_params(trace, name)
    if not owned:
        raise ValueError(f"layer {name!r} has no trainable parameters: no share of the gradient")
    return [(names[id(p)], p) for p in owned.values() if id(p) in names], {name}, None


def _contributions(trace, p, steps, usable, odd, cache) -> list | str:
    """[(step, layer, factor)] of every layer that uses p in the selected steps, or why p is left out."""
    out = []
    for k in steps:
        holders = [h for h in answering_holders(trace, p) if any(c.step == k for c in trace.layers[h].calls)]
        if not holders:
            continue
        reasons = {h: None if h in usable[k] else (ps._layer_reason(trace, h, k, odd[k], False) or
                                                    "no exact per-sample rule in this step") for h in holders}

        def factors_of(ok, k=k):
            return [f for h in ok for f in _factors(trace, h, k, p, cache)]

        gap = ps.coverage_gap(trace, p, k, reasons, factors_of)
        if gap is not None:
            return f"step {k}: {gap}"
        fs = factors_of(holders)
        key = ("shares: factors complete", id(p), k)  # the record does not change: checked once per trace
        checked = trace.facts.get(("factors checked", id(p), k, tuple(holders)))  # coverage_gap checked them all
        if key not in trace.facts:
            trace.facts[key] = checked if checked is not None else bool(fs) and ps._complete(trace, p, fs, k)
        if not trace.facts[key]:
            return (f"step {k}: its factors from {', '.join(holders)} do not add up to the .grad the step made (a use "
                    "outside the layers traced, e.g. an excluded layer that shares it; or its .grad was not kept)")
        out += [(k, h, f) for h in holders for f in _factors(trace, h, k, p, cache)]
    return out


def _unanswered(trace, steps: list, known: set) -> dict:
    """Parameters the selected steps gave a gradient that no counted layer answered for and coverage did not name
    (it decides for the last step: a layer over the memory budget in an earlier one), with why."""
    out = {}
    for k in steps:
        for pname in trace.steps[k].grads:
            if pname in known or pname in out:
                continue
            try:
                g = trace.steps[k].grad(pname)
            except ValueError as e:  # kept as a summary only
                out[pname] = f"step {k}: {e}"
                continue
            if g is not None and bool(g.ne(0).any()):
                out[pname] = f"step {k}: no layer with an exact per-sample rule (and its a and δ kept) answered for it"
    return out


def _factors(trace, h: str, k: int, p, cache) -> list:
    key = (h, k)
    if key not in cache:
        calls = [c for c in trace.layers[h].calls if c.step == k]
        cache[key] = ps.layer_factors(trace, h, calls) if calls else []
    owned = owned_params(trace, h)
    return [f for f in cache[key] if owned.get(f.param) is p]


def _made(trace, pname: str, steps: set) -> torch.Tensor | None:
    """The gradient the selected steps made (recorded as they ran; _contributions checked that the factors add
    up to it), or None where a step kept a summary only: then it is rebuilt from the factors."""
    try:
        grads = [trace.steps[k].grad(pname) for k in sorted(steps)]
    except (KeyError, ValueError):
        return None
    if any(g is None or g.is_sparse for g in grads):
        return None
    return grads[0] if len(grads) == 1 else sum(grads)


def _positional(f) -> bool:
    return f.kind in sh.POSITIONAL and (f.kind == "conv" or f.D.dim() == 3)


def _batch_sizes(parts: dict, steps: list) -> dict:
    sizes: dict = {}
    for found in parts.values():
        for k, h, f in found:
            B = f.D.shape[0]
            if sizes.setdefault(k, B) != B:
                raise ValueError(f"step {k}: layer {h!r} sees {B} samples where others see {sizes[k]}: its rows are "
                                 "not the batch's samples; ask for one layer (name=...)")
    for k in steps:
        sizes.setdefault(k, 0)
    return sizes


def _device(parts: dict):
    return next(iter(parts.values()))[0][2].D.device


def _per_layer(by_layer: dict, steps: list, batch: dict, bad: dict, total: float) -> dict:
    """layer -> (N, T) its positions' shares over all selected steps (steps it did not run in: zeros)."""
    out = {}
    for h in dict.fromkeys(h for h, _ in by_layer):
        if h in bad:
            continue
        lengths = {by_layer[(h, k)].shape[1] for k in steps if (h, k) in by_layer}
        if len(lengths) > 1:
            bad[h] = f"its steps have different numbers of positions ({sorted(lengths)})"
            continue
        T = lengths.pop()
        some = next(by_layer[(h, k)] for k in steps if (h, k) in by_layer)
        out[h] = torch.cat([by_layer[(h, k)] if (h, k) in by_layer else some.new_zeros(batch[k], T)
                            for k in steps]) / total
    return out


def _place(layers_pos: dict, samples: torch.Tensor, bad: dict) -> tuple:
    """(positions, unplaced, notes): the layers with the most common number of positions added position by
    position (a layer applied per position keeps the sequence's length; one that changes it, a strided
    convolution, a layer called twice in one pass, has another and stays in by_layer only)."""
    notes = [f"layer {h}: positions not attributed: {why}" for h, why in bad.items()]
    if not layers_pos:
        return None, samples, notes
    counts = Counter(v.shape[1] for v in layers_pos.values())
    T = max(counts, key=lambda n: (counts[n], n))
    positions = sum(v for v in layers_pos.values() if v.shape[1] == T)
    others = [h for h, v in layers_pos.items() if v.shape[1] != T]
    if others:
        notes.append(f"positions summed over the layers with {T} positions; {', '.join(others)} have another "
                     "number (see by_layer): their part is in `unplaced`")
    return positions, samples - positions.sum(1), notes
