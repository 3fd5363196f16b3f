"""The run-long recorder: hooks on across a training loop, statistics per step and layer on device."""

from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack

import torch
from torch import nn
from torch.optim import optimizer as optimizer_mod

from .. import autograd_calls
from .. import capture as capture_mod
from ..handles import Removing
from .detect import Detector
from .flight import FlightRecorder
from .reduce import NAN, STAT_NAMES, STEP_STAT_NAMES, Rows, S, add_delta, delta_stats, input_stats

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
        self.calls = 0  # forward calls of watched layers so far
        self.loss = None
        self.has_loss = False
        self.row = self.step_row = None  # (layers, stats) and [loss, global grad norm], when backward ends
        self.host = None  # (host tensor, row) once moved to the host
        self.update = self.touched = None  # Σ‖ΔW‖² per layer, and the layers an optimizer step changed


class Watch:
    """Hooks on `model` across a training loop; see `hookwidget.watch.watch` for what it records."""

    def __init__(self, model: nn.Module, every: int = 1, spike: float = 6.0, window: int = 20, keep=None,
                 flight_recorder: bool = True, max_kept: int = 8, batch: int = 64, trace_budget_mb: float = 256):
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
        for name, m in model.named_modules():
            own = list(m.parameters(recurse=False))
            if not own:
                continue
            self.layer_names.append(name or type(m).__name__)
            self._layers.append(m)
            for p in own:
                if id(p) not in index:
                    index[id(p)] = len(self._params)
                    self._params.append(p)
                pairs.append((len(self._layers) - 1, index[id(p)]))
        if not self._layers:
            raise ValueError(f"watch: {type(model).__name__} has no parameters to watch")
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
        cur = self._cur
        if (not self.active or cur is None or not cur.recorded or threading.get_ident() != self.thread
                or torch._C._current_autograd_node() is not None or torch.compiler.is_compiling()):
            return None
        out = _first_tensor(output)
        if out is None or not out.requires_grad:
            return None
        a = _first_tensor(inputs)
        cur.calls += 1
        hook = self._delta_hook(self._layer_of[module], input_stats(a) if a is not None else None, cur.calls)
        if _hook_output is not None:
            _hook_output(self._handles, out, hook)
        else:
            self._handles.append(out.register_hook(hook))
        return None

    def _delta_hook(self, li: int, a_stats, seq: int):
        def hook(grad):
            if not self.active or not self._kinds or self._kinds[0] != "backward":
                return None  # autograd.grad calls (gradient penalties) are not steps
            st = delta_stats(grad)
            with self._lock:
                cur = self._cur
                if cur is None or not cur.recorded:
                    return None
                if li in cur.delta:
                    cur.delta[li] = add_delta(cur.delta[li], st)
                else:
                    cur.delta[li] = st
                    cur.order[li] = len(cur.order)
                if a_stats is not None:
                    cur.a[li] = cur.a[li] + a_stats if li in cur.a else a_stats
                    cur.a_order[li] = min(seq, cur.a_order.get(li, seq))
            return None

        return hook

    def on_backward(self, tensors: list, kind: str, create_graph: bool) -> None:
        if not self.active:
            return
        self._kinds.append(kind)
        if len(self._kinds) == 1 and kind == "backward" and self._cur.recorded:
            scalars = [t for t in tensors if t.numel() == 1]
            self._cur.loss = scalars[0].detach().reshape(()).clone() if scalars else None
            self._cur.has_loss = bool(scalars)

    def on_backward_end(self) -> None:
        if not self._kinds:
            return
        kind = self._kinds.pop()
        if not self._kinds and kind == "backward" and self.active:
            self._end_step()

    def _end_step(self) -> None:
        step = self._cur
        if step.recorded:
            dev = self._params[0].device
            step.row, step.step_row = self._rows.row(step.delta, step.a, step.loss, dev)
            step.delta = step.a = step.loss = None
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
            hit = self._opts[opt] = (sizes, idx, [torch.empty_like(self._params[i]) for i in idx])
        _, idx, copies = hit
        if not idx:
            return
        with torch.no_grad():
            torch._foreach_copy_(copies, [self._params[i].detach() for i in idx])
        self._snap = (opt, step, idx, copies)

    def _opt_post(self, opt, args, kwargs):
        snap, self._snap = self._snap, None
        if not self.active or snap is None or snap[0] is not opt:
            return
        _, step, idx, copies = snap
        dev = copies[0].device
        with torch.no_grad():
            torch._foreach_sub_(copies, [self._params[i].detach() for i in idx])
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
        both = torch.cat([torch.stack([s.row for s in take]).flatten(),
                          torch.stack([s.step_row for s in take]).flatten()]).cpu()  # one transfer
        rows, step_rows = both[:n * L * len(STAT_NAMES)].view(n, L, -1), both[n * L * len(STAT_NAMES):].view(n, 2)
        for r, s in enumerate(take):
            s.host, s.row, s.step_row = (rows, r), None, None
        self._chunks.append(rows)
        self._step_chunks.append(step_rows)
        self._recorded += [s.index for s in take]
        self._cache = None
        for r, s in enumerate(take):
            self._detector.check(s.index, rows[r], step_rows[r], s.order, s.a_order, s.has_loss)

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

    def series(self, layer: str, stat: str | None = None) -> torch.Tensor:
        """One statistic of one layer over the recorded steps; series("loss") and series("grad_norm")
        give the per-step ones."""
        if stat is None:
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

    def __repr__(self) -> str:
        state = "open" if self.active else "closed"
        n = len(self.steps)
        return (f"Watch ({state}): {len(self.layer_names)} layers, {self._n} steps, {n} recorded, "
                f"{len(self._detector.anomalies)} anomalies" + (f", traces kept at steps {self.kept}"
                                                                if self.flight_recorder else ""))

    @property
    def dropped_traces(self) -> int:
        """Anomalous steps whose Trace was not kept, max_kept being reached."""
        return self._flight.dropped if self._flight is not None else 0
