"""hookwidget: see what PyTorch's hooks see, where gradients go, and what changes when you change them.

```python
import hookwidget as hw
t = hw.trace(step)            # or: with hw.tracing() as t: ...  or the %%hooktrace cell magic
t.layers["fc1"].a, t.layers["fc1"].delta, t.weight_grad("fc1"), t.graph
t.save("t.pt"); t = hw.load("t.pt")   # a Trace as data: read-only, every query but rerun and hooks
with hw.watch(model) as w: train()   # per-layer statistics every step, anomalous steps kept as Traces
```
"""

from hookwidget.api import load, trace, tracing
from hookwidget.interventions import KINDS, InterventionError
from hookwidget.trace import Layer, Trace
from hookwidget.watch import Watch, watch

__version__ = "0.1.0"
__all__ = ["KINDS", "InterventionError", "Layer", "Trace", "Watch", "load", "load_ipython_extension", "trace",
           "tracing", "watch"]


def load_ipython_extension(ipython) -> None:
    """Register the `%%hooktrace` and `%%hookwatch` cell magics: what `%load_ext hookwidget` calls.

    Args:

    - `ipython`: the IPython shell to register them in.

    Example:

    ```python
    %load_ext hookwidget
    ```
    """
    from hookwidget.magic import HookTraceMagics

    ipython.register_magics(HookTraceMagics)
