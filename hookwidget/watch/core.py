"""The run-long recorder: hooks on across a training loop, statistics per step and layer on device.

The hooks are the one tracer's (capture/tracer.py) with the keep strategy "stats" (capture/step_stats.py): it
hands each step's row here when the step's backward ends (an optimizer step of several passes: when it has run);
the Watch moves rows to the host (host.py), judges them (detect.py), keeps Traces (flight.py), unscales
GradScaler steps (amp.py) and says what it could not see."""

from __future__ import annotations

import threading
import warnings
import weakref
from contextlib import ExitStack

import numpy as np
import torch
from torch import nn

from hookwidget._torch.compile import uncompiled
from hookwidget.capture.sample_stats import PerSample
from hookwidget.capture.stat_rows import STAT_NAMES, STEP_STAT_NAMES
from hookwidget.capture.step_stats import STATS, Watched
from hookwidget.capture.tracer import Tracer
from hookwidget.options import check_path
from hookwidget.watch import amp, compiled, leads
from hookwidget.watch.amp import ScaleTrack
from hookwidget.watch.detect import Detector
from hookwidget.watch.flight import FlightRecorder
from hookwidget.watch.host import HostRows
from hookwidget.watch.ranks import MODES
from hookwidget.watch.ranks import of as _spread_of
from hookwidget.watch.reads import Reads

_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> the open watch on it

AGAIN = ("hw.watch: {model} is already watched by an open watch ({other}); both record, each at its own cost: "
         "close that one first (w.close()), or open watches as `with hw.watch(model) as w:`")


EARLY = ("hw.watch: the first optimizer step accumulated backward passes whose rows had moved to the host already "
         "(a read, a slow step, an anomaly): steps {first}..{last} stay one backward pass each; every later optimizer "
         "step is one row. Call w.count_optimizer_steps() before the loop to count optimizer steps from the first")


NOT_CALLED = ("hw.watch: no call of {layers} reached backward in the first recorded step: their delta_* and a_* "
              "statistics are NaN (not measured); grad_norm, weight_norm and update_ratio are recorded wherever their "
              "weights get a gradient. A layer whose weight another module uses directly is never called itself "
              "(nn.MultiheadAttention's out_proj); a layer a step skips (a routed expert, a branch) has no call")


class Watch(Reads):
    """Hooks on a model across a training loop, and what they recorded: statistics per step and layer, anomalies,
    kept Traces.

    `hw.watch(model, ...)` makes one (its arguments and what it records are documented there). Use it as
    `with hw.watch(model) as w: ...`, or call `w.close()` when the loop ends. In a notebook it displays as its
    live explorer.

    Attributes:

    - `model`: the watched model.
    - `layer_names`: the watched layers (each with parameters of its own), in the order of `w.stats`' second axis.
    - `stat_names`: the statistics along `w.stats`' last axis; `step_stat_names`: along `w.step_stats`' ("loss",
      "grad_norm").
    - `notes`: what the watch could not see, and why, one line each.
    - `every`, `batch`, `max_kept`, `trace_budget_mb`, `flight_recorder`: as given to `hw.watch`
      (`flight_recorder` is False where the model holds TorchScript modules, which a Trace cannot hook).
    - `tracks_per_sample`: whether it records per-sample gradient norms (`per_sample=True`).
    - `closed`: whether `close()` ran.
    """

    def __init__(self, model: nn.Module, every: int = 1, spike: float = 6.0, window: int = 20, keep=None,
                 flight_recorder: bool = True, max_kept: int = 8, batch: int = 64, trace_budget_mb: float = 256,
                 scaler=None, tensorboard=None, per_sample: bool = False, log_dir=None, ranks: str = "global"):
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
        model = uncompiled(model)  # torch.compile(model): its layers, named as in the model
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
        self._detector = Detector(self.layer_names, spike, int(window), keep)
        self.closed = False
        self._stack = ExitStack()
        self._flight: FlightRecorder | None = None
        self.notes: list = []  # what the watch could not see, and why
        if script_note:
            self.notes.append(script_note)
            warnings.warn(script_note, stacklevel=3)
        ps = PerSample(self._layers, self.layer_names, pairs) if per_sample else None
        if ps is not None and ps.note:
            self.notes.append(ps.note)
        self._listeners: list = []  # see listen()
        self._amp = ScaleTrack(scaler) if scaler is not None else None
        self.thread = threading.get_ident()  # the thread whose GradScaler.scale() calls tell the scaler (amp.py)
        self._unseen_checks = 0  # steps checked for hooks that compiled code did not call (at most 3)
        self._warned = False  # the "hooks not seen" warning, given once
        self._called_checked = False  # the first recorded step's layers without a call: named once
        if ranks not in MODES:
            raise ValueError(f"watch: ranks={ranks!r} must be 'global' or 'local'")
        # a model spread over ranks (DDP, FSDP2, DTensor): its rows made global (ranks.py); else None
        self._spread = _spread_of(model, self._params, pairs, self.layer_names, self.notes,
                                  lambda: self._rows.changed(), ranks)
        self._rows = HostRows(len(self._layers), self._detector, lambda: self._amp, ps is not None, self._tell,
                              self._spread)
        self._tracer = Tracer(self._layers, capture=STATS, norms_rule=Watched(
            self._layers, self._params, pairs, self.every, ps, self._scale_now, self._rows.add, self._rows.changed,
            self._step_ended, self._step_began, self._take_back))
        self._stats = self._tracer.keep  # the steps (capture/step_stats.StatsKeep)
        self._ps = ps
        self.tracks_per_sample = ps is not None  # per_sample=True: each step's largest per-sample gradient norm
        if tensorboard is not None:  # written as rows reach the host
            from hookwidget.views.tensorboard import TensorBoardLog

            self.listen(TensorBoardLog(tensorboard, self))
        if log_dir is not None:  # shards of rows as they reach the host (views/watch_log.py)
            from hookwidget.views.watch_log import WatchLog

            self.listen(WatchLog(log_dir, self))

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        return self if self.active else self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> Watch:
        """Put the hooks on (`hw.watch` does it before it returns; `with` does it if they are off) and return the
        watch. RuntimeError once it is closed: make a new one with `hw.watch(model)`."""
        if self.active:
            return self
        if self.closed:
            raise RuntimeError("this watch is closed; make a new one with hw.watch(model)")
        s = self._stack
        other = next((w for m in self._layers if (w := _OPEN.get(m)) is not None and w is not self), None)
        if other is not None:
            warnings.warn(AGAIN.format(model=type(self.model).__name__, other=repr(other)), stacklevel=3)
        try:
            s.enter_context(self._tracer)  # its hooks on; removed and swept when the stack closes
            s.callback(amp.unlisten, self)
            amp.listen(self)
            if self.flight_recorder:
                self._flight = FlightRecorder(self._tracer, self.model, self.trace_budget_mb, self.max_kept)
                s.callback(self._flight.close)
                self._flight.open()
        except BaseException:
            self._tracer.hooks.active = False
            self._stack.close()
            raise
        for m in self._layers:
            _OPEN[m] = self
        s.callback(self._forget)
        return self

    def _forget(self) -> None:
        for m in self._layers:
            if _OPEN.get(m) is self:
                del _OPEN[m]

    def close(self) -> None:
        """Remove every hook (always, whatever happened in the loop), then move what is left to the host.
        The latest step's Trace is kept; the recording opened after it (no backward in it) is dropped."""
        if self.closed:
            return
        self.closed, was_active = True, self.active
        self._tracer.hooks.active = False
        self._stack.close()
        if was_active:
            self._stats.finish()  # an optimizer step whose passes are still being added up: its row
            if self._spread is not None:
                self._spread.finish()  # the last step's update ratio: one more gather, on every rank
            self._flush()
            if self._flight is not None:
                self._flight.finish(self._detector.rank)
            self._tell("closed")

    def _scale_now(self):
        """The GradScaler's scale now (a device tensor), or None: asked as each backward starts."""
        return self._amp.now() if self._amp is not None else None

    def saw_scaler(self, scaler) -> None:
        """Told by the GradScaler stand-in: a GradScaler.scale() call on the watch's thread; the watch unscales by
        it, unless told scaler=."""
        # called by amp.py's stand-in for GradScaler.scale
        if self._amp is None:
            self._amp = ScaleTrack(scaler, explicit=False)
        elif self._amp.scaler is not scaler and not self._amp.explicit and amp.SEVERAL not in self.notes:
            self.notes.append(amp.SEVERAL)
            warnings.warn(amp.SEVERAL, stacklevel=4)

    def _step_ended(self, step) -> None:
        """Backward of `step` ended (capture/step_stats.py): say what was not seen. Rows before it are complete
        (their optimizer step ran) and go to the host in batches; the flight recorder judges the step before
        (compiled code, where no forward hook told of this step's start) from its scalars."""
        if step.compiled and self.flight_recorder and compiled.FLIGHT not in self.notes:
            self.notes.append(compiled.FLIGHT)
        if step.roots is not None:
            self._unseen(step)
        if not self._called_checked and step.recorded and step.order and not step.compiled:
            self._not_called(step)
        for note in self._ps.notes() if self._ps is not None else ():
            if note not in self.notes:
                self.notes.append(note)
        if self._flight is not None:
            if self._flight.latest is not None:  # no forward ran since the step before (compiled code): judged now
                self._judge(upto=step.index - 1)
            self._flight.step_ended(step.index, self._detector.rank)
        if self._rows.due(self.batch, timed=self._flight is not None or self._params[0].device.type == "cpu"):
            self._flush(upto=step.index - 1)

    def _take_back(self, steps: list) -> bool:
        """The first accumulating optimizer step holds `steps` (backward passes made steps of their own, their rows
        waiting on device): taken back from the rows, their early verdicts and Traces moved to the first's index
        (StatsKeep._take_back). False where a row moved to the host already (a read, or an anomaly's row):
        then they stay steps of their own."""
        pending = {id(s) for s in self._rows.pending}
        if not all(id(s) in pending for s in steps):
            self.notes.append(EARLY.format(first=steps[0].index, last=steps[-1].index))
            warnings.warn(self.notes[-1], stacklevel=2)
            return False
        taken = {id(s) for s in steps}
        self._rows.pending = [s for s in self._rows.pending if id(s) not in taken]
        indices = [s.index for s in steps]
        self._detector.forget(indices)
        if self._flight is not None and indices:
            self._flight.rekey(indices[1:], indices[0])
        return True

    def _step_began(self, step) -> None:
        """The forward of `step` began: the step before is complete (its optimizer steps have run), so the flight
        recorder judges it now, before this forward allocates: at most one step's detail alive beside the kept
        Traces while the model runs."""
        if self._flight is not None and self._flight.latest is not None:
            self._judge(upto=step.index - 1)
            self._flight.judge(self._detector.rank)

    def _judge(self, upto: int) -> None:
        """Judge the steps up to `upto` for the flight recorder from their scalars (loss, global gradient norm) and
        one flag (a non-finite count in the row), read in one small transfer; their rows stay on the device until
        the batch moves. Where the verdict needs the whole row (a non-finite count to locate, a keep= predicate,
        a GradScaler's skipped steps) the rows move to the host now."""
        if self._detector.keep is not None or self._amp is not None:
            self._flush(upto=upto)
            return
        for s in self._rows.pending:
            if s.index > upto or self._detector.judged(s.index):
                continue
            self._rows.settle(s)  # spread over ranks: judged on the global row, the same verdict on every rank
            if self._detector.judge_on_device(s.index, s.row, s.step_row, s.has_loss):
                self._flush(upto=s.index)

    def _not_called(self, step) -> None:
        """Watched layers no call of which reached backward in the first recorded step: named in one note."""
        self._called_checked = True
        seen = step.order  # the layers whose δ arrived (a recomputation's too: gradient checkpointing)
        names = [n for li, n in enumerate(self.layer_names) if li not in seen]
        if names:
            self.notes.append(NOT_CALLED.format(layers=", ".join(names[:8]) + (" ..." if len(names) > 8 else "")))

    def _unseen(self, step) -> None:
        """Backward reached the watched parameters, yet no hook of the watch ran: say once why, and the fix."""
        roots, step.roots = step.roots, None
        if self._unseen_checks >= 3 or self._warned:
            return
        self._unseen_checks += 1
        how = compiled.reaches(roots, self._params)
        if how is not None:
            self._warned = True
            self.notes.append(compiled.NOT_SEEN[how])
            warnings.warn(compiled.NOT_SEEN[how], stacklevel=5)

    # -- host side -----------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether the hooks are on (between open() and close())."""
        return self._tracer.hooks.active

    def listen(self, fn) -> None:
        """Call `fn(event, *args)` on the loop's thread, with host data only (never a device sync of its own):
        ("rows", stats, step_stats, steps, per_sample maxima or None) as rows reach the host, and ("closed",)
        when the watch closes. The live view, TensorBoard, W&B and log_dir= listen so."""
        self._listeners.append(fn)

    @property
    def found_anomalies(self) -> list:
        """The anomalies found so far among the rows already on the host (w.anomalies moves the rest first), with
        their leads from those rows (no transfer: the live view and the exports read this)."""
        return self._with_leads(list(self._detector.anomalies), *self._rows.host_tables())

    @property
    def seen(self) -> int:
        """Backward passes seen so far (recorded or not: every=k records one step in k)."""
        return self._stats.n

    def sync(self) -> None:
        """Move the statistics of every step whose optimizer step has run to the host, in one transfer (as reading
        w.stats does; the live view calls it after each cell). The running step's row stays on the device."""
        if self.active:
            self._flush(upto=self._stats.complete())

    def count_optimizer_steps(self) -> None:
        """From now on each row is an optimizer step (the backward passes it accumulated, or ran inside
        step(closure), added up), as it is anyway from the first such step the watch sees; call it before the
        loop's first backward where the first optimizer step accumulates (the callbacks do)."""
        self._stats.count_optimizer_steps()

    @property
    def micro_batches(self) -> dict:
        """Step -> the backward passes (0, 1, ... over the run: w.seen counts them) it held, for the recorded
        steps; a step is one pass until the watch counts optimizer steps."""
        self._flush()
        micro = self._rows.micro
        return {k: micro[k][0] if k in micro else [k] for k in self._rows.recorded}

    def micro(self, step: int) -> tuple:
        """(stats, step_stats) of the backward passes of recorded step `step`, as the watch records a pass
        (w.micro_batches[step] lists them): (passes, layers, statistics) and (passes, 2) float64. A pass's
        grad_norm is ‖.grad‖ as its backward left it (accumulated so far), its update_ratio NaN, its loss the
        loss backward started from."""
        self._flush()
        if step in self._rows.micro:
            _, stats, step_stats = self._rows.micro[step]
            return stats, step_stats
        if step not in self._rows.recorded:
            raise KeyError(f"step {step} was not recorded; recorded steps: w.steps")
        r = list(self._rows.recorded).index(step)
        return self.stats[r:r + 1], self.step_stats[r:r + 1]

    @property
    def skipped(self) -> list:
        """Steps whose optimizer step the GradScaler skipped (found inf/NaN), among the rows on the host."""
        return self._rows.skipped

    def _flush(self, upto: int | None = None) -> None:
        """Move the statistics of pending steps (those up to `upto`) to the host in one transfer."""
        self._rows.flush(upto)

    def _tell(self, event: str, *args) -> None:
        """Call the listeners (the live widget) with host data only: they never cause a device sync."""
        for fn in list(self._listeners):
            fn(event, *args)

    # -- what users read -----------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        """Recorded rows on the host so far (no transfer, no device sync)."""
        return len(self._rows.recorded)

    def _table(self, start: int, stop: int) -> tuple:
        stats, step_stats = self._rows.host_tables()
        return (np.asarray(self._rows.recorded[start:stop], np.int64), stats[start:stop].numpy(),
                step_stats[start:stop].numpy())

    @property
    def stats(self) -> torch.Tensor:
        """(recorded steps, layers, statistics) float64 on the host; names in stat_names, layer_names."""
        return self._rows.tables()[0]

    @property
    def step_stats(self) -> torch.Tensor:
        """(recorded steps, 2): the loss and the global gradient norm (step_stat_names)."""
        return self._rows.tables()[1]

    @property
    def steps(self) -> list:
        """The step (backward pass) index of each row of stats."""
        self._flush()
        return list(self._rows.recorded)

    @property
    def loss(self) -> torch.Tensor:
        """(recorded steps,) float64: the loss of each recorded step, the scalar backward started from
        (`w.series("loss")`)."""
        return self.step_stats[:, 0]

    @property
    def grad_norm(self) -> torch.Tensor:
        """(recorded steps,) float64: the global gradient norm of each recorded step (`w.series("grad_norm")`)."""
        return self.step_stats[:, 1]

    @property
    def per_sample(self) -> torch.Tensor:
        """per_sample=True: (recorded steps, 2) float64, the largest per-sample gradient norm of each step (over
        the layers with an exact (a, δ) rule; w.notes names any left out) and the index of that sample in
        the batch; NaN where not known."""
        if self._ps is None:
            raise KeyError("per-sample norms are off: hw.watch(model, per_sample=True) records them")
        return self._rows.per_sample_table()

    @property
    def local_stats(self) -> torch.Tensor:
        """Like w.stats, as this rank held them (a shard's norms under FSDP2/DTensor, its own batch's δ and a);
        w.stats itself where the model is not spread over ranks (w.scope says which figure is whose)."""
        return self._local()[0]

    @property
    def local_step_stats(self) -> torch.Tensor:
        """Like w.step_stats, as this rank held them: its own loss, the norm of its own (local) gradients."""
        return self._local()[1]

    @property
    def scope(self) -> dict:
        """statistic -> whose figure w.stats holds: "global" (over ranks) or "rank r"; {} for one process."""
        return dict(self._spread.scope) if self._spread is not None else {}

    def _local(self) -> tuple:
        stats, step_stats = self._rows.tables()
        return self._spread.local_tables(stats, step_stats) if self._spread is not None else (stats, step_stats)

    def series(self, layer: str, stat: str | None = None, scope: str = "global") -> torch.Tensor:
        """One statistic of one layer over the recorded steps, or one of the per-step ones.

        Args:

        - `layer`: a name of `w.layer_names`; or `"loss"` / `"grad_norm"` (the per-step ones, `w.step_stat_names`)
          with no `stat`.
        - `stat`: a name of `w.stat_names`.
        - `scope`: `"global"` (default); `"local"`: as this rank held it (a model spread over ranks: see
          `w.scope`).

        Returns:

        A float64 tensor of shape (recorded steps,).

        Raises:

        - `KeyError`: no such layer or statistic (the message lists the valid ones).
        - `ValueError`: a bad `scope`.

        Example:

        ```python
        w.series("fc1", "grad_norm"), w.series("loss")
        ```
        """
        if scope not in MODES:
            raise ValueError(f"series(scope={scope!r}): 'global' (over ranks) or 'local' (this rank's)")
        stats, step_stats = self._local() if scope == "local" else (self.stats, self.step_stats)
        if stat is None:
            if layer in ("per_sample_max", "per_sample_argmax"):
                return self.per_sample[:, 0 if layer == "per_sample_max" else 1]
            if layer not in self.step_stat_names:
                raise KeyError(f"series({layer!r}): give a layer and a statistic, or one of {self.step_stat_names}")
            return step_stats[:, self.step_stat_names.index(layer)]
        if layer not in self.layer_names:
            close = [n for n in self.layer_names if layer.lower() in n.lower()][:5] or self.layer_names[:8]
            raise KeyError(f"no layer {layer!r} watched (layers with parameters); e.g. {', '.join(close)}")
        if stat not in self.stat_names:
            raise KeyError(f"no statistic {stat!r}; choose one of {', '.join(self.stat_names)}")
        return stats[:, self.layer_names.index(layer), self.stat_names.index(stat)]

    @property
    def anomalies(self) -> list:
        """Anomaly(step, where, reason, lead) entries, in step order (see `hw.watch` for the rules); `lead`: where
        the cause shows first (a `Lead`), or None."""
        # leads: watch/leads.py
        self._flush()
        return self._with_leads(list(self._detector.anomalies), *self._rows.tables())

    def _with_leads(self, anomalies: list, stats, step_stats) -> list:
        if not anomalies:
            return anomalies
        n = stats.shape[0]
        rows = leads.Rows(stats.numpy(), step_stats.numpy(), list(self._rows.recorded)[:n], self.layer_names,
                          self.stat_names, self.step_stat_names)
        return leads.with_leads(anomalies, rows)

    @property
    def found_nonfinite(self) -> dict:
        """w.nonfinite among the rows already on the host (no transfer: the live view reads it)."""
        return dict(self._detector.stretches)

    @property
    def nonfinite(self) -> dict:
        """Onset step of each non-finite stretch (its one anomaly in w.anomalies) -> the recorded steps after it that
        were non-finite too (counted, not listed; detect.py)."""
        self._flush()
        return dict(self._detector.stretches)

    @property
    def kept(self) -> list:
        """Steps whose full Trace w.trace(k) returns now."""
        self._flush()
        return self._flight.steps() if self._flight is not None else []

    def trace(self, k: int = -1):
        """The full Trace of kept step `k` (an anomalous one, one keep= asked for, the latest); k=-1: the latest.

        Raises:

        - `KeyError`: step `k` is not kept (`w.kept` lists those that are), or the flight recorder is off.
        """
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
        return (f"Watch ({state}): {len(self.layer_names)} layers, {self.seen} steps, {n} recorded, "
                f"{len(self._detector.anomalies)} anomalies" + (f", traces kept at steps {self.kept}"
                                                                if self.flight_recorder else ""))

    def to_tensorboard(self, log_dir) -> str:
        """Write what was recorded so far as TensorBoard scalars (`{stat}/{layer}`, `step/loss`,
        `step/grad_norm`; x = step) and the anomalies as text.

        Args:

        - `log_dir`: the TensorBoard log directory.

        Returns:

        The run's folder. Needs: pip install hookwidget[tensorboard].
        """
        from hookwidget.views.tensorboard import write

        return write(self, log_dir)

    def to_wandb(self, run=None):
        """Log what was recorded so far to a W&B run: the same keys as to_tensorboard against x =
        `hookwidget_step`, the anomalies as a table.

        On an open watch the later rows follow from a background thread until close().

        Args:

        - `run`: a W&B run; None (default): the active one, else a new one.

        Returns:

        The run. Needs: pip install hookwidget[wandb].
        """
        from hookwidget.views.wandb import write

        return write(self, run)

    def gather(self, dst: int = 0, group=None):
        """Distributed: every rank's own statistics (w.local_stats) on rank `dst` (list of RankStats indexed by
        rank; None on the others), in one gather_object call at the end; call it on every rank. Each rank's own:
        δ and a of its own batch; .grad as backward leaves it (DDP: all-reduced; FSDP2: the rank's local shard
        of the reduce-scattered gradient, and ‖W‖ of its local shard). w.stats holds the global figures."""
        from hookwidget.watch.gather import gather

        return gather(self, dst, group)

    @property
    def dropped_traces(self) -> int:
        """Anomalous steps whose Trace was not kept, or was given up for a higher-ranked one, max_kept being
        reached (FlightRecorder.decide)."""
        return self._flight.dropped if self._flight is not None else 0

    def save(self, path) -> None:
        """Write this watch to `path` as data (statistics, steps, names, anomalies, notes, the kept Traces; no
        code), for `hw.load(path)`: a read-only watch that answers the same queries and shows the same view.

        Args:

        - `path`: the file to write (a str or os.PathLike).

        Raises:

        - `TypeError`: `path` is not a path.

        Example:

        ```python
        w.save("run.pt")
        hw.load("run.pt").series("loss")
        ```
        """
        from hookwidget.record import saved

        check_path(path, "w.save(path)", "w.save('run.pt')")
        try:
            ps = self.per_sample
        except KeyError:  # per_sample=False
            ps = None
        tree = {"layers": list(self.layer_names), "stat_names": list(self.stat_names),
                "step_stat_names": list(self.step_stat_names), "every": self.every, "stats": self.stats,
                "step_stats": self.step_stats, "steps": torch.tensor(self.steps, dtype=torch.int64),
                "per_sample": ps, "anomalies": [tuple(a[:3]) for a in self.anomalies],
                "notes": [str(n) for n in self.notes], "skipped": list(self.skipped), "seen": int(self.seen),
                "nonfinite": {int(k): int(v) for k, v in self.nonfinite.items()},
                "dropped": self.dropped_traces,
                "traces": None if self._flight is None else [(k, self.trace(k).to_data()) for k in self.kept]}
        saved.write(path, "watch", tree)  # a loaded watch saves the same way (watch/saved.py's SavedWatch)
