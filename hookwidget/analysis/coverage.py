"""What factor queries cover in a finished trace, as notes (record/notes.py): layers with no (a, δ) factor rule,
and the parameters that per-sample norms over the whole model leave out (per_sample.left_out), with why.

Decided once per trace, from what the trace kept of its modules when it ended (the registry's answers at their
first calls, the parameters each layer answers for: facts.record_facts), so that a model changed afterwards
does not change them. Where the decision still depends on the live modules (a generic-rule layer reruns its
module; a parameter several layers hold is checked through their rules), `settle` takes it when the run ends.

Floor: analysis. Imports record/ (the notes), layers/ and analysis.facts / per_sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from hookwidget.analysis import facts
from hookwidget.analysis import per_sample as ps
from hookwidget.layers import factors as fx
from hookwidget.layers import registry
from hookwidget.record.notes import Note


@dataclass(frozen=True)
class Coverage:
    notes: tuple  # Note records, in the order the trace shows them
    left_out: dict  # parameter name -> why per-sample norms over the whole model leave it out


_NONE = Coverage((), {})  # of a run still going, and while it is decided (notes read for an error message)


def settle(trace) -> None:
    """When the run ends: keep what the decision reads of the modules, and decide now where it reads more."""
    with registry.memo(trace.record.answers):
        if not facts.record_facts(trace):
            decide(trace)


def decide(trace) -> Coverage:
    """The trace's coverage, decided on first use (whichever thread asks first) and kept in trace.facts."""
    record, cache = trace.record, trace.facts
    if not record.done:
        return _NONE
    with cache.lock:
        found = cache.get("coverage")
        if found is None:
            cache["coverage"] = _NONE  # the notes may be read while they are decided (an error message)
            try:
                with registry.memo(record.answers):
                    found = _decide(trace)
            except BaseException:
                del cache["coverage"]
                raise
            cache["coverage"] = found
        return found


def _decide(trace) -> Coverage:
    notes = []
    reasons = {n: fx.unsupported_reason(layer.module) for n, layer in trace.layers.items()
               if facts.owned_params(trace, n)}
    unsupported = sorted(((n, why) for n, why in reasons.items() if why), key=lambda p: f"{p[0]} ({p[1]})")
    if unsupported:
        notes.append(Note("no_factor_rule", {"reasons": tuple(unsupported),
                                             "layers": tuple(n for n, _ in unsupported)}))
    left = ps.left_out(trace) if trace.steps else {}
    if left and trace.session.options.capture != "summary":  # summaries keep no (a, δ): no news in a note
        total = sum(g.numel() for g in trace.param_grads.values() if g is not None)
        lost = sum(trace.params[n].numel() for n in left)
        holders = facts.param_holders(trace)
        layers = tuple(dict.fromkeys(h for n in left for h in holders.get(id(trace.params[n]), ())))
        notes.append(Note("params_left_out", {"reasons": tuple(left.items()), "lost": lost, "total": total,
                                              "layers": layers}))
    return Coverage(tuple(notes), left)
