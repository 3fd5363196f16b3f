"""GradScaler steps: statistics unscaled, and the steps the scaler skipped marked as such.

The watch learns the scaler from `scaler=`, or else from the first `GradScaler.scale()` call on its
thread while it is open (a stand-in for that method, installed while any watch is open, like
capture/backward.py's for backward: both through _torch/patch.py). It reads the scaler's scale tensor
(on device, no sync) when each backward starts. backward ran on `loss * scale`, so the loss, δ and .grad it saw
are scaled: they are divided by that scale (a power of two: exact; capture/stat_rows.unscale). A step is skipped
when the scaler found inf/NaN in its gradients and did not step the optimizer; `update()` then lowers the scale, and
it lowers it only then: so step k was skipped exactly when the scale at the next backward (or, for
the latest step, the scale when its row reaches the host) is below the scale at its own backward.
"""

from __future__ import annotations

import threading

import torch
from torch.amp import GradScaler

from hookwidget._torch.amp import current_scale, is_grad_scaler
from hookwidget._torch.patch import Patch
from hookwidget.capture.stat_rows import F64, NAN


class ScaleTrack:
    def __init__(self, scaler, explicit: bool = True):
        self.explicit = explicit  # given as scaler=, not seen in scale()
        if not is_grad_scaler(scaler):
            raise TypeError(f"watch(scaler=...) takes the torch.amp.GradScaler your loop uses, got "
                            f"{type(scaler).__name__}")
        self.scaler = scaler

    def now(self):
        """The scale now (a device tensor copy), or None while the scaler is off or has not scaled yet."""
        s = current_scale(self.scaler)
        return s.detach().clone() if self.scaler.is_enabled() and s is not None else None

    def pairs(self, steps: list, dev) -> torch.Tensor:
        """(steps, 2): each step's scale and the scale after it (NaN: no scaler scale), on `dev`."""
        now = None
        out = []
        for s in steps:
            nxt = s.next_scale
            if nxt is None and s.scale is not None:
                nxt = now = self.now() if now is None else now
            out.append(torch.stack([torch.full((), NAN, dtype=F64, device=dev) if v is None
                                    else v.to(dev, F64).reshape(()) for v in (s.scale, nxt)]))
        return torch.stack(out)


SKIPPED = ("GradScaler skipped this step: inf/NaN in the scaled gradients, so no optimizer step (update "
           "ratio NaN) and update() lowered the scale {:g} -> {:g}; expected now and then under mixed precision, "
           "a fault of the model only if it keeps happening")

SEVERAL = ("hw.watch: the loop uses more than one GradScaler; statistics are unscaled by the first one seen "
           "only: pass the one that scales the watched model's loss, hw.watch(model, scaler=...)")



def _stand_in(name: str, original, listening):
    def scale(self, outputs):
        me = threading.get_ident()
        for w in listening():
            if w.thread == me:
                w.saw_scaler(self)
        return original(self, outputs)

    scale.__wrapped__ = original
    scale.__name__, scale.__doc__ = original.__name__, original.__doc__
    return scale


_PATCH = Patch(GradScaler, ("scale",), _stand_in)  # open watches, each with .thread and .saw_scaler(scaler)


def listen(watch) -> None:
    """Tell `watch` of every GradScaler.scale() call on its thread until unlisten(watch)."""
    _PATCH.listen(watch)


def unlisten(watch) -> None:
    _PATCH.unlisten(watch)
