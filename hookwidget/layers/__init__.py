"""Layer specs: one small module per layer family registers its exact (a, δ) rule (see registry.py)."""

from . import conv, embedding, linear, norm  # noqa: F401  (each registers its specs)
from .base import KINDS, ConvCall, ConvCalls, Factor, Kind, gram_applies
from .registry import (
    SPECS,
    LayerSpec,
    forward_state,
    lookup,
    needs_input,
    per_sample_meaning,
    register,
    spec_for,
    supported_types,
    unsupported_reason,
)

__all__ = ["KINDS", "SPECS", "ConvCall", "ConvCalls", "Factor", "Kind", "LayerSpec", "forward_state", "gram_applies",
           "lookup", "needs_input", "per_sample_meaning", "register", "spec_for", "supported_types",
           "unsupported_reason"]
