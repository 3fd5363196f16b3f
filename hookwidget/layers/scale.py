"""timm's LayerScale and LayerScale2d, transformers' Dinov2LayerScale: y = x ⊙ γ, so γ.grad = Σ δ ⊙ x over the
positions (a diag factor of x).

Found by their code, as the transformers norms are (registry.register's by_code): a class whose forward is a copy of
one of these references, over the same bases, gets the rule (timm's ViTs with layer scale, EVA, CaiT,
EfficientFormer; DINOv2 and 10 copies in transformers);
the generic rule read the same rows from the call's graph (affine_nodes.py), but only the exact rules stream in
capture="norms" and in hw.watch(per_sample=True). The references are never run.
"""

from __future__ import annotations

import torch
from torch import nn

from hookwidget.layers.norm import affine_factors
from hookwidget.layers.registry import register


class TimmLayerScale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class TimmLayerScale2d(nn.Module):
    def forward(self, x):
        gamma = self.gamma.view(1, -1, 1, 1)
        return x.mul_(gamma) if self.inplace else x * gamma


def _vector(name: str):
    """refuse(m): why m's `name` is not the vector parameter its forward scales by, or None."""

    def refuse(m) -> str | None:
        g = getattr(m, name, None)
        return None if isinstance(g, nn.Parameter) and g.dim() == 1 else f"{type(m).__name__}.{name} is not a vector"

    return refuse


def _keeps_input(m) -> bool:
    return not getattr(m, "inplace", True)  # in place, x is overwritten: capture keeps its own copy


@register(TimmLayerScale, by_code=True, refuse=_vector("gamma"), params=("gamma",), tokens=True,
          keeps_input=_keeps_input)
def layer_scale(m, a, delta, state=None):
    return affine_factors(a, delta, ("gamma", m.gamma), None)


@register(TimmLayerScale2d, by_code=True, refuse=_vector("gamma"), params=("gamma",), keeps_input=_keeps_input)
def layer_scale_2d(m, a, delta, state=None):
    return affine_factors(a, delta, ("gamma", m.gamma), None, channel_dim=1)


class Dinov2StyleLayerScale(nn.Module):
    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        return hidden_state * self.lambda1


@register(Dinov2StyleLayerScale, by_code=True, refuse=_vector("lambda1"), params=("lambda1",), tokens=True)
def dinov2_layer_scale(m, a, delta, state=None):
    return affine_factors(a, delta, ("lambda1", m.lambda1), None)
