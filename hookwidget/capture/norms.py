"""Per-sample gradient norms computed while backward runs, freeing the factors at once.

Used by capture="norms": a layer's norms are computed as soon as the δ of its last pending
call arrives (or when the backward pass ends, for calls no gradient reached), and its a and δ
are dropped. A parameter shared by several layers (weight tying) keeps its factors until the
pass ends, since its per-sample gradient is the sum over those layers: its norm then comes from each
contribution's ghost norm and their cross terms where that is cheaper (layers/shared.py). Each backward pass (step)
has its own rows: under gradient accumulation every micro-batch's samples are kept, in order.
Under activation checkpointing a layer's input is not held from the first forward to its δ, which would keep the
activations checkpointing frees: without reentrance, the call waits for the rerun's input (the rerun of the same
checkpoint, _torch.autograd.checkpoint_frame); with it, the first forward's calls (no gradient) stand for their reruns,
and their inputs are let go as backward begins.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter, deque

import torch
from torch import nn

from hookwidget._torch.layers import is_conv
from hookwidget._torch.modules import own_parameters
from hookwidget._torch.tensors import version
from hookwidget.layers import factors as fx
from hookwidget.layers import freivalds, generic, shared
from hookwidget.layers.batch_first import samples_first

INCOMPLETE = ("its .grad holds more than its calls gave (checked along random directions as the step ended): its "
              "gradient also comes from outside its recorded calls (read directly, as F.linear(x, emb.weight) in a "
              "parent's forward; a tied layer left out of the trace); use it through traced modules to count it")


class StreamingNorms:
    def __init__(self):
        self._sq: dict = {}  # this step: leading dimension -> list of (module, (B,) squared norms), summed at its end
        self._layers: dict = {}  # this step: leading dimension -> modules counted in it
        self._steps: list = []  # per finished step: (squared norms, modules left out)
        self._shared: dict = {}  # parameter -> list of (module, Factor)
        self._owners: Counter | None = None
        self._wants: dict = {}
        self._readers: Counter | None = None  # input key -> Linear layers reading that input (q, k, v: 3)
        self._grams: dict = {}  # input key -> [input, X Xᵀ, readers still to come]
        self._open: dict = {}  # this step: module -> its calls whose input is kept, not yet counted
        self._left: dict = {}  # this step: modules whose norms could not be counted (see end_step) -> why, or None
        self._awaiting: dict = {}  # this step: (module, id(checkpoint frame)) -> its calls awaiting their input
        self._waiting: set = set()  # ids of those calls
        self._no_grad: set = set()  # this step: ids of calls whose output needs no gradient (no_delta)
        self._modules: dict = {}  # the tracer's records, as on_delta last got them
        # this step, per parameter one module answers for alone: its .grad before the step and its counted factors,
        # projected along random directions (layers/freivalds.py), to check at the step's end that they are all of
        # the gradient the step made (a weight also read outside its layer's calls is not counted by part)
        self._checks: dict = {}  # id(p) -> _Check

    def wants(self, module) -> bool:
        w = self._wants.get(module)
        if w is None:  # asked on every forward call: answer once per module and trace
            # a generic-rule module is not streamed: capture keeps its calls, per_sample.py adds its norms when asked
            w = self._wants[module] = fx.unsupported_reason(module) is None and not fx.is_generic(module) and any(
                p is not None and p.requires_grad for p in own_parameters(module).values())
        return w

    def on_input(self, module, call) -> None:
        """The tracer kept `call.a` of a module it wants: the call waits for its δ. A call backward reruns
        (reentrant checkpointing) takes the place of one of the module's calls whose output needed no gradient
        (no_delta: the first forward's, which stood for it), whose input is let go then."""
        calls = self._open.setdefault(module, [])
        if call.recomputed:
            stand_in = next((c for c in calls if id(c) in self._no_grad), None)
            if stand_in is not None:
                call.sample_dim, call.folded_from, call.in_shape = (stand_in.sample_dim, stand_in.folded_from,
                                                                    stand_in.in_shape)  # where its samples are
                self._no_grad.discard(id(stand_in))
                self._waiting.discard(id(stand_in))
                stand_in.a = None
                calls[:] = [c for c in calls if c is not stand_in]
        calls.append(call)

    def await_input(self, module, call, frame) -> None:
        """A call in a forward that activation checkpointing (use_reentrant=False) reruns in backward: its input is
        taken from the rerun (rerun_input) instead of held from now until its δ, the memory checkpointing frees."""
        self._open.setdefault(module, []).append(call)
        self._awaiting.setdefault((module, id(frame)), deque()).append(call)
        self._waiting.add(id(call))

    def rerun_input(self, module, frame, a) -> None:
        """Backward reran `frame`'s forward: `a` is the input of the module's next call in it, whose δ arrives (or
        arrived) at the first forward's call. A rerun no call awaits (its input was held) gives nothing."""
        calls = self._awaiting.get((module, id(frame)))
        if not calls:
            return
        call = calls.popleft()  # popped whatever it is: the reruns come in the order of the calls
        if id(call) not in self._waiting:  # its output needed no gradient (no_delta): nothing to count
            return
        self._waiting.discard(id(call))
        call.a = a
        if call.delta is not None:  # the last layer of a checkpointed block: its δ came before the rerun
            self.on_delta(module, self._modules)

    def no_delta(self, module, call) -> None:
        """The call's output needs no gradient, so no δ comes for it: a forward without grad, the first one of
        reentrant checkpointing, whose rerun in backward (on_input) takes its place. Until then it is waited for
        as that rerun: the module's norms are of all its calls. (Not rerun, it is counted out as the step ends; a
        forward-only trace keeps its input.)"""
        self._no_grad.add(id(call))

    def begin_step(self) -> None:
        """Backward begins: the inputs of calls whose output needed no gradient are let go (their reruns bring
        their own); a trace that ends without backward keeps them, to show. The .grad of the parameters the step
        may count is projected now: what the step adds is checked against its factors as it ends. Only token tables'
        weights are checked (a head tied to one by F.linear is the case met in practice): a check costs about ten
        small kernels, which doubled the norms' cost on a chain of small Linear layers."""
        self._checks = {} if _reduced_over_ranks() else {  # token tables: where a weight is read outside its layer
            id(p): _Check(p) for m in self._open if isinstance(m, nn.Embedding)  # (a head tied by F.linear); each
            for p in own_parameters(m).values() if p is not None and p.requires_grad and p.dim() == 2}  # check costs
        for calls in self._open.values():
            for c in calls:
                if id(c) in self._no_grad:
                    c.a = None
                    self._waiting.add(id(c))  # still stands for its rerun: waited for without an input

    def _pending(self, module) -> list:
        """The module's calls this step that will add to its norms: input kept or awaited, or one a rerun will
        stand in for."""
        return [c for c in self._open.get(module, ()) if c.a is not None or id(c) in self._waiting]

    def on_delta(self, module, modules) -> None:
        self._modules = modules
        pending = self._pending(module)
        if pending and all(c.delta is not None and c.a is not None for c in pending):  # else wait for the rest
            self._consume(module, pending, modules)

    def end_step(self, modules, model_batch: int | None = None) -> None:
        """The backward pass ended: count the calls that got a δ, forget those that did not. model_batch: the
        leading dimension of the model's input this step (see per_sample.model_batches), where known."""
        for module, calls in list(self._open.items()):
            pending = self._pending(module)
            got = [c for c in pending if c.delta is not None]  # a first forward no rerun stood in for: none
            if any(c.a is None for c in got):  # a δ whose input checkpointing's rerun never gave: not countable
                self._left.setdefault(module, None)
            elif got:
                self._consume(module, got, modules)
            for c in calls:
                c.a = c.delta = None
        for p, pairs in self._shared.items():
            # counted only where every module holding it contributed (else its per-sample gradient is partial)
            whole = len({id(m) for m, _ in pairs}) == self._owners[id(p)]
            if whole and len({shared.batch_of(f) for _, f in pairs}) == 1:
                try:
                    self._add(pairs[0][0], fx.shared_norm_sq([f for _, f in pairs]))
                except ValueError:  # a tied head reduced at token ids its embedding's calls did not end with
                    self._left.update((m, None) for m, _ in pairs)
        for check in self._checks.values():
            if check.modules and not check.whole():  # its .grad holds more than its layer's calls gave
                for m in check.modules:
                    self._drop(m)
        self._checks = {}
        self._steps.append(self._step_result(model_batch))
        self._sq, self._layers, self._shared, self._readers, self._grams = {}, {}, {}, None, {}
        self._open, self._left, self._awaiting, self._waiting, self._no_grad = {}, {}, {}, set(), set()

    def _consume(self, module, calls, modules) -> None:
        if self._owners is None:
            self._owners = _owners(modules)
        if any(c.a.numel() == 0 or c.delta.numel() == 0 for c in calls):
            pass  # an empty batch has no rows to count (per_sample_norms says so in one line)
        elif all(_placed(c, module) for c in calls):
            self._count(module, calls, modules)
        else:  # no proof says where its samples are: not counted, and named (per_sample.left_out)
            self._left.setdefault(module, None)
        for c in calls:
            c.a = c.delta = None
            if c.bdelta is not None:
                c.bdelta = None
        left = self._pending(module)
        if left:
            self._open[module] = left
        else:
            self._open.pop(module, None)

    def _count(self, module, calls, modules) -> None:
        x_gram = self._shared_gram(module, calls, modules)
        own = []
        for f in _factors(module, calls):
            p = getattr(module, f.param)
            if self._owners[id(p)] > 1:
                part = self._head_part(module, p, f) or f
                self._shared.setdefault(p, []).append((module, part))
            else:
                own.append(f)
        for f in own:
            check = self._checks.get(id(getattr(module, f.param)))
            if check is not None:
                check.add(module, f)
        w = next((f for f in own if f.param == "weight"), None)
        b = next((f for f in own if f.param == "bias"), None)
        both = fx.per_sample_norm_sq_with_bias(w, b, x_gram) if w is not None and b is not None else None
        if both is not None:  # weight and bias from one Gram product: fewer kernels per layer
            self._add(module, both)
            self._layers[both.shape[0]].append(module)  # counted as two parameters, as below
            own = [f for f in own if f is not w and f is not b]
        for f in own:
            self._add(module, fx.per_sample_norm_sq(f, x_gram if f.kind == "outer" else None))

    def _head_part(self, module, p, f):
        """`f` reduced to a shared.HeadPart where it is the first of two contributions to `p`: an LM head's, the
        other a token embedding's whose one call this step still waits for its δ (its ids known since its forward);
        else None (the factor is kept whole until the step ends)."""
        if self._owners[id(p)] != 2 or p in self._shared:
            return None
        for m in self._open:
            if m is module or not isinstance(m, nn.Embedding) or m.weight is not p:
                continue
            pending = self._pending(m)
            if (len(pending) != 1 or pending[0].a is None or pending[0].delta is not None
                    or pending[0].folded_from is not None or pending[0].sample_dim):
                return None
            return shared.head_part(f, m, pending[0].a)
        return None

    def _shared_gram(self, module, calls, modules):
        """X Xᵀ of a Linear layer's input, computed once for all layers that read the same tensor.
        An entry holds its input, so no other tensor can take its memory (and key) while it is cached;
        it is dropped when the last reader has used it."""
        if not (isinstance(module, nn.Linear) and len(calls) == 1):
            return None
        if self._readers is None:
            pending = {m: [c for c in cs if c.a is not None] for m, cs in self._open.items()
                       if isinstance(m, nn.Linear)}
            self._readers = Counter(_input_key(m, cs[0].a) for m, cs in pending.items() if len(cs) == 1)
        key = _input_key(module, calls[0].a)
        readers = self._readers.get(key, 0)
        if readers < 2:
            return None
        a = calls[0].a

        def x_gram(X: torch.Tensor) -> torch.Tensor:
            entry = self._grams.get(key)
            if entry is None:
                entry = self._grams[key] = [a, torch.bmm(X, X.transpose(1, 2)), readers]
            entry[2] -= 1
            if entry[2] <= 0:
                del self._grams[key]
            return entry[1]

        return x_gram

    def _drop(self, module) -> None:
        """The module's norms taken out of this step's, and the module named as left out."""
        for b, parts in self._sq.items():
            self._sq[b] = [(m, sq) for m, sq in parts if m is not module]
        for b, ms in self._layers.items():
            self._layers[b] = [m for m in ms if m is not module]
        self._sq = {b: parts for b, parts in self._sq.items() if parts}
        self._layers = {b: ms for b, ms in self._layers.items() if ms}
        self._left[module] = INCOMPLETE

    def _add(self, module, sq: torch.Tensor) -> None:
        b = sq.shape[0]
        self._sq.setdefault(b, []).append((module, sq))
        self._layers.setdefault(b, []).append(module)

    def _step_result(self, model_batch: int | None):
        """(B,) squared norms for the model's batch size (its input's along the batch dim, where every proof starts),
        and the modules left out: those whose samples no proof placed (a position table, rows folded another way),
        and any whose rows are not the batch's."""
        if not self._sq or model_batch not in self._sq:
            return None, {**dict.fromkeys(m for ms in self._layers.values() for m in ms), **self._left}
        left_out = {**dict.fromkeys(m for b, ms in self._layers.items() if b != model_batch for m in ms), **self._left}
        return _summed([sq for _, sq in self._sq[model_batch]]), left_out

    def result(self) -> list:
        """Per step: (squared norms or None, modules left out -> why, None where no proof placed their samples)."""
        return list(self._steps)


def _summed(parts: list) -> torch.Tensor:
    """One sum of the layers' (B,) squared norms: two kernels, where adding them as they come took one per layer."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in parts))
    return torch.stack([t.to(dtype) for t in parts]).sum(0)


def _factors(module, calls: list) -> list:
    """The layer's factors over its calls as their samples saw them: a position table's per sample
    (_per_sample_call); a call on the B samples folded into rows ((B, T, d) viewed as (B·T, d), as capture proved:
    samples.py) unfolded where the layer's rule is over tokens (OPT's MLP, MobileViT's patches), its factors' rows
    grouped per sample where it is not (LeViT's BatchNorm1d over B·T rows); analysis/batches.py does the same for
    capture="full". A folded call that cannot be either stays as it is: left out, and named (per_sample.left_out)."""
    if all(c.folded_from is None for c in calls):
        return fx.factors(module, [_per_sample_call(c, module) for c in calls])
    if fx.spec_for(module).tokens:
        return fx.factors(module, [_per_sample_call(c, module) if c.folded_from is None or c.bdelta is not None
                                   else fx.unfolded(c, c.folded_from) or c for c in calls])
    per_call = []
    for c in calls:
        fs = fx.factors(module, [c])
        if c.folded_from is not None and not is_conv(module):  # a convolution's factors are not token sums
            try:
                fs = fx.grouped_rows(fs, c.folded_from)
            except ValueError:  # not token sums: its rows stay as they are
                pass
        per_call.append(fs)
    return fx.merge_calls(per_call)


def _placed(call, module) -> bool:
    """Whether the call's samples are where its rule can take them: each sample's δ of a position table, rows
    folded sample-major, or a dim capture proved (moved to the front where it is not there: samples_first)."""
    if call.folded_from is not None or _per_sample_call(call, module) is not call:
        return True
    return call.sample_dim is not None and samples_first(call, module) is not None


def _per_sample_call(call, module):
    """A position table's call whose (1, ...) or (T, d) output was added to the batch: each sample's δ is the
    gradient that arrived at that add (call.bdelta, kept where capture hooks the add), exact where autograd's sum
    of it over the samples is the call's δ; its input is then the same for every sample. A call whose samples are
    in another dim than the first, with that dim moved to the front (samples_first). Any other call as it is
    (per_sample.batched_call does the same for capture="full")."""
    bd = call.bdelta
    if bd is None or call.delta is None or call.a is None:
        return samples_first(call, module) or call if call.sample_dim else call
    summed = bd.sum(0, keepdim=bd.dim() == call.delta.dim())
    if summed.shape != call.delta.shape or not torch.allclose(
            summed, call.delta, rtol=1e-4, atol=1e-5 * float(call.delta.abs().max()) + 1e-12):
        return call
    out = copy.copy(call)
    out.delta = bd
    if bd.dim() > call.delta.dim():  # (T, d) added to (B, T, d): a new leading dimension
        out.a = call.a.expand(bd.shape[0], *call.a.shape)
    elif call.a.dim() and call.a.shape[0] == 1:
        out.a = call.a.expand(bd.shape[0], *call.a.shape[1:])
    else:
        return call
    return out


def _input_key(module, a: torch.Tensor) -> tuple:
    """Same key, same values: one storage, offset, shape, strides, version, and the layer's dtype."""
    return (a.data_ptr(), a.device, a.dtype, tuple(a.shape), a.stride(), version(a), module.weight.dtype)


def _owners(modules: dict) -> Counter:
    """id(parameter) -> how many called modules answer for it: a generic-rule module does not answer for a
    parameter a called layer inside it holds too (BERT's head holds its decoder's bias: the decoder answers).
    `modules`: the tracer's records (module -> ModuleRecord, whose `generic` was decided at its first call)."""
    called = {id(m) for m in modules}
    out = Counter()
    for m, rec in modules.items():
        own = {id(p): p for p in own_parameters(m).values() if p is not None}.values()  # as parameters(recurse=False)
        if rec.generic:
            answered = {id(p) for p in generic.owned(m, called).values()}
            own = [p for p in own if id(p) in answered]
        out.update(id(p) for p in own)
    return out


class _Check:
    """One parameter's step: its .grad before (projected), its factors as they are counted (projected), compared
    when the step ends with what its .grad became. A factor that cannot be projected stops the check (trusted, as
    an exact rule is)."""

    def __init__(self, p):
        self.p, self.modules, self.open = p, [], True
        self.U, self.V = freivalds.directions(tuple(p.shape), p.device)
        self.before = freivalds.of_grad(p.grad, self.U, self.V) if p.grad is not None else None
        self.got = self.scale = 0

    def add(self, module, f) -> None:
        if not self.open or not freivalds.projectable(f, tuple(self.p.shape), self.p.dtype):
            self.open = False
            return
        g, s = freivalds.of_factor(f, self.U, self.V)
        self.got, self.scale = self.got + g, self.scale + s
        if module not in self.modules:
            self.modules.append(module)

    def whole(self) -> bool:
        g = self.p.grad
        if not self.open or g is None or g.is_sparse or g.dtype != self.p.dtype:
            return True  # nothing to compare with: trusted
        ref, bound = freivalds.of_grad(g, self.U, self.V)
        if self.before is not None:
            ref, bound = ref - self.before[0], bound + self.before[1]
        return freivalds.agree(self.got, ref, self.scale + bound)


def _reduced_over_ranks() -> bool:
    """Whether .grad may be averaged over ranks after backward (DDP): then it is not this rank's factors' sum."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
