"""The detail of one layer or graph node, sent on request: its shapes, notes and health, and its tensors
(a, δ, W.grad from autograd beside Σ δ⊗a from the factors (grads.py), sample 0's share, per-sample norms) as
buffers (payload_schema.json, "detail_meta")."""

from __future__ import annotations

import torch

from hookwidget.views.payload import grads, summaries
from hookwidget.views.payload.numbers import _num, _shape
from hookwidget.views.payload.summaries import _param_names, _supports, _tensor_info
from hookwidget.views.payload.tensors import MAX_SIDE, _Buffers

PER_SAMPLE_LIMIT = 50_000_000  # floats: above this, the per-sample δ⊗a heatmap is skipped


def detail(trace, target: str, max_side: int = MAX_SIDE, memo: dict | None = None) -> tuple[dict, list[bytes]]:
    """Meta + buffers for one layer name or graph node id. Raises KeyError for an unknown target.

    Heatmaps have at most `max_side` cells per side (the standalone page inlines every layer: smaller).
    `memo` (a dict the caller keeps for one export) reuses the picture of a tensor already described,
    such as a weight's .grad shown by its layer and by its parameter node."""
    out = _Buffers(max_side, memo)
    if target in trace.layers:
        meta = _layer_detail(trace, target, out)
    elif target in trace.graph:
        meta = _node_detail(trace, target, out)
    else:
        raise KeyError(f"unknown target {target!r}: give a layer name or a graph node id")
    meta["tensors"] = out.meta
    return meta, out.buffers



def _layer_detail(trace, name: str, out: _Buffers) -> dict:
    layer = trace.layers[name]
    c = layer.calls[0] if layer.calls else None
    flags = summaries.health(trace).get("layers", {}).get(name, [])  # through the module: benchmarks time it
    meta = {"kind": "layer", "target": name, "cls": type(layer.module).__name__, "calls": len(layer.calls),
            "shapes": {}, "notes": _layer_notes(trace, name), "flags": flags}
    if c is not None:
        meta["shapes"] = {"a": _tensor_info(c.a, c.a_summary), "delta": _tensor_info(c.delta, c.delta_summary),
                          "output": _shape(c.output_shape)}
        out.add("a", c.a, "rows")
        out.add("delta", c.delta, "rows")
    w = getattr(layer.module, "weight", None)
    if not isinstance(w, torch.Tensor):
        if any(p.requires_grad for p in layer.module.parameters(recurse=False)):
            reason = _unsupported(trace, name)  # parameters under other names (an LSTM's, a layer scale)
            if reason is not None:
                meta["unsupported"] = reason
            else:
                out.add("per_sample_norms", _try(lambda: trace.per_sample_grad_norms(name), meta), "vector")
        return meta
    meta["shapes"]["weight"] = _shape(w.shape)
    pname = _param_names(trace).get(id(w)) or (f"{name}.weight" if name else "weight")
    autograd = trace.param_grads.get(pname)
    out.add("grad_autograd", autograd, "param")
    reason = _unsupported(trace, name)
    if reason is not None:
        meta["unsupported"] = reason
        return meta
    if grads.weight_grads(trace, name, w, autograd, out, meta) and c is not None and c.a is not None:
        batch = c.a.shape[0]
        if batch * w.numel() <= PER_SAMPLE_LIMIT:
            out.add("per_sample_grad0", _try(lambda: first_sample_grad(trace, name), meta), "param")
        else:
            meta["notes"].append(f"per-sample δ⊗a not shown: {batch} × {w.numel()} floats")
        norms = _try(lambda: trace.per_sample_grad_norms(name), meta)
        out.add("per_sample_norms", norms, "vector")
    storage = _try(lambda: trace.storage(name), meta)
    if storage is not None and any(v for v in storage.values() if isinstance(v, (int, float))):
        meta["storage"] = {k: (_shape(v) if isinstance(v, tuple) else v) for k, v in storage.items()}
    return meta



def first_sample_grad(trace, name: str) -> torch.Tensor:
    """Sample 0's share of W.grad: from its own rows of (a, δ) where the factor allows (a linear map or an
    embedding, one step: B times less work than every sample's), else row 0 of trace.per_sample_grads."""
    from hookwidget.analysis import batches
    from hookwidget.analysis import per_sample as ps
    from hookwidget.layers import factors as fx

    try:
        fs = ps.param_factors(trace, name, "weight", None)
    except ValueError:
        fs = []
    if len(fs) == 1 and fs[0].conv is None and fs[0].X is not None and fs[0].per_sample == "exact":
        f = fs[0]
        batches.check_batched(trace, name, None)
        one = fx.Factor(f.param, f.kind, f.D[:1], f.X[:1], f.shape, f.rows, per_sample=f.per_sample)
        return fx.per_sample_grad(one)[0]
    return trace.per_sample_grads(name)[0]



def _node_detail(trace, node: str, out: _Buffers) -> dict:
    g = trace.graph
    d = g.nodes[node]
    meta = {"kind": "node", "target": node, "name": str(d.get("name")), "role": str(d.get("role")),
            "module": str(d.get("module") or ""), "param": str(d.get("param") or ""),
            "shape": _shape(d.get("shape")), "grad_norm": _num(d.get("grad_norm")),
            "next": [str(v) for v in g.successors(node)][:50], "prev": [str(u) for u in g.predecessors(node)][:50],
            "notes": []}
    if meta["param"]:
        out.add("grad_autograd", trace.param_grads.get(meta["param"]), "param")
    return meta



def _unsupported(trace, name: str) -> str | None:
    """One line saying why (a, δ) do not rebuild this layer's W.grad, or None when they do."""
    if _supports(trace, name):
        return None
    module = trace.layers[name].module
    try:
        from hookwidget.layers import factors

        why = factors.unsupported_reason(module)
        if why is None:  # the generic rule was refused here (random numbers, samples mixed): its note says why
            why = next((w[len(name) + 2:] for w in trace.per_sample_left_out.values() if w.startswith(f"{name}: ")),
                       None)
    except Exception:
        why = None
    return (f"{type(module).__name__}: no (a, δ) factor rule{f' ({why})' if why else ''}, so W.grad is shown "
            "from autograd only (no rebuilt W.grad, per-sample gradients or storage figures)")



NOTE_CHARS = 400  # of a trace's note in a layer's detail (one on GPT-2 124M lists 148 parameters: 27,500 characters)


def _layer_notes(trace, name: str) -> list[str]:
    """The trace's notes that concern this layer (their `layers` field), one line each, a long one cut with a
    pointer to the whole (the detail is read beside the graph: one note must not be pages of text)."""
    out = []
    for n in trace.note_records:
        if name and name in n.layers and len(out) < 10:
            line = str(n).splitlines()[0]
            out.append(line if len(line) <= NOTE_CHARS else f"{line[:NOTE_CHARS]}… (the whole note: t.notes)")
    return out



def _try(fn, meta: dict):
    """Run fn; on an error keep its one-line message in meta['notes'] and return None."""
    try:
        return fn()
    except Exception as e:
        text = str(e).strip().splitlines()
        meta["notes"].append(text[0][:300] if text else f"failed: {type(e).__name__}")
        return None
