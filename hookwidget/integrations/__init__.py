"""Where users already train: callbacks for the Hugging Face Trainer and for Lightning.

```python
from hookwidget.integrations.transformers import HookwidgetCallback   # pip install hookwidget[transformers]
from hookwidget.integrations.lightning import HookwidgetCallback      # pip install hookwidget[lightning]
```

Each watches the model for the whole fit (hw.watch, closed however the fit ends), counts steps as the trainer
does (an optimizer step and the backward passes, micro-batches, it held) and forwards per-layer series
to the trainer's own loggers at its logging cadence; `callback.watch` is the Watch. Neither transformers nor
lightning is imported until its module is: importing hookwidget (or this package) needs neither.
"""

# Floor: the top one; imports watch (hw.watch) and nothing imports it. Steps counted as the trainer does: fit.py.
