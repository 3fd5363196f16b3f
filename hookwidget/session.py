"""How to run: the code, its options and the hooks to apply; runs it, and reruns it as a what-if.

A Session is shared by a trace, its reruns and the explorer showing them, so they agree on which
hooks are on (`interventions`) and which trace is current (`latest`); `baseline` is the first,
hook-free run that diffs compare with. Whoever shows the session (an explorer) asks to be told
of changes with `on_change`, so a hook added or a rerun made from a cell reaches the screen too.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from contextlib import contextmanager

from torch import nn

from hookwidget._torch.compile import is_compiled
from hookwidget.analysis import coverage
from hookwidget.capture.recording import Recording
from hookwidget.capture.tracer import Tracer
from hookwidget.interventions import KINDS, Intervention, make
from hookwidget.options import Options, check_modules, check_name, did_you_mean, shown, suggest
from hookwidget.record.assemble import assemble
from hookwidget.record.naming import name_filter, qualified_names
from hookwidget.record.run import Pending
from hookwidget.state import RunState, code_scope, related_objects
from hookwidget.trace import Trace

log = logging.getLogger("hookwidget")

# The one line for hooks and reruns on a Trace the flight recorder of hw.watch kept (its widget says the same).
KEPT_BY_WATCH = ("hooks and reruns on a step kept by hw.watch are not available here: trace that step with "
                 "hw.trace(step_fn) or %%hooktrace to try them")


class Session:
    """`kept_by`: "hw.watch" for the flight recorder's recordings, which take no hooks and no reruns."""

    def __init__(self, fn, modules=None, options=None, names=None, namespace=None, code=None, kept_by=None):
        try:  # a wrong option raises from here: the traceback is the user's line, hw.trace's and this one
            self.options = options if isinstance(options, Options) else Options.from_kwargs(**(options or {}))
            check_filters(modules, names, self.options)
        except (TypeError, ValueError) as e:
            raise e.with_traceback(None) from None
        self.fn = fn
        self.kept_by = kept_by
        self.modules = modules
        self.names = names  # the user's variable names of `modules` (from the magic)
        scope = code_scope(fn, namespace, code)  # what the code reads by name
        self.namespace = namespace if namespace is not None else scope  # to name leaf tensors like `x`
        self.interventions: list[Intervention] = []
        self._first = None  # weak reference to the first run's Trace: see latest
        self._is_baseline = False  # the first run started from a recorded state (hw.trace, %%hooktrace): a baseline
        self._rerun: Trace | None = None  # the latest rerun's Trace
        self._related = related_objects(scope)
        self._state: RunState | None = None  # what the first run started from
        self._listeners: list = []  # weak references to callbacks: see on_change

    # -- which traces it knows --------------------------------------------------------------------
    @property
    def latest(self) -> Trace | None:
        """The newest run's Trace: the latest rerun, else the first run (while someone holds it).

        The first run's Trace is held weakly. Every Trace points to its session; a session holding its first Trace
        back would make each trace a reference cycle, freed only by the garbage collector: its tensors held
        past `del t` and the collector's passes over every record (a tenth of a 100-layer trace's cost). A
        rerun is held (the explorer shows it, and nothing else may), and holds the first run (its `_baseline`)."""
        return self._rerun if self._rerun is not None else self.first

    @property
    def first(self) -> Trace | None:
        return self._first() if self._first is not None else None

    @property
    def baseline(self) -> Trace | None:
        """The hook-free first run that diffs compare with (None after `with hw.tracing()`, which runs once)."""
        return self.first if self._is_baseline else None

    def run(self) -> Trace:
        """The first run: records what it changes, so that reruns can start where it started."""
        state = RunState(self._related)
        for obj in self.options.restore:
            state.add(obj, eager=True)
        with self.recording(state) as t:
            self.fn()
        return t

    def rerun(self) -> Trace:
        """The same code again from the same starting point, with the interventions on; afterwards
        everything hookwidget put back is as it was before the rerun."""
        refused = self.no_rerun()
        if refused:
            raise RuntimeError(refused)
        now = self._state.snapshot()
        try:
            self._state.restore()
            with self.recording() as t:
                self.fn()
        finally:
            now.restore()
        return t

    def no_rerun(self) -> str:
        """Why this session cannot run its code again (one line), or ""."""
        if self.kept_by is not None:
            return KEPT_BY_WATCH
        if self.fn is None or self._state is None:
            return "rerun needs the code to run again: use hw.trace(fn) or %%hooktrace, not `with hw.tracing()`"
        return ""

    def tracer(self, state: RunState | None = None) -> Tracer:
        """A Tracer for one recording, with this session's options and hooks (its hooks go on when it is entered)."""
        opts = self.options
        layer_ivs, node_ivs = defaultdict(list), defaultdict(list)
        for iv in self.interventions:
            (layer_ivs if isinstance(iv.anchor, nn.Module) else node_ivs)[iv.anchor].append(iv)
        # the flight recorder's recordings take no fast rule's parts: most of its steps are dropped unread, and a kept
        # step's per-sample rows come from the same rules' rerun of the module (exact, checked alike)
        return Tracer(self.modules, capture=opts.capture, budget_mb=opts.budget_mb, node_grads=opts.node_grads,
                      backward_hooks=opts.backward_hooks, layer_interventions=layer_ivs, node_interventions=node_ivs,
                      state=state, fast_captures=self.kept_by is None, eager=self.kept_by is None,
                      wrappers=[m for m in self._related if isinstance(m, nn.Module) and is_compiled(m)],
                      batch_dim=opts.batch_dim)

    @contextmanager
    def recording(self, state: RunState | None = None):
        """Hooks on for the block; the Trace's record is assembled when it ends, whatever happens in it."""
        tracer = self.tracer(state)
        pending = Pending()
        t = Trace(self, pending, applied=self.interventions, baseline=self.baseline)
        failed = True
        try:
            with tracer:
                yield t
            failed = False
        finally:
            if tracer.records is not None:
                try:
                    self._ended(t, pending, tracer.records, tracer, state, failed)
                except Exception:
                    if not failed:
                        raise  # otherwise the code's own exception propagates, not hookwidget's

    def _ended(self, t: Trace, pending: Pending, rec, tracer: Tracer, state: RunState | None, failed: bool) -> None:
        """The run's record (`rec`: what `tracer` captured) assembled (record/assemble.py) and given to its Trace;
        coverage settled while the modules are as the run left them; the first run becomes the baseline."""
        opts = self.options
        if state is not None:
            for s in rec.steps:
                state.on_grads(s.before)
        pending.fill(assemble(rec, targets=tracer.targets, names=self.names, include=opts.include,
                              exclude=opts.exclude, namespace=self.namespace, applied=t.applied,
                              norms=tracer.norms_rule.result() if tracer.norms_rule is not None else None,
                              show_hook_nodes=opts.show_hook_nodes,
                              unrestorable=state.unrestorable() if state is not None else ()))
        coverage.settle(t)
        if state is not None:
            self._state, self._is_baseline = state, True
        if self._first is None:
            self._first = weakref.ref(t)
        elif not failed or self.latest is None:  # a rerun that failed does not replace one that ran
            self._rerun = t
        else:
            return
        self._changed("latest")

    # -- who is told of changes ------------------------------------------------------------------
    def on_change(self, callback) -> None:
        """Call `callback(what)` after hooks change ("hooks") and after a run becomes `latest` ("latest").

        Held weakly (a bound method through its object): an explorer that is closed stops listening,
        and a session never keeps a display alive."""
        ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else weakref.ref(callback)
        self._listeners.append(ref)

    def _changed(self, what: str) -> None:
        alive = []
        for ref in self._listeners:
            cb = ref()
            if cb is None:
                continue
            alive.append(ref)
            try:
                cb(what)
            except Exception as e:  # a display that fails must not fail the user's run or hook
                log.warning("hookwidget: a listener of the session failed on %r: %s: %s", what, type(e).__name__, e)
        self._listeners[:] = alive

    # -- hooks ---------------------------------------------------------------------------------
    def add_hook(self, target: str, kind: str, **params) -> Intervention:
        """Attach an intervention for the next rerun(); the same kind on the same target is replaced."""
        self._check_hook(target, kind)
        iv = make(target, kind, params)
        iv.anchor = self._resolve(target, kind)
        self._remove(target, kind)
        self.interventions.append(iv)
        self._changed("hooks")
        return iv

    def remove_hook(self, target: str, kind: str, missing_ok: bool = False) -> None:
        self._check_hook(target, kind)
        if self._remove(target, kind):
            self._changed("hooks")
        elif not missing_ok:
            on = [f"{iv.kind.name} on {iv.target!r}" for iv in self.interventions]
            raise KeyError(f"no {kind} hook on {shown(target)} to remove; attached: {_few(on)}")

    def _check_hook(self, target, kind) -> None:
        """The arguments every hook method takes, checked before anything looks them up."""
        if self.kept_by is not None:
            raise ValueError(KEPT_BY_WATCH)
        check_name("target", target)
        check_name("kind", kind, "'grad_zero'")
        if kind not in KINDS:
            raise ValueError(f"unknown intervention kind {kind[:80]!r}; choose one of: {', '.join(KINDS)}"
                             + did_you_mean(kind, KINDS))
        if self.baseline is None and (self.latest is None or not self.latest.record.done):
            raise RuntimeError("hooks apply to a finished trace: add them after the traced code has run")

    def _remove(self, target: str, kind: str) -> bool:
        before = len(self.interventions)
        self.interventions[:] = [iv for iv in self.interventions if not (iv.target == target and iv.kind.name == kind)]
        return len(self.interventions) < before

    def _resolve(self, target: str, kind: str):
        t = self.baseline or self.latest
        if target in t.layers:
            return t.layers[target].module
        if target in t.graph:
            if KINDS[kind].attach == "out":
                raise ValueError(f"{kind} replaces a layer's output: give a layer name, not node {target!r}")
            return target
        raise KeyError(f"unknown target {shown(target)}: give a layer name ({suggest(target, t.layers, 'layers')}) "
                       f"or a graph node id (e.g. {next(iter(t.graph.nodes), 'AddmmBackward0#0')!r})")


class Deferred:
    """One recording whose record is assembled on demand: the flight recorder's (hw.watch), which judges a step
    after it ended and drops most steps unassembled. `ended(captured, tracer)` gives it what the tracer captured,
    its Records or a settled Recording that a cut returned (`steps`: how many backward passes); `assemble()`
    makes its Trace and record once (finishing the Recording first) and returns the Trace. A dropped step makes
    neither."""

    def __init__(self, session: Session):
        self.session = session
        self.trace: Trace | None = None
        self.steps = 0
        self._captured = None

    def ended(self, captured, tracer: Tracer) -> None:
        if captured is not None:
            self.steps, self._captured = len(captured.steps), (captured, tracer)

    def assemble(self) -> Trace:
        if self.trace is None:
            pending = Pending()
            self.trace = Trace(self.session, pending, applied=self.session.interventions)
            held, self._captured = self._captured, None
            if held is not None:
                captured, tracer = held
                records = captured.finish(tracer.answers) if isinstance(captured, Recording) else captured
                self.session._ended(self.trace, pending, records, tracer, None, False)
        return self.trace


def _few(items: list, k: int = 4) -> str:
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "") if items else "none"


def check_filters(modules, names, options: Options) -> None:
    """include= / exclude= that leave none of the given modules are refused before anything runs, naming modules that
    exist (with no modules given, which modules the code calls is known only once it ran)."""
    roots = check_modules(modules)
    if roots is None or (options.include is None and options.exclude is None):
        return
    named = list(qualified_names([], roots, names)[0].values())
    if named and not any(map(name_filter(options.include, options.exclude), named)):
        given = ", ".join(f"{k}={v[0] if len(v) == 1 else list(v)!r}" for k, v in
                          (("include", options.include), ("exclude", options.exclude)) if v)
        pattern = (options.include or ("",))[0]
        raise ValueError(f"{given} match no module: {suggest(pattern, named, 'modules', 6)}; "
                         "e.g. include='fc*' (a glob on these names)")
