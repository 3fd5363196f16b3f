"""What changed between two traces of the same code: grads, loss, δ per layer.

An honest diff ranks what matters: each parameter's change ‖g₁−g₀‖₂ is weighed against the model's gradient
scale (`Diff.scale`, the larger of the two runs' whole-model gradient norms), so a big relative change of a tiny
gradient does not come first. A gradient is only known to float precision: a change below `NOISE_ULPS` units of
rounding of the magnitudes it was summed from (the largest gradient norm in its module, and the module's ‖δ‖₂,
in either run) is rounding noise (`noise`), ranked last, and where either vector is that small its direction
means nothing (`cosine` is None). A bias feeding a BatchNorm is the classic case: its exact gradient is 0, its
computed one ~1e-7 of its weight's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

NOISE_ULPS = 16  # rounding error of a float sum grows ~√n ulps; below this many ulps of its scale, a change is noise


@dataclass(frozen=True)
class ParamChange:
    name: str
    before: float | None  # grad norm
    after: float | None
    rel_change: float | None  # ‖after - before‖ / ‖before‖
    cosine: float | None  # None where a vector is missing, zero or at rounding level (noise)
    change: float | None = None  # ‖after - before‖₂
    impact: float | None = None  # change / the model's gradient scale (Diff.scale): how much it matters
    noise: bool = False  # the change is below the float precision of this gradient


@dataclass
class Diff:
    params: list = field(default_factory=list)
    loss_before: float | None = None
    loss_after: float | None = None
    layers: dict = field(default_factory=dict)  # layer name -> (δ norm before, δ norm after)
    scale: float | None = None  # the model's gradient scale: max over the two runs of ‖all parameter grads‖₂
    # parameters of the same name and shape whose values differ: two model instances, or a model changed between the
    # traces; their gradients differ for that reason too, which a diff must say (it would read as a hook's effect)
    weights_differ: list = field(default_factory=list)

    def param(self, name: str) -> ParamChange:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r}; parameters: {', '.join(p.name for p in self.params)}")

    @property
    def changed(self) -> list[str]:
        """Parameters whose gradient changed by more than float noise (or appeared, or went)."""
        return [p.name for p in self.params if (p.rel_change is None or p.rel_change != 0.0) and not p.noise]

    @property
    def ranked(self) -> list[ParamChange]:
        """The params by how much their change matters: appeared gradients first, then impact, noise last."""
        return sorted(self.params, key=rank_key)

    def __repr__(self) -> str:
        lines = [weights_line(self.weights_differ)] if self.weights_differ else []
        if self.loss_before is not None or self.loss_after is not None:
            lines.append(f"loss: {_f(self.loss_before)} -> {_f(self.loss_after)}")
        width = max((len(p.name) for p in self.params), default=4)
        header = ("parameter", "|grad| before", "|grad| after", "rel.change", "cosine", "impact")
        lines.append(f"{header[0]:<{width}}  {header[1]:>13}  {header[2]:>13}  {header[3]:>10}  {header[4]:>7}  "
                     f"{header[5]:>8}")
        for p in self.ranked:
            lines.append(f"{p.name:<{width}}  {_f(p.before):>13}  {_f(p.after):>13}  {_f(p.rel_change):>10}  "
                         f"{_f(p.cosine):>7}  {'noise' if p.noise else _f(p.impact):>8}")
        return "\n".join(lines)


def rank_key(p: ParamChange) -> tuple:
    """Sort key of the ranking: a gradient that appeared from zero first, then by impact, noise and unknowns last
    (the same order as js/explorer/diffview.js's rankRows)."""
    appeared = p.rel_change == math.inf
    return (p.noise, not appeared, -(p.impact if p.impact is not None else -1.0), p.name)


def diff(before, after) -> Diff:
    _check_related(before, after)
    names = list(dict.fromkeys([*before.param_grads, *after.param_grads]))
    g0s, g1s = [before.param_grads.get(n) for n in names], [after.param_grads.get(n) for n in names]
    n0s, n1s = [_norm(g) for g in g0s], [_norm(g) for g in g1s]
    scale = max(_total(n0s), _total(n1s))
    deltas = {name: (_delta_norm(before.layers.get(name)), _delta_norm(after.layers.get(name)))
              for name in dict.fromkeys([*before.layers, *after.layers])}
    floors = _noise_floors(names, g0s, g1s, n0s, n1s, deltas)
    out = Diff(loss_before=before.loss, loss_after=after.loss, layers=deltas, scale=scale or None,
               weights_differ=_weights_differ(before.params, after.params))
    for k, name in enumerate(names):
        out.params.append(_change(name, g0s[k], g1s[k], n0s[k], n1s[k], scale, floors[k]))
    return out


def _check_related(before, after) -> None:
    """Two traces of unrelated models (no parameter of the same name and shape) are refused in one line: every
    parameter would read as changed, like a hook's effect."""
    p0, p1 = before.params, after.params
    if p0 and p1 and not any(n in p1 and tuple(p.shape) == tuple(p1[n].shape) for n, p in p0.items()):
        few = ", ".join(list(p0)[:2]), ", ".join(list(p1)[:2])
        raise ValueError(f"these traces share no parameter (before: {few[0]}, ...; after: {few[1]}, ...): diff "
                         "compares two runs of the same code, e.g. t.rerun().diff(t)")


def weights_line(names: list) -> str:
    """The one line that says two traces ran with different weights (repr; the explorer says the same)."""
    few = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"weights differ: {few} held other values in the two runs (two model instances, or the model changed "
            "between them), so their gradients differ for that reason too, not only by a hook")


def _weights_differ(p0: dict, p1: dict) -> list[str]:
    """Parameters of the same name and shape whose values differ. A rerun's are its first run's own tensors (put
    back before it ran): the same object, not compared."""
    out = []
    for name, a in p0.items():
        b = p1.get(name)
        if b is None or a is b or tuple(a.shape) != tuple(b.shape):
            continue
        if a.device != b.device:
            b = b.to(a.device)
        if not torch.equal(a.detach(), b.detach()):
            out.append(name)
    return out


def _change(name, g0, g1, n0, n1, scale, floor) -> ParamChange:
    if g0 is None or g1 is None or g0.shape != g1.shape:
        return ParamChange(name, n0, n1, None, None)
    a, b = g0.double().flatten(), g1.double().flatten()
    change = float(torch.linalg.vector_norm(b - a))
    rel = change / n0 if n0 else (0.0 if not n1 else float("inf"))
    noise = change <= floor and change > 0
    # A direction needs a vector above rounding level: a noise-level gradient's cosine is a random number.
    cos = float(a @ b / (n0 * n1)) if n0 and n1 and min(n0, n1) > floor else None
    return ParamChange(name, n0, n1, rel, cos, change, change / scale if scale else None, noise)


def _noise_floors(names, g0s, g1s, n0s, n1s, deltas) -> list[float]:
    """Per parameter: NOISE_ULPS units of rounding (of its dtype) of the magnitudes its gradient was summed from:
    the largest gradient norm among its module's parameters and that module's ‖δ‖₂ (first call), in either run."""
    module_scale: dict = {}
    for name, n0, n1 in zip(names, n0s, n1s):
        mod = name.rpartition(".")[0]
        module_scale[mod] = max(module_scale.get(mod, 0.0), n0 or 0.0, n1 or 0.0)
    out = []
    for name, g0, g1 in zip(names, g0s, g1s):
        mod = name.rpartition(".")[0]
        ref = max(module_scale[mod], *(v for v in deltas.get(mod, ()) if v is not None and math.isfinite(v)), 0.0)
        g = g0 if g0 is not None else g1
        eps = torch.finfo(g.dtype).eps if g is not None and g.is_floating_point() else 0.0
        out.append(NOISE_ULPS * eps * ref if math.isfinite(ref) else 0.0)
    return out


def _norm(g) -> float | None:
    return None if g is None else float(torch.linalg.vector_norm(g.double()))


def _total(norms) -> float:
    finite = [v for v in norms if v is not None and math.isfinite(v)]
    return math.sqrt(sum(v * v for v in finite))


def _delta_norm(layer) -> float | None:
    if layer is None or not layer.calls:
        return None
    c = layer.calls[0]
    if c.delta is not None:
        return float(torch.linalg.vector_norm(c.delta.double()))
    return c.delta_summary.norm if c.delta_summary is not None else None


def _f(v) -> str:
    return "-" if v is None else f"{v:.4g}"
