"""A Trace as data and back (what `t.save` writes, `hw.load` reads): the record (its format: record/saved.py), with
the answers of analysis/ that would need the live code to work out again."""

from __future__ import annotations

import torch

from hookwidget.analysis import coverage
from hookwidget.analysis.facts import Refusal
from hookwidget.analysis.generic import generic_rows
from hookwidget.layers import factors as fx
from hookwidget.layers import registry
from hookwidget.record import saved


def to_tree(t, activations: bool = True) -> dict:
    """What t.save writes: t's record as nested dicts and lists of plain values and tensors, and what analysis kept;
    without activations, each layer's a and δ replaced by their statistics (and each step's per-sample gradient
    norms, taken now, kept in their place)."""
    if not t.record.done:
        raise RuntimeError("this trace's run is still going: save it after its `with hw.tracing()` block")
    tree = saved.trace_tree(t.record, t.graph, t.options, t.applied, _kept(t),
                            getattr(t.session, "baseline", None) is t)
    if not activations:
        tree = saved.without_activations(tree, [_norms_sq(t, k) for k in range(len(t.steps))])
    return tree


def from_tree(cls, tree: dict, source):
    """The read-only `cls` (Trace) of what to_tree gave, read back from the file `source`."""
    session = saved.ReadOnly(source, tree["options"], tree["applied"])
    t = cls(session, saved.trace_record(tree), applied=session.applied)
    session.latest = t
    if tree["baseline"]:
        session.baseline = t
    kept = tree["kept"]
    t.facts["coverage"] = coverage.Coverage(tuple(kept["notes"]), kept["left_out"])
    for name, k, rows in kept["rows"]:
        t.facts[("rows", name, k)] = Refusal(rows) if isinstance(rows, str) else rows
    return t


def not_copied(t) -> TypeError:
    """Why pickle and deepcopy refuse t: its file already is the copy, or it holds the live model and code."""
    if isinstance(t.session, saved.ReadOnly):  # no live model here: its file already is the copy
        return TypeError(f"a Trace loaded with hw.load is not pickled or deep-copied: {t.session.path} holds it; "
                         f"read it again with hw.load({t.session.path!r}), or write a copy with t.save(path)")
    return TypeError("a Trace holds the live model and the code that made it, which pickle and deepcopy do not "
                     "copy: keep it with t.save(path), read it back with hw.load(path)")


def _norms_sq(t, k: int) -> torch.Tensor | None:
    """Step k's squared per-sample gradient norms over the whole model, or None where it has none."""
    if t.record.no_factors or t.steps[k].kind != "backward":
        return None
    try:
        return t.per_sample_grad_norms(step=k).square()
    except ValueError:
        return None


def _kept(t) -> dict:
    """What a saved trace keeps of analysis's answers that would need the code again: coverage (its notes, what
    per-sample norms leave out) and the generic rule's checked rows per layer and step (it reruns the module)."""
    found = coverage.decide(t)
    rows = []
    if not t.record.no_factors:
        with registry.memo(t.record.answers):
            for name, layer in t.layers.items():
                if fx.is_generic(layer.module):
                    for k in sorted({c.step for c in layer.calls if c.step is not None}):
                        r = generic_rows(t, name, k)
                        rows.append((name, k, r.reason if isinstance(r, Refusal) else {
                            pn: fx.per_sample_grad(g) if isinstance(g, fx.Factor) and g.conv is not None else g
                            for pn, g in r.items()}))
    return {"notes": found.notes, "left_out": found.left_out, "rows": rows}
