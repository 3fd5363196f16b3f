"""A Lightning callback: the model watched for the whole fit, its series in the Trainer's own loggers.

Why these events: on_train_start and on_train_end bound the fit, and Lightning calls on_exception for any exception
of the fit (KeyboardInterrupt included), so the hooks never outlive it. Lightning runs backward inside
optimizer.step(closure): the steps are counted from trainer.global_step by integrations/fit.py.
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:
    raise ImportError("hookwidget.integrations.lightning needs Lightning: pip install hookwidget[lightning]") from None

from hookwidget.integrations.fit import Watching


class HookwidgetCallback(Watching, Callback):
    """A Lightning callback: the model watched for the whole fit, its series in the Trainer's own loggers.

    The watch opens at on_train_start and closes at on_train_end and on_exception. Steps are the Trainer's: each
    row of `cb.watch.stats` is one optimizer step (with accumulate_grad_batches the micro-batches before it are
    added up); `cb.optimizer_steps()` gives its trainer.global_step, `cb.micro_batches[s]` the backward passes
    step `s` held. Every `log_every_n_steps` optimizer steps the keys that `integrations.fit.Watching` lists go
    to every logger of the Trainer (trainer.loggers), at x = trainer.global_step.

    Example:

    ```python
    import lightning.pytorch as L
    from hookwidget.integrations.lightning import HookwidgetCallback   # pip install hookwidget[lightning]

    cb = HookwidgetCallback(every=1, log_stats=("grad_norm",))
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=2, callbacks=[cb], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), loader)
    cb.watch                  # the Watch: live view, w.series, w.trace(k), w.anomalies
    ```
    """

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
