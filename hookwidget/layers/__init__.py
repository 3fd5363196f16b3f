"""Layer specs: one small module per layer family registers its exact (a, δ) rule (see registry.py; a rule may also
serve other packages' copies of a forward, found by their code), or a fast rule of the generic one (generic.py);
cost.py chooses per factor between the ghost norm and the materialised per-sample gradient, shared.py adds
the cross terms of a parameter several layers hold (tied weights).

Floor: above _torch, which is all of hookwidget it imports (torch internals only through it)."""

# first: its fast rules are tried before those of one module type (the order of generic.FAST_RULES; affine_nodes
# puts its own before them)
from hookwidget.layers import batch_copies  # noqa: F401  # isort: skip

from hookwidget.layers import (  # noqa: F401  (each registers its specs)
    affine_nodes,
    attention,
    conv,
    embedding,
    generic,
    linear,
    linear_calls,
    norm,
    recurrent,
    scale,
)
from hookwidget.layers.base import KINDS, ConvCall, ConvCalls, Factor, Kind, gram_applies
from hookwidget.layers.registry import (
    GENERIC,
    SPECS,
    LayerSpec,
    exact_reason,
    forward_state,
    is_generic,
    keeps_rows,
    lookup,
    needs_input,
    per_sample_meaning,
    register,
    spec_for,
    supported_types,
    unsupported_reason,
)

__all__ = ["GENERIC", "KINDS", "SPECS", "ConvCall", "ConvCalls", "Factor", "Kind", "LayerSpec", "exact_reason",
           "forward_state", "generic", "gram_applies", "is_generic", "keeps_rows", "lookup", "needs_input",
           "per_sample_meaning", "register", "spec_for", "supported_types", "unsupported_reason"]
