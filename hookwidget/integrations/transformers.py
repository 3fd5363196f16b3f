"""A Hugging Face `Trainer` callback: the model watched for the whole fit, its series in the Trainer's own logs.

Trainer has no exception event, so the callback wraps the instance's `train` to close the watch however the fit
ends (when it is handed to the Trainer's constructor: on_init_end; added later with add_callback, the first fit's
training_step is wrapped too, and an exception outside it leaves the hooks until cb.close()). It moves itself
first in the Trainer's callback list because the report_to integrations, which the Trainer puts before the user's
callbacks, read the logs on_log fills. Steps are counted by integrations/fit.py.

Only the Trainer finds the Trainer: callbacks are not given it, so the callback looks for it (and for the
CallbackHandler calling it) among its callers' frames, through inspect's public frame API.
"""

from __future__ import annotations

import functools
import inspect
import sys

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler
except ImportError:
    raise ImportError("hookwidget.integrations.transformers needs transformers: "
                      "pip install hookwidget[transformers]") from None

from hookwidget.integrations.fit import Watching

GUARD = "_hookwidget_guard"  # marks a method this module wrapped


def _callers(frame, depth: int = 8):
    """The `self` of the callers of `frame`, innermost first."""
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            return
        yield frame.f_locals.get("self")


class HookwidgetCallback(Watching, TrainerCallback):
    """A Hugging Face `Trainer` callback: the model watched for the whole fit, its series in the Trainer's own logs.

    The watch opens at on_train_begin and closes at on_train_end, and whatever ends the fit early. Steps are the
    Trainer's: each row of `cb.watch.stats` is one optimizer step, its gradient_accumulation_steps micro-batches
    added up (‖W.grad‖ of the gradient the step used, after clipping; the loss as the Trainer logs it);
    `cb.optimizer_steps()` gives its state.global_step, `cb.micro_batches[s]` the backward passes step `s` held.
    At the Trainer's logging cadence (on_log, logging_steps) the logs gain the keys that
    `integrations.fit.Watching` lists (the Trainer's own grad_norm is the norm before clipping,
    hookwidget/grad_norm the one the optimizer used). The callback moves itself first in the Trainer's callback
    list, so the report_to integrations (W&B, TensorBoard, MLflow, ...) log those keys too; so does
    state.log_history.

    Example:

    ```python
    from transformers import Trainer, TrainingArguments
    from hookwidget.integrations.transformers import HookwidgetCallback   # pip install hookwidget[transformers]

    cb = HookwidgetCallback(every=1)
    args = TrainingArguments("out", max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=8,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb]).train()
    cb.watch                  # the Watch: live view, w.series, w.trace(k), w.anomalies
    ```
    """

    # -- the Trainer's events --------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        self._take_over(inspect.currentframe(), this_fit=False)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._take_over(inspect.currentframe(), this_fit=True)
        self._fit.open(model, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self._fit.stepped(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or not self._fit.active:  # training logs only, not eval/summary
            return
        series = self._fit.metrics(state.global_step)
        logs.update(series)
        last = state.log_history[-1] if state.log_history else {}
        if last.get("step") == state.global_step and "loss" in last:  # the record Trainer.log just kept
            last.update(series)

    def on_train_end(self, args, state, control, **kwargs):
        self._fit.close()

    # -- finding the Trainer ---------------------------------------------------------------------------
    def _take_over(self, frame, this_fit: bool) -> None:
        """Move first in the CallbackHandler calling us (safe while it iterates: we are at the index it is at,
        and everything after us keeps its index) and guard the Trainer's train (and, when first seen at the
        start of a fit, its training_step) so that an exception closes the watch."""
        trainer_mod = sys.modules.get("transformers.trainer")
        trainer_cls = getattr(trainer_mod, "Trainer", None)
        for obj in _callers(frame):
            if isinstance(obj, CallbackHandler) and obj.callbacks and obj.callbacks[0] is not self \
                    and self in obj.callbacks:
                obj.callbacks.remove(self)
                obj.callbacks.insert(0, self)
            elif trainer_cls is not None and isinstance(obj, trainer_cls):
                if not getattr(obj.train, GUARD, False):
                    self._guard(obj, "train")
                    if this_fit:  # this fit's train() runs already: its training steps are what can be guarded
                        self._guard(obj, "training_step")
                return

    def _guard(self, trainer, name: str) -> None:
        method, fit = getattr(trainer, name), self._fit

        @functools.wraps(method)
        def guarded(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except BaseException:
                fit.close()
                raise

        setattr(guarded, GUARD, True)
        setattr(trainer, name, guarded)  # an instance attribute: this Trainer only
