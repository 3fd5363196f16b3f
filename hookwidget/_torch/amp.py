"""A GradScaler's current scale.

Checked on torch 2.13. Why a private name: GradScaler.get_scale() returns a Python float, which synchronises with
the device on every call; `scaler._scale` is the device tensor itself (None until the first scale()), which the
watch copies without waiting for the device.
"""

from __future__ import annotations


def is_grad_scaler(obj) -> bool:
    """Whether obj works as torch.amp.GradScaler does (holds a scale, can say whether it is enabled)."""
    return hasattr(obj, "_scale") and callable(getattr(obj, "is_enabled", None))


def current_scale(scaler):
    """The scale the scaler multiplies losses by now: a device tensor, or None before its first scale()."""
    return scaler._scale
