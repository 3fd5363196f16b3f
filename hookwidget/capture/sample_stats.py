"""Per-sample gradient norms per step for the watch (`hw.watch(per_sample=True)`): the largest one and its
sample, from each layer's (a, δ) shortcut as its δ arrives (the keep strategy "stats", step_stats.py, calls it)."""

from __future__ import annotations

import torch

from hookwidget._torch.tensors import version
from hookwidget.capture.stat_rows import F64, NAN


class _Call:
    """One forward call of a layer, as the per-sample rules read it (a, δ, the layer's state then)."""

    __slots__ = ("a", "delta", "state", "version")

    def __init__(self, a: torch.Tensor, state):
        self.a, self.delta, self.state, self.version = a.detach(), None, state, version(a)


class PerSample:
    """Per step, the largest per-sample gradient norm and its sample, from the layers' (a, δ) shortcuts
    (ghost norms: Linear's ‖Σ_t δ_t a_tᵀ‖² from two Gram products, never the per-sample gradients
    themselves, where that is cheaper). A layer's squared norms are computed as soon as the δ of its
    last call of the step arrives, and its a and δ let go at once."""

    def __init__(self, layers: list, layer_names: list, pairs: list):
        from hookwidget.layers import factors as fx

        self.fx = fx
        owners: dict = {}
        for li, pi in pairs:
            owners.setdefault(pi, set()).add(li)
        shared = {li for ls in owners.values() if len(ls) > 1 for li in ls}
        self.eligible, left = set(), []
        for li, m in enumerate(layers):
            why = fx.unsupported_reason(m)
            if why is None and fx.is_generic(m):
                why = "no exact (a, δ) rule"
            if why is None and li in shared:
                why = "a parameter shared with another layer (weight tying)"
            if why is None and not any(p.requires_grad for p in m.parameters(recurse=False)):
                continue
            if why is None:
                self.eligible.add(li)
            else:
                left.append(f"{layer_names[li]} ({why})")
        self.layers, self.layer_names, self.odd = layers, layer_names, set()
        self.note = (f"hw.watch(per_sample=True): per-sample norms leave out {', '.join(left[:6])}"
                     f"{' ...' if len(left) > 6 else ''}") if left else None

    def forward(self, step, li: int, module, a: torch.Tensor):
        """A call of layer li read a: its _Call (None where the layer is left out)."""
        if step.ps_batch is None and a is not None and a.dim() > 0:
            step.ps_batch = a.shape[0]  # the first watched call reads the model's input: its batch
        if li not in self.eligible or a is None or a.dim() == 0:
            return None
        call = _Call(a, self.fx.forward_state(module))
        step.ps_calls.setdefault(li, []).append(call)
        return call

    def delta(self, step, li: int, call, grad: torch.Tensor) -> None:
        """δ of that call arrived (under the watch's lock): reduce the layer once all its calls have theirs."""
        call.delta = grad.detach()
        calls = step.ps_calls.get(li)
        if calls and all(c.delta is not None for c in calls):
            self._reduce(step, li, calls)

    def end(self, step, dev):
        """The step's [largest per-sample gradient norm, its sample] (float64, on dev), NaN if not known."""
        for li, calls in list(step.ps_calls.items()):
            got = [c for c in calls if c.delta is not None]
            if got:
                self._reduce(step, li, got)
        step.ps_calls = {}
        sq = step.ps_sq.get(step.ps_batch)
        if sq is None or step.ps_bad:
            return torch.full((2,), NAN, dtype=F64, device=dev)
        m, i = torch.max(sq.to(dev, F64), 0)
        return torch.stack([m.sqrt(), i.to(F64)])

    def odd_note(self) -> str | None:
        if not self.odd:
            return None
        names = ", ".join(self.layer_names[li] for li in sorted(self.odd))
        return (f"hw.watch(per_sample=True): per-sample norms leave out {names}: the leading dimension of its "
                "input is not the batch's (the leading dimension of the first watched layer's input)")

    def _reduce(self, step, li: int, calls: list) -> None:
        step.ps_calls.pop(li, None)
        if any(version(c.a) != c.version for c in calls):
            step.ps_bad = True  # an input changed in place after the layer read it: not known this step
        else:
            with torch.no_grad():
                m = self.layers[li]
                sq = self.fx.layer_norm_sq(m, self.fx.factors(m, calls)).to(F64)
            n = sq.shape[0]
            step.ps_sq[n] = step.ps_sq[n] + sq if n in step.ps_sq else sq
            if n != step.ps_batch:
                self.odd.add(li)  # its rows are not the batch's samples (a position embedding: tokens)
        for c in calls:
            c.a = c.delta = None
