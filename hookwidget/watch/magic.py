"""`%%hookwatch MODEL [-o NAME]`: run a cell (a training loop) under hw.watch and bind the Watch to NAME."""

from __future__ import annotations

import argparse
import shlex

from torch import nn


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="%%hookwatch", add_help=False, exit_on_error=False)
    p.add_argument("model", metavar="MODEL")
    p.add_argument("-o", "--out", default="_hookwatch", metavar="NAME")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--no-flight-recorder", action="store_true")
    p.add_argument("--no-widget", action="store_true")
    return p


def hookwatch_magic(shell, line: str, cell: str):
    """`%%hookwatch MODEL [-o NAME] [--every N] [--no-flight-recorder] [--no-widget]`: run the cell with
    hw.watch(MODEL) on; the Watch is bound to NAME (default _hookwatch) even when the cell raises, and
    every hook is removed whatever happens. In a Jupyter kernel its live explorer is shown above the
    cell's output before the loop starts, and grows while it runs. Returns None (Out[n] would keep the
    watch and its Traces alive); the Watch is in NAME."""
    from . import watch

    try:
        args = _parser().parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit, ValueError) as e:
        raise _usage_error(f"%%hookwatch {line!r}: {e}; usage: %%hookwatch MODEL [-o NAME] [--every N] "
                           "[--no-flight-recorder] [--no-widget]") from None
    ns = shell.user_ns
    if args.model not in ns:
        raise _usage_error(f"%%hookwatch: no variable {args.model!r} in your namespace; name the nn.Module "
                           "to watch, e.g. %%hookwatch model")
    model = ns[args.model]
    if not isinstance(model, nn.Module):
        raise _usage_error(f"%%hookwatch: {args.model} is a {type(model).__name__}, not an nn.Module")
    run_cell = _runner(shell, cell, ns)
    w = watch(model, every=args.every, flight_recorder=not args.no_flight_recorder)
    ns[args.out] = w
    if not args.no_widget:
        _show(w)
    with w:
        run_cell()
    return None


def _show(w) -> None:
    """Display the live explorer, in a Jupyter kernel only (a terminal would print the repr)."""
    from .widget import _kernel_shell

    if _kernel_shell() is not None:
        from IPython.display import display

        display(w)


def _runner(shell, cell: str, ns):
    """The cell as a function: through %%hooktrace's helpers where they are there (tracebacks that show the
    cell's lines, top-level await), else compiled plainly."""
    try:
        from ..magic import cell_runner, compile_cell
    except Exception:  # magic.py without them
        code = compile(shell.transform_cell(cell), "<hookwatch>", "exec")
        return lambda: exec(code, ns)
    return cell_runner(compile_cell(shell, cell), ns)


def _usage_error(text: str) -> Exception:
    from IPython.core.error import UsageError  # IPython prints one line for this exact class

    return UsageError(text)
