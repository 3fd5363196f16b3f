"""A Lightning callback: the model watched for the whole fit, its series in the Trainer's own loggers.

    cb = HookwidgetCallback()                    # hw.watch's arguments go here: every=, flight_recorder=, ...
    L.Trainer(callbacks=[cb], ...).fit(module, data)
    cb.watch                                     # the Watch: live view, w.series, w.trace(k), w.anomalies

The watch opens at on_train_start and closes at on_train_end and on_exception (Lightning calls it for any
exception of the fit, KeyboardInterrupt included). Steps are the Trainer's: each row of `cb.watch.stats` is one
optimizer step (Lightning runs backward inside optimizer.step(closure); with accumulate_grad_batches the micro-batches
before it are added up: integrations/fit.py), `cb.optimizer_steps()` its trainer.global_step, `cb.micro_batches[s]`
the backward passes step `s` held. Every `log_every_n_steps` optimizer steps a handful of keys go to every logger of
the Trainer (trainer.loggers), at x = trainer.global_step: hookwidget/grad_norm (global), hookwidget/update_ratio_max
and hookwidget/update_ratio_max_layer (an index into cb.watch.layer_names), hookwidget/anomalies (so far) and
hookwidget/anomaly_step (the latest one's); per layer, `hookwidget/{stat}/{layer}` only for the stats in `log_stats`.
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:
    raise ImportError("hookwidget.integrations.lightning needs Lightning: pip install hookwidget[lightning]") from None

from hookwidget.integrations.fit import Fit, Watching


class HookwidgetCallback(Callback, Watching):
    """A Lightning callback: the model watched for the whole fit, its series in the Trainer's own loggers.

    The watch opens at on_train_start and closes at on_train_end and on_exception (Lightning calls it for any
    exception of the fit, KeyboardInterrupt included). Steps are the Trainer's: each row of `cb.watch.stats` is
    one optimizer step (Lightning runs backward inside optimizer.step(closure); with accumulate_grad_batches the
    micro-batches before it are added up); `cb.optimizer_steps()` gives its trainer.global_step,
    `cb.micro_batches[s]` the backward passes step `s` held. Every `log_every_n_steps` optimizer steps a handful of
    keys go to every logger of the Trainer (trainer.loggers), at x = trainer.global_step: hookwidget/grad_norm
    (global), hookwidget/update_ratio_max and hookwidget/update_ratio_max_layer (an index into
    cb.watch.layer_names), hookwidget/anomalies (so far), hookwidget/anomaly_step (the latest one's) and
    hookwidget/anomaly_lead_step (where its cause shows first); per layer,
    `hookwidget/{stat}/{layer}` only for the stats in `log_stats`.

    Args:

    - `log_stats`: statistics forwarded per layer to the loggers (default none), e.g.
      `log_stats=("grad_norm", "update_ratio")`.
    - `**watch_kwargs`: the arguments of `hw.watch` (every, spike, window, keep, flight_recorder, max_kept,
      per_sample, ...).

    Example:

    ```python
    from hookwidget.integrations.lightning import HookwidgetCallback   # pip install hookwidget[lightning]

    cb = HookwidgetCallback(every=1, log_stats=("grad_norm",))
    L.Trainer(callbacks=[cb], max_epochs=1).fit(module, data)
    cb.watch                  # the Watch: live view, w.series, w.trace(k), w.anomalies
    ```
    """

    def __init__(self, log_stats=(), **watch_kwargs):
        self._fit = Fit(watch_kwargs, log_stats)

    def on_train_start(self, trainer, pl_module) -> None:
        self._fit.open(pl_module, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._fit.stepped(step) and trainer.loggers and step % max(trainer.log_every_n_steps, 1) == 0:
            metrics = self._fit.metrics(step)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def on_train_end(self, trainer, pl_module) -> None:
        self._fit.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._fit.close()
