"""`%%hooktrace`: run a cell under hooks and show what it did.

The cell should behave like a plain cell: its variables stay in the namespace, top-level `await`
works, and an exception reads like the same exception in a plain cell (the user's line with its
source, hookwidget's frames hidden). The trace options and their flags come from `Options`."""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import keyword
import shlex
import sys
from dataclasses import fields

from IPython.core.error import UsageError  # IPython prints one line only for this exact class
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from torch import nn

from hookwidget.options import Options
from hookwidget.session import check_filters


def _option_flags(func):
    """One argparse flag per trace option (`budget_mb` -> --budget-mb), help from the field's metadata.
    Flags default to None so that only what the line gives is passed on, and Options keeps the defaults."""
    for f in reversed([f for f in fields(Options) if f.metadata.get("magic", True)]):
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        default = "" if f.default in (None, False) else f" (default {f.default:g})" if isinstance(
            f.default, float) else f" (default {f.default})"
        kw = {"dest": f.name, "default": None, "help": meta["help"] + default}
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        elif meta.get("magic") == "name" or f.type == "str | None":  # one word: a variable's name, a layer's name
            kw.update(metavar=meta.get("metavar"))
        elif f.type == "bool | None":
            kw["action"] = argparse.BooleanOptionalAction
        elif f.type == "bool":
            kw.update(action="store_const", const=True)
        elif f.type == "float":
            kw.update(type=float, metavar=meta.get("metavar"))  # float("inf") parses "inf"
        elif f.type == "int | None":
            kw.update(type=int, metavar=meta.get("metavar"))
        else:
            kw.update(action="append", metavar=meta.get("metavar"))
        func = argument(flag, **kw)(func)
    return func


@magics_class
class HookTraceMagics(Magics):
    @magic_arguments()
    @argument("models", nargs="*", metavar="MODEL",
              help="names of nn.Modules in your namespace to hook (default: every module the cell calls)")
    @argument("-o", "--out", default="_hooktrace", metavar="NAME", help="bind the Trace to NAME (default _hooktrace)")
    @argument("--no-widget", action="store_true", help="print a text summary instead of the explorer")
    @_option_flags
    @cell_magic
    def hooktrace(self, line: str, cell: str):
        """Run the cell with hooks on every layer; the Trace (activations, gradients, autograd
        graph, (a, δ) factors) is bound to NAME and shown as the explorer.

        Examples::

            %%hooktrace                       # every module the cell calls; Trace in _hooktrace
            loss = loss_fn(model(x), y)
            loss.backward()

            %%hooktrace model -o t            # only model's modules; Trace bound to t
            %%hooktrace model --include "blocks.0.*" --exclude "*.dropout"
            %%hooktrace model --budget-mb 2048   # keep more a and δ before falling back to summaries
            %%hooktrace model --budget-mb inf    # no memory limit
            %%hooktrace model --capture norms    # per-sample gradient norms only (fast, little memory)
            %%hooktrace model --no-widget        # print a text summary instead of the explorer
            %%hooktrace model --decode tokenizer # the explorer's token strip shows each token's text

        Then: t.layers["fc1"].a, t.weight_grad("fc1"), t.add_hook("fc1", "grad_zero"); t.rerun().
        The cell's variables stay in your namespace and top-level `await` works; errors in the cell
        propagate with every hook removed, and the Trace of what ran is still bound to NAME.
        """
        __tracebackhide__ = True
        args = _parse(line)
        _check_out("%%hooktrace", args.out)
        ns = self.shell.user_ns
        options = _options(args, ns)
        modules, names = _models(args.models, ns)
        try:
            check_filters(modules, names, options)  # --include / --exclude that match no module: before the cell
        except ValueError as e:
            raise UsageError(f"%%hooktrace: {e}") from None
        code = compile_cell(self.shell, cell)  # a SyntaxError shows before anything runs
        run_cell = cell_runner(code, ns)

        def bind(t):
            ns[args.out] = t

        try:
            t = _trace(run_cell, modules, options, names, ns, code, bind)
        except BaseException as e:
            e.__traceback__ = _from_cell(e.__traceback__, code)
            raise  # the same exception, its cause and context kept
        if options.decode is not None:
            _check_token_ids(t)
        if args.no_widget:
            print(repr(t))
        else:
            from IPython.display import display

            display(t)
        return None  # not the Trace: Out[n] would keep every trace alive

    @cell_magic
    def hookwatch(self, line: str, cell: str):
        """%%hookwatch MODEL [-o NAME] [--every N] [--no-flight-recorder] [--no-widget]: run a training loop under
        hw.watch(MODEL); the Watch is bound to NAME (default _hookwatch). See hw.watch? for what it records.
        """
        return hookwatch_magic(self.shell, line, cell)


HookTraceMagics.hooktrace.parser.allow_abbrev = False  # flags are matched exactly: --budget is not --budget-mb


def _parse(line: str):
    try:  # split as a shell does: --include "blocks.0.*" is the glob blocks.0.*, without its quotes
        return HookTraceMagics.hooktrace.parser.parse_args(shlex.split(line))
    except Exception as e:  # argparse exits; IPython wraps it
        raise UsageError(f"%%hooktrace {line!r}: {e}; see %%hooktrace? for the options") from None


def _check_out(magic: str, name: str) -> None:
    """-o NAME binds a variable the user types next: a name Python cannot read back is refused before the cell runs."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"{magic}: -o {name[:60]!r} is not a Python variable name (letters, digits and _, not "
                         f"starting with a digit, not a keyword); e.g. -o t1")


def _options(args, ns: dict) -> Options:
    given = {f.name: getattr(args, f.name) for f in fields(Options) if getattr(args, f.name, None) is not None}
    for f in fields(Options):  # --decode tokenizer: the object of that name in the namespace
        if f.metadata.get("magic") == "name" and f.name in given:
            name = given[f.name]
            flag = "--" + f.name.replace("_", "-")
            if name not in ns:
                raise UsageError(f"%%hooktrace: {flag} {name[:60]!r}: no variable of that name in your namespace; "
                                 f"define it first, e.g. {f.name} = tokenizer, then {flag} {f.name}")
            given[f.name] = ns[name]
    try:
        return Options.from_kwargs(**given)
    except (TypeError, ValueError) as e:
        raise UsageError(f"%%hooktrace: {e}") from None


def _check_token_ids(t) -> None:
    """--decode turns token ids into text: where t.token_ids() finds none to turn (no embedding, or several that
    qualify), say so in one line as the cell ends, not only when the explorer's shares panel is opened."""
    if not t.steps:
        return
    try:
        t.token_ids(step=-1)  # the last step's: one call a step proves the layer
    except ValueError as e:
        first = str(e).splitlines()[0][:300]
        print(f"%%hooktrace --decode: {first} (in the magic: --token-layer NAME)", file=sys.stderr)


def _models(names, ns):
    if not names:
        return None, None
    missing = [n for n in names if n not in ns]
    if missing:
        raise UsageError(f"%%hooktrace: no variable {', '.join(map(shlex.quote, missing))} in your namespace; "
                         "name the nn.Module(s) to hook, e.g. %%hooktrace model")
    bad = [n for n in names if not isinstance(ns[n], nn.Module)]
    if bad:
        raise UsageError(f"%%hooktrace: {', '.join(f'{n} is a {type(ns[n]).__name__}' for n in bad)}, "
                         "not an nn.Module")
    return [ns[n] for n in names], list(names)


# -- running a cell's code like IPython does (reusable by other cell magics) ---------------------
def compile_cell(shell, cell: str):
    """The cell's code, compiled under a name IPython's traceback can show the source of, with the
    line numbers of the notebook cell (line 1 is the magic's line) and top-level await allowed."""
    __tracebackhide__ = True
    source = "\n" + shell.transform_cell(cell)
    filename = shell.compile.cache(source, _cell_number(shell))
    flags = shell.compile.flags | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    return compile(source, filename, "exec", flags=flags, dont_inherit=True)


def _cell_number(shell) -> int:
    """The n of In[n] of the running cell, so the traceback names the cell the user sees. It is the
    number IPython cached the calling cell under; execution_count may be one past it by now (ipykernel)."""
    numbers = getattr(shell.compile, "_filename_map", {})
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename in numbers:
            return numbers[frame.f_code.co_filename]
        frame = frame.f_back
    return shell.execution_count


def cell_runner(code, ns):
    """A plain zero-argument function that runs the cell's code in `ns` on the calling thread (the
    tracer records only its own thread), awaiting it there if it has a top-level await."""

    def run_cell():
        __tracebackhide__ = True
        result = eval(code, ns)
        if code.co_flags & inspect.CO_COROUTINE:
            _run_here(result)

    return run_cell


def _run_here(coro) -> None:
    """Run a coroutine to the end on a fresh event loop on this thread. In ipykernel a loop is already
    running here (asyncio.run would refuse), so it is unset for the while and put back afterwards.
    Like asyncio.run, tasks the cell started but did not await are cancelled when it ends."""
    __tracebackhide__ = True
    running = asyncio.events._get_running_loop()
    asyncio.events._set_running_loop(None)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
            asyncio.events._set_running_loop(running)


def _from_cell(tb, code):
    """The traceback from the cell's own frame on, so hookwidget's frames between the magic and the
    cell do not show; unchanged when the error came before the cell ran."""
    start = tb
    while start is not None and start.tb_frame.f_code is not code:
        start = start.tb_next
    return start if start is not None else tb


def _trace(run_cell, modules, options: Options, names, namespace, code, bind):
    """Run the cell once under hooks; the Trace is bound (by `bind`) even when the cell raises."""
    from hookwidget.session import Session

    __tracebackhide__ = True
    session = Session(run_cell, modules, options, names=names, namespace=namespace, code=code)
    try:
        return session.run()
    finally:
        if session.latest is not None:
            bind(session.latest)


# -- %%hookwatch ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse that raises its one-line message (no usage printed, no exit) and matches flags exactly."""

    def __init__(self, **kwargs):
        super().__init__(add_help=False, exit_on_error=False, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        raise ValueError(message)


def _watch_parser() -> argparse.ArgumentParser:
    """%%hookwatch's flags, with the help text `%%hookwatch?` and the docs' table of flags show."""
    p = _Parser(prog="%%hookwatch")
    p.add_argument("model", metavar="MODEL", help="the name of the nn.Module in your namespace to watch")
    p.add_argument("-o", "--out", default="_hookwatch", metavar="NAME",
                   help="bind the Watch to NAME (default _hookwatch)")
    p.add_argument("--every", type=int, default=1, metavar="N", help="record every N-th step (default 1)")
    p.add_argument("--no-flight-recorder", action="store_true", help="hw.watch(model, flight_recorder=False): "
                   "statistics only, no kept Traces")
    p.add_argument("--no-widget", action="store_true", help="print a text summary instead of the live view")
    return p


def hookwatch_magic(shell, line: str, cell: str):
    """`%%hookwatch MODEL [-o NAME] [--every N] [--no-flight-recorder] [--no-widget]`: run the cell with
    hw.watch(MODEL) on; the Watch is bound to NAME (default _hookwatch) even when the cell raises, and
    every hook is removed whatever happens. In a Jupyter kernel its live explorer is shown above the
    cell's output before the loop starts, and grows while it runs. Returns None (Out[n] would keep the
    watch and its Traces alive); the Watch is in NAME."""
    from hookwidget.watch import argument_problem, watch

    try:
        args = _watch_parser().parse_args(shlex.split(line))
    except (argparse.ArgumentError, ValueError) as e:
        raise _usage_error(f"%%hookwatch {line!r}: {e}; usage: %%hookwatch MODEL [-o NAME] [--every N] "
                           "[--no-flight-recorder] [--no-widget]") from None
    _check_out("%%hookwatch", args.out)
    ns = shell.user_ns
    if args.model not in ns:
        raise _usage_error(f"%%hookwatch: no variable {args.model!r} in your namespace; name the nn.Module "
                           "to watch, e.g. %%hookwatch model")
    model = ns[args.model]
    if not isinstance(model, nn.Module):
        raise _usage_error(f"%%hookwatch: {args.model} is a {type(model).__name__}, not an nn.Module")
    problem = argument_problem("every", args.every)  # before the cell is compiled, as %%hooktrace's options
    if problem:
        raise _usage_error(f"%%hookwatch: --every {args.every} {problem}")
    run_cell = cell_runner(compile_cell(shell, cell), ns)
    w = watch(model, every=args.every, flight_recorder=not args.no_flight_recorder)
    ns[args.out] = w
    if not args.no_widget:
        _show_watch(w)
    with w:
        run_cell()
    return None


def _show_watch(w) -> None:
    """Display the live explorer, in a Jupyter kernel only (a terminal would print the repr)."""
    from hookwidget.views.watch_widget import _kernel_shell

    if _kernel_shell() is not None:
        from IPython.display import display

        display(w)


def _usage_error(text: str) -> Exception:
    return UsageError(text)  # IPython prints one line for this exact class


# %%hookwatch? lists the flags, as %%hooktrace? does (its help made by magic_arguments)
if HookTraceMagics.hookwatch.__doc__:  # None under python -OO
    HookTraceMagics.hookwatch.__doc__ = HookTraceMagics.hookwatch.__doc__.rstrip() + "\n\n        Flags:\n\n" + \
        "\n".join(f"        {', '.join(a.option_strings) or a.metavar}: {a.help}" for a in _watch_parser()._actions)
