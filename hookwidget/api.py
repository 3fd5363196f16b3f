"""hw.trace and hw.tracing: run the user's code once under capture and hand back its Trace.

Floor: above session (which runs the code); imported by magic and the package's public names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

from hookwidget.options import check_callable, check_path
from hookwidget.record import saved
from hookwidget.session import Session
from hookwidget.trace import Trace
from hookwidget.watch.saved import SavedWatch


def trace(fn: Callable[[], object], modules=None, **options) -> Trace:
    """Run `fn()` once with hooks on every module it calls (or on `modules`) and return the Trace.

    Options: capture ("full": keep a and δ; "summary": statistics only; "norms": per-sample
    gradient norms only), budget_mb (memory for kept tensors and .grad copies, default 512;
    float("inf") for no limit), include / exclude (glob patterns on layer names), node_grads
    (gradient norm at every graph node; default: for graphs of up to 256 nodes), backward_hooks
    (also run full module backward hooks, to see grad_input), restore (objects a rerun must put
    back that the code does not name: optimizers, schedulers, GradScalers, modules).
    Every hook is removed when fn returns or raises. Each backward pass is a step (`t.steps`).

    Example::

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        t = hw.trace(step)
        t.layers["fc1"].a, t.layers["fc1"].delta, t.weight_grad("fc1"), t.per_sample_grad_norms()
        t.add_hook("fc1", "grad_zero"); t.rerun().diff(t)   # a what-if: model and optimizer are put back
    """
    check_callable(fn)
    return Session(fn, modules, options).run()


@contextmanager
def tracing(modules=None, **options) -> Iterator[Trace]:
    """`with hw.tracing() as t:` traces the block; `t`'s record is assembled when the block ends (empty until then)."""
    with Session(None, modules, options).recording() as t:
        yield t


# what hw.load opens, by the kind a file names (record/saved.py): kind -> loader(path, tree)
LOADERS: dict[str, Callable] = {"trace": lambda path, tree: Trace.from_data(tree, path),
                                "watch": lambda path, tree: SavedWatch.from_data(tree, path)}


def load(path):
    """A record that `t.save(path)` wrote, read back as data: a read-only Trace that answers the queries a live
    one does (layers, a, δ, graph, steps, weight_grad, per-sample gradients, notes, health, diff, its explorer);
    `rerun` and hooks need the code, and say so. A file `w.save(path)` wrote, or a folder that
    hw.watch(model, log_dir=path) wrote (up to its last complete shard), comes back as a read-only watch: stats,
    series, anomalies, notes, its view, and (from w.save) the kept Traces as loaded Traces."""
    check_path(path, "hw.load(path)", "hw.load('step.pt')")
    if os.path.isdir(path):
        return SavedWatch.from_log(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"hw.load: no file or folder {os.fspath(path)!r}; give the path that t.save(path), "
                                "w.save(path) or hw.watch(model, log_dir=path) wrote, e.g. hw.load('step.pt')")
    kind, tree = saved.read(path)
    loader = LOADERS.get(kind)
    if loader is None:
        raise ValueError(f"{path}: a saved {kind!r}, which this hookwidget does not open (it opens: "
                         f"{', '.join(LOADERS)}); upgrade hookwidget")
    return loader(path, tree)
