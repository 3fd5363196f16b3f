"""`%%hooktrace`: run a cell under hooks and show what it did."""

from __future__ import annotations

import shlex

from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from torch import nn

from .trace import Trace


class UsageError(IPythonUsageError, ValueError):
    """A bad %%hooktrace line; IPython shows its one-line message without a traceback."""


@magics_class
class HookTraceMagics(Magics):
    @magic_arguments()
    @argument("models", nargs="*", metavar="MODEL",
              help="names of nn.Modules in your namespace to hook (default: every module the cell calls)")
    @argument("-o", "--out", default="_hooktrace", metavar="NAME", help="bind the Trace to NAME (default _hooktrace)")
    @argument("--include", action="append", metavar="GLOB", help="keep only layers whose name matches (repeatable)")
    @argument("--exclude", action="append", metavar="GLOB", help="drop layers whose name matches (repeatable)")
    @argument("--budget-mb", type=float, default=512, metavar="N", help="memory for kept tensors (default 512)")
    @argument("--capture", default="full", choices=["full", "summary", "norms"],
              help="full: keep a and δ; summary: statistics only; norms: per-sample gradient norms only")
    @argument("--no-widget", action="store_true", help="print a text summary instead of the explorer")
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
            %%hooktrace model --capture norms    # per-sample gradient norms only (fast, little memory)
            %%hooktrace model --no-widget        # print a text summary instead of the explorer

        Then: t.layers["fc1"].a, t.weight_grad("fc1"), t.add_hook("fc1", "grad_zero"); t.rerun().
        The cell's variables stay in your namespace; errors in the cell propagate with every hook removed.
        """
        args = self._parse(line)
        ns = self.shell.user_ns
        modules, names = self._models(args.models, ns)
        code = compile(self.shell.transform_cell(cell), "<hooktrace>", "exec")

        def run_cell():
            exec(code, ns)

        options = {"budget_mb": args.budget_mb, "capture": args.capture}
        if args.include:
            options["include"] = args.include
        if args.exclude:
            options["exclude"] = args.exclude
        t = Trace(fn=run_cell, modules=modules, options=options, names=names, namespace=ns)
        try:
            t._run()
        finally:
            ns[args.out] = t
        if args.no_widget:
            print(repr(t))
            return None
        return t

    def _parse(self, line: str):
        try:
            return parse_argstring(self.hooktrace, line)
        except Exception as e:  # argparse exits; IPython wraps it
            raise UsageError(f"%%hooktrace {line!r}: {e}; see %%hooktrace? for the options") from None

    @staticmethod
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
