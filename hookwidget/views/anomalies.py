"""An anomaly as the watch view reads it, the same in the live widget's rows and in a to_html page."""

from __future__ import annotations

from hookwidget.views.payload.numbers import _num


def anomaly_entry(a) -> list:
    """[step, where, reason, lead, samples] as the view reads an anomaly: the lead (the watch worked it out:
    watch/leads.py) and the samples that carried its step (watch/carriers.py; per_sample=True) as plain JSON, NaN
    and ±Inf as strings, or null; the view computes none of its own."""
    lead = a.lead
    if lead is not None:
        lead = {"step": int(lead.step), "stat": lead.stat, "layers": list(lead.layers), "ratio": _num(lead.ratio),
                "base": _num(lead.base), "value": _num(lead.value), "lr": bool(lead.lr), "text": lead.text}
    carried = getattr(a, "samples", None)
    if carried is not None:
        carried = {"samples": [[int(i), _num(s)] for i, s in carried.samples],
                   "position": None if carried.position is None else int(carried.position),
                   "position_share": None if carried.position_share is None else _num(carried.position_share),
                   "text": carried.text}
    return [int(a.step), str(a.where), str(a.reason), lead, carried]
