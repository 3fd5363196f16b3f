"""Which dimension of a tensor holds the batch's samples, proven from the autograd graph.

Every per-sample rule needs to know where the samples are in a layer's input and output gradient. A size match
proves nothing (a (T, B, d) input with T = B has two candidates), so the samples are followed instead: from the
roots (Roots: the model's inputs along their batch dimension, declared or 0, and the outputs of calls proven
before) through each operation of the autograd graph. `sample_dim` finds the one dimension of a tensor whose
index i holds sample i alone; `sample_major` whether its leading dimension holds the samples folded in blocks of
consecutive rows (MobileViT runs its transformer on (B·P, N, C), the patches of a sample next to each other: row
r holds sample r // (n/B)). Both walk back from the tensor's grad_fn, following the dimension through each
operation, until every path reaches a root holding the samples along the dimension the walk arrived at, or holds
no samples (a parameter, something broadcast along that dimension). Operations known to keep each sample in its
own block along a dimension: elementwise ops, row-major views (the dimension starts at the same element count,
merged or split), transposes, permutes, flips, unbind, select, (un)squeeze, stack, softmax, cat and split along
other dimensions, reductions over other dimensions (sum, mean, max, norms), batched matmul and attention, layer,
group and batch norm (its statistics are shared, as a parameter is; each sample keeps its place), mm/addmm of rows
by a parameter (F.linear on the batch's data: its saved rows, by their storage). An input slot without grad (a
buffer, a mask) is taken for a constant, except where the op reads the data through it. Any other operation on
the way, a walk that reaches no root, or one over MAX_NODES, proves nothing: the layer is then not given
per-sample results (the note says so)."""

from __future__ import annotations

import math
import weakref

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
    "PreluKernelBackward0", "HardtanhBackward0", "LogSigmoidBackward0", "CeluBackward0", "SoftshrinkBackward0",
    "HardshrinkBackward0", "MaximumBackward0", "MinimumBackward0", "SinBackward0", "CosBackward0",
    "ReciprocalBackward0", "Log1pBackward0", "Expm1Backward0", "AddcmulBackward0", "AddcdivBackward0",
    "ClampBackward0", "ClampMaxBackward0", "MaskedFillBackward0", "NanToNumBackward0", "LerpBackward0",
    "LerpBackward1",
})
VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
# ops whose empty input slot is what they read, not a constant (F.linear or a conv on the batch's data)
READS_DATA = frozenset({"MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "ConvolutionBackward0",
                        "EmbeddingBackward0", "EmbeddingBagBackward0"})
# reductions over the dims in `dim` (saved, with keepdim)
REDUCTIONS = frozenset({"MeanBackward1", "SumBackward1", "AmaxBackward0", "AminBackward0", "MaxBackward0",
                        "MinBackward0", "LogsumexpBackward0", "LinalgVectorNormBackward0", "VarBackward0",
                        "StdBackward0", "ProdBackward1"})
BATCH_NORMS = frozenset({"NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0"})


class Roots:
    """Tensors known to hold the samples along one dim, in blocks of shape[d] // B (1: the samples themselves):
    the model's inputs along their batch dim, and outputs of calls proven before (capture/samples.py adds them).
    A tensor with a grad_fn is known by its node, a leaf that requires grad by its AccumulateGrad's variable, a
    tensor without grad (the batch's data) by identity and, for its views, by storage (samples.view_dim)."""

    def __init__(self):
        self.nodes: dict = {}  # (grad_fn, output_nr) -> dim
        self.leaves: dict = {}  # id(leaf) -> (weakref to it, dim)
        self.data: dict = {}  # id(tensor without grad) -> (weakref to it, dim): held weakly, as leaves are (a
        self._node_set: set = set()  # checkpointed block's activations must go when checkpointing lets them go)

    def add(self, t: torch.Tensor, d: int) -> None:
        if t.grad_fn is not None:
            self.nodes[(t.grad_fn, t.output_nr)] = d
            self._node_set.add(t.grad_fn)
        else:
            (self.leaves if t.requires_grad else self.data)[id(t)] = (weakref.ref(t), d)

    def tensor_dim(self, t: torch.Tensor):
        """The dim of a root that is t itself (a leaf, the data; a tensor that a Function's output became since),
        else None."""
        for table in (self.data, self.leaves):
            found = table.get(id(t))
            if found is not None and found[0]() is t:
                return found[1]
        return None

    def data_roots(self):
        """(tensor, dim) of the data roots still alive."""
        for ref, d in list(self.data.values()):
            r = ref()
            if r is not None:
                yield r, d

    def clear(self) -> None:
        self.nodes.clear()
        self.leaves.clear()
        self.data.clear()
        self._node_set.clear()

    def node_dim(self, node, nr: int):
        """The dim along which output nr of node holds the samples, where it is a root; else None."""
        d = self.nodes.get((node, nr))
        if d is None and type(node).__name__ == "AccumulateGrad":
            leaf = self.leaves.get(id(node.variable))
            d = leaf[1] if leaf is not None and leaf[0]() is node.variable else None
        return d

    def data_rows(self, t: torch.Tensor, B: int) -> bool:
        """Whether t, a tensor without grad, is a row-major reshape of a data root whose samples lead (the same
        storage and elements, both contiguous) with dim 0 a multiple of B: its rows hold the samples in blocks."""
        for r, d in self.data_roots():
            if (all(s == 1 for s in r.shape[:d]) and t.dim() and t.shape[0] % B == 0 and t.numel() == r.numel()
                    and t.device == r.device and t.data_ptr() == r.data_ptr() and t.is_contiguous()
                    and r.is_contiguous()):
                return True
        return False

    def holds(self, node) -> bool:
        """Whether some output of node is a root (it holds samples, whatever its inputs)."""
        return node in self._node_set or self.node_dim(node, 0) is not None


def of(t: torch.Tensor, d: int = 0) -> Roots:
    """Roots holding one tensor's samples along d (the proofs' tests, and a model with one input)."""
    r = Roots()
    r.add(t, d)
    return r


def sample_major(node, output_nr: int, B: int, roots: Roots, memo: dict | None = None) -> bool:
    """Whether output `output_nr` of grad_fn `node` holds the B samples in blocks of consecutive rows (its
    leading dimension n is a multiple of B and row r belongs to sample r // (n/B) alone). `memo` may be shared
    by the proofs of one forward pass (the graph does not change under them)."""
    memo = {} if memo is None else memo
    try:
        return _proven(node, output_nr, 0, B, roots, memo, [MAX_NODES])
    except RecursionError:  # a path longer than Python's stack: no proof
        return False


def sample_dim(node, output_nr: int, B: int, roots: Roots, memo: dict | None = None) -> int | None:
    """The one dim of output `output_nr` of `node` whose index i holds sample i alone (its size is B), proven
    back to the roots; None where no dim, or more than one, is proven. A dim of size B is only a candidate."""
    shape = _shape(node, output_nr)
    if shape is None or B <= 0:
        return None
    memo = {} if memo is None else memo
    found = []
    for d, s in enumerate(shape):
        if s != B:
            continue
        try:
            if _proven(node, output_nr, d, B, roots, memo, [MAX_NODES]):
                found.append(d)
        except RecursionError:
            return None
    return found[0] if len(found) == 1 else None


_shape = output_shape


def _proven(node, nr: int, d: int, B: int, roots: Roots, memo: dict, budget: list) -> bool:
    """Output nr of node holds the samples along dim d, each in its own block of n/B indices."""
    root = roots.node_dim(node, nr)
    if root is not None:
        return root == d  # a root holds them along its own dim, and along no other
    shape = _shape(node, nr)
    if shape is None or d >= len(shape) or shape[d] % B:
        return False
    key = (node, nr, d)
    if key in memo:
        return memo[key]
    memo[key] = False  # a cycle proves nothing
    budget[0] -= 1
    memo[key] = budget[0] > 0 and _keeps_samples(node, shape, d, B, roots, memo, budget)
    return memo[key]


def _keeps_samples(node, shape: tuple, d: int, B: int, roots: Roots, memo: dict, budget: list) -> bool:
    name = type(node).__name__
    kids = [(c, nr) for c, nr in node.next_functions if c is not None and not _sample_free(c, roots, memo)]
    if name in ("MmBackward0", "AddmmBackward0"):  # rows of mat1 times a parameter: mat1's rows
        mat1 = node.next_functions[0 if name == "MmBackward0" else 1]
        if mat1[0] is None:  # the batch's data (F.linear on the model's input): the saved mat1, by its storage
            try:
                data = saved(node, "self" if name == "MmBackward0" else "mat1")
            except AttributeError:
                return False
            return d == 0 and not kids and roots.data_rows(data, B)
        return d == 0 and kids == [mat1] and _proven(*mat1, 0, B, roots, memo, budget)
    if not kids:  # nothing that holds samples reaches it through the graph (the data may, unseen): no proof
        return False

    def along(child, nr, dim):
        return _proven(child, nr, dim, B, roots, memo, budget)

    if name in ELEMENTWISE:
        return all(_broadcast_input(c, nr, shape, d, B, roots, memo, budget) for c, nr in kids)
    if name in VIEWS:  # row-major order: see view_input_dim
        for c, nr in kids:
            d_in = view_input_dim(shape, _shape(c, nr), d, B)
            if d_in is None or not along(c, nr, d_in):
                return False
        return True
    if name in ("BmmBackward0", "BaddbmmBackward0"):  # batched over dim 0
        return d == 0 and all(along(c, nr, 0) for c, nr in kids)
    if name.startswith("ScaledDotProduct") or name in ("NativeLayerNormBackward0", "NativeGroupNormBackward0"):
        if d >= len(shape) - _mixed_trailing_dims(node, name, len(shape)):
            return False  # attention mixes its last two dims, layer norm its normalized ones, group norm all but 0
        return all(_broadcast_input(c, nr, shape, d, B, roots, memo, budget) for c, nr in kids)
    d_in = _input_dim(node, name, d, len(shape))
    return d_in is not None and all(along(c, nr, d_in) for c, nr in kids)


def view_input_dim(out_shape: tuple, in_shape, d: int, B: int) -> int | None:
    """Under a row-major view of in_shape as out_shape, the input dim j whose sample blocks out dim d holds: the
    input's dims before j have as many elements as the output's dims before d, so both start at the same element
    of every prefix, and out dim d's size n is a multiple of B. Then, with j's samples in blocks of in[j]/B and M
    the elements from j (and from d) on, index i of d lies at input index ⌊i·M/n⌋ // (M/in[j]) of j, of sample
    ⌊i·B/n⌋ = i // (n/B): blocks again, whatever d merges or splits after j. Else None."""
    if in_shape is None or out_shape[d] % B:
        return None
    pre = math.prod(out_shape[:d])
    p = 1
    for j, s in enumerate(in_shape):
        if p > pre:
            return None
        if p == pre and s != 1:
            return j
        p *= s
    return None


def _mixed_trailing_dims(node, name: str, ndim: int) -> int:
    if name.startswith("ScaledDotProduct"):
        return 2
    if name == "NativeLayerNormBackward0":
        try:
            return len(saved(node, "normalized_shape"))
        except AttributeError:
            return ndim
    return ndim - 1  # group norm: every dim but the batch's


def _broadcast_input(child, nr: int, out_shape: tuple, d: int, B: int, roots: Roots, memo: dict,
                     budget: list) -> bool:
    """An input laid out as the output (trailing dims aligned), proven along its own d. One broadcast along d
    (size 1 there, or fewer dims) is the same for every sample only if free of samples, and those were
    filtered out before: this one is not."""
    s = _shape(child, nr)
    if s is None:
        return False
    d_in = d - (len(out_shape) - len(s))
    if d_in < 0 or s[d_in] == 1 and out_shape[d] != 1:
        return False  # broadcast along the samples' dim, and not free of samples (kids holds no free input)
    return _proven(child, nr, d_in, B, roots, memo, budget)


def _input_dim(node, name: str, d: int, ndim: int):
    """The input's dim that the output's dim d comes from, where the op leaves it whole; else None."""
    try:
        if name == "TransposeBackward0":
            a, b = (_signed(saved(node, k)) % ndim for k in ("dim0", "dim1"))
            return b if d == a else a if d == b else d
        if name == "PermuteBackward0":
            return _signed(saved(node, "dims")[d]) % ndim
        if name in ("UnbindBackward0", "SelectBackward0"):  # the input has one more dim, at `dim`
            u = _signed(saved(node, "dim")) % (ndim + 1)
            return d + 1 if u <= d else d
        if name in ("UnsqueezeBackward0", "StackBackward0"):  # the output has one more dim, at `dim`
            u = _signed(saved(node, "dim")) % ndim
            return None if u == d else d - 1 if u < d else d
        if name == "SqueezeBackward1":  # the input had a size-1 dim at `dim`
            s = _signed(saved(node, "dim")) % (ndim + 1)
            return d + 1 if s <= d else d
        if name in REDUCTIONS:  # over `dim` (each sample's own values where d is none of them)
            return _reduced_input_dim(node, d, ndim)
        if name == "FlipBackward0":  # reverses the dims in `dims`: a sample's index moves along them only
            return None if d in {_signed(x) % ndim for x in saved(node, "dims")} else d
        if name in BATCH_NORMS:  # statistics per channel (dim 1), shared by all samples: each keeps its place
            return None if d == 1 else d
        if name in ("SoftmaxBackward0", "LogSoftmaxBackward0", "SafeSoftmaxBackward0", "CatBackward0",
                    "SliceBackward0", "SplitBackward0", "SplitWithSizesBackward0"):
            return None if _signed(saved(node, "dim")) % ndim == d else d
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    return None


def _signed(dim: int) -> int:
    """A saved dim as given: torch hands a negative one back as an unsigned 64-bit one (transpose(-2, -1) saves
    dim0 18446744073709551614, softmax(-1) 18446744073709551615), which % ndim misplaces wherever ndim is not a
    power of two (a (B, T, d) tensor's -1 read as dim 0)."""
    return dim - 2**64 if dim >= 2**63 else dim


def _reduced_input_dim(node, d: int, ndim: int):
    """The input's dim that output dim d of a reduction comes from; None where d is one it reduces."""
    dims = saved(node, "dim")
    keep = bool(saved(node, "keepdim"))
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [_signed(x) for x in dims]
    n_in = ndim if keep else ndim + len(dims)
    reduced = sorted({x % n_in for x in dims}) if dims else list(range(n_in))
    if keep:
        return None if d in reduced else d
    kept = [i for i in range(n_in) if i not in reduced]
    return kept[d] if d < len(kept) else None


def _sample_free(node, roots: Roots, memo: dict, depth: int = 32) -> bool:
    """Whether a tensor holds nothing of any sample: every path back ends at a leaf that is not a root (an
    nn.Parameter, a constant that requires grad) and none at a root. An input without grad (an empty slot: a
    buffer, a mask) is taken for a constant, as the elementwise rule takes it; a node with no input but such
    slots is not free (its values come from outside the graph: the data, maybe)."""
    key = ("free", node)
    if key in memo:
        return memo[key]
    if roots.holds(node):
        free = False
    elif type(node).__name__ == "AccumulateGrad":
        free = True  # not a root (holds() above): a parameter, or a leaf that is none of the model's inputs
    else:
        kids = [c for c, _ in node.next_functions if c is not None]
        free = depth > 0 and bool(kids) and all(_sample_free(c, roots, memo, depth - 1) for c in kids) and not (
            type(node).__name__ in READS_DATA and len(kids) < len(node.next_functions))
    memo[key] = free
    return free
