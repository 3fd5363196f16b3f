"""The run-long recorder: hooks on across a training loop, statistics per step and layer on device.

The hooks are the one tracer's (capture/tracer.py) with the keep strategy "stats" (capture/step_stats.py): it
hands each step's row here when the step's backward ends (an optimizer step of several passes: when it has run);
the Watch moves rows to the host (host.py), judges them (detect.py), keeps Traces (flight.py), unscales
GradScaler steps (amp.py) and says what it could not see."""

from __future__ import annotations

import shutil
import tempfile
import threading
import warnings
import weakref
from contextlib import ExitStack

import torch
from torch import nn

from hookwidget._torch.compile import uncompiled
from hookwidget.capture.sample_stats import PerSample
from hookwidget.capture.stat_rows import STAT_NAMES, STEP_STAT_NAMES
from hookwidget.capture.step_stats import STATS, Watched
from hookwidget.capture.tracer import Tracer
from hookwidget.watch import amp, compiled
from hookwidget.watch.amp import ScaleTrack
from hookwidget.watch.detect import Detector
from hookwidget.watch.flight import FlightRecorder
from hookwidget.watch.gather import RankViews
from hookwidget.watch.history import History
from hookwidget.watch.host import HostRows
from hookwidget.watch.ranks import MODES
from hookwidget.watch.ranks import of as _spread_of
from hookwidget.watch.reads import Reads
from hookwidget.watch.verdicts import Verdicts

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


class Watch(Reads, RankViews):
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
                 scaler=None, tensorboard=None, per_sample: bool | str = False, log_dir=None, ranks: str = "global"):
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
        ps = PerSample(self._layers, self.layer_names, pairs, shares=per_sample != "norms") if per_sample else None
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
        self.tracks_per_sample = ps is not None  # per_sample=True: each step's largest per-sample gradient norm
        # float32 rows, unless the model holds float64 parameters (docs/guide/watch.md: what float64 would buy)
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32
        # every row on disk (views/watch_log.py), from its own thread
        self._log = _log(self, log_dir, torch.empty(0, dtype=dtype).numpy().dtype)
        self._history = History(len(self._layers), len(STAT_NAMES), dtype, ps is not None, self._log)
        self._rows = HostRows(len(self._layers), self._detector, lambda: self._amp, ps is not None, self._tell,
                              self._spread, self._history)
        self._tracer = Tracer(self._layers, capture=STATS, norms_rule=Watched(
            self._layers, self._params, pairs, self.every, ps, self._scale_now, self._rows.add, self._rows.changed,
            self._step_ended, self._step_began, self._take_back))
        self._stats = self._tracer.keep  # the steps (capture/step_stats.StatsKeep)
        self._verdicts = Verdicts(self._rows, self._detector, lambda: self._detector.keep is not None or
                                  self._amp is not None, lambda upto, wait: self._flush(upto, wait))
        self._ps = ps
        if tensorboard is not None:  # written as rows reach the host
            from hookwidget.views.tensorboard import TensorBoardLog

            self.listen(TensorBoardLog(tensorboard, self))
        self.listen(self._log)

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
            self._history.finish()
            if self._flight is not None:
                self._flight.finish(self._verdicts.ready, self._detector.rank)
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
            if self._flight.waiting:  # no forward ran since the step before (compiled code): judged now
                self._verdicts.send(upto=step.index - 1)
            self._flight.step_ended(step.index)
            self._flight.settle(self._verdicts.ready, self._detector.rank)
        if self._rows.due(self.batch):
            self._flush(upto=step.index - 1, wait=False)

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
        recorder judges it now, before this forward allocates, if its values are on the host already; else at the
        end of this step's backward (waiting for them then): at most two steps' detail alive beside the kept
        Traces while the model runs, the running step's and the one before."""
        if self._flight is not None and self._flight.waiting:
            self._verdicts.send(upto=step.index - 1)
            self._flight.settle(self._verdicts.ready, self._detector.rank)

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
        step(closure), added up), as it is anyway from the first such step the watch sees.

        Call it before the loop's first backward where the first optimizer step accumulates several backward
        passes (the callbacks do): until the watch has seen an optimizer step, each backward pass is a row.

        Example:

        ```python
        with hw.watch(model) as w:
            w.count_optimizer_steps()
            for k, (xb, yb) in enumerate(loader):       # 4 micro-batches, an optimizer step every 2
                loss_fn(model(xb), yb).backward()
                if k % 2 == 1:
                    opt.step()
                    opt.zero_grad()
        w.steps, w.micro_batches                      # ([0, 1], {0: [0, 1], 1: [2, 3]})
        ```
        """
        self._stats.count_optimizer_steps()

    @property
    def micro_batches(self) -> dict:
        """Step -> the backward passes (0, 1, ... over the run: w.seen counts them) it held, for the recorded
        steps; a step is one pass until the watch counts optimizer steps."""
        self._flush()
        micro = self._rows.micro
        return {k: micro.passes(k) or [k] for k in self._history.steps}

    def micro(self, step: int) -> tuple:
        """The statistics of each backward pass of recorded step `step`, as the watch records a pass
        (`w.micro_batches[step]` lists them).

        A pass's grad_norm is ‖.grad‖ as its backward left it (accumulated so far), its update_ratio NaN, its loss
        the loss backward started from.

        Args:

        - `step`: a recorded step (`w.steps`).

        Returns:

        `(stats, step_stats)`: (passes, layers, statistics) and (passes, 2) tensors, laid out as `w.stats` and
        `w.step_stats`; a step of one pass gives its own row.

        Raises:

        - `KeyError`: `step` was not recorded (`w.steps` lists those that were).

        Example:

        ```python
        stats, step_stats = w.micro(w.steps[-1])
        stats.shape, step_stats[:, 0]                 # (passes, layers, statistics); each pass's loss
        ```
        """
        self._flush()
        got = self._rows.micro.rows(step)
        if got is not None:
            return got
        r = self._row_of(step)
        if r is None:
            raise KeyError(f"step {step} was not recorded; recorded steps: w.steps")
        _, stats, step_stats = self.rows(r, r + 1)
        return stats, step_stats

    @property
    def skipped(self) -> list:
        """Steps whose optimizer step the GradScaler skipped (found inf/NaN), among the rows on the host."""
        return self._rows.skipped

    def _flush(self, upto: int | None = None, wait: bool = True) -> None:
        """Move the statistics of pending steps (those up to `upto`) to the host in one transfer; `wait` for every
        row in flight (a read), else land those that have arrived (HostRows.flush)."""
        self._rows.flush(upto, wait)

    def _tell(self, event: str, *args) -> None:
        """Call the listeners (the live widget) with host data only: they never cause a device sync."""
        for fn in list(self._listeners):
            fn(event, *args)

    # -- what users read (the rest: reads.py) -----------------------------------------------------
    @property
    def n_rows(self) -> int:
        """Recorded rows on the host so far (no transfer, no device sync)."""
        return self._history.n

    @property
    def log_dir(self) -> str:
        """The folder holding every row on disk: log_dir= as given, else a temporary one (deleted with the watch,
        or at the interpreter's exit: docs/guide/watch.md)."""
        return self._log.log_dir

    @property
    def memory(self) -> int:
        """Bytes of RAM the watch's rows take on the host: the full-resolution window, the summary and the step
        indices (watch/history.py), the latest accumulated passes (watch/micro.py); the rest of the run is on
        disk."""
        return self._history.nbytes + self._rows.micro.nbytes

    def _settle(self) -> None:
        self._flush()

    def _table(self, start: int, stop: int) -> tuple:
        return self._history.table(start, stop)

    def _column(self, start: int, stop: int, at: tuple, field: str):
        return self._history.column(start, stop, at, field)

    def _steps(self) -> list:
        return list(self._history.steps)

    def _step_index(self):
        return self._history.steps  # in RAM: 8 B a row

    def _level(self):
        return self._history.summary()

    def _found(self) -> list:
        return list(self._detector.anomalies)

    @property
    def per_sample(self) -> torch.Tensor:
        """per_sample=True: (recorded steps, 2) float64, the largest per-sample gradient norm of each step (over
        the layers with an exact (a, δ) rule; w.notes names any left out) and the index of that sample in
        the batch; NaN where not known."""
        if self._ps is None:
            raise KeyError("per-sample norms are off: hw.watch(model, per_sample=True) records them")
        self._flush()
        return torch.from_numpy(self._history.column(0, self.n_rows, (slice(0, 2),), "per_sample").reshape(-1, 2))

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

    def __repr__(self) -> str:
        state = "open" if self.active else "closed"
        n = len(self.steps)
        return (f"Watch ({state}): {len(self.layer_names)} layers, {self.seen} steps, {n} recorded, "
                f"{len(self._detector.anomalies)} anomalies" + (f", traces kept at steps {self.kept}"
                                                                if self.flight_recorder else ""))

    @property
    def dropped_traces(self) -> int:
        """Anomalous steps whose Trace was not kept, or was given up for a higher-ranked one, max_kept being
        reached (FlightRecorder.decide)."""
        return self._flight.dropped if self._flight is not None else 0


def _log(watch: Watch, log_dir, dtype):
    """The watch's log (views/watch_log.py): in `log_dir`, or in a temporary folder of the system's (tempfile)
    removed when the watch is garbage-collected or the interpreter exits (its shards not fsynced: the folder does
    not outlive the process anyway)."""
    from hookwidget.views.watch_log import WatchLog

    if log_dir is not None:
        return WatchLog(log_dir, watch, dtype)
    folder = tempfile.mkdtemp(prefix="hookwidget-watch-")
    weakref.finalize(watch, shutil.rmtree, folder, ignore_errors=True)
    return WatchLog(folder, watch, dtype, durable=False)  # gone at exit: no fsync per shard
