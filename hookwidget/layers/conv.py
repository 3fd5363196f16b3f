"""Convolutions, 1-d to 3-d, plain and transposed: any stride, dilation, padding (numbers, "same",
"valid"), groups and padding_mode. The weight gradient comes from the kernel autograd runs
(aten.convolution_backward); per sample, the batch becomes groups of one convolution. timm's StdConv2d
(weight standardisation, BiT's ResNet-V2) convolves with its weight standardised per output channel: its
kernel's gradient is the convolution's, and the weight's is the standardisation's backward of it; so with
torch's weight_norm (w = g · v / ‖v‖: wav2vec2's, TCNs', vocoders'), a fast rule of the generic one. timm's
Conv2dSame (the tf_ EfficientNets, MixNets) pads its input as TensorFlow's SAME does, from the input's size at
each call: the convolution of the input padded the same way."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hookwidget._torch.layers import CONV_FORWARD_METHODS, conv_self_padding, is_transposed_conv, weight_norm_dim
from hookwidget.layers import generic
from hookwidget.layers.base import ConvCall, Factor
from hookwidget.layers.registry import register

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _pads_itself(m) -> bool:
    """Whether the convolution pads its input by a separate op (so the op autograd saves is not the input)."""
    if m.padding_mode != "zeros":
        return True
    if m.padding == "same":
        return any(d * (k - 1) % 2 for d, k in zip(m.dilation, m.kernel_size))  # uneven: ATen pads first
    return False


def _call(m, a, delta, padding=None) -> ConvCall:
    n = m.weight.dim() - 2
    if a.dim() == n + 1:  # unbatched input (C, *S): a batch of one
        a, delta = a.unsqueeze(0), delta.unsqueeze(0)
    transposed = is_transposed_conv(m)
    padding = m.padding if padding is None else padding
    if not transposed and (isinstance(padding, str) or m.padding_mode != "zeros"):
        pad = conv_self_padding(m)
        if any(pad):  # exactly what the layer does ("same": right side gets the extra)
            a = F.pad(a, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
        padding = (0,) * n
    return ConvCall(a, delta, tuple(m.kernel_size), tuple(m.dilation), tuple(padding), tuple(m.stride),
                    m.groups, transposed)


def _factors(m, call: ConvCall) -> list:
    B, cout = call.delta.shape[:2]
    D = call.delta.reshape(B, cout, -1).transpose(1, 2)  # (B, L, Cout)
    plain = not call.transposed and call.groups == 1 and len(call.kernel) <= 2  # X = unfold(a) exists: Gram norms
    out = [Factor("weight", "outer" if plain else "conv", D, None, tuple(m.weight.shape), conv=call)]
    if m.bias is not None:
        out.append(Factor("bias", "sum", D, None, tuple(m.bias.shape)))
    return out


@register(*_CONV, keeps_input=lambda m: not _pads_itself(m), forward_methods=CONV_FORWARD_METHODS)
def conv(m, a, delta, state=None):
    return _factors(m, _call(m, a, delta))


@register(*_TRANSPOSED, forward_methods=CONV_FORWARD_METHODS)
def conv_transpose(m, a, delta, state=None):
    """W.grad of y = conv_transpose(x, W) is the weight gradient of the convolution it is the adjoint of;
    output_padding (or forward's output_size) is read from δ's shape."""
    return _factors(m, _call(m, a, delta))


class Standardised:
    """The backward of weight standardisation at one forward. timm's StdConv2d convolves with ŵ = (w - mean) / σ
    per output channel (σ² the biased variance plus eps); ScaledStdConv2d (NFNets) with ŵ · gain · scale. A
    kernel gradient g gives w's as (g' - mean(g') - ŵ·mean(g' ⊙ ŵ)) / σ over each output channel's fan-in, with
    g' = g · gain · scale (g where there is no gain), and gain's as scale · Σ g ⊙ ŵ; per sample too (both maps
    are linear)."""

    def __init__(self, m):
        w = m.weight.detach().reshape(m.weight.shape[0], -1)
        var, mean = torch.var_mean(w, dim=1, correction=0, keepdim=True)
        self.sigma = (var + m.eps).sqrt()
        self.w_hat = (w - mean) / self.sigma
        gain = getattr(m, "gain", None)
        self.scale = float(m.scale) if gain is not None else None
        self.gain = None if gain is None else gain.detach().reshape(-1, 1) * self.scale

    def grad(self, param: str, g: torch.Tensor) -> torch.Tensor:
        """g (B, *weight shape), the kernel's gradient -> (B, ...) the gradient of `param` ("weight" or "gain")."""
        w_hat, sigma = self.w_hat.to(g.dtype), self.sigma.to(g.dtype)
        k = g.reshape(g.shape[0], *w_hat.shape)
        if param == "gain":
            return (k * w_hat).sum(-1) * self.scale
        if self.gain is not None:
            k = k * self.gain.to(g.dtype)
        return ((k - k.mean(-1, keepdim=True) - w_hat * (k * w_hat).mean(-1, keepdim=True)) / sigma).reshape(g.shape)

    def same(self, other) -> bool:
        """Whether another call standardised the same weight (and gain): then the calls' gradients merge."""
        mine, theirs = self._parts(), other._parts()
        return len(mine) == len(theirs) and all(torch.equal(x, y) for x, y in zip(mine, theirs))

    def _parts(self) -> list:
        return [t for t in (self.w_hat, self.sigma, self.gain) if t is not None]


def _tf_same_padding(m, a) -> tuple:
    """F.pad's (left, right, top, bottom) that timm's pad_same adds before the convolution: TensorFlow's SAME, the
    odd pixel on the right and at the bottom."""
    pads = []
    for size, k, s, d in zip(a.shape[-2:], m.kernel_size, m.stride, m.dilation):
        p = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        pads.append((p // 2, p - p // 2))
    (top, bottom), (left, right) = pads
    return left, right, top, bottom


@register("timm.layers.conv2d_same.Conv2dSame", keeps_input=lambda m: False)
def same_padded_conv(m, a, delta, state=None):
    """y = conv2d(pad_same(x), W, bias), the padding computed from x's size (timm's conv2d_same, which passes no
    padding of the module's own to the convolution)."""
    pad = _tf_same_padding(m, a)
    return _factors(m, _call(m, F.pad(a, pad) if any(pad) else a, delta, padding=(0, 0)))


class WeightNormed:
    """The backward of torch's weight_norm at one forward: w = g · v / ‖v‖, the norm over every axis but `dim`
    (all of them for dim -1). A kernel gradient k gives g's as Σ k ⊙ v̂ and v's as (g / ‖v‖)(k - v̂ Σ k ⊙ v̂) over
    those axes (v̂ = v / ‖v‖); per sample too (both maps are linear)."""

    G, V = "parametrizations.weight.original0", "parametrizations.weight.original1"

    def __init__(self, g: torch.Tensor, v: torch.Tensor, dim: int):
        self.g, self.v = g.detach(), v.detach()
        self.axes = tuple(i for i in range(v.dim()) if dim == -1 or i != dim)
        n = torch.linalg.vector_norm(self.v, dim=self.axes, keepdim=True)
        self.v_hat, self.scale = self.v / n, self.g.reshape(n.shape) / n

    def grad(self, param: str, k: torch.Tensor) -> torch.Tensor:
        """k (B, *weight shape), the kernel's gradient -> (B, ...) the gradient of `param` (g or v)."""
        v_hat = self.v_hat.to(k.dtype)
        along = tuple(a + 1 for a in self.axes)
        s = (k * v_hat).sum(along, keepdim=True)
        if param == self.G:
            return s.reshape(k.shape[0], *self.g.shape)
        return self.scale.to(k.dtype) * (k - v_hat * s)


def _weight_normed_conv(m) -> bool:
    base = next((c for c in _CONV if isinstance(m, c)), None)  # weight_norm makes a class of its own: Parametrized*
    return (base is not None and weight_norm_dim(m) is not None
            and all(getattr(type(m), name) is getattr(base, name) for name in CONV_FORWARD_METHODS))


def weight_normed_factors(m, call, names: list, B: int) -> tuple:
    """(name -> Factor, the code path's key) of one call of a weight-normed convolution: the convolution's
    per-sample kernel gradients (from its input and δ, as the conv rule takes them) mapped by weight_norm's
    backward to g and v; raises generic.NotApplicable where the call is not one plain convolution of a batch."""
    if not set(names) <= {WeightNormed.G, WeightNormed.V, "bias"}:
        raise generic.NotApplicable("other parameters")
    args, kwargs = call.inputs
    a = args[0] if args else kwargs.get("input")
    delta = call.deltas[0] if call.deltas else None
    n = call.params[WeightNormed.V].dim() - 2
    if (not isinstance(a, torch.Tensor) or a.dim() != n + 2 or a.shape[0] != B or len(args) + len(kwargs) != 1
            or delta is None or delta.shape[0] != B):
        raise generic.NotApplicable("not one batched input")
    dim = weight_norm_dim(m)
    wn = WeightNormed(call.params[WeightNormed.G], call.params[WeightNormed.V], dim)
    fs = _factors(m, _call(m, a.detach(), delta))
    out = {p: Factor(p, "mapped", fs[0].D, None, tuple(call.params[p].shape), conv=fs[0].conv, back=wn)
           for p in (WeightNormed.G, WeightNormed.V) if p in names}
    if "bias" in names:
        out["bias"] = fs[1]
    return out, ("weight_norm", dim, tuple(a.shape), tuple(delta.shape))


generic.FAST_RULES.append((_weight_normed_conv, weight_normed_factors))


_STD_CONVS = ("timm.layers.std_conv.StdConv2d", "timm.layers.std_conv.ScaledStdConv2d")


@register(*_STD_CONVS, keeps_input=lambda m: not _pads_itself(m), state=Standardised,
          params=("weight", "bias", "gain"))
def standardised_conv(m, a, delta, state=None):
    """y = conv2d(x, ŵ, bias) with ŵ the weight standardised (and scaled by gain) at this forward (`state`)."""
    std = state if state is not None else Standardised(m)
    fs = _factors(m, _call(m, a, delta))
    w = fs[0]
    fs[0] = Factor("weight", "mapped", w.D, None, w.shape, conv=w.conv, back=std)
    if std.gain is not None:
        fs.append(Factor("gain", "mapped", w.D, None, tuple(m.gain.shape), conv=w.conv, back=std))
    return fs
