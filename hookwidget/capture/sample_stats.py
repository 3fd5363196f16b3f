"""Per-sample gradient norms per step for the watch (`hw.watch(per_sample=True)`): the largest one and its
sample, from each layer's (a, δ) shortcut as its δ arrives (the keep strategy "stats", step_stats.py, calls it);
and each sample's share of the step's gradient, from the same factors (sample_shares.py)."""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from hookwidget._torch.autograd import checkpoint_frame
from hookwidget._torch.tensors import version
from hookwidget.capture.sample_shares import WIDTH, SampleShares
from hookwidget.capture.samples import Samples
from hookwidget.capture.stat_rows import F64, NAN
from hookwidget.layers.batch_first import movable


class _Call:
    """One forward call of a layer, as the per-sample rules read it (a, δ, the layer's state then)."""

    __slots__ = ("a", "delta", "state", "version", "sample_dim", "folded_from", "in_shape")

    def __init__(self, a: torch.Tensor | None, state):
        self.a, self.delta, self.state = None, None, state
        self.sample_dim = self.folded_from = self.in_shape = None  # where its samples are (capture/samples.py)
        if a is not None:
            self.take(a)

    def take(self, a: torch.Tensor) -> None:
        self.a, self.version = a.detach(), version(a)
        if self.sample_dim:
            self.a = self.a.movedim(self.sample_dim, 0)


class PerSample:
    """Per step, the largest per-sample gradient norm and its sample, from the layers' (a, δ) shortcuts
    (ghost norms: Linear's ‖Σ_t δ_t a_tᵀ‖² from two Gram products, never the per-sample gradients
    themselves, where that is cheaper). A layer's squared norms are computed as soon as the δ of its
    last call of the step arrives, and its a and δ let go at once. Layers that share a parameter (a tied
    embedding and LM head) are reduced together once the last of them has its δ, the shared parameter's
    norm with its cross terms (layers/shared.py): the first one's a and δ wait until then, but for a tied LM
    head's, reduced as it arrives to what the cross term needs (_head_part). A call in a forward that
    non-reentrant checkpointing reruns holds no input: it takes the rerun's (rerun), as capture/norms.py does."""

    def __init__(self, layers: list, layer_names: list, pairs: list, shares: bool = True):
        from hookwidget.layers import factors as fx
        from hookwidget.layers import shared

        self.fx, self.shared = fx, shared
        owners: dict = {}
        for li, pi in pairs:
            owners.setdefault(pi, set()).add(li)
        self.eligible, left = set(), []
        for li, m in enumerate(layers):
            why = fx.unsupported_reason(m)
            if why is None and fx.is_generic(m):
                why = "no exact (a, δ) rule"
            if why is None and not any(p.requires_grad for p in m.parameters(recurse=False)):
                continue
            if why is None:
                self.eligible.add(li)
            else:
                left.append(f"{layer_names[li]} ({why})")
        self.group = _tied_groups(owners)  # layer -> the layers it shares a parameter with
        for g in set(self.group.values()):
            if not g <= self.eligible:  # a partner without a rule: the shared parameter's norm is not known
                for li in sorted(g & self.eligible):
                    self.eligible.discard(li)
                    left.append(f"{layer_names[li]} (a parameter shared with a layer left out)")
        self.layers, self.layer_names, self.odd = layers, layer_names, set()
        self.samples = Samples()  # where each call's samples are, proven from the first watched call's input
        self.partial_reruns: set = set()  # layers reentrant checkpointing reran after their norms were taken
        self.accumulated = False  # an optimizer step of several backward passes was recorded (its shares NaN)
        # which samples carried each step (shares=False: per_sample="norms", no parameter hooked, NaN)
        self.shares = SampleShares(layers, self.eligible if shares else set(), self.group)
        self.note = (f"hw.watch(per_sample=True): per-sample norms leave out {', '.join(left[:6])}"
                     f"{' ...' if len(left) > 6 else ''}") if left else None

    def forward(self, step, li: int, module, a: torch.Tensor, rerun: bool = False, out=None):
        """A call of layer li read a (and gave out): its _Call (None where the layer is left out). rerun: a call
        reentrant checkpointing reruns in backward (its first forward, without grad, went unseen: its samples are
        taken where the first forward's were, dim 0). The first watched call of a step reads the model's input:
        its dim 0 holds the samples; every other call's are followed from there (capture/samples.py), never
        taken from a size that matches."""
        if step.ps_batch is None and a is not None and a.dim() > 0:
            step.ps_batch = self.samples.root(a)
        if a is None or a.dim() == 0 or li not in self.eligible and rerun:
            return None
        call = _Call(None, None)
        if not rerun:
            self.samples.place(module, call, a)
            if out is not None:
                self.samples.output(module, call, a, out)
            if li in self.eligible and (call.sample_dim is None or not movable(module, call.sample_dim, a)):
                left = self.group.get(li, (li,))  # and the layers it shares a parameter with: it would be partial
                self.odd.update(left)  # no proof places its samples where its rule takes them: left out, named
                step.ps_odd.update(left)
                return None
        if li not in self.eligible:
            return None
        if rerun and li in step.ps_done:  # its norms were taken without this call: the step's are not known
            step.ps_bad = True
            self.partial_reruns.add(li)
            return None
        where = checkpoint_frame()  # non-reentrant checkpointing reruns this forward: its input comes again then
        awaits = where is not None and where[0] == "forward"
        call.state = self.fx.forward_state(module)
        if not awaits:
            call.take(a)
        step.ps_calls.setdefault(li, []).append(call)
        if awaits:
            step.ps_awaiting.setdefault((li, id(where[1])), deque()).append(call)
        return call

    def rerun(self, step, li: int, a: torch.Tensor) -> None:
        """Backward reruns a checkpointed forward (use_reentrant=False): `a` is the input of layer li's next call
        in it, whose δ arrives (or arrived) at the first forward's call (under the watch's lock)."""
        where = checkpoint_frame()
        calls = step.ps_awaiting.get((li, id(where[1]))) if where is not None else None
        if calls:  # the reruns come in the order of the calls
            call = calls.popleft()
            call.take(a)
            if call.delta is not None:  # the last layer of a checkpointed block: its δ came before the rerun
                self._ready(step, li)

    def delta(self, step, li: int, call, grad: torch.Tensor) -> None:
        """δ of that call arrived (under the watch's lock)."""
        call.delta = grad.detach()
        if call.sample_dim:  # samples proven in another dim: moved to the front for the rule, a and δ alike
            call.delta = call.delta.movedim(call.sample_dim, 0)
        self._ready(step, li)

    def _ready(self, step, li: int) -> None:
        """Reduce layer li once all its calls have their a and δ (and those of the layers it shares a parameter
        with; a tied LM head is reduced as far as it can be at once, _head_part)."""
        members = [m for m in self.group.get(li, (li,)) if m in step.ps_calls]
        if all(c.delta is not None and c.a is not None for m in members for c in step.ps_calls[m]):
            parts = {m: step.ps_parts.pop(m) for m in self.group.get(li, ()) if m in step.ps_parts}
            self._reduce(step, {m: step.ps_calls.pop(m) for m in members}, parts)
        elif li in self.group and all(c.delta is not None and c.a is not None for c in step.ps_calls.get(li, ())):
            self._head_part(step, li)

    def _head_part(self, step, li: int) -> None:
        """Layer li has all its δ and shares its weight with a token embedding whose one call still waits for its
        δ (a tied LM head): its contribution is reduced now (layers/shared.HeadPart, its other parameters' norms
        with it) and its a and δ let go, instead of holding the vocabulary-wide δ until backward ends."""
        others = [m for m in self.group[li] if m != li]
        head, calls = self.layers[li], step.ps_calls[li]
        e = others[0] if len(others) == 1 else None
        lookup = self.layers[e] if e is not None else None
        pending = step.ps_calls.get(e, ())
        if (not isinstance(lookup, nn.Embedding) or lookup.weight is not getattr(head, "weight", None)
                or len(pending) != 1 or pending[0].delta is not None or pending[0].a is None
                or any(version(c.a) != c.version for c in calls)):
            return
        with torch.no_grad():
            fs = self.fx.factors(head, calls)
            w = next((f for f in fs if f.param == "weight"), None)
            part = self.shared.head_part(w, lookup, pending[0].a) if w is not None else None
            if part is None:
                return
            rest = [self.fx.per_sample_norm_sq(f) for f in fs if f is not w]
            step.ps_parts[li] = (part, sum(rest) if rest else None)
            self.shares.head(step, li, fs, w, pending[0].a)  # its shares' part, its δ let go too
        del step.ps_calls[li]
        for c in calls:
            c.a = c.delta = None

    def end(self, step, dev):
        """The step's [largest per-sample gradient norm, its sample, then sample_shares.WIDTH floats: the top
        samples by share] (float64, on dev), NaN where not known."""
        while step.ps_calls:  # calls no δ reached added nothing to .grad: the others are counted
            li = next(iter(step.ps_calls))
            calls = {m: step.ps_calls.pop(m) for m in self.group.get(li, (li,)) if m in step.ps_calls}
            got = {m: [c for c in cs if c.delta is not None] for m, cs in calls.items()}
            got = {m: cs for m, cs in got.items() if cs}
            if any(c.a is None for cs in got.values() for c in cs):  # checkpointing's rerun never gave its input
                step.ps_bad = True
                continue
            parts = {m: step.ps_parts.pop(m) for m in self.group.get(li, ()) if m in step.ps_parts}
            if got or parts:
                self._reduce(step, got, parts)
        for li in list(step.ps_parts):  # a tied head whose embedding's call got no δ: its own contribution
            self._reduce(step, {}, {li: step.ps_parts.pop(li)})
        self.samples.clear()  # the step's tensors and graph nodes go with it
        sq = step.ps_sq.get(step.ps_batch)
        shares = self.shares.row(step, step.ps_batch, dev)
        if step.ps_bad:
            return torch.full((2 + WIDTH,), NAN, dtype=F64, device=dev)
        if sq is None:
            return torch.cat([torch.full((2,), NAN, dtype=F64, device=dev), shares])
        m, i = torch.max(sq.to(dev, F64), 0)
        return torch.cat([torch.stack([m.sqrt(), i.to(F64)]), shares])

    def notes(self) -> list:
        """What the per-sample norms left out so far, and why (the watch adds each new one to w.notes)."""
        out = []
        if self.odd:
            names = ", ".join(self.layer_names[li] for li in sorted(self.odd))
            out.append(f"hw.watch(per_sample=True): per-sample norms leave out {names}: no proof places the samples "
                       "of the first watched layer's input (its dim 0) where its rule takes them (a table called on "
                       "positions, a copy of the data, rows folded); hw.trace(..., batch_dim=N) shows each layer's")
        if self.accumulated and self.shares.params:
            out.append("hw.watch(per_sample=True): the samples' shares (w.sample_shares, Anomaly.samples) are NaN in "
                       "optimizer steps of several backward passes: the step's gradient is known only after its last "
                       "pass, when the earlier passes' a and δ are gone (a kept Trace holds the last pass only); "
                       "hw.trace of the whole optimizer step has them: t.shares()")
        if self.partial_reruns:
            names = ", ".join(self.layer_names[li] for li in sorted(self.partial_reruns))
            out.append(f"hw.watch(per_sample=True): per-sample norms are NaN (not known) in steps where reentrant "
                       f"checkpointing reran {names} in another block after its gradient had arrived from one: its "
                       "per-sample gradient sums its calls; checkpoint(..., use_reentrant=False) reruns them in order")
        return out

    def _reduce(self, step, calls: dict, parts: dict | None = None) -> None:
        """The squared per-sample norms of the layers in `calls` (layer -> its calls this step: one layer, or
        layers that share a parameter, taken out of step.ps_calls) and `parts` (a tied head reduced before,
        _head_part), added to the step's; their a and δ let go."""
        every = [c for cs in calls.values() for c in cs]
        step.ps_done.update(calls)
        if step.ps_odd.intersection(calls) or step.ps_odd.intersection(parts or ()):
            pass  # a layer of the group was left out at its call (forward): none of them is counted
        elif any(version(c.a) != c.version for c in every):
            step.ps_bad = True  # an input changed in place after the layer read it: not known this step
        else:
            with torch.no_grad():
                fs = {li: self.fx.factors(self.layers[li], cs) for li, cs in calls.items()}
                sq = self._norm_sq(fs, parts or {})
            if sq is None or sq.shape[0] != step.ps_batch:
                self.odd.update(calls)  # its rows are not the batch's samples (a position embedding: tokens)
            if sq is not None:
                n = sq.shape[0]
                step.ps_sq[n] = step.ps_sq[n] + sq.to(F64) if n in step.ps_sq else sq.to(F64)
                for li, lfs in fs.items():
                    self.shares.factors(step, li, lfs)
        for c in every:
            c.a = c.delta = None

    def _norm_sq(self, factors: dict, parts: dict) -> torch.Tensor | None:
        """(rows,) squared norms from each layer's factors (layer -> its factors this step); None where layers
        sharing a parameter saw different leading dimensions (rows that are not the same samples: their shared
        gradient has no per-row split)."""
        fx = self.fx
        if len(factors) == 1 and not parts:
            (li, fs), = factors.items()
            return fx.layer_norm_sq(self.layers[li], fs)
        by_param: dict = {}  # id(parameter) -> its factors, from every layer that holds it
        rest = []  # a reduced head's other parameters' squared norms
        for li, (part, own) in parts.items():
            by_param.setdefault(id(self.layers[li].weight), []).append(part)
            rest += [own] if own is not None else []
        for li, fs in factors.items():
            m = self.layers[li]
            for f in fs:
                by_param.setdefault(id(getattr(m, f.param)), []).append(f)
        if len({self.shared.batch_of(f) for fs in by_param.values() for f in fs}) > 1:
            return None
        return sum(fx.shared_norm_sq(fs) for fs in by_param.values()) + sum(rest)


def _tied_groups(owners: dict) -> dict:
    """layer -> the frozenset of layers connected to it by shared parameters (`owners`: parameter -> its layers),
    for the layers that share one."""
    group: dict = {}
    for ls in owners.values():
        if len(ls) < 2:
            continue
        merged = set(ls).union(*(group.get(li, ()) for li in ls))
        for li in merged:
            group[li] = frozenset(merged)
    return group
