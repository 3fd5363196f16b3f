"""What the explorer draws before any click: the graph, the module tree with its norms and shapes, the
parameters' gradient norms, the notes, the hooks on, the intervention kinds and the health flags. Plain JSON,
no tensor values (payload_schema.json, "summary")."""

from __future__ import annotations

import math
import weakref

import torch

from hookwidget.record.saved import dense_layout
from hookwidget.stats import l2_norm_map
from hookwidget.views.payload.numbers import _norm, _num, _shape

HEALTH_LIMIT = 4_000_000  # layers × parameters: above this trace.health() (quadratic today) is skipped
_health_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def summary(trace) -> dict:
    """Everything the explorer draws before any click: JSON-safe, no tensor values. Tensor norms come from
    stats.l2_norms: one multi-tensor reduction, and none again for a tensor the graph's nodes reduced."""
    h = health(trace)  # builds the graph first: its .grad and δ norms are the tree's and the parameters'
    notes = trace.note_records
    return {
        "graph": graph_summary(trace.graph),
        "modules": module_tree(trace, h.get("layers", {})),
        "params": {n: _num(v) for n, v in l2_norm_map(trace.param_grads).items()},
        "loss": _num(trace.loss),
        "notes": [str(n) for n in notes],
        "note_ids": [n.id for n in notes],  # the front-end finds a note by its id, never by its text
        "has_grads": bool(trace.param_grads) or any(c.delta is not None or c.delta_summary is not None
                                                    for layer in trace.layers.values() for c in layer.calls[:1]),
        "hooks": hooks(trace),
        "kinds": kinds(),
        "health": h,
    }



def graph_summary(g) -> dict:
    """Columnar node attributes plus edges as flat pairs of node indices (u → v: gradient flow)."""
    ids = list(g.nodes)
    index = {n: i for i, n in enumerate(ids)}
    cols = {k: [] for k in ("name", "role", "module", "param", "shape", "grad_norm")}
    for n in ids:
        d = g.nodes[n]
        cols["name"].append(str(d.get("name", n)))
        cols["role"].append(str(d.get("role", "op")))
        cols["module"].append(str(d.get("module") or ""))
        cols["param"].append(str(d.get("param") or ""))
        shape = d.get("shape")
        cols["shape"].append(None if shape is None else [int(s) for s in shape])
        cols["grad_norm"].append(_num(d.get("grad_norm")))
    edges = [i for u, v in g.edges for i in (index[u], index[v])]
    return {"id": ids, **cols, "edges": edges}



def module_tree(trace, flags: dict | None = None) -> list[dict]:
    """One row per called module, in call order: name, class, parent, parameter and call counts, shapes,
    and the user's own hooks on it and its parameters."""
    layers = trace.layers
    parent = _parents(layers)
    flags = health(trace).get("layers", {}) if flags is None else flags
    grad_norm = l2_norm_map(trace.param_grads)
    firsts = [layer.calls[0] for layer in layers.values() if layer.calls]
    kept = ((t, s) for c in firsts for t, s in ((c.a, c.a_summary), (c.delta, c.delta_summary)))
    # kept without a summary: reduced here, all at once, as a saved record holds them (the same figure loaded)
    norms = l2_norm_map({id(t): dense_layout(t) for t, s in kept if t is not None and s is None})
    qualified = _param_names(trace)
    rows = []
    for name, layer in layers.items():
        m, c = layer.module, layer.calls[0] if layer.calls else None
        own = [qualified.get(id(p)) or (f"{name}.{n}" if name else n) for n, p in m.named_parameters(recurse=False)]
        grads = [grad_norm.get(p) for p in own]
        rows.append({
            "name": name,
            "cls": type(m).__name__,
            "parent": parent.get(name),
            "params": int(sum(p.numel() for p in m.parameters())),
            "own_params": own,
            "calls": len(layer.calls),
            "a": _tensor_info(c.a if c else None, c.a_summary if c else None, norms),
            "delta": _tensor_info(c.delta if c else None, c.delta_summary if c else None, norms),
            "output_shape": _shape(c.output_shape) if c else None,
            "grad_norm": _num(math.sqrt(sum(v * v for v in grads if v is not None)))
            if any(v is not None for v in grads) else None,
            "supports": bool(own) and _supports(trace, name),
            "flags": flags.get(name, []),
            "user_hooks": [h for key in (name, *own)
                           for h in trace.user_hooks.get(key, ())],
        })
    return rows



def hooks(trace) -> list[dict]:
    """The interventions on the trace; a Python callable is shown by its name, never sent."""
    out = []
    session = getattr(trace, "session", None)
    for iv in (session.interventions if session is not None else getattr(trace, "interventions", [])):
        params = {k: (_num(v) if isinstance(v, (int, float)) else getattr(v, "__qualname__", type(v).__name__))
                  for k, v in iv.params.items()}
        out.append({"target": iv.target, "kind": iv.kind.name, "params": params})
    return out



def kinds() -> list[dict]:
    """The registered intervention kinds, so the controls list exactly what the kernel accepts."""
    from hookwidget.interventions import KINDS

    return [{"name": k.name, "doc": k.doc, "attach": getattr(k, "attach", "grad"), "python_only": k.python_only,
             "params": [{"name": p, "type": getattr(t, "__name__", str(t)), "default": _num(d)}
                        for p, (t, d) in k.params.items()]}
            for k in KINDS.values()]



def health(trace) -> dict:
    """Health flags per layer and the first node whose gradient is not finite; {} without health().

    Computed once per trace (the summary and every detail use it)."""
    try:
        return _health_cache[trace]
    except (KeyError, TypeError):
        pass
    out = _health(trace)
    try:
        _health_cache[trace] = out
    except TypeError:  # not weak-referenceable: just do not cache
        pass
    return out



def _health(trace) -> dict:
    fn = getattr(trace, "health", None)
    if fn is None:
        return {}
    if len(trace.layers) * max(1, len(getattr(trace, "params", {}))) > HEALTH_LIMIT:
        return {"error": f"health flags skipped: {len(trace.layers)} layers is too many to check here"}
    try:
        h = fn()
    except Exception as e:  # health is advisory: never let it hide the explorer
        return {"error": f"{type(e).__name__}: {e}"}
    return {"layers": {n: f for n, f in h.flagged.items()}, "first_nonfinite_node": h.first_nonfinite_node,
            "nonfinite_nodes": list(h.nonfinite_nodes)[:100]}



def _param_names(trace) -> dict:
    """id(parameter) -> its qualified name in the trace (a traced root layer's weight is "weight", whatever
    the layer's own name in the tree)."""
    return {id(p): n for n, p in getattr(trace, "params", {}).items()}



def _tensor_info(t, s, norms: dict | None = None) -> dict | None:
    """Shape, norm, range and NaN/Inf count of a kept tensor or of its summary (`norms`: id(t) -> ‖t‖₂ where
    already reduced)."""
    if s is not None:  # statistics the capture already took
        return {"shape": _shape(s.shape), "dtype": s.dtype, "kept": t is not None, "norm": _num(s.norm),
                "nonfinite": int(s.nan + s.inf)}
    if t is not None:
        norm = norms.get(id(t)) if norms is not None else None
        norm = norm if norm is not None else (_norm(dense_layout(t)) if t.numel() else 0.0)
        # A finite norm means finite entries; count NaN/Inf only when it is not (or it overflowed).
        bad = 0 if math.isfinite(norm) or not t.is_floating_point() else int((~torch.isfinite(t.detach())).sum())
        return {"shape": _shape(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "kept": True,
                "norm": _num(norm), "nonfinite": bad}
    if s is not None:
        return {"shape": _shape(s.shape), "dtype": s.dtype, "kept": False, "norm": _num(s.norm),
                "nonfinite": int(s.nan + s.inf)}
    return None



def _supports(trace, name: str) -> bool:
    try:
        return bool(trace.supports(name))
    except Exception:
        return False



def _parents(layers: dict) -> dict:
    """Layer name -> nearest enclosing called module's name (through uncalled containers like ModuleList)."""
    by_id = {id(layer.module): name for name, layer in layers.items()}
    parent: dict = {}
    for name, layer in layers.items():
        stack = list(layer.module.children())
        seen = set()
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            child = by_id.get(id(m))
            if child is not None and child != name:
                parent.setdefault(child, name)
            else:
                stack.extend(m.children())
    return parent
