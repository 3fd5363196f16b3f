"""An anomaly as the watch view reads it, the same in the live widget's rows and in a to_html page."""

from __future__ import annotations

from hookwidget.views.payload.numbers import _num


def anomaly_entry(a) -> list:
    """[step, where, reason, lead] as the view reads an anomaly: the lead (the watch worked it out: watch/leads.py)
    as plain JSON, NaN and ±Inf as strings; the view computes none of its own."""
    lead = a.lead
    if lead is not None:
        lead = {"step": int(lead.step), "stat": lead.stat, "layers": list(lead.layers), "ratio": _num(lead.ratio),
                "base": _num(lead.base), "value": _num(lead.value), "lr": bool(lead.lr), "text": lead.text}
    return [int(a.step), str(a.where), str(a.reason), lead]
