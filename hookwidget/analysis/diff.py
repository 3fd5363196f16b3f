"""What changed between two traces of the same code: grads, loss, δ per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ParamChange:
    name: str
    before: float | None  # grad norm
    after: float | None
    rel_change: float | None  # ‖after - before‖ / ‖before‖
    cosine: float | None


@dataclass
class Diff:
    params: list = field(default_factory=list)
    loss_before: float | None = None
    loss_after: float | None = None
    layers: dict = field(default_factory=dict)  # layer name -> (δ norm before, δ norm after)

    def param(self, name: str) -> ParamChange:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r}; parameters: {', '.join(p.name for p in self.params)}")

    @property
    def changed(self) -> list[str]:
        return [p.name for p in self.params if p.rel_change is None or p.rel_change != 0.0]

    def __repr__(self) -> str:
        lines = []
        if self.loss_before is not None or self.loss_after is not None:
            lines.append(f"loss: {_f(self.loss_before)} -> {_f(self.loss_after)}")
        width = max((len(p.name) for p in self.params), default=4)
        header = ("parameter", "|grad| before", "|grad| after", "rel.change", "cosine")
        lines.append(f"{header[0]:<{width}}  {header[1]:>13}  {header[2]:>13}  {header[3]:>10}  {header[4]:>7}")
        for p in self.params:
            lines.append(f"{p.name:<{width}}  {_f(p.before):>13}  {_f(p.after):>13}  {_f(p.rel_change):>10}  "
                         f"{_f(p.cosine):>7}")
        return "\n".join(lines)


def diff(before, after) -> Diff:
    _check_related(before, after)
    out = Diff(loss_before=before.loss, loss_after=after.loss)
    for name in dict.fromkeys([*before.param_grads, *after.param_grads]):
        out.params.append(_change(name, before.param_grads.get(name), after.param_grads.get(name)))
    for name in dict.fromkeys([*before.layers, *after.layers]):
        out.layers[name] = (_delta_norm(before.layers.get(name)), _delta_norm(after.layers.get(name)))
    return out


def _check_related(before, after) -> None:
    """Two traces of unrelated models (no parameter of the same name and shape) are refused in one line: every
    parameter would read as changed, like a hook's effect."""
    p0, p1 = before.params, after.params
    if p0 and p1 and not any(n in p1 and tuple(p.shape) == tuple(p1[n].shape) for n, p in p0.items()):
        few = ", ".join(list(p0)[:2]), ", ".join(list(p1)[:2])
        raise ValueError(f"these traces share no parameter (before: {few[0]}, ...; after: {few[1]}, ...): diff "
                         "compares two runs of the same code, e.g. t.rerun().diff(t)")


def _change(name, g0, g1) -> ParamChange:
    n0 = None if g0 is None else float(torch.linalg.vector_norm(g0.double()))
    n1 = None if g1 is None else float(torch.linalg.vector_norm(g1.double()))
    if g0 is None or g1 is None or g0.shape != g1.shape:
        return ParamChange(name, n0, n1, None, None)
    a, b = g0.double().flatten(), g1.double().flatten()
    rel = float(torch.linalg.vector_norm(b - a) / n0) if n0 else (0.0 if not n1 else float("inf"))
    cos = float(a @ b / (n0 * n1)) if n0 and n1 else None
    return ParamChange(name, n0, n1, rel, cos)


def _delta_norm(layer) -> float | None:
    if layer is None or not layer.calls:
        return None
    c = layer.calls[0]
    if c.delta is not None:
        return float(torch.linalg.vector_norm(c.delta.double()))
    return c.delta_summary.norm if c.delta_summary is not None else None


def _f(v) -> str:
    return "-" if v is None else f"{v:.4g}"
