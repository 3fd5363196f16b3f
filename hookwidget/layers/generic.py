"""The generic rule: per-sample gradients of any module's own parameters by torch.func, checked before use.

For a module no exact (a, δ) spec covers (an LSTM, MultiheadAttention, an RMSNorm class of another package,
a subclass that overrides forward, a weight-normed conv), capture keeps every tensor a call got (positional
and keyword), every output's δ, the module's train/eval flags and its parameters and buffers as they were
(copy-on-write). Per sample b the rule reruns the module's forward on that sample alone and pulls its δ back:
vmap over the batch of the vjp of the forward (Opacus' and torch.func's way), or, where vmap cannot run
(`.item()`, data-dependent control flow), a loop of vjps; where the call's arguments state its samples (bags given
by offsets, a PackedSequence: SPLITS), a loop over those. Its result is used only after the check in
analysis/per_sample.py: the per-sample gradients must add up to the gradient the step made; a module that mixes
samples (BatchNorm in train mode) fails it and is named in a note, never used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import PackedSequence

from hookwidget._torch.autograd import sequence_nr
from hookwidget._torch.modules import children, own_parameters, parameters_swapped
from hookwidget._torch.pytree import tree_flatten, tree_unflatten

MIXES = "mixes samples: per-sample gradients are not separable"
_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


class Refused(Exception):
    """The generic rule is not exact for this module here; the message says why, in one line."""


class NotApplicable(Exception):
    """A fast rule (FAST_RULES) does not cover this call: the vmap rule answers instead."""


# (applies(module) -> bool, rule(module, call, names, B) -> ({name: Factor}, key)): exact token factors for a module
# type the generic rule serves, cheaper than vmap of its vjp (attention.py: nn.MultiheadAttention); key names the code
# path the call took (layout, masks, parameters). Checked in analysis/per_sample.py as the vmap rule's rows (they sum to
# the step's gradient), and, on the first call of each key, one sample's rows against its own vjp (one_sample).
FAST_RULES: list = []
LAST_RULES: list = []  # as FAST_RULES, tried after all of them: rules that apply to many modules (linear_calls.py)

# (applies(module) -> bool, capture(module, call, out) -> (parts, hooks)): what a fast rule takes from the call's own
# graph at forward time, so that it need not rerun the module: `parts` (name -> tensor, e.g. an input autograd saved,
# or a plain value that says how to read them) go to call.rule_parts, and each (node, name) of `hooks` keeps the
# gradient arriving at that node as call.rule_parts[name] (capture/generic.py). The rule checks what it finds and falls
# back where anything is missing.
FAST_CAPTURES: list = []

# (applies(module) -> bool, split(module, call) -> Samples | None): calls whose arguments state their samples
# themselves (nn.EmbeddingBag's bags given by offsets, a recurrent layer's PackedSequence): rows of no tensor are the
# samples, so no batch dimension can be read from them; the split says how many samples there are and gives each one's
# own call.
SPLITS: list = []


@dataclasses.dataclass(frozen=True)
class Samples:
    """The samples a call's arguments state: n of them, and one(b) -> (args, kwargs, deltas): sample b's call alone,
    deltas aligned with flat_outputs of its output (None where no gradient is pulled back)."""

    n: int
    one: Callable


def samples_of(module, call) -> Samples | None:
    """The samples the call's arguments state (SPLITS), or None where its tensors carry a batch dimension as usual."""
    if call.inputs is None:
        return None
    for applies, split in SPLITS:
        if applies(module):
            found = split(module, call)
            if found is not None:
                return found
    return None


def call_nodes(root, seq_start: int, limit: int | None = None) -> list | None:
    """The backward nodes a module call made (sequence numbers from seq_start on: the call's own ops), found from its
    output's node `root` down, for a fast capture to read; None where there are more than `limit`."""
    found, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad" or sequence_nr(node) < seq_start:
            continue
        if limit is not None and len(found) >= limit:
            return None
        seen.add(node)
        found.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return found


def fast_rules(module) -> list:
    """The fast rules that may serve this module, in order."""
    return [rule for applies, rule in FAST_RULES + LAST_RULES if applies(module)]


# -- which parameters a module answers for -----------------------------------------------------------
def is_parametrization(module: nn.Module) -> bool:
    """A weight_norm / parametrize container: its parameters are its parametrized module's."""
    return isinstance(module, parametrize.ParametrizationList)


def owned(module: nn.Module, called=None) -> dict:
    """name -> trainable parameter this module's rule answers for: its own, its parametrizations' (a
    weight-normed conv owns original0/original1), and those of descendants never called as modules
    (MultiheadAttention's out_proj, a ParameterList). `called`: ids of the modules the trace saw called;
    without it, a static guess (used before any call is seen): only parametrizations, ParameterList /
    ParameterDict and MultiheadAttention's out_proj count as never called."""
    out = {n: p for n, p in own_parameters(module).items() if p is not None and p.requires_grad}
    stack = [(n, c) for n, c in children(module).items() if c is not None]
    while stack:
        prefix, child = stack.pop()
        functional = (prefix == "parametrizations" and parametrize.is_parametrized(module)
                      or isinstance(child, _CONTAINERS)
                      or isinstance(module, nn.MultiheadAttention) and prefix == "out_proj")
        if called is not None and id(child) in called and not functional:
            continue
        if called is None and not (functional or isinstance(child, (nn.ModuleList, nn.ModuleDict))):
            continue
        if functional:
            out.update((f"{prefix}.{n}", p) for n, p in child.named_parameters() if p.requires_grad)
            continue
        out.update((f"{prefix}.{n}", p) for n, p in own_parameters(child).items()
                   if p is not None and p.requires_grad)
        stack += [(f"{prefix}.{n}", c) for n, c in children(child).items() if c is not None]
    if called is not None:  # a parameter a called layer inside holds too (a tied bias) is that layer's to answer for
        inner = {id(p) for d in module.modules() if d is not module and id(d) in called
                 and not isinstance(d, parametrize.ParametrizationList) for p in own_parameters(d).values()}
        out = {n: p for n, p in out.items() if id(p) not in inner}
    return out


def may_serve(module: nn.Module) -> bool:
    """Whether the generic rule may answer for this module (decided once per module, before its first call)."""
    return not is_parametrization(module) and bool(owned(module))


# -- what a call's tensors look like -------------------------------------------------------------------
def flat_outputs(obj) -> list:
    """Tensors of a module's output, in a fixed order: a tensor; the tensors of a tuple, list, dict
    (Hugging Face ModelOutput), dataclass or namedtuple, one level of nesting included (LSTM's (out, (h, c)))."""
    return _flat(obj, 2)


def _flat(obj, depth: int) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, (tuple, list)):
        values = obj
    elif isinstance(obj, dict):
        values = obj.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        return []
    return [t for v in values for t in _flat(v, depth - 1)]


def _documented_in(module, key):
    """The batch dimension of a 3-d input where the module documents one other than 0, else None."""
    if isinstance(module, nn.RNNBase):
        if key in (0, "input"):
            return 0 if module.batch_first else 1
        if key in (1, "hx"):
            return 1  # h_0 / c_0: (layers * directions, B, H)
    if isinstance(module, nn.MultiheadAttention) and key in (0, 1, 2, "query", "key", "value"):
        return 0 if module.batch_first else 1
    return None


def _documented_out(module, i: int):
    if isinstance(module, nn.RNNBase):
        return (0 if module.batch_first else 1) if i == 0 else 1  # output, then h_n (and c_n)
    if isinstance(module, nn.MultiheadAttention):
        return (0 if module.batch_first else 1) if i == 0 else 0  # attn_output, then attn_weights (B, L, S)
    return None


def _dim(x, B: int, documented) -> int | None:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    if documented is not None:
        return documented if x.dim() == 3 and x.shape[documented] == B else None
    return 0 if x.shape[0] == B else None


def batch_size_hint(module, inputs) -> int | None:
    """The batch size the module's first input says (its documented batch dimension)."""
    args, kwargs = inputs
    for key, value in [*enumerate(args), *kwargs.items()]:
        for x in tree_flatten(value)[0]:
            if isinstance(x, torch.Tensor) and x.dim():
                d = _documented_in(module, key)
                return int(x.shape[d if d is not None and x.dim() == 3 else 0])
    return None


# -- the per-sample computation ------------------------------------------------------------------------
@dataclasses.dataclass
class _Prepared:
    parts: list  # (key, spec) per positional / keyword argument
    leaves: list  # every leaf of the arguments
    batched: list  # indices of the leaves with a batch dimension
    in_dims: list  # their batch dimensions
    outs: list  # indices of the outputs with a δ
    out_dims: list
    cots: list  # their δ
    frozen: dict  # name -> tensor: the other parameters and the buffers, as they were at the call
    buffers: set  # the names of the buffers among them


def _prepare(module, call, names: list, B: int) -> _Prepared:
    why = _unsplit(module, call)
    if why is not None:
        raise Refused(why)
    args, kwargs = call.inputs
    parts, leaves, dims = [], [], []
    for key, value in [*enumerate(args), *kwargs.items()]:
        flat, spec = tree_flatten(value)
        parts.append((key, spec, len(flat)))
        doc = _documented_in(module, key)
        leaves += flat
        dims += [_dim(x, B, doc) for x in flat]
    deltas = call.deltas
    outs, out_dims, cots = [], [], []
    for i, d in enumerate(deltas):
        if d is None:
            continue
        od = _documented_out(module, i)
        od = (od if d.dim() == 3 and d.shape[od] == B else None) if od is not None else (
            0 if d.dim() and d.shape[0] == B else None)
        if od is None:
            raise Refused(f"its output {i} of shape {tuple(d.shape)} has no batch dimension of size {B} (its "
                          "gradient is already summed over the batch)")
        outs.append(i)
        out_dims.append(od)
        cots.append(d)
    if not outs:
        raise Refused("no gradient reached its outputs")
    batched = [i for i, d in enumerate(dims) if d is not None]
    frozen = {n: t for n, t in call.params.items() if n not in names}
    buffers = {n for n, _ in module.named_buffers()}
    return _Prepared(parts, leaves, batched, [dims[i] for i in batched], outs, out_dims, cots, frozen, buffers)


def _unsplit(module, call) -> str | None:
    """Why the call cannot be split per sample along a batch dimension, where its arguments say which rows are whose
    (a PackedSequence, bags given by offsets) and no split (SPLITS) served it; in words the user can act on."""
    args, kwargs = call.inputs
    packed = next((x for x in (*args, *kwargs.values()) if isinstance(x, PackedSequence)), None)
    name = type(module).__name__
    if packed is not None:
        return (f"it was called on a PackedSequence ({int(packed.batch_sizes[0])} sequences, data "
                f"{tuple(packed.data.shape)}): its rows are time steps of several sequences, and only a layer with "
                f"nn.RNN's, nn.GRU's or nn.LSTM's own forward is split into its sequences, not {name}; give it the "
                "padded batch (nn.utils.rnn.pad_packed_sequence) so that each sequence is a row")
    offsets = kwargs.get("offsets", args[1] if len(args) > 1 else None)
    if isinstance(module, nn.EmbeddingBag) and isinstance(offsets, torch.Tensor):
        return (f"it was called on bags given by offsets, and only nn.EmbeddingBag's own forward is split into its "
                f"bags, not {name}'s; give it a 2-d input (one bag per row, padded with padding_idx)")
    return None


def rebuild(prep: _Prepared, leaves: list) -> tuple:
    """(args, kwargs) of a call from its flattened tensors (prep.parts says how they nest)."""
    args, kwargs, at = [], {}, 0
    for key, spec, n in prep.parts:
        value = tree_unflatten(leaves[at:at + n], spec)
        at += n
        if isinstance(key, int):
            args.append(value)
        else:
            kwargs[key] = value
    return args, kwargs


def _forward(module, prep: _Prepared, train: dict, batched: list, squeeze: bool) -> tuple:
    """The module's outputs that have a δ, from the given parameters and batched arguments."""
    leaves = list(prep.leaves)
    for i, d, x in zip(prep.batched, prep.in_dims, batched):
        leaves[i] = x.unsqueeze(d) if squeeze else x
    args, kwargs = rebuild(prep, leaves)
    # module.forward, not module(): the module's own hooks (the user's, another trace's) do not run again
    # buffers as fresh copies: a forward that updates them (BatchNorm's running statistics) writes to those
    frozen = {n: t.clone() if n in prep.buffers else t for n, t in prep.frozen.items()}
    with parameters_swapped(module, {**frozen, **train}):
        out = flat_outputs(module.forward(*args, **kwargs))
    if len(out) <= max(prep.outs):
        raise Refused("its forward returns other outputs than at the call")
    return tuple(out[i].squeeze(d) if squeeze else out[i] for i, d in zip(prep.outs, prep.out_dims))


def per_sample(module, call, names: list, B: int) -> dict:
    """name -> (B, *shape): each sample's gradient of one call, by vmap of the vjp, or a loop of vjps where
    vmap cannot run (or where the call's arguments state its samples: a loop over them, see SPLITS). Raises Refused
    with the reason where neither gives an answer."""
    split = samples_of(module, call)
    if split is not None:
        return _split_loop(module, call, names, split)
    prep = _prepare(module, call, names, B)
    train = {n: call.params[n] for n in names}
    xs = [prep.leaves[i] for i in prep.batched]
    with _modes(module, call.training), torch.random.fork_rng(devices=_cuda_devices(call)):
        try:
            return _vmapped(module, prep, train, xs)
        except Refused:
            raise
        except Exception as e:  # noqa: BLE001  (vmap cannot run this forward: the loop below may)
            if "randomness" in str(e):
                raise Refused(f"{type(module).__name__} draws random numbers in its forward (dropout in train "
                              "mode): per-sample gradients need the same random numbers; put it in eval mode") from e
            first = e
        try:
            return _looped(module, prep, train, xs, B)
        except Refused:
            raise
        except Exception as e:  # noqa: BLE001
            raise Refused(f"torch.func cannot rerun its forward per sample: {first_line(e)} (vmap: "
                          f"{first_line(first)})") from e


def _vmapped(module, prep: _Prepared, train: dict, xs: list) -> dict:
    def one(xs_b, cots_b):
        _, vjp_fn = torch.func.vjp(lambda tr: _forward(module, prep, tr, xs_b, True), train)
        return vjp_fn(tuple(cots_b))[0]

    with warnings.catch_warnings():  # vmap's note that an op has no batching rule yet (LSTM): it is still exact
        warnings.filterwarnings("ignore", message="There is a performance drop")
        return torch.func.vmap(one, in_dims=(prep.in_dims, prep.out_dims), randomness="error")(xs, prep.cots)


def _looped(module, prep: _Prepared, train: dict, xs: list, B: int) -> dict:
    rows = []
    for b in range(B):
        xs_b = [x.narrow(d, b, 1) for x, d in zip(xs, prep.in_dims)]
        cots_b = tuple(c.narrow(d, b, 1) for c, d in zip(prep.cots, prep.out_dims))
        state = torch.get_rng_state()
        _, vjp_fn = torch.func.vjp(lambda tr, xs_b=xs_b: _forward(module, prep, tr, xs_b, False), train)
        if not torch.equal(state, torch.get_rng_state()):
            raise Refused(f"{type(module).__name__} draws random numbers in its forward (dropout in train mode): "
                          "per-sample gradients need the same random numbers; put it in eval mode")
        rows.append(vjp_fn(cots_b)[0])
    return {n: torch.stack([r[n] for r in rows]) for n in train}


def one_sample(module, call, names: list, B: int, b: int) -> dict:
    """name -> the gradient of sample b alone: the forward rerun on that sample only, its δ pulled back."""
    split = samples_of(module, call)
    if split is not None:
        with _modes(module, call.training), torch.random.fork_rng(devices=_cuda_devices(call)):
            return _call_vjp(module, call, names, *split.one(b))
    prep = _prepare(module, call, names, B)
    train = {n: call.params[n] for n in names}
    xs = [prep.leaves[i].narrow(d, b, 1) for i, d in zip(prep.batched, prep.in_dims)]
    cots = tuple(c.narrow(d, b, 1) for c, d in zip(prep.cots, prep.out_dims))
    with _modes(module, call.training), torch.random.fork_rng(devices=_cuda_devices(call)):
        _, vjp_fn = torch.func.vjp(lambda tr: _forward(module, prep, tr, xs, False), train)
        return vjp_fn(cots)[0]


@contextlib.contextmanager
def batch_rerun(module, call, prep: _Prepared, train: dict, xs: list, mode=None):
    """The module's outputs that have a δ, from its forward rerun on the whole batch `xs` with parameters `train`
    (inside `mode`, a TorchFunctionMode, where given), in the train/eval flags of the call and with the random
    number generators left as they were; the caller takes its gradients inside the block. Raises NotApplicable
    where the forward draws random numbers or gives other outputs than at the call."""
    with _modes(module, call.training), torch.random.fork_rng(devices=_cuda_devices(call)), torch.enable_grad():
        state = torch.get_rng_state()
        with mode if mode is not None else contextlib.nullcontext():
            outs = _forward(module, prep, train, xs, False)
        if not torch.equal(state, torch.get_rng_state()):
            raise NotApplicable("its forward draws random numbers")
        if any(o.shape != c.shape for o, c in zip(outs, prep.cots)):
            raise NotApplicable("other outputs than at the call")
        yield outs


def full_batch(module, call, names: list, B: int) -> dict:
    """name -> the gradient of the whole call (every sample at once): what the per-sample rows must add up to."""
    if samples_of(module, call) is not None:
        with _modes(module, call.training), torch.random.fork_rng(devices=_cuda_devices(call)):
            return _call_vjp(module, call, names, *call.inputs, call.deltas)
    prep = _prepare(module, call, names, B)
    train = {n: call.params[n] for n in names}
    xs = [prep.leaves[i] for i in prep.batched]
    with _modes(module, call.training), torch.random.fork_rng(devices=_cuda_devices(call)):
        _, vjp_fn = torch.func.vjp(lambda tr: _forward(module, prep, tr, xs, False), train)
        return vjp_fn(tuple(prep.cots))[0]


def _call_vjp(module, call, names: list, args, kwargs, deltas) -> dict:
    """name -> the gradient of the module's forward on (args, kwargs), the parameters as at the call, `deltas`
    (aligned with flat_outputs, None where none) pulled back."""
    buffers = {n for n, _ in module.named_buffers()}
    frozen = {n: t.clone() if n in buffers else t for n, t in call.params.items() if n not in names}
    train = {n: call.params[n] for n in names}
    picked = [i for i, d in enumerate(deltas) if d is not None]
    if not picked:
        raise Refused("no gradient reached its outputs")
    # autograd, not torch.func.vjp: a recurrent layer's kernel on a PackedSequence reads its weights' memory, which
    # torch.func's wrapped tensors have none of
    train = {n: t.detach().requires_grad_() for n, t in train.items()}
    with torch.enable_grad(), parameters_swapped(module, {**frozen, **train}):
        out = flat_outputs(module.forward(*args, **kwargs))
    if len(out) != len(deltas):
        raise Refused("its forward returns other outputs than at the call")
    grads = torch.autograd.grad([out[i] for i in picked], list(train.values()), [deltas[i] for i in picked],
                                allow_unused=True)
    return {n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(train.items(), grads)}


def _split_loop(module, call, names: list, split: Samples) -> dict:
    """name -> (n, *shape): a loop over the samples the call's arguments state, each one's forward rerun alone and
    its δ pulled back (vmap needs samples of one shape; bags and sequences differ in length)."""
    rows = []
    with _modes(module, call.training), torch.random.fork_rng(devices=_cuda_devices(call)):
        for b in range(split.n):
            state = torch.get_rng_state()
            rows.append(_call_vjp(module, call, names, *split.one(b)))
            if not torch.equal(state, torch.get_rng_state()):
                raise Refused(f"{type(module).__name__} draws random numbers in its forward (dropout in train mode): "
                              "per-sample gradients need the same random numbers; put it in eval mode")
    if not rows:
        raise Refused("its call holds no sample")
    return {n: torch.stack([r[n] for r in rows]) for n in names}


def missing(call) -> str | None:
    """Why a call cannot be used by the generic rule, or None."""
    if call.inputs is None or call.params is None or call.deltas is None:
        return "its inputs, parameters or output gradients were not kept (memory budget, or capture mode)"
    return None


class _modes:
    """The train/eval flags of the module and its submodules as they were at the call, for the recomputation;
    and cuDNN off where it holds a recurrent layer: cuDNN's RNN reads its weights' memory directly, which
    torch.func's per-sample tensors have none of (on a GPU vmap and the loop both failed, every LSTM's weights left
    out), and torch's own RNN kernels, which it runs instead, compute the same gradient."""

    def __init__(self, module, flags):
        self.modules = list(module.modules())
        self.flags = flags
        self.cudnn = (torch.backends.cudnn.flags(enabled=False)
                      if any(isinstance(m, nn.RNNBase) for m in self.modules) else contextlib.nullcontext())

    def __enter__(self):
        self.before = [m.training for m in self.modules]
        if self.flags is not None and len(self.flags) == len(self.modules):
            for m, f in zip(self.modules, self.flags):
                m.training = f
        self.cudnn.__enter__()

    def __exit__(self, *exc):
        self.cudnn.__exit__(*exc)
        for m, f in zip(self.modules, self.before):
            m.training = f


def _cuda_devices(call) -> list:
    return sorted({t.device.index or 0 for t in call.params.values() if t.device.type == "cuda"})


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
