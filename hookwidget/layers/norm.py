"""Normalisation layers: y = x̂ ⊙ w + b, so w.grad = Σ δ ⊙ x̂ and b.grad = Σ δ (diag and sum factors).

x̂ is recomputed from the kept input by the layer's own normalisation kernel, without the affine part.
LayerNorm and RMSNorm normalise the trailing normalized_shape, GroupNorm each sample's groups: per-sample
gradients are exact. BatchNorm on running statistics (eval with track_running_stats) is exact too; on
batch statistics (training, or no running statistics) samples share the statistics, so a sample's row is
its *contribution*: what its own δ and x̂ add to .grad (rows still sum to .grad exactly).

Other packages' norms get these rules where their code is a known copy (registry.register's by_code: references
below): timm's and torchvision's channels-last LayerNorms, transformers' RMSNorms (Llama's, T5's, Gemma's, Afmoe's)
and its ConvNeXt LayerNorm, each x̂ recomputed exactly as that forward computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hookwidget._torch.layers import unbatched_rank
from hookwidget.layers.base import Factor
from hookwidget.layers.registry import register


def _diag(m, xhat, delta, channel_dim: int | None = None, per_sample: str = "exact") -> list:
    """Factors of weight (diag) and bias (sum). channel_dim: where the parameter's axis is (norms over
    channels: GroupNorm, BatchNorm), else the parameter covers the trailing dimensions."""
    bias = getattr(m, "bias", None)
    return affine_factors(xhat, delta, ("weight", m.weight) if m.weight is not None else None,
                          ("bias", bias) if bias is not None else None, channel_dim, per_sample)


def affine_factors(xhat, delta, weight, bias, channel_dim: int | None = None, per_sample: str = "exact") -> list:
    """Factors of y = x̂ ⊙ w + b: weight (diag: Σ δ ⊙ x̂) and bias (sum: Σ δ), each given as (name, parameter) or
    None (as _diag; affine_nodes.py names the parameters of a module of another package)."""
    if weight is None and bias is None:
        return []
    B = xhat.shape[0]
    if channel_dim is not None:
        C = xhat.shape[channel_dim]
        X = xhat.reshape(B, C, -1).transpose(1, 2)
        D = delta.reshape(B, C, -1).transpose(1, 2)
    else:
        n = (weight or bias)[1].numel()
        X, D = xhat.reshape(B, -1, n), delta.reshape(B, -1, n)
    out = []
    if weight is not None:
        out.append(Factor(weight[0], "diag", D, X, tuple(weight[1].shape), per_sample=per_sample))
    if bias is not None:
        out.append(Factor(bias[0], "sum", D, None, tuple(bias[1].shape), per_sample=per_sample))
    return out


@register(nn.LayerNorm, tokens=True)
def layer_norm(m: nn.LayerNorm, a, delta, state=None):
    if not m.elementwise_affine:
        return []
    # x̂ by the layer's own normalisation kernel (one fused pass; a separate var() took 3x the forward)
    return _diag(m, F.layer_norm(a, m.normalized_shape, None, None, m.eps), delta)


@register(nn.RMSNorm, params=("weight",), tokens=True)
def rms_norm(m: nn.RMSNorm, a, delta, state=None):
    if m.weight is None:
        return []
    return _diag(m, F.rms_norm(a, m.normalized_shape, None, m.eps), delta)


# nn.LayerNorm subclasses whose forward is F.layer_norm, channels last for the 2d ones: timm's LayerNorm and
# LayerNorm2d (its ViTs, DeiT, EVA, ConvNeXt) and torchvision's LayerNorm2d (ConvNeXt). References of their code (never
# run: timm's fast_layer_norm is a name of timm's module, not of this one); a layer with timm's fast norm on is refused.
class TimmLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast_norm:
            x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # noqa: F821
        else:
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x


class TimmLayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        if self._fast_norm:
            x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # noqa: F821
        else:
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


class TorchvisionLayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


class HFConvNextLayerNorm(nn.LayerNorm):
    """transformers' ConvNextLayerNorm and 19 copies (ConvNextV2, DINOv3's ConvNext, ...): nn.LayerNorm's forward,
    over the channels of NCHW where data_format says channels_first."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """
        Args:
            features: Tensor of shape (batch_size, channels, height, width) OR (batch_size, height, width, channels)
        """
        if self.data_format == "channels_first":
            features = features.permute(0, 2, 3, 1)
            features = super().forward(features)
            features = features.permute(0, 3, 1, 2)
        else:
            features = super().forward(features)
        return features


def _not_fast(m) -> str | None:
    return "timm's fast norm is on: it may normalise in another precision" if getattr(m, "_fast_norm", False) else None


register(TimmLayerNorm, by_code=True, refuse=_not_fast, tokens=True)(layer_norm)


@register(TimmLayerNorm2d, TorchvisionLayerNorm2d, by_code=True, refuse=_not_fast, keeps_input=lambda m: False)
def channels_first_layer_norm(m: nn.LayerNorm, a, delta, state=None):
    """LayerNorm over the channels of an NCHW tensor: w.grad = Σ over positions of δ ⊙ x̂, per channel."""
    if not m.elementwise_affine:
        return []
    xhat = F.layer_norm(a.permute(0, 2, 3, 1), m.normalized_shape, None, None, m.eps).permute(0, 3, 1, 2)
    return _diag(m, xhat, delta, channel_dim=1)


def _data_format(m) -> str | None:
    if getattr(m, "data_format", None) not in ("channels_first", "channels_last"):
        return f"{type(m).__name__}.data_format is neither channels_first nor channels_last"
    return None


@register(HFConvNextLayerNorm, by_code=True, refuse=_data_format, keeps_input=lambda m: False)
def hf_convnext_layer_norm(m, a, delta, state=None):
    if m.data_format == "channels_first":
        return channels_first_layer_norm(m, a, delta)
    return layer_norm(m, a, delta)


# transformers' RMSNorm classes, each copied word for word into many models' (found by their methods' code: a changed
# copy gets no exact rule). All are y = w' ⊙ x̂ with x̂ = x·rsqrt(mean(x²) + eps), so w.grad = Σ δ ⊙ x̂ (times what w'
# is of w: 1); they differ in where they compute in float32 and cast back, which each rule repeats.
class LlamaStyleRMSNorm(nn.Module):
    """LlamaRMSNorm and 141 copies (Mistral, Qwen2, OLMo, ...): x̂ in float32, cast to x's dtype, then w ⊙ x̂."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class CastAfterRMSNorm(nn.Module):
    """AfmoeRMSNorm and 11 copies (DeepSeek-V4, FlexOlmo, GPT-OSS, ...): w ⊙ x̂ in float32, then cast to x's dtype."""

    def forward(self, hidden_states) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class T5StyleRMSNorm(nn.Module):
    """T5LayerNorm and 9 copies (MT5, LongT5, SwitchTransformers, ...): the variance in float32, x̂ in x's dtype
    promoted, cast to a half-precision weight's dtype, then w ⊙ x̂."""

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class GemmaStyleRMSNorm(nn.Module):
    """GemmaRMSNorm and 12 copies (Gemma 2 and 3, Qwen3-Next, ...): x̂ in float32, times (1 + w) in float32, cast
    to x's dtype."""

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def _reads(eps: str):
    def refuse(m) -> str | None:
        w = getattr(m, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 1 or not isinstance(getattr(m, eps, None), float):
            return f"{type(m).__name__}: not a weight vector and a float {eps}, as its forward reads them"
        return None

    return refuse


_RMS = {"by_code": True, "params": ("weight",), "tokens": True,
        "keeps_input": lambda m: False}  # autograd may save a float32 copy of the input, not the input


def _inv_rms(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x²) + eps) over the last dimension, from x in float32: what every one of these forwards computes."""
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


@register(LlamaStyleRMSNorm, refuse=_reads("variance_epsilon"), **_RMS)
def llama_style_rms_norm(m, a, delta, state=None):
    h = a.to(torch.float32)
    return _diag(m, (h * _inv_rms(h, m.variance_epsilon)).to(a.dtype), delta)


@register(CastAfterRMSNorm, refuse=_reads("variance_epsilon"), **_RMS)
def cast_after_rms_norm(m, a, delta, state=None):
    h = a.to(torch.float32)
    h = h * _inv_rms(h, m.variance_epsilon)
    return _diag(m, h, delta.to(torch.promote_types(m.weight.dtype, torch.float32)))  # where w met x̂


@register(T5StyleRMSNorm, refuse=_reads("variance_epsilon"), **_RMS)
def t5_style_rms_norm(m, a, delta, state=None):
    h = a * _inv_rms(a.to(torch.float32), m.variance_epsilon)
    return _diag(m, h.to(m.weight.dtype) if m.weight.dtype in (torch.float16, torch.bfloat16) else h, delta)


@register(GemmaStyleRMSNorm, refuse=_reads("eps"), **_RMS)
def gemma_style_rms_norm(m, a, delta, state=None):
    h = a.float()
    return _diag(m, h * _inv_rms(h, m.eps), delta.float())  # δ in float32, where (1 + w) met x̂ (type_as's backward)


@register(nn.GroupNorm)
def group_norm(m: nn.GroupNorm, a, delta, state=None):
    if not m.affine:
        return []
    return _diag(m, F.group_norm(a, m.num_groups, None, None, m.eps), delta, channel_dim=1)


def _bn_state(m) -> tuple:
    """(uses batch statistics, running mean, running var) as forward will use them."""
    batch = m.training or m.running_mean is None
    if batch:
        return True, None, None
    return False, m.running_mean.detach().clone(), m.running_var.detach().clone()


def _bn_per_sample(m, state=None) -> str:
    return "contribution" if (state if state is not None else _bn_state(m))[0] else "exact"


@register(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, state=_bn_state, per_sample=_bn_per_sample)
def batch_norm(m, a, delta, state=None):
    """Exact per sample on running statistics; on batch statistics a row is the sample's contribution."""
    if not m.affine:
        return []
    batch, mean, var = state if state is not None else _bn_state(m)
    xhat = F.batch_norm(a, mean, var, None, None, batch, 0.0, m.eps)
    return _diag(m, xhat, delta, channel_dim=1, per_sample="contribution" if batch else "exact")


@register(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm(m, a, delta, state=None):
    """Each sample's channels normalised by their own statistics (or running ones in eval): exact per sample."""
    if not m.affine:
        return []
    if a.dim() == unbatched_rank(m):  # unbatched (C, *S): a batch of one
        a, delta = a.unsqueeze(0), delta.unsqueeze(0)
    running = m.track_running_stats and not m.training
    xhat = F.instance_norm(a, m.running_mean if running else None, m.running_var if running else None,
                           None, None, not running, 0.0, m.eps)
    return _diag(m, xhat, delta, channel_dim=1)
