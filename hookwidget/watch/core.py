"""The run-long recorder: hooks on across a training loop, statistics per step and layer on device."""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from contextlib import ExitStack

import torch
from torch import nn
from torch.optim import optimizer as optimizer_mod

from hookwidget.capture import backward as autograd_calls
from hookwidget.capture import tracer as capture_mod
from hookwidget.capture.handles import Removing
from hookwidget.watch import amp, compiled
from hookwidget.watch.amp import SKIPPED, ScaleTrack
from hookwidget.watch.detect import Detector
from hookwidget.watch.flight import FlightRecorder
from hookwidget.watch.reduce import (
    F64,
    NAN,
    STAT_NAMES,
    STEP_STAT_NAMES,
    PerSample,
    Rows,
    S,
    _locals,
    add_delta,
    local,
    reduce_delta,
    reduce_input,
)

_hook_output = getattr(capture_mod, "_hook_output", None)  # δ hook that survives an in-place op after a view


def _first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        return next((x for x in obj if isinstance(x, torch.Tensor)), None)
    return None


class _Step:
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


class Watch:
    """Hooks on `model` across a training loop; see `hookwidget.watch.watch` for what it records."""

    def __init__(self, model: nn.Module, every: int = 1, spike: float = 6.0, window: int = 20, keep=None,
                 flight_recorder: bool = True, max_kept: int = 8, batch: int = 64, trace_budget_mb: float = 256,
                 scaler=None, tensorboard=None, per_sample: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"watch(model): model must be an nn.Module, got {type(model).__name__}")
        if int(every) < 1 or int(window) < 2 or int(batch) < 1:
            raise ValueError("watch: every and batch must be >= 1 and window >= 2")
        if keep is not None and not callable(keep):
            raise TypeError("watch(keep=...) takes a callable keep(step, stats) -> bool")
        self.model, self.every, self.batch = model, int(every), int(batch)
        self.flight_recorder, self.max_kept, self.trace_budget_mb = flight_recorder, int(max_kept), trace_budget_mb
        self.stat_names, self.step_stat_names = STAT_NAMES, STEP_STAT_NAMES
        self.layer_names, self._layers, self._params, pairs, index = [], [], [], [], {}
        frames = sys.modules.get("torch._dynamo.eval_frame")  # imported once torch.compile was called
        if frames is not None and isinstance(model, frames.OptimizedModule):
            model = model._orig_mod  # torch.compile(model): its layers, named as in the model
        scripted = []
        for name, m in model.named_modules():
            own = list(m.parameters(recurse=False))
            if not own:
                continue
            if isinstance(m, torch.jit.ScriptModule):  # module hooks cannot be registered there
                scripted.append(name or type(m).__name__)
                continue
            self.layer_names.append(name or type(m).__name__)
            self._layers.append(m)
            for p in own:
                if id(p) not in index:
                    index[id(p)] = len(self._params)
                    self._params.append(p)
                pairs.append((len(self._layers) - 1, index[id(p)]))
        script_note = (f"hw.watch: {', '.join(scripted[:5])}{' ...' if len(scripted) > 5 else ''} run as "
                       "TorchScript, where module hooks never run: not watched; watch the model before "
                       "torch.jit.script / torch.jit.trace") if scripted else None
        if flight_recorder and any(isinstance(m, torch.jit.ScriptModule) for m in model.modules()):
            flight_recorder = self.flight_recorder = False  # a Trace cannot hook TorchScript modules either
            script_note = (script_note or "hw.watch: the model holds TorchScript modules") + \
                "; the flight recorder is off (w.trace): a Trace cannot hook them"
        if not self._layers:
            raise ValueError(script_note or f"watch: {type(model).__name__} has no parameters to watch")
        self._layer_of = {m: i for i, m in enumerate(self._layers)}
        self._rows = Rows(len(self._layers), self._params, pairs)
        self._detector = Detector(self.layer_names, spike, int(window), keep)
        self.thread = threading.get_ident()
        self.active = self.closed = False
        self._lock = threading.Lock()
        self._stack = ExitStack()
        self._handles: list = []  # δ hooks on module outputs
        self._n = 0  # backward passes seen: the index of the next step
        self._kinds: list = []  # kinds of the backward calls running now (nested ones included)
        self._cur: _Step | None = None  # the step whose forward/backward runs now
        self._last: _Step | None = None  # the latest step whose backward ended (optimizer steps belong to it)
        self._pending: list = []  # recorded steps whose statistics are still on device
        self._chunks, self._step_chunks, self._recorded = [], [], []
        self._cache = None
        self._opts = weakref.WeakKeyDictionary()  # optimizer -> (its param-group sizes, param indices, copies)
        self._snap = None  # (optimizer, step, param indices, copies) between an optimizer's pre and post hooks
        self._flight: FlightRecorder | None = None
        self._sinks = compiled.sinks(self._layers)  # where compiled code leaves its statistics
        self._unseen_checks = 0  # steps checked for hooks that compiled code did not call (at most 3)
        self._warned = False  # the "hooks not seen" warning, given once
        self.notes: list = []  # what the watch could not see, and why
        if script_note:
            self.notes.append(script_note)
            warnings.warn(script_note, stacklevel=3)
        self._amp = ScaleTrack(scaler) if scaler is not None else None
        self._ps = PerSample(self._layers, self.layer_names, pairs) if per_sample else None
        self._ps_chunks: list = []  # per_sample=True: (recorded steps, 2) on the host
        if self._ps is not None and self._ps.note:
            self.notes.append(self._ps.note)
        self.skipped: list = []  # steps whose optimizer step the GradScaler skipped (found inf/NaN)
        self._listeners: list = []  # fn("rows", stats, step_stats, steps) as rows reach the host; fn("closed")
        if tensorboard is not None:  # written as rows reach the host
            from hookwidget.views.tensorboard import TensorBoardLog

            self._listeners.append(TensorBoardLog(tensorboard, self))

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        return self if self.active else self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> Watch:
        if self.active:
            return self
        if self.closed:
            raise RuntimeError("this watch is closed; make a new one with hw.watch(model)")
        s = self._stack
        try:
            s.callback(self._sweep)
            s.callback(autograd_calls.unlisten, self)
            for m in self._layers:
                s.enter_context(Removing(m.register_forward_hook(self._forward_hook)))
            s.enter_context(Removing(optimizer_mod.register_optimizer_step_pre_hook(self._opt_pre)))
            s.enter_context(Removing(optimizer_mod.register_optimizer_step_post_hook(self._opt_post)))
            s.callback(amp.unlisten, self)
            amp.listen(self)
            autograd_calls.listen(self)
            self.active = True
            self._cur = _Step(0, True)
            if self.flight_recorder:
                self._flight = FlightRecorder(self, self.model, self.trace_budget_mb, self.max_kept)
                s.callback(self._flight.close)
                self._flight.open()
        except BaseException:
            self.active = False
            self._stack.close()
            raise
        return self

    def close(self) -> None:
        """Remove every hook (always, whatever happened in the loop), then move what is left to the host.
        The latest step's Trace is kept; the recording opened after it (no backward in it) is dropped."""
        if self.closed:
            return
        self.closed, was_active, self.active = True, self.active, False
        try:
            for h in self._handles:
                h.remove()
            self._handles = []
        finally:
            self._stack.close()
        if was_active:
            self._flush()
            if self._flight is not None:
                self._flight.finish(self._detector.flagged)
            self._tell("closed")

    def _sweep(self) -> None:
        """Remove any hook of this watch still registered (one an interrupt left half-registered)."""
        owners = [(m, ("_forward_hooks",)) for m in self._layers]
        owners.append((optimizer_mod, ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")))
        for owner, names in owners:
            for n in names:
                d = getattr(owner, n, None) or {}
                for key, fn in list(d.items()):
                    if getattr(fn, "__self__", None) is self:
                        del d[key]

    # -- forward and backward hooks ------------------------------------------------------------
    def _forward_hook(self, module, inputs, output):
        if torch.compiler.is_compiling():  # Dynamo traces this branch into the compiled graph
            return compiled.probe(self._sinks[self._layer_of[module]], inputs, output) if self.active else None
        cur = self._cur
        if (not self.active or cur is None or not cur.recorded or threading.get_ident() != self.thread
                or torch._C._current_autograd_node() is not None):
            return None
        out = _first_tensor(output)
        if out is None or not out.requires_grad:
            return None
        a = _first_tensor(inputs)
        cur.calls += 1
        # Reduced now, while a is hot in cache, to 0-d tensors; put together into the row when backward ends.
        li = self._layer_of[module]
        call = self._ps.forward(cur, li, module, a) if self._ps is not None else None
        hook = self._delta_hook(li, reduce_input(a) if a is not None else None, cur.calls, call)
        if _hook_output is not None:
            _hook_output(self._handles, out, hook)
        else:
            self._handles.append(out.register_hook(hook))
        return None

    def _delta_hook(self, li: int, a_red, seq: int, call=None):
        def hook(grad):
            if not self.active or not self._kinds or self._kinds[0] != "backward":
                return None  # autograd.grad calls (gradient penalties) are not steps
            red = reduce_delta(grad)
            with self._lock:
                cur = self._cur
                if cur is None or not cur.recorded:
                    return None
                cur.ds.append((li, seq, red, a_red))
                if call is not None:
                    self._ps.delta(cur, li, call, grad)
            return None

        return hook

    def on_backward(self, tensors: list, kind: str, create_graph: bool) -> None:
        if not self.active:
            return
        self._kinds.append(kind)
        if len(self._kinds) == 1 and kind == "backward" and self._amp is not None:
            self._cur.scale = self._amp.now()
            if self._last is not None and self._last.recorded:
                self._last.next_scale = self._cur.scale
        if len(self._kinds) == 1 and kind == "backward" and self._cur.recorded:
            scalars = [t for t in tensors if t.numel() == 1]
            self._cur.loss = scalars[0].detach().reshape(()).clone() if scalars else None
            self._cur.has_loss = bool(scalars)
            if self._cur.calls == 0 and self._unseen_checks < 3 and not self._warned:
                self._cur.roots = list(tensors)  # no layer hook ran in eager code: judged when backward ends

    def on_backward_end(self) -> None:
        if not self._kinds:
            return
        kind = self._kinds.pop()
        if not self._kinds and kind == "backward" and self.active:
            self._end_step()

    def _end_step(self) -> None:
        step = self._cur
        compiled.take(self._sinks, step)
        if step.compiled and self._flight is not None and compiled.FLIGHT not in self.notes:
            self.notes.append(compiled.FLIGHT)
        if step.roots is not None:
            self._unseen(step)
        if step.recorded:
            self._reduce(step)
            ScaleTrack.unscale(step.row, step.step_row, step.scale)
            step.delta = step.a = step.loss = step.ds = None
            self._pending.append(step)
        self._handles = [h for h in self._handles if h.hooks_dict_ref() is not None]  # outputs still alive
        self._last = step
        self._n += 1
        self._cur = _Step(self._n, self._n % self.every == 0)
        if self._flight is not None:
            # Rows before this step are complete (their optimizer step ran): to the host, then decide.
            self._flush(upto=step.index - 1)
            self._flight.step_ended(step.index, self._detector.flagged)
        elif len(self._pending) > self.batch:
            self._flush(upto=step.index - 1)

    def _reduce(self, step) -> None:
        """The step's (layers, stats) row from what its hooks reduced, put together on device in a few kernels."""
        dev = self._params[0].device
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
            step.row, step.step_row = self._rows.row(step.delta, step.a, step.loss, dev)
        else:
            step.row, step.step_row = self._rows.row_from([(li, *d) for li, _, d, _ in step.ds],
                                                          [(li, *a) for li, _, _, a in step.ds if a is not None],
                                                          step.loss, dev)
        if self._ps is not None:
            step.ps = self._ps.end(step, dev)
            if step.scale is not None:  # backward ran on loss · scale: so did every sample's gradient
                step.ps[0].div_(step.scale.to(dev, F64))
            odd = self._ps.odd_note()
            if odd is not None and odd not in self.notes:
                self.notes.append(odd)

    def saw_scaler(self, scaler) -> None:
        """A GradScaler.scale() call on the watch's thread (amp.py): unscale by it, unless told scaler=."""
        if self._amp is None:
            self._amp = ScaleTrack(scaler, explicit=False)
        elif self._amp.scaler is not scaler and not self._amp.explicit and amp.SEVERAL not in self.notes:
            self.notes.append(amp.SEVERAL)
            warnings.warn(amp.SEVERAL, stacklevel=4)

    def _unseen(self, step) -> None:
        """Backward reached the watched parameters, yet no hook of the watch ran: say once why, and the fix."""
        roots, step.roots = step.roots, None
        if step.delta or step.ds:
            return
        self._unseen_checks += 1
        how = compiled.reaches(roots, self._params)
        if how is not None:
            self._warned = True
            self.notes.append(compiled.NOT_SEEN[how])
            warnings.warn(compiled.NOT_SEEN[how], stacklevel=4)

    # -- optimizer steps: the update ratio ‖ΔW‖/‖W‖ -------------------------------------------
    def _opt_pre(self, opt, args, kwargs):
        step = self._last
        if not self.active or step is None or not step.recorded or threading.get_ident() != self.thread:
            return
        sizes = tuple(len(g["params"]) for g in opt.param_groups)
        hit = self._opts.get(opt)
        if hit is None or hit[0] != sizes:
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            idx = tuple(i for i, p in enumerate(self._params) if id(p) in ids)
            hit = self._opts[opt] = (sizes, idx, [torch.empty_like(local(self._params[i])) for i in idx])
        _, idx, copies = hit
        if not idx:
            return
        torch._foreach_copy_(copies, _locals([self._params[i] for i in idx]))  # detached: nothing recorded
        self._snap = (opt, step, idx, copies)

    def _opt_post(self, opt, args, kwargs):
        snap, self._snap = self._snap, None
        if not self.active or snap is None or snap[0] is not opt:
            return
        _, step, idx, copies = snap
        dev = copies[0].device
        torch._foreach_sub_(copies, _locals([self._params[i] for i in idx]))
        sq, mask = self._rows.update(idx, list(torch._foreach_norm(copies)), dev)
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
            self._cache = None

    # -- host side -----------------------------------------------------------------------------
    def _flush(self, upto: int | None = None) -> None:
        """Move the statistics of pending steps (those up to `upto`) to the host in one transfer."""
        take = [s for s in self._pending if upto is None or s.index <= upto]
        if not take:
            return
        self._pending = self._pending[len(take):]
        n, L = len(take), len(self.layer_names)
        scales = [self._amp.pairs(take, take[0].row.device).flatten()] if self._amp is not None else []
        ps = [torch.stack([s.ps for s in take]).flatten()] if self._ps is not None else []
        both = torch.cat([torch.stack([s.row for s in take]).flatten(),
                          torch.stack([s.step_row for s in take]).flatten(), *ps, *scales]).cpu()  # one transfer
        skipped = both[-2 * n:].view(n, 2) if scales else None  # (scale, scale after) per step
        both = both[:-2 * n] if scales else both
        if ps:
            self._ps_chunks.append(both[-2 * n:].view(n, 2))
            both = both[:-2 * n]
            for s in take:
                s.ps = None
        rows, step_rows = both[:n * L * len(STAT_NAMES)].view(n, L, -1), both[n * L * len(STAT_NAMES):].view(n, 2)
        for r, s in enumerate(take):
            s.host, s.row, s.step_row = (rows, r), None, None
        self._chunks.append(rows)
        self._step_chunks.append(step_rows)
        self._recorded += [s.index for s in take]
        self._cache = None
        for r, s in enumerate(take):
            skip = None
            if skipped is not None and skipped[r, 1] < skipped[r, 0]:
                rows[r, :, S["update_ratio"]] = NAN  # a fused optimizer "steps" by zero: still no update
                self.skipped.append(s.index)
                skip = SKIPPED.format(*skipped[r].tolist())
            self._detector.check(s.index, rows[r], step_rows[r], s.order, s.a_order, s.has_loss, skipped=skip)
        self._tell("rows", rows, step_rows, [s.index for s in take])

    def _tell(self, event: str, *args) -> None:
        """Call the listeners (the live widget) with host data only: they never cause a device sync."""
        for fn in list(self._listeners):
            fn(event, *args)

    def _host(self):
        self._flush()
        if self._cache is None:
            L, K = len(self.layer_names), len(self.stat_names)
            stats = torch.cat(self._chunks) if self._chunks else torch.zeros(0, L, K, dtype=torch.float64)
            steps = torch.cat(self._step_chunks) if self._step_chunks else torch.zeros(0, 2, dtype=torch.float64)
            self._cache = (stats, steps)
        return self._cache

    # -- what users read -----------------------------------------------------------------------
    @property
    def stats(self) -> torch.Tensor:
        """(recorded steps, layers, statistics) float64 on the host; names in stat_names, layer_names."""
        return self._host()[0]

    @property
    def step_stats(self) -> torch.Tensor:
        """(recorded steps, 2): the loss and the global gradient norm (step_stat_names)."""
        return self._host()[1]

    @property
    def steps(self) -> list:
        """The step (backward pass) index of each row of stats."""
        self._flush()
        return list(self._recorded)

    @property
    def loss(self) -> torch.Tensor:
        return self.step_stats[:, 0]

    @property
    def grad_norm(self) -> torch.Tensor:
        return self.step_stats[:, 1]

    @property
    def per_sample(self) -> torch.Tensor:
        """per_sample=True: (recorded steps, 2) float64, the largest per-sample gradient norm of each step (over
        the layers with an exact (a, δ) rule; w.notes names any left out) and the index of that sample in
        the batch; NaN where not known."""
        if self._ps is None:
            raise KeyError("per-sample norms are off: hw.watch(model, per_sample=True) records them")
        self._flush()
        return torch.cat(self._ps_chunks) if self._ps_chunks else torch.zeros(0, 2, dtype=F64)

    def series(self, layer: str, stat: str | None = None) -> torch.Tensor:
        """One statistic of one layer over the recorded steps; series("loss") and series("grad_norm")
        give the per-step ones."""
        if stat is None:
            if layer in ("per_sample_max", "per_sample_argmax"):
                return self.per_sample[:, 0 if layer == "per_sample_max" else 1]
            if layer not in self.step_stat_names:
                raise KeyError(f"series({layer!r}): give a layer and a statistic, or one of {self.step_stat_names}")
            return self.step_stats[:, self.step_stat_names.index(layer)]
        if layer not in self.layer_names:
            close = [n for n in self.layer_names if layer.lower() in n.lower()][:5] or self.layer_names[:8]
            raise KeyError(f"no layer {layer!r} watched (layers with parameters); e.g. {', '.join(close)}")
        if stat not in self.stat_names:
            raise KeyError(f"no statistic {stat!r}; choose one of {', '.join(self.stat_names)}")
        return self.stats[:, self.layer_names.index(layer), self.stat_names.index(stat)]

    @property
    def anomalies(self) -> list:
        """(step, where, reason) entries, in step order (see watch() for the rules)."""
        self._flush()
        return list(self._detector.anomalies)

    @property
    def kept(self) -> list:
        """Steps whose full Trace w.trace(k) returns now."""
        self._flush()
        return self._flight.steps() if self._flight is not None else []

    def trace(self, k: int = -1):
        """The full Trace of kept step k (the first, the latest, an anomalous one); k=-1: the latest."""
        if not self.flight_recorder:
            raise KeyError("the flight recorder is off: watch(model, flight_recorder=True) keeps full Traces")
        kept = self.kept
        if k == -1 and kept:
            k = kept[-1]
        return self._flight.trace(k)

    def widget(self):
        """The live explorer of this watch (one per watch): heatmap, sparklines, loss; it grows while the loop runs."""
        from hookwidget.views.watch_widget import widget_of

        return widget_of(self)

    def _repr_mimebundle_(self, include=None, exclude=None):
        """In a Jupyter kernel the live explorer, elsewhere the plain-text repr."""
        from hookwidget.views.watch_widget import mimebundle

        return mimebundle(self, include, exclude)

    def to_html(self, path):
        """Write the explorer of this watch (statistics, anomalies, kept Traces) as one standalone page."""
        from hookwidget.views.watch_export import to_html

        return to_html(self, path)

    def __repr__(self) -> str:
        state = "open" if self.active else "closed"
        n = len(self.steps)
        return (f"Watch ({state}): {len(self.layer_names)} layers, {self._n} steps, {n} recorded, "
                f"{len(self._detector.anomalies)} anomalies" + (f", traces kept at steps {self.kept}"
                                                                if self.flight_recorder else ""))

    def to_tensorboard(self, log_dir) -> str:
        """Write what was recorded so far as TensorBoard scalars (`{stat}/{layer}`, `step/loss`,
        `step/grad_norm`; x = step) and the anomalies as text; returns the run's folder."""
        from hookwidget.views.tensorboard import write

        return write(self, log_dir)

    def gather(self, dst: int = 0, group=None):
        """Distributed: every rank's statistics on rank `dst` (list of RankStats indexed by rank; None on the
        others), in one gather_object call at the end; call it on every rank. Each rank records its own:
        δ and a of its own batch; .grad as backward leaves it (DDP: all-reduced; FSDP2: the rank's local shard
        of the reduce-scattered gradient, and ‖W‖ of its local shard)."""
        from hookwidget.watch.gather import gather

        return gather(self, dst, group)

    @property
    def dropped_traces(self) -> int:
        """Anomalous steps whose Trace was not kept, max_kept being reached."""
        return self._flight.dropped if self._flight is not None else 0
