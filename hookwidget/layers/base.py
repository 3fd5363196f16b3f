"""Token factors and the operations on them, one entry per factor kind.

Per sample b, a parameter's gradient is a sum over tokens t of a small product of δ_bt with
something built from a_bt. A Factor holds those pieces; KINDS says, per kind, how they give the
summed gradient (W.grad), per-sample gradients and, where a kind has one, per-sample squared norms in
ghost (Gram) form; layers/cost.py says when that form is the cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from hookwidget.layers import cost


class Factor:
    """Token factors of one parameter. kind: outer (D, X), onehot (D, index), diag (D, X), sum (D), conv,
    dense (D: the per-sample gradients (B, *shape) of the generic rule; param may be dotted, "out_proj.weight").

    D: (B, T, o). X: (B, T, i) for outer/diag, (B, T) indices for onehot. rows: onehot's number of
    embeddings. A convolution's X (its unfolded input, k² times the input) is built only when asked
    for: its gradients come cheaper from the convolution's own weight-gradient kernel; kind "conv"
    (grouped, transposed or 3-d convolutions) has no X at all. per_sample: "exact", or "contribution"
    where samples share statistics (BatchNorm on batch statistics): then a sample's row is what its
    own δ and x̂ add to .grad; the rows still sum to .grad exactly."""

    def __init__(self, param: str, kind: str, D: torch.Tensor, X: torch.Tensor | None, shape: tuple,
                 rows: int = 0, conv: ConvCall | ConvCalls | None = None, per_sample: str = "exact", back=None):
        self.param, self.kind, self.D, self._X, self.shape, self.rows, self.conv = param, kind, D, X, shape, rows, conv
        self.per_sample = per_sample
        self.back = back  # kind "mapped": what maps the kernel's gradient to the parameter's (conv.py)

    @property
    def X(self) -> torch.Tensor | None:
        if self._X is None and self.conv is not None and self.kind == "outer":
            self._X = self.conv.unfold()
        return self._X

    @X.setter
    def X(self, value) -> None:
        self._X = value

    def __repr__(self) -> str:
        return f"Factor({self.param!r}, {self.kind!r}, D={tuple(self.D.shape)}, shape={self.shape})"


@dataclass
class ConvCall:
    """One convolution call, input a (B, Cin, *S) already padded where the layer pads itself, δ (B, Cout, *S')."""

    a: torch.Tensor
    delta: torch.Tensor
    kernel: tuple
    dilation: tuple
    padding: tuple
    stride: tuple
    groups: int = 1
    transposed: bool = False

    def _weight_shape(self, B: int = 1) -> tuple:
        cin, cout = self.a.shape[1], self.delta.shape[1]
        if self.transposed:  # ConvTranspose weight: (Cin, Cout/groups, *k)
            return (B * cin, cout // self.groups, *self.kernel)
        return (B * cout, cin // self.groups, *self.kernel)

    def _output_padding(self) -> list:
        if not self.transposed:
            return [0] * len(self.kernel)
        # from the shapes, so a forward(x, output_size=...) is covered too
        return [self.delta.shape[2 + i] - ((self.a.shape[2 + i] - 1) * s - 2 * p + d * (k - 1) + 1)
                for i, (s, p, d, k) in enumerate(zip(self.stride, self.padding, self.dilation, self.kernel))]

    def _weight_grad(self, delta, a, B: int) -> torch.Tensor:
        w = a.new_empty(()).expand(self._weight_shape(B))  # only its shape is read
        _, gw, _ = torch.ops.aten.convolution_backward(
            delta, a, w, None, list(self.stride), list(self.padding), list(self.dilation), self.transposed,
            self._output_padding(), self.groups * B, [False, True, False])
        return gw

    def summed_weight_grad(self) -> torch.Tensor:
        """The weight's .grad by the kernel autograd itself runs."""
        return self._weight_grad(self.delta, self.a, 1)

    def per_sample_weight_grad(self) -> torch.Tensor:
        """(B, *weight shape): the batch as groups of one convolution, so the weight-gradient kernel
        gives each sample's gradient (exact; 2.4x faster than unfold + bmm on CPU). A 1×1 convolution's is one
        batched product δ xᵀ over its positions instead (2.5-4x faster than that kernel at a few samples)."""
        B = self.a.shape[0]
        x = self._pointwise_input()
        if x is not None:
            return torch.bmm(self.delta.reshape(B, self.delta.shape[1], -1), x).reshape(B, *self._weight_shape())
        gw = self._weight_grad(self.delta.reshape(1, -1, *self.delta.shape[2:]),
                               self.a.reshape(1, -1, *self.a.shape[2:]), B)
        return gw.reshape(B, *self._weight_shape())

    def _pointwise_input(self) -> torch.Tensor | None:
        """(B, L, Cin): what each output position of a 1×1 convolution (ungrouped, not transposed) reads, padded
        and strided as the convolution reads it (a view of the input where it pads nothing); None for any other."""
        if self.transposed or self.groups != 1 or any(k != 1 for k in self.kernel):
            return None
        a = self.a
        if any(self.padding):  # zeros, as the convolution pads (a layer that pads otherwise padded `a` itself)
            a = F.pad(a, [q for p in reversed(self.padding) for q in (p, p)])
        if any(s != 1 for s in self.stride):
            a = a[(slice(None), slice(None), *(slice(None, None, s) for s in self.stride))]
        return a.reshape(a.shape[0], a.shape[1], -1).transpose(1, 2)

    def unfold(self) -> torch.Tensor:  # (B, L, Cin*k); 1-d and 2-d, ungrouped, not transposed
        x = self._pointwise_input()
        if x is not None:
            return x
        a, k, d, p, s = self.a, self.kernel, self.dilation, self.padding, self.stride
        if a.dim() == 3:
            a, k, d, p, s = a.unsqueeze(-2), (1, *k), (1, *d), (0, *p), (1, *s)
        return F.unfold(a, k, dilation=d, padding=p, stride=s).transpose(1, 2)

    def to(self, dtype) -> None:
        self.a, self.delta = self.a.to(dtype), self.delta.to(dtype)


class ConvCalls:
    """Several calls of one convolution (a layer reused in one forward): their gradients add."""

    def __init__(self, calls: list):
        self.calls = calls

    def summed_weight_grad(self):
        return sum(c.summed_weight_grad() for c in self.calls)

    def per_sample_weight_grad(self):
        return sum(c.per_sample_weight_grad() for c in self.calls)

    def unfold(self):
        return torch.cat([c.unfold() for c in self.calls], 1)

    def to(self, dtype) -> None:
        for c in self.calls:
            c.to(dtype)


# -- per kind: summed gradient, per-sample gradients, and a cheaper exact norm where there is one --
@dataclass(frozen=True)
class Kind:
    summed: Callable  # f -> tensor with prod(f.shape) elements
    per_sample: Callable  # f -> (B, ...) with prod(f.shape) elements per sample
    norm_sq: Callable | None = None  # (f, x_gram) -> (B,) squared norms by the ghost form (cost.method chooses)


# Σ_t δ_t a_tᵀ as (batched) matrix products: torch.einsum plans the same product in Python first (16 µs where the
# product of a small layer takes 3)
def _outer_summed(f):
    if f.conv is not None and f._X is None:
        return f.conv.summed_weight_grad()
    return torch.mm(f.D.flatten(0, 1).T, f.X.flatten(0, 1))


def _outer_per_sample(f):
    if f.conv is not None and f._X is None:
        return f.conv.per_sample_weight_grad()
    return torch.bmm(f.D.transpose(1, 2), f.X)


def batch_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B,) Σ over all but the first dimension of a ⊙ b."""
    return torch.linalg.vecdot(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1))


def sq_norms(g: torch.Tensor) -> torch.Tensor:
    """(B,) squared norms of the rows of g (B, ...): one reduction, no g² in memory (a materialised per-sample
    gradient is the largest tensor of the norms)."""
    return torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square()


def gram_applies(f) -> bool:
    """Whether the Gram form Σ_{t,t'} (a_t·a_t')(δ_t·δ_t') is cheaper than the gradient itself (layers/cost.py)."""
    return cost.method(f) == "ghost"


def _outer_norm_sq(f, x_gram=None):
    gx = x_gram(f.X) if x_gram is not None else torch.bmm(f.X, f.X.transpose(1, 2))
    return batch_dot(gx, torch.bmm(f.D, f.D.transpose(1, 2)))


def _onehot_summed(f):
    g = torch.zeros(f.rows, f.D.shape[-1], dtype=f.D.dtype, device=f.D.device)
    return g.index_add_(0, f.X.reshape(-1), f.D.reshape(-1, f.D.shape[-1]))


def _onehot_per_sample(f):
    g = torch.zeros(f.D.shape[0], f.rows, f.D.shape[-1], dtype=f.D.dtype, device=f.D.device)
    return g.scatter_add_(1, f.X.unsqueeze(-1).expand_as(f.D), f.D)


def _onehot_norm_sq(f, x_gram=None):
    same = (f.X.unsqueeze(2) == f.X.unsqueeze(1)).to(f.D.dtype)
    return batch_dot(same, torch.bmm(f.D, f.D.transpose(1, 2)))


KINDS: dict[str, Kind] = {
    "outer": Kind(_outer_summed, _outer_per_sample, _outer_norm_sq),
    "onehot": Kind(_onehot_summed, _onehot_per_sample, _onehot_norm_sq),
    "diag": Kind(lambda f: (f.D * f.X).sum((0, 1)), lambda f: (f.D * f.X).sum(1)),
    "sum": Kind(lambda f: f.D.sum((0, 1)), lambda f: f.D.sum(1)),
    "conv": Kind(lambda f: f.conv.summed_weight_grad(), lambda f: f.conv.per_sample_weight_grad()),
    # a convolution whose kernel is computed from the parameters (weight standardisation, weight_norm): its kernel's
    # gradient mapped to each parameter's by f.back (linear, so per sample too)
    "mapped": Kind(lambda f: f.back.grad(f.param, f.conv.summed_weight_grad().unsqueeze(0))[0],
                   lambda f: f.back.grad(f.param, f.conv.per_sample_weight_grad())),
    # the generic torch.func rule: D holds the per-sample gradients themselves, (B, *shape)
    "dense": Kind(lambda f: f.D.sum(0), lambda f: f.D),
}
