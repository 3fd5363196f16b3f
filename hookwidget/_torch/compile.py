"""torch.compile's wrapper module and the model it wraps.

Checked on torch 2.13. Why private names: `torch.compile(model)` returns an OptimizedModule
(torch._dynamo.eval_frame) that holds the model as its child `_orig_mod`; torch has no public way to tell the
wrapper or reach the model inside, whose layers (and their names) are the ones hooks and names are about.
torch._dynamo is not imported here: it is looked up only once torch.compile has loaded it.
"""

from __future__ import annotations

import sys

from torch import nn


def is_compiled(module: nn.Module) -> bool:
    """Whether the module is torch.compile's wrapper around another."""
    return "_orig_mod" in module._modules


def uncompiled(model: nn.Module) -> nn.Module:
    """The model a torch.compile wrapper wraps; any other module itself."""
    frames = sys.modules.get("torch._dynamo.eval_frame")  # imported once torch.compile was called
    if frames is not None and isinstance(model, frames.OptimizedModule):
        return model._orig_mod
    return model
