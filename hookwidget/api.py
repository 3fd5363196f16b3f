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

    Every hook is removed when `fn` returns or raises. Each backward pass `fn` runs is a step (`t.steps`).

    Args:

    - `fn`: a function of no arguments: the code to trace (a training step, a forward and backward).
    - `modules`: an `nn.Module` or a list of them to hook; default: every module `fn` calls.
    - `capture`: `"full"` keeps each layer's input activation a and output gradient δ; `"summary"`
      statistics only; `"norms"` per-sample gradient norms only.
    - `budget_mb`: megabytes for kept tensors and .grad copies, default 512; `float("inf")` for no limit.
    - `include`, `exclude`: glob patterns on layer names.
    - `node_grads`: record the gradient norm at every graph node; default: for graphs of up to 256 nodes.
    - `backward_hooks`: also run full module backward hooks, to see grad_input.
    - `restore`: objects a rerun must put back that the code does not name: optimizers, schedulers,
      GradScalers, modules.
    - `show_hook_nodes`: show autograd's hook nodes (BackwardHookFunction) in the graph.
    - `batch_dim`: the dim of the model's inputs that holds the samples (default: the module's batch_first,
      else 0).

    Returns:

    The `Trace` of the run.

    Raises:

    - `TypeError`: `fn` is not callable, or an option name is unknown (the message names close ones).
    - `ValueError`: an option has a bad value (the message names a valid one).
    - Whatever `fn` raises, with every hook removed.

    Example:

    ```python
    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    t = hw.trace(step)
    t.layers["fc1"].a, t.layers["fc1"].delta, t.weight_grad("fc1"), t.per_sample_grad_norms()
    t.add_hook("fc1", "grad_zero"); t.rerun().diff(t)   # a what-if: model and optimizer are put back
    ```
    """
    check_callable(fn)
    return Session(fn, modules, options).run()


@contextmanager
def tracing(modules=None, **options) -> Iterator[Trace]:
    """Trace the code of a `with` block: `with hw.tracing() as t: ...`.

    The same as `hw.trace`, for code that is easier to write as a block than as a function. `t`'s record is
    assembled when the block ends (it is empty until then). A `hw.tracing` block runs once: `t.rerun()` needs
    `hw.trace` (a function it can call again).

    Args:

    - `modules`, `**options`: as `hw.trace`'s.

    Returns:

    A context manager whose `as` target is the `Trace`.

    Example:

    ```python
    with hw.tracing() as t:
        loss_fn(model(x), y).backward()
    t.weight_grad("fc1")
    ```
    """
    with Session(None, modules, options).recording() as t:
        yield t


# what hw.load opens, by the kind a file names (record/saved.py): kind -> loader(path, tree)
LOADERS: dict[str, Callable] = {"trace": lambda path, tree: Trace.from_data(tree, path),
                                "watch": lambda path, tree: SavedWatch.from_data(tree, path)}


def load(path):
    """Read back a saved Trace, a saved Watch, or a watch's `log_dir`, as read-only data.

    A file `t.save(path)` wrote comes back as a read-only Trace that answers the queries a live one does (layers,
    a, δ, graph, steps, weight_grad, per-sample gradients, notes, health, diff, its explorer); `rerun` and hooks
    need the code, and say so. A file `w.save(path)` wrote, or a folder that `hw.watch(model, log_dir=path)` wrote
    (up to its last complete shard), comes back as a read-only watch: stats, series, rows, lod, anomalies, notes,
    its view, and (from `w.save`) the kept Traces as loaded Traces. A folder is read lazily: its names, anomalies
    and summary now, its rows from the memory-mapped shards when asked.

    Args:

    - `path`: a file that `t.save` or `w.save` wrote, or a watch's `log_dir` folder.

    Returns:

    A read-only `Trace`, or a read-only watch (the same queries as a `Watch`).

    Raises:

    - `TypeError`: `path` is not a path.
    - `FileNotFoundError`: no file or folder at `path`.
    - `ValueError`: the file holds a kind of record this hookwidget does not open (upgrade hookwidget).

    Example:

    ```python
    t.save("step.pt")
    t2 = hw.load("step.pt")
    t2.weight_grad("fc1")
    ```
    """
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
