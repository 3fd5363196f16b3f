"""`hw.watch`: hooks on across a whole training loop, a few statistics per step and layer, a flight recorder."""

from __future__ import annotations

from .core import Watch
from .detect import Anomaly
from .magic import hookwatch_magic
from .reduce import STAT_NAMES, STEP_STAT_NAMES

__all__ = ["STAT_NAMES", "STEP_STAT_NAMES", "Anomaly", "Watch", "hookwatch_magic", "watch"]


def watch(model, every: int = 1, spike: float = 6.0, window: int = 20, keep=None, flight_recorder: bool = True,
          max_kept: int = 8, batch: int = 64, trace_budget_mb: float = 256) -> Watch:
    """Watch `model` across a training loop: `with hw.watch(model) as w: ...`, or `w = hw.watch(model)`
    ... `w.close()` (the hooks go on when watch() returns). They stay on across steps and are removed
    by close() / the end of the `with` block, whatever happened (exceptions, KeyboardInterrupt); the
    statistics and kept Traces stay readable afterwards. Observing changes nothing: losses,
    every .grad and the RNG stream are bitwise those of the loop without the watch.

    A step is one `backward()` call (torch.autograd.grad calls are not steps and are not counted).
    Every `every`-th step (0, every, 2·every, ...) is recorded: for each layer with parameters of its
    own (w.layer_names), the statistics of w.stat_names:
      delta_norm, delta_max  ‖δ‖₂ and max|δ| of the gradient w.r.t. its output (all its calls that
                             backward reached, together)
      a_rms, a_zero_frac     RMS of its input activation, and the fraction of its entries that are 0
      a_nonfinite            the number of its NaN or Inf entries
      grad_norm, weight_norm ‖W.grad‖₂ (all its own parameters together, as .grad is when backward
                             ends) and ‖W‖₂ then
      update_ratio           ‖ΔW‖₂/‖W‖₂ of the optimizer step(s) after that backward (NaN: none), ‖W‖
                             being weight_norm; it costs one copy of the optimizer's parameters (a
                             buffer reused across steps), taken before the step with torch._foreach ops
      delta_nan, delta_inf, grad_nan, grad_inf   NaN and Inf counts of δ and of .grad
    and per step the loss (the scalar backward started from) and the global gradient norm
    (w.step_stats, w.loss, w.grad_norm). NaN means "not measured" (the layer was not reached).
    Statistics are reduced on the model's device and moved to the host `batch` steps at a time, or
    when read: no host sync per hook or per step (with the flight recorder on: one small one per step,
    to decide which Trace to keep). w.stats is (recorded steps × layers × statistics), float64;
    w.steps the step index of each row; w.series("fc1", "grad_norm"), w.series("loss").

    w.anomalies: (step, where, reason) for a recorded step with
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

    Flight recorder (flight_recorder=True): a full recording (capture="full", as hw.trace does) runs
    from the end of backward k-1 (or the opening of the watch) to the end of backward k, so the Trace
    of step k holds the optimizer step and zero_grad that followed step k-1, the forward of step k
    and its backward (t.steps[-1], its .grad, its graph). w.trace(k) returns it for the kept steps
    (w.kept): step 0, the latest step, and every anomalous step (at most max_kept of these;
    w.dropped_traces counts the rest); w.trace() is the latest. The others are dropped when the next
    step ends: besides the kept ones at most two are alive (the latest, and the one being recorded).
    A kept Trace costs what hw.trace of one step costs: each layer's input a and output gradient δ
    (up to trace_budget_mb, summaries beyond), copies of .grad as that backward found and left it
    (up to 2x the parameters' size), the graph of the step, and the loss. A long forward-only stretch
    between two backward passes (an evaluation loop with grad on) goes into one recording, within
    the same budget. At worst, (max_kept + 3) Traces are alive, each up to trace_budget_mb of a and δ
    plus its .grad copies, on the model's device. Off, the watch keeps only the statistics: layers x 12
    float64 per recorded step.
    """
    return Watch(model, every=every, spike=spike, window=window, keep=keep, flight_recorder=flight_recorder,
                 max_kept=max_kept, batch=batch, trace_budget_mb=trace_budget_mb).open()
