"""The watch's per-step hook sweep: a forward hook per watched layer and a δ hook on its output, the
backward listener that cuts the run into steps, and the optimizer hooks that measure the update.

Everything a hook gathers is reduced on device to small tensors at once (while the tensor is hot in
cache) and put together into the step's (layers, statistics) row when its backward ends; the row then
goes to `HostRows` (host.py), which moves rows to the host in batches.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch

from hookwidget._torch.autograd import current_node
from hookwidget._torch.norms import foreach_copy_, foreach_sub_
from hookwidget.capture.tensors import first_tensor, hook_output
from hookwidget.stats import l2_batch
from hookwidget.watch import amp, compiled
from hookwidget.watch.amp import ScaleTrack
from hookwidget.watch.reduce import F64, NAN, S, _locals, add_delta, local, reduce_delta, reduce_input


class Step:
    """What hooks gathered for one step (backward pass) while it runs; all on device."""

    def __init__(self, index: int, recorded: bool):
        self.index, self.recorded = index, recorded
        self.delta: dict = {}  # layer index -> [‖δ‖², max|δ|, NaN, Inf] over its calls
        self.a: dict = {}  # layer index -> [Σa², zeros, entries] over its calls that δ reached
        self.order: dict = {}  # layer index -> position in backward order (δ arrival)
        self.a_order: dict = {}  # layer index -> position in forward order (of the calls δ reached)
        self.ds: list = []  # (layer index, forward position, reduce_delta(δ), reduce_input(a) or None) per call
        self.calls = 0  # forward calls of watched layers so far
        self.loss = None
        self.has_loss = False
        self.row = self.step_row = None  # (layers, stats) and [loss, global grad norm], when backward ends
        self.host = None  # (host tensor, row) once moved to the host
        self.update = self.touched = None  # Σ‖ΔW‖² per layer, and the layers an optimizer step changed
        self.compiled = False  # statistics came (also) from compiled code (compiled.py)
        self.scale = self.next_scale = None  # a GradScaler's scale at this backward and at the next (amp.py)
        self.roots = None  # the tensors backward started from, kept while nothing was recorded (see _unseen)
        self.ps_batch, self.ps_calls, self.ps_sq, self.ps_bad = None, {}, {}, False  # per_sample=True (PerSample)
        self.ps = None  # [largest per-sample gradient norm, its sample], when backward ends


class StepHooks:
    """The hooks of one watch and the steps they cut the run into. `layers`/`params`: the watched layers and
    their parameters; `rows`: reduce.Rows; `ps`: reduce.PerSample or None; `host`: HostRows, which takes each
    recorded step when its backward ends; `ended(step)`: told after each step (recorded or not); `notes`:
    the watch's list of what it could not see. Only hooks on `thread` record."""

    def __init__(self, layers: list, params: list, rows, ps, scaler, every: int, host, ended, notes: list,
                 flight_recorder: bool):
        self.layers, self.params, self.rows, self.ps, self.every = layers, params, rows, ps, every
        self.layer_of = {m: i for i, m in enumerate(layers)}
        self.host, self.ended, self.notes, self.flight_recorder = host, ended, notes, flight_recorder
        self.amp = ScaleTrack(scaler) if scaler is not None else None
        self.thread = threading.get_ident()
        self.active = False
        self.lock = threading.Lock()
        self.handles: list = []  # δ hooks on module outputs
        self.n = 0  # backward passes seen: the index of the next step
        self.kinds: list = []  # kinds of the backward calls running now (nested ones included)
        self.cur: Step | None = None  # the step whose forward/backward runs now
        self.last: Step | None = None  # the latest step whose backward ended (optimizer steps belong to it)
        self.opts = weakref.WeakKeyDictionary()  # optimizer -> (its param-group sizes, param indices, copies)
        self.snap = None  # (optimizer, step, param indices, copies) between an optimizer's pre and post hooks
        self.sinks = compiled.sinks(layers)  # where compiled code leaves its statistics
        self.unseen_checks = 0  # steps checked for hooks that compiled code did not call (at most 3)
        self.warned = False  # the "hooks not seen" warning, given once

    def start(self) -> None:
        self.active = True
        self.cur = Step(0, True)

    def stop(self) -> None:
        """Hooks off; the δ hooks on outputs still alive removed."""
        self.active = False
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()

    # -- forward and backward hooks ------------------------------------------------------------
    def forward(self, module, inputs, output):
        if torch.compiler.is_compiling():  # Dynamo traces this branch into the compiled graph
            return compiled.probe(self.sinks[self.layer_of[module]], inputs, output) if self.active else None
        cur = self.cur
        if (not self.active or cur is None or not cur.recorded or threading.get_ident() != self.thread
                or current_node() is not None):
            return None
        out = first_tensor(output)
        if out is None or not out.requires_grad:
            return None
        a = first_tensor(inputs)
        cur.calls += 1
        # Reduced now, while a is hot in cache, to 0-d tensors; put together into the row when backward ends.
        li = self.layer_of[module]
        call = self.ps.forward(cur, li, module, a) if self.ps is not None else None
        hook_output(self.handles, out, self._delta_hook(li, reduce_input(a) if a is not None else None, cur.calls,
                                                        call))
        return None

    def _delta_hook(self, li: int, a_red, seq: int, call=None):
        def hook(grad):
            if not self.active or not self.kinds or self.kinds[0] != "backward":
                return None  # autograd.grad calls (gradient penalties) are not steps
            red = reduce_delta(grad)
            with self.lock:
                cur = self.cur
                if cur is None or not cur.recorded:
                    return None
                cur.ds.append((li, seq, red, a_red))
                if call is not None:
                    self.ps.delta(cur, li, call, grad)
            return None

        return hook

    def on_backward(self, tensors: list, kind: str, create_graph: bool) -> None:
        if not self.active:
            return
        self.kinds.append(kind)
        if len(self.kinds) == 1 and kind == "backward" and self.amp is not None:
            self.cur.scale = self.amp.now()
            if self.last is not None and self.last.recorded:
                self.last.next_scale = self.cur.scale
        if len(self.kinds) == 1 and kind == "backward" and self.cur.recorded:
            scalars = [t for t in tensors if t.numel() == 1]
            self.cur.loss = scalars[0].detach().reshape(()).clone() if scalars else None
            self.cur.has_loss = bool(scalars)
            if self.cur.calls == 0 and self.unseen_checks < 3 and not self.warned:
                self.cur.roots = list(tensors)  # no layer hook ran in eager code: judged when backward ends

    def on_backward_end(self) -> None:
        if not self.kinds:
            return
        kind = self.kinds.pop()
        if not self.kinds and kind == "backward" and self.active:
            self._end_step()

    def _end_step(self) -> None:
        step = self.cur
        compiled.take(self.sinks, step)
        if step.compiled and self.flight_recorder and compiled.FLIGHT not in self.notes:
            self.notes.append(compiled.FLIGHT)
        if step.roots is not None:
            self._unseen(step)
        if step.recorded:
            self._reduce(step)
            ScaleTrack.unscale(step.row, step.step_row, step.scale)
            step.delta = step.a = step.loss = step.ds = None
            self.host.add(step)
        self.handles = [h for h in self.handles if h.hooks_dict_ref() is not None]  # outputs still alive
        self.last = step
        self.n += 1
        self.cur = Step(self.n, self.n % self.every == 0)
        self.ended(step)

    def _reduce(self, step) -> None:
        """The step's (layers, stats) row from what its hooks reduced, put together on device in a few kernels."""
        dev = self.params[0].device
        for li, seq, _, a_red in step.ds:
            if li not in step.order:
                step.order[li] = len(step.order)  # backward order: the first δ of each layer
            if a_red is not None:
                step.a_order[li] = min(seq, step.a_order.get(li, seq))
        if step.delta or step.a:  # compiled code left statistics too (compiled.take): merged per layer
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
            odd = self.ps.odd_note()
            if odd is not None and odd not in self.notes:
                self.notes.append(odd)

    def saw_scaler(self, scaler) -> None:
        """A GradScaler.scale() call on the watch's thread (amp.py): unscale by it, unless told scaler=."""
        if self.amp is None:
            self.amp = ScaleTrack(scaler, explicit=False)
        elif self.amp.scaler is not scaler and not self.amp.explicit and amp.SEVERAL not in self.notes:
            self.notes.append(amp.SEVERAL)
            warnings.warn(amp.SEVERAL, stacklevel=4)

    def _unseen(self, step) -> None:
        """Backward reached the watched parameters, yet no hook of the watch ran: say once why, and the fix."""
        roots, step.roots = step.roots, None
        if step.delta or step.ds:
            return
        self.unseen_checks += 1
        how = compiled.reaches(roots, self.params)
        if how is not None:
            self.warned = True
            self.notes.append(compiled.NOT_SEEN[how])
            warnings.warn(compiled.NOT_SEEN[how], stacklevel=4)

    # -- optimizer steps: the update ratio ‖ΔW‖/‖W‖ -------------------------------------------
    def opt_pre(self, opt, args, kwargs):
        step = self.last
        if not self.active or step is None or not step.recorded or threading.get_ident() != self.thread:
            return
        sizes = tuple(len(g["params"]) for g in opt.param_groups)
        hit = self.opts.get(opt)
        if hit is None or hit[0] != sizes:
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            idx = tuple(i for i, p in enumerate(self.params) if id(p) in ids)
            hit = self.opts[opt] = (sizes, idx, [torch.empty_like(local(self.params[i])) for i in idx])
        _, idx, copies = hit
        if not idx:
            return
        foreach_copy_(copies, _locals([self.params[i] for i in idx]))  # detached: nothing recorded
        self.snap = (opt, step, idx, copies)

    def opt_post(self, opt, args, kwargs):
        snap, self.snap = self.snap, None
        if not self.active or snap is None or snap[0] is not opt:
            return
        _, step, idx, copies = snap
        dev = copies[0].device
        foreach_sub_(copies, _locals([self.params[i] for i in idx]))
        sq, mask = self.rows.update(idx, l2_batch(copies), dev)
        step.update = sq if step.update is None else step.update + sq
        step.touched = mask if step.touched is None else step.touched | mask
        col = S["update_ratio"]
        if step.host is None:
            row = step.row
            row[:, col] = torch.where(step.touched, step.update.sqrt() / row[:, S["weight_norm"]], NAN)
        else:  # read already (w.stats mid-step): write into the host copy (one sync, only then)
            host, r = step.host
            w = host[r, :, S["weight_norm"]]
            host[r, :, col] = torch.where(step.touched.cpu(), step.update.cpu().sqrt() / w, NAN)
            self.host.changed()
