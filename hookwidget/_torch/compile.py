"""torch.compile's wrapper module, the model it wraps, and running compiled code eagerly.

Checked on torch 2.13. Why private names: `torch.compile(model)` returns an OptimizedModule
(torch._dynamo.eval_frame) that holds the model as its child `_orig_mod`; torch has no public way to tell the
wrapper or reach the model inside, whose layers (and their names) are the ones hooks and names are about.
torch._dynamo is not imported here: it is looked up only once torch.compile has loaded it.

Why eagerly: hooks do not fire inside compiled code, so a traced step runs under the public
`torch.compiler.set_stance("force_eager")` (torch >= 2.6): the same ops, run op by op, every layer's hooks
called, and the compiled model as it was afterwards (the stance is put back, nothing is recompiled).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings

import torch
from torch import nn

# torch warns, on each call of a compiled wrapper while global module hooks are on, that they also fire for the
# wrapper: the tracer skips the wrapper's call, so the warning says nothing true of a trace (its text's start)
_WRAPPER_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


def is_compiled(module: nn.Module) -> bool:
    """Whether the module is torch.compile's wrapper around another."""
    return "_orig_mod" in module._modules


def uncompiled(model: nn.Module) -> nn.Module:
    """The model a torch.compile wrapper wraps; any other module itself."""
    frames = sys.modules.get("torch._dynamo.eval_frame")  # imported once torch.compile was called
    if frames is not None and isinstance(model, frames.OptimizedModule):
        return model._orig_mod
    return model


def can_run_eagerly() -> bool:
    """Whether this torch can run compiled code eagerly for a while (torch.compiler.set_stance, torch >= 2.6)."""
    return hasattr(torch.compiler, "set_stance")


@contextlib.contextmanager
def eagerly():
    """Compiled code (torch.compile'd modules and functions) runs eagerly in the block where this torch can
    (can_run_eagerly); the stance before it is put back however the block ends. The stance is one for the
    process: blocks that overlap (traces in two threads, ending in either order) share one force_eager, set by
    the first to begin and taken back by the last to end (each putting back what it found would leave the
    first one's force_eager in place)."""
    if not can_run_eagerly():
        yield
        return
    # one filter added and taken out again: warnings.catch_warnings would also undo the filters the code sets
    warnings.filterwarnings("ignore", message=_WRAPPER_WARNING, category=UserWarning)
    entry = warnings.filters[0]
    with _EAGER_LOCK:
        if not _EAGER:
            _EAGER.append(torch.compiler.set_stance("force_eager"))  # set now; its __exit__ puts back the one before
        _EAGER.append(None)
    try:
        yield
    finally:
        with _EAGER_LOCK:
            _EAGER.pop()
            if len(_EAGER) == 1:
                _EAGER.pop().__exit__(None, None, None)
        with contextlib.suppress(ValueError):
            warnings.filters.remove(entry)


_EAGER: list = []  # while blocks run eagerly: the stance setter, then one entry per running block
_EAGER_LOCK = threading.Lock()
