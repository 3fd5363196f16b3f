"""What the front-end shows of a Trace: small JSON summaries up front, tensor detail on request.

Summaries (graph, module tree, norms, shapes, health, the hooks on) are plain JSON. Tensors are
never JSON lists: `detail()` returns a meta dict plus a list of binary buffers, each described in
the meta as `{buffer, dtype, shape, true_shape, ...}` and downsampled here to at most MAX_SIDE
cells per side. Shared by the live widget (custom messages) and the standalone page (inlined).
The shapes of it all are written down once, in ../payload_schema.json, which the Python and the
front-end tests both check.

One module a job: summaries (before any click), details (one layer or node, on request), grads (a layer's
W.grad beside its factors' Σ δ⊗a, in a detail), changes (what a rerun changed), tensors (pictures as buffers),
numbers (JSON-safe values and whole-tensor statistics).
Imports stats, layers, interventions and analysis (lazily) below it; nothing outside views/ imports it.
"""

from hookwidget.views.payload.changes import _rel, diff
from hookwidget.views.payload.details import PER_SAMPLE_LIMIT, detail, first_sample_grad
from hookwidget.views.payload.numbers import CHUNK, _num, max_abs_diff, stats
from hookwidget.views.payload.summaries import (
    HEALTH_LIMIT,
    _tensor_info,
    graph_summary,
    health,
    hooks,
    kinds,
    module_tree,
    summary,
)
from hookwidget.views.payload.tensors import MAP_SIDE, MAX_CHANNELS, MAX_SAMPLES, MAX_SIDE, downsample, samples

__all__ = ["CHUNK", "HEALTH_LIMIT", "MAP_SIDE", "MAX_CHANNELS", "MAX_SAMPLES", "MAX_SIDE", "PER_SAMPLE_LIMIT",
           "_num", "_rel", "_tensor_info", "detail", "diff", "downsample", "first_sample_grad", "graph_summary",
           "health", "hooks", "kinds", "max_abs_diff", "module_tree", "samples", "stats", "summary"]
