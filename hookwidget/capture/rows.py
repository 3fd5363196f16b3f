"""Whether a tensor's rows are the batch's samples folded sample-major, proven from the autograd graph.

A model may fold its B samples into more rows: MobileViT runs its transformer on (B·P, N, C), the patches of a
sample next to each other. Per-sample rules can unfold such rows exactly ((n, ...) as (B, n/B, ...)) only if row
r holds sample r // (n/B) alone. `sample_major` proves it by walking back from the tensor's grad_fn, following
the dimension that holds the samples through each operation, until every path reaches a tensor whose leading
dimension is B (the samples themselves, as every rule assumes) or holds no samples (a parameter, something
broadcast along that dimension). Operations known to keep each sample in its own block along that dimension:
elementwise ops, views in row-major order (the samples' dimension leading), transposes, permutes, unbind,
select, (un)squeeze, softmax, cat and split along other dimensions, batched matmul and attention, layer and
group norm, mm/addmm of rows by a parameter. Any other operation on the way, or a walk over MAX_NODES, proves
nothing: the layer's rows are then not taken for samples (the note says so)."""

from __future__ import annotations

import torch

from hookwidget._torch.autograd import output_shape, saved

MAX_NODES = 4096  # nodes one proof may visit

# every input with the output's number of dims (or broadcast to it) is laid out as the output, element for element
ELEMENTWISE = frozenset({
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "MulBackward0", "MulBackward1",
    "DivBackward0", "DivBackward1", "NegBackward0", "PowBackward0", "PowBackward1", "SqrtBackward0",
    "RsqrtBackward0", "ExpBackward0", "LogBackward0", "TanhBackward0", "SigmoidBackward0", "ReluBackward0",
    "ThresholdBackward0", "GeluBackward0", "SiluBackward0", "HardswishBackward0", "HardsigmoidBackward0",
    "LeakyReluBackward0", "EluBackward0", "SoftplusBackward0", "MishBackward0", "CloneBackward0",
    "ToCopyBackward0", "WhereBackward0", "ClampBackward1", "ClampMinBackward0", "AbsBackward0", "ErfBackward0",
    "NativeDropoutBackward0", "BackwardHookFunctionBackward", "AliasBackward0", "ExpandBackward0",
})
VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})


def sample_major(node, output_nr: int, B: int, memo: dict | None = None) -> bool:
    """Whether output `output_nr` of grad_fn `node` holds the B samples in blocks of consecutive rows (its
    leading dimension n is a multiple of B and row r belongs to sample r // (n/B) alone). `memo` may be shared
    by the proofs of one forward pass (the graph does not change under them)."""
    memo = {} if memo is None else memo
    try:
        return _proven(node, output_nr, 0, B, memo, [MAX_NODES])
    except RecursionError:  # a path longer than Python's stack: no proof
        return False


_shape = output_shape


def _proven(node, nr: int, d: int, B: int, memo: dict, budget: list) -> bool:
    """Output nr of node holds the samples along dim d, each in its own block of n/B indices."""
    shape = _shape(node, nr)
    if shape is None or d >= len(shape) or shape[d] % B:
        return False
    if d == 0 and shape[0] == B:
        return True  # the samples themselves
    key = (node, nr, d)
    if key in memo:
        return memo[key]
    memo[key] = False  # a cycle proves nothing
    budget[0] -= 1
    memo[key] = budget[0] > 0 and _keeps_samples(node, shape, d, B, memo, budget)
    return memo[key]


def _keeps_samples(node, shape: tuple, d: int, B: int, memo: dict, budget: list) -> bool:
    name = type(node).__name__
    kids = [(c, nr) for c, nr in node.next_functions if c is not None and not _sample_free(c, B, memo)]
    if name in ELEMENTWISE:
        return all(_broadcast_input(c, nr, shape, d, B, memo, budget) for c, nr in kids)
    if name in VIEWS:  # row-major order: a block of leading indices stays a block if the samples lead both
        return _leading(shape, d) and all(_proven(c, nr, _first_non_one(_shape(c, nr)), B, memo, budget)
                                          for c, nr in kids)
    if name in ("MmBackward0", "AddmmBackward0"):  # rows of mat1 times a parameter: mat1's rows
        mat1 = node.next_functions[0 if name == "MmBackward0" else 1]
        return d == 0 and kids == [mat1] and _proven(*mat1, 0, B, memo, budget)
    if name in ("BmmBackward0", "BaddbmmBackward0"):  # batched over dim 0
        return d == 0 and all(_proven(c, nr, 0, B, memo, budget) for c, nr in kids)
    if name.startswith("ScaledDotProduct") or name in ("NativeLayerNormBackward0", "NativeGroupNormBackward0"):
        if d >= len(shape) - _mixed_trailing_dims(node, name, len(shape)):
            return False  # attention mixes its last two dims, layer norm its normalized ones, group norm all but 0
        return all(_broadcast_input(c, nr, shape, d, B, memo, budget) for c, nr in kids)
    d_in = _input_dim(node, name, d, len(shape))
    return d_in is not None and all(_proven(c, nr, d_in, B, memo, budget) for c, nr in kids)


def _mixed_trailing_dims(node, name: str, ndim: int) -> int:
    if name.startswith("ScaledDotProduct"):
        return 2
    if name == "NativeLayerNormBackward0":
        try:
            return len(saved(node, "normalized_shape"))
        except AttributeError:
            return ndim
    return ndim - 1  # group norm: every dim but the batch's


def _broadcast_input(child, nr: int, out_shape: tuple, d: int, B: int, memo: dict, budget: list) -> bool:
    """An input laid out as the output (trailing dims aligned), proven along its own d. One broadcast along d
    (size 1 there, or fewer dims) is the same for every sample only if free of samples, and those were
    filtered out before: this one is not."""
    s = _shape(child, nr)
    if s is None:
        return False
    d_in = d - (len(out_shape) - len(s))
    if d_in < 0 or s[d_in] == 1:
        return False  # broadcast along the samples' dim, and not free of samples (kids holds no free input)
    return _proven(child, nr, d_in, B, memo, budget)


def _input_dim(node, name: str, d: int, ndim: int):
    """The input's dim that the output's dim d comes from, where the op leaves it whole; else None."""
    try:
        if name == "TransposeBackward0":
            a, b = (x % ndim for x in (saved(node, "dim0"), saved(node, "dim1")))
            return b if d == a else a if d == b else d
        if name == "PermuteBackward0":
            return saved(node, "dims")[d] % ndim
        if name in ("UnbindBackward0", "SelectBackward0"):  # the input has one more dim, at `dim`
            u = saved(node, "dim") % (ndim + 1)
            return d + 1 if u <= d else d
        if name == "UnsqueezeBackward0":  # the output has one more dim, at `dim`
            u = saved(node, "dim") % ndim
            return None if u == d else d - 1 if u < d else d
        if name == "SqueezeBackward1":  # the input had a size-1 dim at `dim`
            s = saved(node, "dim") % (ndim + 1)
            return d + 1 if s <= d else d
        if name in ("SoftmaxBackward0", "LogSoftmaxBackward0", "CatBackward0", "SliceBackward0",
                    "SplitBackward0", "SplitWithSizesBackward0"):
            return None if saved(node, "dim") % ndim == d else d
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    return None


def _leading(shape: tuple, d: int) -> bool:
    return all(s == 1 for s in shape[:d])


def _first_non_one(shape) -> int:
    if shape is None:
        return 0
    return next((i for i, s in enumerate(shape) if s != 1), 0)


def _sample_free(node, B: int, memo: dict, depth: int = 32) -> bool:
    """Whether a tensor holds nothing of any sample: every path back ends at a parameter (an nn.Parameter, or a
    leaf whose leading dimension is not B: a leaf of B rows may be the samples, an input that requires grad)
    and none at a tensor autograd does not see (the batch's data has no grad_fn, so an op on it shows an empty
    input: not provably free)."""
    key = ("free", node)
    if key in memo:
        return memo[key]
    if type(node).__name__ == "AccumulateGrad":
        v = node.variable
        free = isinstance(v, torch.nn.Parameter) or v.dim() == 0 or v.shape[0] != B
    else:
        kids = node.next_functions
        free = depth > 0 and bool(kids) and all(c is not None and _sample_free(c, B, memo, depth - 1)
                                               for c, _ in kids)
    memo[key] = free
    return free
