"""The keep strategy "stats": the watch's per-step statistics, streamed by the one tracer (tracer.py).

The tracer owns the hooks (one forward hook on each watched layer, the δ hook on its output, the optimizer
hooks), their removal and the step boundaries; this strategy decides what each call reduces, on device and
while the tensor is hot in cache (stat_rows.reduce_input / reduce_delta, per_sample's (a, δ) norms), and puts
a recorded backward pass's reductions together into its (layers, statistics) row in a few kernels when its
backward ends; where a step is an optimizer step of several passes, opt_steps.py adds their rows up when it has
run. It keeps no Call, no StepRecord and no .grad copy (`records = False`): a watch left on for a million steps
holds its rows only. The rows go to the watch through `Watched.add`; what it does with them (moving them to the
host in batches, detection, the flight recorder) is the watch's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, NamedTuple

import torch

from hookwidget._torch import host_reads
from hookwidget._torch.autograd import checkpoint_frame
from hookwidget._torch.norms import foreach_copy_, foreach_sub_
from hookwidget.capture import compiled_stats
from hookwidget.capture.keep import Keep, register
from hookwidget.capture.opt_steps import merge
from hookwidget.capture.stat_rows import F64, NAN, Rows, S, _locals, add_delta, local, reduce_delta, reduce_input
from hookwidget.capture.stat_rows import unscale as unscale_row
from hookwidget.capture.tensors import first_tensor
from hookwidget.stats import l2_batch

STATS = "stats"  # the strategy's name (not a user capture mode: the watch makes its Tracer itself)
RECENT = 256  # backward passes the first accumulating optimizer step can take back (StatsKeep._take_back)


class Watched(NamedTuple):
    """What the watch hands the strategy (Tracer's `norms_rule=`): the watched `layers`, their parameters
    `params` and the (layer index, parameter index) `pairs`; rows every `every` steps; `per_sample`: a
    sample_stats.PerSample or None. The callbacks: `scale()` the GradScaler's scale now (a device tensor) or
    None, asked as each backward starts; `add(step)` a recorded step's row is ready (on device); `changed()` a
    row already on the host was written into; `ended(step)` a step's backward ended, recorded or not;
    `began(step)` the first call of a step's forward (the optimizer steps of the step before have run);
    `take_back(steps)` the rows of `steps` (added, recorded) are to be added up into one optimizer step: whether
    they could be (still on device, their index free: the watch's rows, anomalies and flight recorder)."""

    layers: list
    params: list
    pairs: list
    every: int
    per_sample: object
    scale: Callable
    add: Callable
    changed: Callable
    ended: Callable
    began: Callable
    take_back: Callable


class Step:
    """What hooks gathered for one step while it runs; all on device. A step is one backward pass, or, once the
    watch counts optimizer steps (StatsKeep.grouped), one optimizer step: then each backward pass is a Step of its
    own (its `index` the optimizer step's) and opt_steps.merge adds them up into the optimizer step's Step."""

    def __init__(self, index: int | None = None, recorded: bool = False):
        self.index, self.recorded = index, recorded  # index None: not known until the pass's first call (_open)
        self.pass_index = None  # the backward pass (0, 1, ... over the run) it was
        self.inside = False  # its backward ran inside an optimizer step: step(closure)
        self.accumulates = False  # its backward began with .grad set: it added to the passes' before it
        self.sums = None  # stat_rows.Rows.sums of its row, while an optimizer step may add it up (opt_steps.py)
        self.passes = self.micro = None  # an optimizer step's Step: its passes' indices and (rows, step rows)
        self.delta: dict = {}  # layer index -> [‖δ‖², max|δ|, NaN, Inf] over its calls (compiled code's)
        self.a: dict = {}  # layer index -> [Σa², zeros, non-finite, entries] over its calls (compiled code's)
        self.order: dict = {}  # layer index -> position in backward order (δ arrival)
        self.a_order: dict = {}  # layer index -> position in forward order (of the calls δ reached)
        self.ds: list = []  # (layer index, forward position, reduce_delta(δ), reduce_input(a) or None) per call
        self.calls = 0  # forward calls of watched layers so far (the first tells Watched.began)
        self.loss = None
        self.has_loss = False
        self.row = self.step_row = None  # (layers, stats) and [loss, global grad norm], when backward ends
        self.host = None  # (host tensor, row) once moved to the host
        self.update = self.touched = None  # Σ‖ΔW‖² per layer, and the layers an optimizer step changed
        self.lr: dict = {}  # layer -> its learning rate at the optimizer step (a float, or a device tensor)
        self.parts = None  # stat_rows.Parts of the row (watch/ranks.py sums shards over ranks)
        self.updates: list = []  # (param indices, their ‖ΔW‖ as 0-d tensors) per optimizer step (watch/ranks.py)
        self.compiled = False  # statistics came (also) from compiled code (compiled_stats.py)
        self.scale = self.next_scale = None  # a GradScaler's scale at this backward and at the next
        self.roots = None  # the roots of a backward no eager hook saw (the watch judges why, then lets them go)
        self.ps_batch, self.ps_calls, self.ps_sq, self.ps_bad = None, {}, {}, False  # per_sample=True (PerSample)
        self.ps_parts: dict = {}  # per_sample=True: tied heads reduced before their embedding's δ (PerSample)
        self.ps_awaiting: dict = {}  # per_sample=True: checkpointed calls awaiting their rerun's input (PerSample)
        self.ps_done: set = set()  # per_sample=True: layers whose norms this step were taken (PerSample)
        self.ps_odd: set = set()  # per_sample=True: layers left out this step, no proof placing their samples
        self.shares = None  # per_sample=True: the samples' shares of the step's gradient (sample_shares.py)
        self.ps = None  # [largest per-sample gradient norm, its sample, the top shares], when backward ends


class StatsKeep(Keep):
    """Per-step statistics of the watched layers; `rule` is the watch's `Watched`. `cur`: the backward pass whose
    forward/backward runs now; `last`: the latest pass whose backward ended; `n`: backward passes seen
    (autograd.grad calls, gradient penalties, are not steps); `k`: the index of the step being made.

    Steps are backward passes until the watch sees an optimizer step hold several of them (gradient accumulation)
    or run one inside step(closure) (opt_steps.py says why the optimizer hooks tell it): from then on (`grouped`,
    or from the start where count_optimizer_steps() says so) a step is an optimizer step, made of the passes since
    the one before, and its row goes to the watch when the optimizer's post-hook has run. A plain loop (one
    backward pass, then one optimizer step) never groups: its rows, and their cost, are those of backward passes."""

    records = False
    node_grads = False
    updates = True

    def __init__(self, budget, rule: Watched):
        super().__init__(budget, rule)
        self.layers, self.params, self.ps, self.every = rule.layers, rule.params, rule.per_sample, rule.every
        self.layer_of = {m: i for i, m in enumerate(rule.layers)}
        self.rows = Rows(len(rule.layers), rule.params, rule.pairs)
        self.lock = threading.Lock()  # the δ hooks autograd may run on its device threads
        self.kind = None  # the kind of the outermost backward running now
        self.n = 0
        self.k = 0
        self.grouped = False
        self.group: list = []  # grouped: the passes of the open optimizer step
        self.stepping: list = []  # the optimizers (of watched parameters) whose step runs now, outermost first
        self.since = 0  # backward passes since the latest optimizer step began
        self.recent: list = []  # while steps are backward passes: the passes since the latest optimizer step began
        # whether .grad is set as a backward begins, read from one parameter (cheap, no sync): zero_grad (set to None,
        # its default) came before a pass that starts a gradient, not before one that accumulates into it
        self.probe = next((p for p in rule.params if p.requires_grad), rule.params[0])
        self.cur = Step()
        self.last: Step | None = None
        self.row_step: Step | None = None  # the latest step made: an optimizer step after it writes into its row
        self.opts = weakref.WeakKeyDictionary()  # optimizer -> (param-group sizes, param indices, copies, groups)
        self.snap = None  # (optimizer, param indices, copies) between an optimizer's pre and post hooks
        self.sinks = compiled_stats.sinks(rule.layers)  # where compiled code leaves its statistics

    # -- calls: reduced now, while a and δ are hot in cache, to 0-d tensors -------------------------
    def compiled_call(self, module, inputs, output):
        return compiled_stats.probe(self.sinks[self.layer_of[module]], inputs, output)

    def on_call(self, module, inputs, out):
        cur = self.cur
        if cur.calls == 0:
            if self.group and not self.stepping and self.probe.grad is None:
                self._abandon()
            self._open(cur)
            self.rule.began(cur)
        cur.calls += 1
        if not cur.recorded:
            return None
        a = first_tensor(inputs)
        li = self.layer_of[module]
        call = self.ps.forward(cur, li, module, a, out=out) if self.ps is not None else None
        return li, reduce_input(a) if a is not None else None, cur.calls, call

    def on_recompute(self, module, inputs, out):
        """A forward that backward reruns (gradient checkpointing): reduced as a call, without counting as one of
        the step's forward calls (its forward began long before). Its δ arrives under reentrant checkpointing, whose
        first forward ran without grad and went unseen; under non-reentrant checkpointing it never does, and the
        first forward's call is the one counted. Per-sample norms take its input for that call, which held none
        (on_rerun_input, from the pre-hook); under reentrant checkpointing they take the rerun as a call."""
        cur = self.cur
        if not cur.recorded or self.kind != "backward":
            return None
        a = first_tensor(inputs)
        li = self.layer_of[module]
        with self.lock:  # autograd may run the recomputation on one of its device threads
            # reentrant: the rerun is the call (its first forward, without grad, went unseen); non-reentrant: the
            # first forward's call is, and on_rerun_input gave it this input
            reentrant = self.ps is not None and checkpoint_frame() is None
            call = self.ps.forward(cur, li, module, a, rerun=True) if reentrant else None
        return li, reduce_input(a) if a is not None else None, cur.calls, call

    def param_hooks(self) -> list:
        """(parameter, hook) pairs the tracer registers: per_sample=True takes each backward's gradient of each
        counted parameter, for the samples' shares (sample_shares.py)."""
        return [(p, self._grad_hook(pi)) for pi, p in enumerate(self.ps.shares.params)] if self.ps is not None else []

    def _grad_hook(self, pi: int):
        def hook(g):
            if self.kind == "backward":  # autograd.grad calls (gradient penalties) are not steps
                with self.lock:
                    if self.cur.recorded:
                        self.ps.shares.grad(self.cur, pi, g)
        return hook

    @property
    def rerun_inputs(self) -> bool:
        return self.ps is not None

    def on_rerun_input(self, module, inputs) -> None:
        """A call of a forward that backward reruns is about to run: per-sample norms take its input for the first
        forward's call (PerSample.rerun), which held none."""
        cur = self.cur
        a = first_tensor(inputs)
        if cur.recorded and self.kind == "backward" and a is not None:
            with self.lock:  # autograd may run the recomputation on one of its device threads
                self.ps.rerun(cur, self.layer_of[module], a)

    def on_delta(self, module, token, grad, modules) -> bool:
        if self.kind != "backward":
            return False  # autograd.grad calls (gradient penalties) are not steps
        li, a_red, seq, call = token
        red = reduce_delta(grad)
        with self.lock:
            cur = self.cur
            if cur.recorded:
                cur.ds.append((li, seq, red, a_red))
                if call is not None:
                    self.ps.delta(cur, li, call, grad)
        return False

    # -- steps -----------------------------------------------------------------------------------
    def _open(self, cur: Step) -> None:
        """The pass's step is known at its first call (or backward): the step being made, `k`."""
        if cur.index is None:
            cur.index, cur.recorded = self.k, self.k % self.every == 0

    def count_optimizer_steps(self) -> None:
        """From now on a step is an optimizer step (see the class docstring)."""
        self.grouped = True

    def complete(self) -> int:
        """The last step whose row is complete (its optimizer step ran): before the step being made, and, while
        steps are backward passes, before the latest pass too (an optimizer step may still follow it)."""
        return self.k - 1 if self.grouped else self.k - 2

    def begin_pass(self, kind: str, tensors: list) -> None:
        self.kind = kind
        if kind != "backward":
            return
        cur = self.cur
        cur.accumulates = self.probe.grad is not None
        if self.stepping:  # backward inside step(closure): the pass is that optimizer step's
            cur.inside = True
            self.grouped = True
        elif self.group and not cur.accumulates:  # the gradient of the passes before was let go with no optimizer
            self._abandon()                        # step (a GradScaler skipped it): they make a step of their own
            cur.index = None  # its forward was counted in theirs (zero_grad came after it): the next step's
        self._open(cur)
        cur.scale = self.rule.scale()
        for s in (self.last, self.row_step):
            if s is not None and s.recorded and s.next_scale is None:
                s.next_scale = cur.scale
        if cur.recorded:
            scalars = [t for t in tensors if t.numel() == 1]
            cur.loss = scalars[0].detach().reshape(()).clone() if scalars else None
            cur.has_loss = bool(scalars)
            if cur.calls == 0:
                cur.roots = list(tensors)  # no layer hook ran in eager code: the watch judges why

    def end_pass(self) -> None:
        kind, self.kind = self.kind, None
        if kind != "backward":
            return
        step = self.cur
        compiled_stats.take(self.sinks, step)
        if step.roots is not None and (step.delta or step.ds):
            step.roots = None  # compiled code's hooks saw it
        if step.recorded:
            self._reduce(step)
            unscale_row(step.row, step.step_row, step.scale)
            step.parts = self.rows.parts
            step.delta = step.a = step.loss = step.ds = None
            step.sums = self.rows.sums  # views (no copy): what an optimizer step adds up (_take_back too)
            if not self.grouped:
                self.rule.add(step)
        step.pass_index = self.n
        self.last = step
        self.n += 1
        self.since += 1
        if self.grouped:
            self.group.append(step)
            if self.ps is not None and len(self.group) > 1 and step.recorded:
                self.ps.accumulated = True  # its shares are left out (opt_steps.merge): a note says so now
        else:
            self.row_step = step
            self.recent.append(step)
            if len(self.recent) > RECENT:  # no optimizer step in sight: a loop that updates by hand, or none
                del self.recent[0]
            self.k += 1
        self.cur = Step()
        self.rule.ended(step)

    def _close(self, read_grads: bool) -> Step:
        """The open optimizer step's Step, its passes added up (opt_steps.merge); read_grads: .grad is what the
        step used (the optimizer's post-hook), else the last pass's .grad stands (no optimizer step followed)."""
        group, self.group = self.group, []
        step = Step(group[0].index, group[0].recorded)
        step.passes = [s.pass_index for s in group]
        step.inside = any(s.inside for s in group)
        if step.recorded:
            dev = self.params[0].device
            grads, total = self.rows.grads(dev) if read_grads else (None, None)
            step.row, step.step_row, step.order, step.a_order, step.has_loss, step.ps = merge(group, grads, total)
            if self.ps is not None and len(group) > 1:
                self.ps.accumulated = True  # its shares are left out (opt_steps.merge): a note says so
            step.micro = (torch.stack([s.row for s in group]), torch.stack([s.step_row for s in group]))
            step.scale, step.next_scale = group[-1].scale, group[-1].next_scale
            step.compiled = any(s.compiled for s in group)
        for s in group:
            s.row = s.step_row = s.sums = s.ps = None
        self.row_step = step
        self.k += 1
        return step

    def _abandon(self) -> None:
        """The open optimizer step's passes, which no optimizer step followed, as one step (update_ratio NaN): a
        pass that begins with .grad unset (zero_grad) outside an optimizer step starts a new one."""
        step = self._close(read_grads=False)
        if step.recorded:
            self.rule.add(step)

    def finish(self) -> None:
        """The watch closes: passes no optimizer step followed make one more step."""
        if self.group:
            self._abandon()

    def _reduce(self, step) -> None:
        """The step's (layers, stats) row from what its hooks reduced, put together on device in a few kernels."""
        dev = self.params[0].device
        for li, seq, _, a_red in step.ds:
            if li not in step.order:
                step.order[li] = len(step.order)  # backward order: the first δ of each layer
            if a_red is not None:
                step.a_order[li] = min(seq, step.a_order.get(li, seq))
        if step.delta or step.a:  # compiled code left statistics too (compiled_stats.take): merged per layer
            for li, _, (n, lo, hi, counts), a_red in step.ds:
                z = torch.zeros(2, dtype=F64, device=n.device) if counts is None else counts
                st = torch.cat([torch.stack([n.double().square(), torch.maximum(lo.abs(), hi.abs()).double()]), z])
                step.delta[li] = add_delta(step.delta[li], st) if li in step.delta else st
                if a_red is not None:
                    n, nz, k, bad = a_red
                    st = torch.stack([n.double().square(), k - nz.double(),
                                      bad if bad is not None else torch.zeros((), dtype=F64, device=n.device),
                                      torch.full((), float(k), dtype=F64, device=n.device)])
                    step.a[li] = step.a[li] + st if li in step.a else st
            step.row, step.step_row = self.rows.row(step.delta, step.a, step.loss, dev)
        else:
            step.row, step.step_row = self.rows.row_from([(li, *d) for li, _, d, _ in step.ds],
                                                         [(li, *a) for li, _, _, a in step.ds if a is not None],
                                                         step.loss, dev)
        if self.ps is not None:
            step.ps = self.ps.end(step, dev)
            if step.scale is not None:  # backward ran on loss · scale: so did every sample's gradient
                step.ps[0].div_(step.scale.to(dev, F64))

    # -- optimizer steps: the update ratio ‖ΔW‖/‖W‖ and the learning rate of each layer's param group -----
    def before_update(self, opt) -> None:
        """An optimizer step begins. Steps are optimizer steps from here if it accumulated two or more backward
        passes; its ΔW is measured (parameters copied now) where the step it belongs to is recorded."""
        sizes = tuple(len(g["params"]) for g in opt.param_groups)
        hit = self.opts.get(opt)
        if hit is None or hit[0] != sizes:
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            idx = tuple(i for i, p in enumerate(self.params) if id(p) in ids)
            hit = self.opts[opt] = (sizes, idx, [torch.empty_like(local(self.params[i])) for i in idx] if idx
                                    else [], _layer_groups(opt, self.params, self.rule.pairs))
        _, idx, copies, _ = hit
        if not idx:  # it steps none of the watched parameters
            return
        self.stepping.append(opt)
        if len(self.stepping) > 1:  # a wrapper's step calling the inner optimizer's: the outer one counts
            return
        if not self.grouped and self.since >= 2 and self.last.accumulates:
            self.grouped = True  # accumulation: from this optimizer step on, steps are optimizer steps
            self._take_back()
        self.since = 0
        self.recent = []
        if self.grouped and not self.group:  # its passes are to come (step(closure)): the step being made
            recorded = self.k % self.every == 0
        elif self.grouped:
            recorded = self.group[0].recorded
        else:  # the latest pass's, unless a closure follows (the first step of a closure loop: last is None)
            recorded = self.last is None or self.last.recorded
        if recorded:
            foreach_copy_(copies, _locals([self.params[i] for i in idx]))  # detached: nothing recorded
            self.snap = (opt, idx, copies)

    def _take_back(self) -> None:
        """The passes this first accumulating optimizer step holds were made steps of their own: made its passes
        again where the watch can still add them up (Watched.take_back), else they stay steps of their own."""
        recent, self.recent = self.recent[-self.since:], []
        rows = [s for s in recent if s.recorded]
        if len(rows) not in (0, len(recent)) or not self.rule.take_back(rows):
            return
        first = recent[0].index
        for s in recent:
            s.index = first
        self.group, self.k = recent, first
        self.row_step = None

    def after_update(self, opt) -> None:
        if not self.stepping or self.stepping[-1] is not opt:
            return
        self.stepping.pop()
        if self.stepping:
            return
        snap, self.snap = self.snap, None
        step, made = self.row_step, None
        if self.grouped and self.group:
            step = made = self._close(read_grads=True)
        if snap is not None and snap[0] is opt and step is not None and step.recorded:
            self._update(step, opt, *snap[1:])
        if made is not None and made.recorded:
            self.rule.add(made)

    def _update(self, step: Step, opt, idx: tuple, copies: list) -> None:
        """ΔW of the optimizer step `opt` (copies: the parameters before it) into `step`'s row."""
        dev = copies[0].device
        foreach_sub_(copies, _locals([self.params[i] for i in idx]))
        lrs = learning_rates(opt, self.opts[opt][3])
        norms = l2_batch(copies)
        step.updates.append((idx, norms))
        sq, mask = self.rows.update(idx, norms, dev)
        step.update = sq if step.update is None else step.update + sq
        step.touched = mask if step.touched is None else step.touched | mask
        step.lr.update(lrs)
        col = S["update_ratio"]
        if step.host is None:  # the learning rates go to the host with the row (HostRows.flush)
            row = step.row
            row[:, col] = torch.where(step.touched, step.update.sqrt() / row[:, S["weight_norm"]], NAN)
        else:  # read already (w.stats mid-step): write into the host copy (one sync, only then)
            host, r = step.host
            w = host[r, :, S["weight_norm"]]
            host[r, :, col] = torch.where(step.touched.cpu(), step.update.cpu().sqrt() / w, NAN)
            host[r, :, S["lr"]] = torch.tensor(lr_column(step.lr, len(self.layers)), dtype=F64)
            self.rule.changed()


def _layer_groups(opt, params: list, pairs: list) -> list:
    """(layer, param-group index) for each watched layer with a parameter in `opt`: the group of the layer's
    first such parameter (its weight, as modules register it first)."""
    group = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    out, seen = [], set()
    for li, pi in pairs:
        gi = group.get(id(params[pi]))
        if gi is not None and li not in seen:
            seen.add(li)
            out.append((li, gi))
    return out


def learning_rates(opt, layer_groups: list) -> dict:
    """layer -> the learning rate of its param group now: a Python float (no sync), or, where a scheduler
    keeps it as a device tensor (capturable optimizers), a copy of that tensor (read with the row, in one
    transfer); a CPU tensor is read now (no sync)."""
    lrs = []
    for g in opt.param_groups:
        lr = g.get("lr")
        if isinstance(lr, torch.Tensor):
            lr = float(lr) if host_reads.free(lr.device) else lr.detach().reshape(()).clone()
        lrs.append(lr if isinstance(lr, (torch.Tensor, float, int)) else None)
    return {li: lrs[gi] for li, gi in layer_groups if lrs[gi] is not None}


def lr_column(lr: dict, n_layers: int) -> list:
    """A step's learning rate of each layer, as floats for its host row's column (NaN: no optimizer stepped the
    layer)."""
    col = [NAN] * n_layers
    for li, v in lr.items():
        col[li] = float(v.cpu()) if isinstance(v, torch.Tensor) else float(v)
    return col


register(STATS, StatsKeep)
