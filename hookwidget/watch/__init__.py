"""`hw.watch`: hooks on across a whole training loop, a few statistics per step and layer, a flight recorder.

core.py the Watch handle (layers, lifecycle, what users read) on the one tracer with the keep strategy "stats"
(capture/step_stats.py: the hooks and the statistics); host.py the rows on their way to the host; amp.py,
compiled.py, gather.py GradScaler, torch.compile and distributed; detect.py anomalies; flight.py the kept Traces;
saved.py a watch read back from disk (w.save, a log_dir).
Floor: below magic and api; imports session (the flight recorder's recordings), capture (the tracer and its
"stats" strategy, the backward stand-in), record and trace (saved.py: the file format, loaded Traces), _torch,
and views only lazily, for display and the log_dir (views/watch_log.py).
"""

from __future__ import annotations

import math
import numbers
import os

from torch import nn

from hookwidget.capture.stat_rows import STAT_NAMES, STEP_STAT_NAMES
from hookwidget.options import shown
from hookwidget.watch.core import Watch
from hookwidget.watch.detect import Anomaly

__all__ = ["STAT_NAMES", "STEP_STAT_NAMES", "Anomaly", "Watch", "watch"]


def watch(model, every: int = 1, spike: float = 6.0, window: int = 20, keep=None, flight_recorder: bool = True,
          max_kept: int = 8, batch: int = 64, trace_budget_mb: float = 256, scaler=None,
          tensorboard=None, per_sample: bool | str = False, log_dir=None, ranks: str = "global") -> Watch:
    """Watch `model` across a training loop: statistics per step and layer, anomalies, Traces of the bad steps.

    Use it as `with hw.watch(model) as w: ...`, or `w = hw.watch(model)` ... `w.close()` (the hooks go on when
    watch() returns). They stay on across steps and are removed by close() / the end of the `with` block, whatever
    happened (exceptions, KeyboardInterrupt); the statistics and kept Traces stay readable afterwards. Observing
    changes nothing: losses, every .grad and the RNG stream are bitwise those of the loop without the watch.
    Watching a model (or a layer of it) that an open watch already watches warns once (both would record, each at
    its cost).

    Args:

    - `model`: the `nn.Module` to watch: every layer with parameters of its own.
    - `every`: record every N-th step (0, every, 2·every, ...); default 1.
    - `spike`: a loss or global gradient norm above mean + spike·std of the previous `window` recorded steps is an
      anomaly; default 6.0.
    - `window`: how many recorded steps a spike is judged against; default 20.
    - `keep`: `keep(step, stats) -> bool`, a step you want flagged and kept (see Anomalies); default None.
    - `flight_recorder`: keep full Traces of anomalous steps and of the latest one (see Flight recorder); default
      True.
    - `max_kept`: at most this many anomalous steps' Traces; default 8.
    - `batch`: recorded steps moved to the host at a time; default 64.
    - `trace_budget_mb`: megabytes of a and δ per kept Trace; default 256.
    - `scaler`: the GradScaler the loop uses (default: the first one whose scale() the loop calls).
    - `tensorboard`: a log directory to write scalars to as the run goes.
    - `per_sample`: also record each step's largest per-sample gradient norm and the samples with the largest
      shares of its gradient (True), or the norm only ("norms": cheaper, see which-samples.md); default False.
    - `log_dir`: a folder to append the statistics to as the run goes (see Keeping it).
    - `ranks`: `"global"` (figures over the ranks of a process group, the default) or `"local"` (this rank's).

    Returns:

    The `Watch`, its hooks on.

    Raises:

    One line naming the first wrong argument, its value and a valid example:

    - `TypeError`: `model` is not an `nn.Module`, `keep` is not callable, `scaler` is not a GradScaler.
    - `ValueError`: any other argument with a bad value (e.g. `every=0`).

    Example:

    ```python
    with hw.watch(model) as w:
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    w.series("fc1", "grad_norm"), w.anomalies, w.trace()   # the latest step's full Trace
    ```

    **Steps.** A step is what the optimizer steps on. In a plain loop (backward, optimizer.step) that is one
    `backward()` call (torch.autograd.grad calls are not steps and are not counted). Where an optimizer steps after
    several backward passes (gradient accumulation: the first such optimizer step tells the watch, as do the
    callbacks, which call w.count_optimizer_steps() before the fit) or runs backward inside optimizer.step(closure)
    (Lightning, L-BFGS, SAM), a step is one optimizer step and its row adds up its backward passes exactly:
    grad_norm is ‖W.grad‖ as the optimizer's step used it (accumulated, clipped), the loss the sum of the passes'
    losses (the trainer's loss: each micro-batch's is divided by the accumulation steps; of repeated closure calls
    the first), δ and a statistics over all its passes. w.micro_batches says which backward passes each step held
    and w.micro(step) gives their own rows; w.seen counts backward passes. A pass that begins with .grad unset
    (zero_grad) and no optimizer step since the passes before (a GradScaler skipped it) starts a new step.

    **Statistics.** Every `every`-th step (0, every, 2·every, ...) is recorded: for each layer with parameters of
    its own (w.layer_names), the statistics of w.stat_names:

    - `delta_norm`, `delta_max`: ‖δ‖₂ and max|δ| of the gradient w.r.t. its output (all its calls that backward
      reached, together);
    - `a_rms`, `a_zero_frac`: RMS of its input activation, and the fraction of its entries that are 0;
    - `a_nonfinite`: the number of its NaN or Inf entries;
    - `grad_norm`, `weight_norm`: ‖W.grad‖₂ (all its own parameters together, as .grad is when backward ends; an
      optimizer step's: as its step used it) and ‖W‖₂ then (before the step);
    - `update_ratio`: ‖ΔW‖₂/‖W‖₂ of the step's optimizer step(s) (NaN: none), ‖W‖ being weight_norm; it costs one
      copy of the optimizer's parameters (a buffer reused across steps), taken before the step with torch._foreach
      ops;
    - `delta_nan`, `delta_inf`, `grad_nan`, `grad_inf`: NaN and Inf counts of δ and of .grad;
    - `lr`: the learning rate of the param group holding the layer's weight, at that optimizer step (NaN: none);
      read without a sync (a device tensor LR moves to the host with the row).

    Per step, also the loss (the scalar backward started from) and the global gradient norm
    (w.step_stats, w.loss, w.grad_norm). NaN means "not measured" (the layer was not reached).
    Statistics are reduced on the model's device and moved to the host `batch` steps at a time, or
    when read: no host sync per hook or per step (with the flight recorder on: one small one per step,
    of the step's loss, gradient norm and non-finite counts, to decide which Trace to keep; on the CPU
    or with the flight recorder on, rows also move at least every 0.5 s, for a slow run's live view).
    w.stats is (recorded steps × layers × statistics), float32 (float64 where the model holds float64
    parameters), w.step_stats float64; w.steps the step index of each row; w.series("fc1", "grad_norm"),
    w.series("loss"); w.rows(start, stop) a range of rows, w.lod(bins) the run in bins (min, max, mean, last).

    **Memory.** RAM does not grow with the run: the latest rows at full resolution (32 MiB of them, 64 to 4,096
    rows), a summary of every row in at most 1,024 bins (64 MiB at most) merged pairwise as the run grows, and 8
    bytes a row for its step index; every row also goes to disk (log_dir=, else a temporary folder deleted with
    the watch or at exit: w.log_dir), from where w.stats, w.series and w.rows read what left RAM.

    **Anomalies.** w.anomalies: (step, where, reason) for a recorded step with (a run that turns non-finite gives
    one anomaly for its onset, where = the layer where it arose, the reason listing each of the kinds below with its
    first layer; the non-finite steps right after it are counted in w.nonfinite, {onset: count}, not listed; the
    flight recorder keeps the onset's Trace):

    - a non-finite loss (where="loss");
    - a non-finite δ (where = the first layer in backward order, the order in which gradients
      reached the layers' outputs, whose δ has a NaN or Inf: every layer reached before it had a
      finite δ, so the non-finite value arose in the backward of what lies between its output and
      the layers reached before it, or in the loss);
    - a non-finite input activation (where = the first layer in forward order whose input is);
    - a non-finite .grad (where = the first such layer in backward order);
    - a spike: loss or global gradient norm above mean + spike·std of the previous `window`
      recorded steps' finite values (std at least 1e-6·|mean|; judged once `window` are there);
    - keep(step, stats) returning True (stats: stat name -> (layers,) tensor, plus "loss" and
      "global_grad_norm" floats); where="keep".

    Anomalies are judged on recorded steps only (every=N thins them too).

    **Per-sample norms.** per_sample=True: per recorded step also the largest per-sample gradient norm and which
    sample it was (w.per_sample: (steps, 2), [norm, index in the batch]; w.series("per_sample_max"),
    w.series("per_sample_argmax")), and the three samples with the largest shares s_b = ⟨G_b, G⟩ / ‖G‖² of the
    step's gradient G (w.sample_shares: (steps, 3, 2), [index, share]; w.top_positions: the first one's top
    position; each anomaly's .samples names them; NaN for an optimizer step of several backward passes, whose
    kept Trace holds its last pass only, and throughout with per_sample="norms"). A sample's gradient is its
    contribution to .grad (a mean-reduced loss's 1/B included), its norm taken over every layer with an exact
    (a, δ) rule: ghost norms (Linear: two Gram products per layer, the per-sample gradients never built where
    that is cheaper), computed while
    backward runs, each layer's a and δ let go as soon as its last call's δ arrived. Layers that share a
    parameter (an embedding tied to the LM head) are reduced together when the last of them has its δ (the
    shared norm with its cross term; the first one's a and δ held until then). The batch is the leading
    dimension of the first watched layer's input. Left out, named in w.notes: layers with no exact rule (and
    the layers sharing a parameter with one), layers whose input does not lead with the batch (a position
    embedding).

    **Flight recorder** (flight_recorder=True): a full recording (capture="full", as hw.trace does) runs
    from the end of backward k-1 (or the opening of the watch) to the end of backward k, so the Trace
    of step k holds the optimizer step and zero_grad that followed step k-1, the forward of step k
    and its backward (t.steps[-1], its .grad, its graph); where a step is an optimizer step of several backward
    passes, the recording of its last pass (the ones before it are let go as the next pass begins).
    w.trace(k) returns it for the kept steps
    (w.kept): every anomalous step, including those keep= asks for (at most max_kept of these, and when
    they are full the first step with a non-finite value takes the place of the latest kept for a spike
    or a GradScaler skip, and the first one keep= asks for that of a spike; w.dropped_traces counts the
    steps not kept or given up), and the latest step; w.trace() is the latest. No step is kept
    for nothing: keep=lambda step, stats: step == 0 keeps the first, a healthy step to compare with.
    The others are dropped as the next step's forward begins (under compile: when its backward ends):
    while the model runs, only the running step's recording is alive besides the kept ones.
    A kept Trace costs what hw.trace of one step costs: each layer's input a and output gradient δ
    (up to trace_budget_mb, summaries beyond), copies of .grad as that backward found and left it
    (up to 2x the parameters' size), the graph of the step, and the loss. A long forward-only stretch
    between two backward passes (an evaluation loop with grad on) goes into one recording, within
    the same budget. At worst, (max_kept + 2) Traces are alive, each up to trace_budget_mb of a and δ
    plus its .grad copies, on the model's device. Off, the watch keeps only the statistics (see Memory).

    **In a notebook**, `w` as a cell's last line (or display(w), or %%hookwatch) shows the live explorer: a
    layers × steps heatmap of one statistic, sparklines, the loss and global gradient norm, anomalies
    marked; shown before the loop, it grows while the loop runs (new rows at most every 0.5 s, from
    rows already on the host: no extra device sync). A kept step opens in the trace explorer.
    w.to_html(path) writes the same view as one standalone page.

    **Where real training runs:**

    - torch.compile: install the watch, then compile (w = hw.watch(model); cmodel = torch.compile(model)).
      In compiled code the watch's forward hook is traced into the graph (no graph break, no Python at run
      time): each layer's output passes through an identity whose backward leaves the statistics of δ and
      a in a small per-layer tensor's .grad. Same statistics as eager, except: a layer called more than
      once in a compiled step has delta_max NaN (not known), and the "backward order" that locates a
      non-finite δ is taken as reverse layer order. The graph gains one copy per layer output (Inductor
      fuses it; in our tests loss and .grad stayed bitwise those of the unwatched compiled model), and
      closing the watch makes Dynamo recompile once, without the hook. Code compiled before the watch
      (for this model or another instance of its class) never calls its hooks: one warning, kept in
      w.notes, says so and names the fix (torch.compiler.reset() before hw.watch). Kept Traces of
      compiled steps hold no layer detail (a note says so); the flight recorder's own hooks break the
      compiled graph per layer (the statistics stay exact): flight_recorder=False keeps it one graph.
    - A GradScaler (scaler=, or else the first one whose scale() the loop calls while the watch is open):
      the loss, delta_norm, delta_max and grad_norm are divided by the scale backward ran with. A scaler
      whose class overrides scale() (FSDP's ShardedGradScaler) is seen only as scaler=. A step the scaler
      skipped (inf/NaN found, no optimizer step, scale lowered) is in w.skipped, its update_ratio is NaN,
      and its anomalies start with where="scaler"; each of its other anomalies says the scaler skipped it.
      Under autocast, norms of bf16/fp16 tensors accumulate in float32.
    - DDP, FSDP2 (fully_shard) and DTensor-sharded parameters (parallelize_module), in a process group of 2+
      ranks (ranks="global", the default; watch the wrapped model on every rank, and close it on every rank):
      w.stats, w.series, the anomalies, log_dir and the live view hold global figures, the same on every
      rank. A layer's grad_norm and weight_norm are the root of its shards' summed squares (a DTensor's Shard
      placements summed over their mesh dimension, Replicate ones and plain replicas counted once; an empty
      shard adds nothing), update_ratio the global ‖ΔW‖ over the global ‖W‖, grad_nan/grad_inf summed; the
      step loss is the mean of the ranks' losses and the step grad_norm the global gradient norm; δ and a are
      over all the ranks' samples under data parallelism (DDP, FSDP2), δ that of the mean loss (each rank's
      own divided by the world size), as one process running the ranks' batches together sees them; else
      (tensor parallelism) this rank's, with their NaN/Inf counts summed. Anomalies are judged on these, so
      every rank flags and keeps the same steps (a kept Trace is the rank's own recording). Cost: one
      asynchronous all_gather of a few numbers per layer per recorded step, waited on when the step is
      judged or moved to the host, by the stream on a GPU (no host sync); a rank silent for 120 s on the CPU
      (elsewhere: the process group's timeout) makes the figures from then on local, said in w.notes;
      w.notes and w.scope say what is whose. Each rank's own figures: w.local_stats,
      w.local_step_stats, w.series(layer, stat, scope="local"). ranks="local": no collective, every figure
      this rank's (as a single process). w.gather(dst=0), called on every rank after the loop, brings all
      ranks' own statistics to rank 0 in one gather_object.
    - tensorboard=log_dir writes scalars as rows reach the host (`{stat}/{layer}`, `step/loss`,
      `step/grad_norm`, x = step; the anomalies as text at close); w.to_tensorboard(log_dir) writes what
      was recorded so far. Needs the extra: pip install hookwidget[tensorboard].

    **Keeping it:** w.save(path) writes the watch as data (statistics, anomalies, notes, kept Traces; no code);
    hw.load(path) reads it back read-only (every query above, the view, w.trace(k) as loaded Traces).
    log_dir=d appends the statistics to d as the run goes (every watch does, to a temporary folder where no
    log_dir is given), from a background thread as rows reach the host (no sync of its own): numpy shards
    d/rows-<first row>-<rows>.npy (structured rows: step, stats, step_stats), one every `batch` recorded steps or
    10 s, each written whole (a temporary name, then a rename), d/events.json (the anomalies) and d/watch.json
    (names, notes). hw.load(d) reads it lazily up to the last complete shard, even after the process was
    killed; numpy reads it without hookwidget: np.load(shard, mmap_mode="r")["stats"]. d must hold no log yet.
    """
    # a step of several backward passes (accumulation, a closure) is added up in capture/opt_steps.py
    check_arguments(model=model, every=every, spike=spike, window=window, keep=keep, flight_recorder=flight_recorder,
                    max_kept=max_kept, batch=batch, trace_budget_mb=trace_budget_mb, scaler=scaler,
                    tensorboard=tensorboard, per_sample=per_sample, log_dir=log_dir, ranks=ranks)
    return Watch(model, every=every, spike=spike, window=window, keep=keep, flight_recorder=flight_recorder,
                 max_kept=max_kept, batch=batch, trace_budget_mb=trace_budget_mb, scaler=scaler,
                 tensorboard=tensorboard, per_sample=per_sample, log_dir=log_dir, ranks=ranks).open()


# -- watch()'s arguments, checked where the user gave them (%%hookwatch checks its flags with these too) -----------
_MOST = 10**9  # counts of steps past it are mistakes (and past 2**63 Python's containers refuse them)


def _integer(least: int, example: str, what: str):
    def check(value) -> str:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not least <= value <= _MOST:
            return f"must be an integer >= {least} ({what}, at most {_MOST:,}), e.g. {example}"
        return ""

    return check


def _number(least: float, example: str, what: str, inf: bool = False):
    def check(value) -> str:
        try:
            number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
        except OverflowError:  # an integer past float's range
            number = math.nan
        if math.isnan(number) or number < least or number == math.inf and not inf:
            return f"must be a number >= {least:g} ({what}), e.g. {example}"
        return ""

    return check


def _flag(name: str):
    return lambda value: "" if isinstance(value, bool) else f"must be True or False, e.g. {name}=True"


_CHECKS = {
    "every": _integer(1, "every=10", "record every N-th step"),
    "spike": _number(0, "spike=6.0", "standard deviations above the mean", inf=True),
    "window": _integer(2, "window=20", "recorded steps a spike is judged against"),
    "max_kept": _integer(0, "max_kept=8", "anomalous steps' Traces to keep"),
    "batch": _integer(1, "batch=64", "steps moved to the host at a time"),
    "trace_budget_mb": _number(0, "trace_budget_mb=256", "megabytes per kept Trace", inf=True),
    "flight_recorder": _flag("flight_recorder"),
    "per_sample": lambda v: "" if isinstance(v, bool) or v == "norms" else
    "must be True, False or 'norms' (the norms without the samples' shares), e.g. per_sample=True",
    "keep": lambda v: "" if v is None or callable(v) else "must be a function keep(step, stats) -> bool, or None",
    "scaler": lambda v: "" if v is None or callable(getattr(v, "scale", None)) else
    "must be a torch.amp.GradScaler (or None: found when the loop calls scaler.scale)",
    "tensorboard": lambda v: "" if v is None or isinstance(v, (str, os.PathLike)) else
    "must be a log directory, e.g. tensorboard='runs/watch'",
    "ranks": lambda v: "" if v in ("global", "local") else
    "must be 'global' (figures over ranks) or 'local' (this rank's), e.g. ranks='local'",
    "log_dir": lambda v: "" if v is None or isinstance(v, (str, os.PathLike)) else
    "must be a folder for the statistics, e.g. log_dir='runs/watch1'",
}


def argument_problem(name: str, value) -> str:
    """What is wrong with watch()'s argument `name` (a phrase: "must be ..., e.g. ..."), or ""."""
    return _CHECKS[name](value)


def check_arguments(model, **given) -> None:
    """One line for the first of watch()'s arguments that is wrong, naming it, its value and a valid example:
    TypeError for the model, the keep callable and the scaler, ValueError for the rest."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"watch(model): model must be an nn.Module, got {type(model).__name__} {shown(model)}; "
                        "e.g. hw.watch(model)")
    for name, value in given.items():
        problem = argument_problem(name, value)
        if problem:
            kind = TypeError if name in ("keep", "scaler") else ValueError
            raise kind(f"watch: {name}={shown(value)} {problem}")
