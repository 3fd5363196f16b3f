"""What a rerun changed: the loss and per-parameter gradient norms before and after, how much each change
matters (its impact: ‖g₁−g₀‖₂ over the model's gradient scale) or whether it is float noise, and the nodes and
modules whose gradients moved (payload_schema.json, "diff"). Rows come ranked (analysis/diff.py's rank_key)."""

from __future__ import annotations

from hookwidget.views.payload.numbers import _num, _same
from hookwidget.views.payload.summaries import hooks, module_tree


def diff(before, after) -> dict:
    """Loss and per-parameter grad norms before/after a rerun, and which nodes and modules changed."""
    d = after.diff(before)
    g0, g1 = before.graph, after.graph
    noise = {p.name for p in d.params if p.noise}  # a parameter's node whose gradient moved by rounding only
    changed_nodes = [n for n, attrs in g1.nodes(data=True) if attrs.get("param") not in noise
                     and (n not in g0 or not _same(g0.nodes[n].get("grad_norm"), attrs.get("grad_norm")))]
    owner = {n: r["name"] for r in module_tree(after, {}) for n in r["own_params"]}
    hooked = {h["target"] for h in hooks(after)}
    params = [{"name": p.name, "before": _num(p.before), "after": _num(p.after),
               "rel_change": _rel(p), "cosine": _num(p.cosine), "change": _num(p.change), "impact": _num(p.impact),
               "noise": p.noise, "hooked": p.name in hooked or owner.get(p.name) in hooked} for p in d.ranked]
    changed_params = {p["name"] for p in params if p["rel_change"] != 0.0 and not p["noise"]}
    return {
        "against": "baseline" if before is getattr(getattr(after, "session", None), "baseline", None) else "previous",
        "hooks": sorted(hooked),
        "grad_scale": _num(d.scale),
        "weights_differ": list(d.weights_differ),
        "loss_before": _num(d.loss_before), "loss_after": _num(d.loss_after), "params": params,
        "layers": {n: [_num(b), _num(a)] for n, (b, a) in d.layers.items()},
        "changed_nodes": changed_nodes,
        "changed_modules": sorted({owner[p] for p in changed_params if p in owner}
                                  | {g1.nodes[n].get("module") or "" for n in changed_nodes} - {""}),
    }


def _rel(p):
    """‖g₁−g₀‖/‖g₀‖; "new" where g₀ = 0 and g₁ is not."""
    if p.rel_change is not None and not p.before and p.after:
        return "new"
    return _num(p.rel_change)
