"""What the front-end shows of a Trace: small JSON summaries up front, tensor detail on request.

Summaries (graph, module tree, norms, shapes, health, the hooks on) are plain JSON. Tensors are
never JSON lists: `detail()` returns a meta dict plus a list of binary buffers, each described in
the meta as `{buffer, dtype, shape, true_shape, ...}` and downsampled here to at most MAX_SIDE
cells per side. Shared by the live widget (custom messages) and the standalone page (inlined).
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from hookwidget.stats import known_l2, l2_norm_map

MAX_SIDE = 200  # cells per side of a heatmap sent to the front-end
MAX_SAMPLES = 8  # samples of a (B, C, H, W) or (B, T, d) tensor sent as pictures (one selectable at a time)
MAX_CHANNELS = 64  # channel maps per sample of a conv activation / δ
MAP_SIDE = 32  # cells per side of one channel map
PER_SAMPLE_LIMIT = 50_000_000  # floats: above this, the per-sample δ⊗a heatmap is skipped
CHUNK = 1 << 18  # entries per piece when a statistic of a large tensor is taken a piece at a time (2 MiB of float64)
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
    norms = l2_norm_map({id(t): t for c in firsts for t, s in ((c.a, c.a_summary), (c.delta, c.delta_summary))
                       if t is not None and s is None})  # kept without a summary: reduced here, all at once
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


def diff(before, after) -> dict:
    """Loss and per-parameter grad norms before/after a rerun, and which nodes and modules changed."""
    d = after.diff(before)
    g0, g1 = before.graph, after.graph
    changed_nodes = [n for n, attrs in g1.nodes(data=True)
                     if n not in g0 or not _same(g0.nodes[n].get("grad_norm"), attrs.get("grad_norm"))]
    owner = {n: r["name"] for r in module_tree(after, {}) for n in r["own_params"]}
    hooked = {h["target"] for h in hooks(after)}
    params = [{"name": p.name, "before": _num(p.before), "after": _num(p.after),
               "rel_change": _rel(p), "cosine": _num(p.cosine),
               "hooked": p.name in hooked or owner.get(p.name) in hooked} for p in d.params]
    changed_params = {p["name"] for p in params if p["rel_change"] != 0.0}
    return {
        "against": "baseline" if before is getattr(getattr(after, "session", None), "baseline", None) else "previous",
        "hooks": sorted(hooked),
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


# -- detail --------------------------------------------------------------------------------------
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
    meta = {"kind": "layer", "target": name, "cls": type(layer.module).__name__, "calls": len(layer.calls),
            "shapes": {}, "notes": _layer_notes(trace, name), "flags": health(trace).get("layers", {}).get(name, [])}
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
    rebuilt = _try(lambda: trace.weight_grad(name), meta)
    out.add("grad_rebuilt", rebuilt, "param")
    if autograd is not None and rebuilt is not None and autograd.shape == rebuilt.shape:
        meta["max_abs_diff"] = _num(max_abs_diff(autograd, rebuilt))
    if rebuilt is not None and c is not None and c.a is not None:
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


class _Buffers:
    """Collects downsampled float32 buffers and their descriptions."""

    def __init__(self, max_side: int = MAX_SIDE, memo: dict | None = None):
        self.max_side = max_side
        self.memo = memo
        self.meta: dict = {}
        self.buffers: list[bytes] = []

    def add(self, key: str, t, layout: str) -> None:
        if t is None:
            return
        hit = self.memo.get((id(t), layout)) if self.memo is not None else None
        if hit is not None and hit[0] is t:
            _, data, info = hit
        else:
            if layout == "rows" and t.dim() in (3, 4) and t.shape[0] > 0:
                view, info = samples(t, self.max_side)
            else:
                view, info = downsample(t, layout, self.max_side)
            data = view.tobytes()
            if self.memo is not None:
                self.memo[(id(t), layout)] = (t, data, info)  # holds t: its id is not reused meanwhile
        self.meta[key] = {**info, "buffer": len(self.buffers)}
        self.buffers.append(data)


def downsample(t: torch.Tensor, layout: str = "rows", max_side: int = MAX_SIDE) -> tuple[np.ndarray, dict]:
    """A 2-D float32 view of `t` with at most max_side cells per side (block means), plus its description.

    layout "rows": leading dims flattened into rows, last dim as columns (activations, δ);
    "param": first dim as rows, the rest as columns (weights); "vector": 1-D, at most MAX_SIDE*5 bars."""
    MAX = max_side  # noqa: N806
    x = t.detach().to("cpu", torch.float32)
    if layout == "vector":
        x = x.reshape(-1)
        n = x.numel()
        if n > MAX_SIDE * 5:
            x = F.adaptive_avg_pool1d(x.view(1, 1, n), MAX_SIDE * 5).view(-1)
        arr = x.numpy()
        shape = [int(arr.shape[0])]
    else:
        if x.dim() == 0:
            x = x.reshape(1, 1)
        elif x.dim() == 1:
            x = x.reshape(1, -1)
        elif layout == "param":
            x = x.reshape(x.shape[0], -1)
        else:
            x = x.reshape(-1, x.shape[-1])
        rows, cols = x.shape
        if rows > MAX or cols > MAX:
            x = F.adaptive_avg_pool2d(x.view(1, 1, rows, cols), (min(rows, MAX), min(cols, MAX)))[0, 0]
        arr = x.contiguous().numpy()
        shape = [int(arr.shape[0]), int(arr.shape[1])]
    arr = np.ascontiguousarray(arr, dtype="<f4")
    return arr, _describe(arr, shape, t, "matrix")


def samples(t: torch.Tensor, max_side: int = MAX_SIDE) -> tuple[np.ndarray, dict]:
    """Pictures that fit the tensor, for the first MAX_SAMPLES samples:

    (B, C, H, W) -> (S, C', h, w): per-channel maps (C' ≤ MAX_CHANNELS, h, w ≤ MAP_SIDE), layout "channels";
    (B, T, d)    -> (S, T', d'): one T × d picture per sample (≤ max_side per side), layout "sequence"."""
    x = t.detach().to("cpu", torch.float32)[:MAX_SAMPLES]
    if x.dim() == 4:
        s, c, hh, ww = x.shape
        x = x[:, :MAX_CHANNELS]
        side = min(MAP_SIDE, max_side)
        if hh > side or ww > side:
            x = F.adaptive_avg_pool2d(x, (min(hh, side), min(ww, side)))
        layout = "channels"
    else:
        s, tt, d = x.shape
        if tt > max_side or d > max_side:
            x = F.adaptive_avg_pool2d(x.unsqueeze(1), (min(tt, max_side), min(d, max_side)))[:, 0]
        layout = "sequence"
    arr = np.ascontiguousarray(x.contiguous().numpy(), dtype="<f4")
    info = _describe(arr, [int(v) for v in arr.shape], t, layout)
    info["samples"] = int(arr.shape[0])
    return arr, info


def _describe(arr: np.ndarray, shape: list, t: torch.Tensor, layout: str) -> dict:
    """The picture's own range (for its colour scale) and the statistics of the FULL tensor beside it."""
    finite = arr[np.isfinite(arr)]
    return {"dtype": "float32", "shape": shape, "true_shape": [int(s) for s in t.shape], "layout": layout,
            "min": _num(float(finite.min())) if finite.size else None,
            "max": _num(float(finite.max())) if finite.size else None,
            "nonfinite": int(arr.size - finite.size), "stats": stats(t)}


def stats(t: torch.Tensor) -> dict:
    """min, max, mean, std over the finite entries, the 2-norm, and NaN / Inf counts of the whole tensor."""
    x = t.detach()
    x = x if x.is_floating_point() else x.float()
    n = x.numel()
    if n == 0:
        return {"numel": 0, "min": None, "max": None, "mean": None, "std": None, "norm": 0.0, "nan": 0, "inf": 0}
    lo, hi = torch.aminmax(x.reshape(-1))  # NaN propagates: both finite means every entry is
    if math.isfinite(float(lo)) and math.isfinite(float(hi)):
        nan = inf = 0
        f = x.reshape(-1)
    else:  # count them, and describe the finite entries
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        f = x[torch.isfinite(x)]
        if f.numel() == 0:
            return {"numel": n, "min": None, "max": None, "mean": None, "std": None, "norm": _num(_norm(x)),
                    "nan": nan, "inf": inf}
        lo, hi = torch.aminmax(f)
    if f.numel() <= CHUNK or f.device.type != "cpu":  # small, or on an accelerator: float64 in one go
        std, mean = torch.std_mean(f.double(), unbiased=False)
        mean, std = float(mean), float(std)
    else:  # two passes a piece at a time in float64: no full-size copy, and no cancellation in the variance
        f = f.reshape(-1)
        mean = sum(float(p.sum()) for _, p in _pieces(f)) / f.numel()
        std = math.sqrt(sum(float(torch.linalg.vector_norm(p.sub_(mean))) ** 2 for _, p in _pieces(f)) / f.numel())
    return {"numel": int(n), "min": _num(float(lo)), "max": _num(float(hi)), "mean": _num(mean),
            "std": _num(std), "norm": _num(_norm(x)), "nan": nan, "inf": inf}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| in float64; on the CPU a piece at a time (GPT-2's head gradient is 38M floats: no float64 copy)."""
    if a.device.type != "cpu":  # an accelerator does the float64 copies at memory speed
        return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0
    b = b.detach().reshape(-1)
    peaks = [float(p.sub_(b[i:i + len(p)]).abs_().max()) for i, p in _pieces(a.detach().reshape(-1))]
    return math.nan if any(v != v for v in peaks) else max(peaks, default=0.0)  # NaN wins, as torch's max


def _pieces(x: torch.Tensor):
    """(offset, piece) over flat `x`, each piece copied into one reused float64 buffer of CHUNK entries: it stays
    in cache, where a full-size temporary of a large tensor costs more in page faults than the arithmetic."""
    buf = torch.empty(min(CHUNK, x.numel()), dtype=torch.float64)
    for i in range(0, x.numel(), CHUNK):
        c = x[i:i + CHUNK]
        yield i, buf[:c.numel()].copy_(c)


# -- helpers -------------------------------------------------------------------------------------
def _num(v):
    """JSON-safe number: NaN/±Inf become the strings "nan", "inf", "-inf" (JSON has no NaN)."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return v if math.isfinite(v) else ("nan" if v != v else ("inf" if v > 0 else "-inf"))
    return v


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (a != a and b != b)


def _shape(s):
    return None if s is None else [int(v) for v in s]


def _norm(t: torch.Tensor) -> float:
    """2-norm for display, without a float64 copy of the tensor (an embedding's grad is 38M floats); not
    again for one whose norm the graph or the summary took (a .grad, a δ)."""
    known = known_l2(t)
    if known is not None:
        return known
    t = t.detach()
    return float(torch.linalg.vector_norm(t if t.is_floating_point() else t.float()))


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
        norm = norm if norm is not None else (_norm(t) if t.numel() else 0.0)
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


def _layer_notes(trace, name: str) -> list[str]:
    """The trace's notes that concern this layer (their `layers` field), one line each."""
    return [str(n).splitlines()[0] for n in trace.note_records if name and name in n.layers][:10]


def _try(fn, meta: dict):
    """Run fn; on an error keep its one-line message in meta['notes'] and return None."""
    try:
        return fn()
    except Exception as e:
        text = str(e).strip().splitlines()
        meta["notes"].append(text[0][:300] if text else f"failed: {type(e).__name__}")
        return None


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
