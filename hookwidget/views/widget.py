"""The explorer widget: traitlets and the handlers of the front-end's messages, nothing else.

Messages follow a fixed schema (DESIGN.md). Anything else is rejected with a logged one-line
error and a `status: error` reply; nothing from the front-end is ever evaluated, and only the
registered intervention kinds that take plain numbers can be set from it.
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
import weakref

import anywidget
import traitlets

from hookwidget.views import payload

log = logging.getLogger("hookwidget")

PAYLOAD_SCHEMA = pathlib.Path(__file__).with_name("payload_schema.json")  # Python's and the front-end's, both tested


def request_keys(widget: str) -> dict:
    """type -> the keys it must carry besides type and request_id, for each front-end message `widget` ("explorer",
    "watch") accepts: read from the payload schema, the one place the protocol is written down."""
    schema = json.loads(PAYLOAD_SCHEMA.read_text(encoding="utf-8"))
    return {t: set(schema["$defs"][f"request_{t}"]["required"]) - {"type", "request_id"}
            for t in schema["x-messages"][widget]["requests"]}


SCHEMA = request_keys("explorer")
MAX_TEXT = 1000  # longest accepted target / kind / request_id
# Bounds of any message the schema allows, checked before anything reads it: {"params": {"factor": 1.0}} is the
# deepest (2); the most keys any carries is 5. A message past them (a 100,000-deep nesting, a megabyte string,
# an integer of 5,000 digits) is rejected in a few hundred steps, with no recursion.
MAX_DEPTH, MAX_ITEMS, MAX_STRING, MAX_INT_BITS = 4, 64, 4 * MAX_TEXT, 256
ESM = pathlib.Path(__file__).resolve().parents[1] / "static" / "widget.js"  # built from js/ by `npm run build`
# Shown instead of the explorer when the bundle was never built (a source checkout without npm).
NOT_BUILT = ('export default { render({ el }) { el.textContent = "hookwidget: the front-end is not built '
             '(hookwidget/static/widget.js is missing): run `npm run build` or `pip install -e .`"; } };')


# A widget holds its trace weakly, so a trace that nothing else holds (`hw.trace(step).widget()`) is freed at once.
FREED = ("this trace was freed (nothing holds it any more): keep it in a variable, t = hw.trace(step), show t or "
         "t.widget(), and run the cell again")


class TraceFreed(RuntimeError):
    """The trace this widget showed was garbage-collected (the widget holds it weakly)."""


class MessageError(ValueError):
    """A front-end message that does not follow the schema."""


class HookWidget(anywidget.AnyWidget):
    """Module tree + grad_fn graph + detail panel + hook controls for one Trace; holds the newest after a rerun."""

    _esm = ESM if ESM.exists() else NOT_BUILT  # ANYWIDGET_HMR=1 reloads it when `npm run dev` rebuilds
    summary = traitlets.Dict().tag(sync=True)
    readonly = traitlets.Bool(False).tag(sync=True)
    diff = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)  # the last rerun's changes

    def __init__(self, trace, **kwargs):
        # The comm opens first, with the front-end's code (~180 kB) and no summary yet: the browser loads that
        # code while the summary is computed here, which then follows as a state update.
        super().__init__(**kwargs)
        # Held weakly: displaying a trace must not keep it (and its tensors) alive after `del t`. The session is
        # followed where it runs its code again; the flight recorder's (hw.watch) is shared by every kept step and
        # its `latest` moves on to the next one, so an explorer of a kept step stays on that step.
        session = getattr(trace, "session", None)
        follow = session is not None and getattr(session, "kept_by", None) is None
        self._session_ref = weakref.ref(session) if follow else None
        self._trace_ref = weakref.ref(trace)
        self._busy = False  # handling a front-end command: it updates the screen itself
        latest = getattr(self.session, "latest", None)
        if latest is not None and latest is not trace:
            self.sync()  # `t` shown after t.rerun(): the session's latest run and its diff, as an open explorer shows
        else:
            self.summary = payload.summary(trace)
        self.on_msg(self._on_msg)
        if self.session is not None and hasattr(self.session, "on_change"):
            self.session.on_change(self._on_session_change)  # held weakly by the session

    @property
    def session(self):
        """The session shared by the trace, its reruns and this widget (None once freed or without one)."""
        return self._session_ref() if self._session_ref is not None else None

    @property
    def trace(self):
        """The trace on screen: the session's latest after a rerun; raises once the user's trace was freed."""
        session = self.session
        t = getattr(session, "latest", None) if session is not None else None
        t = t if t is not None else self._trace_ref()
        if t is None:
            raise TraceFreed(FREED)
        return t

    @trace.setter
    def trace(self, t) -> None:
        self._trace_ref = weakref.ref(t)

    def sync(self) -> None:
        """Catch up with what Python did to the session since the last message: a rerun from Python
        (session.latest is newer than the trace on screen) or hooks added or removed with t.add_hook."""
        session = self.session
        latest = getattr(session, "latest", None) if session is not None else None
        if latest is not None and latest is not self._trace_ref():
            self.trace = latest
            self.summary = payload.summary(latest)
            baseline = getattr(session, "baseline", None)
            self.diff = payload.diff(baseline, latest) if baseline is not None and latest is not baseline else None
        elif session is not None or self._trace_ref() is not None:
            hooks = payload.hooks(self.trace)
            if hooks != self.summary.get("hooks"):
                self.summary = {**self.summary, "hooks": hooks}

    def _on_session_change(self, what: str) -> None:
        """Python changed the session (t.add_hook, t.remove_hook, t.rerun() in a cell): show it now."""
        if not self._busy:
            self.sync()

    def _on_msg(self, _widget, content, buffers) -> None:
        rid = reply_id(content)
        try:
            msg = validate(content)
        except MessageError as e:
            log.warning("hookwidget: rejected front-end message: %s", e)
            self._status(rid, "error", f"rejected message: {e}")
            return
        self._busy = True
        try:
            self.sync()
            getattr(self, "_do_" + msg["type"])(msg)
        except TraceFreed as e:
            self._status(rid, "error", str(e))
        except Exception as e:  # reported to the front-end, never swallowed
            text = _one_line(e)
            log.warning("hookwidget: %s failed: %s", msg["type"], text)
            self._status(rid, "error", f"{msg['type']} failed: {text}")
        finally:
            self._busy = False

    # -- handlers ----------------------------------------------------------------------------
    def _do_detail(self, msg: dict) -> None:
        meta, buffers = payload.detail(self.trace, msg["target"])
        self.send({"type": "detail", "request_id": msg["request_id"], "target": msg["target"], "meta": meta},
                  buffers)

    def _do_shares(self, msg: dict) -> None:
        """The samples' (and, for msg["sample"] >= 0, that sample's positions') shares of the step's gradient, of
        layer msg["layer"] ("" = the whole model): computed on this request only (views/payload/shares.py)."""
        from hookwidget.views.payload.shares import shares_view

        sample = msg["sample"] if msg["sample"] >= 0 else None
        meta, buffers = shares_view(self.trace, msg["layer"], sample, _ShareProgress(self, msg["request_id"]))
        self.send({"type": "shares", "request_id": msg["request_id"], "layer": msg["layer"], "meta": meta}, buffers)

    def _do_add_hook(self, msg: dict) -> None:
        from hookwidget.interventions import make

        make(msg["target"], msg["kind"], msg["params"], from_frontend=True)  # validates; raises one line
        owner = self.session or self.trace
        owner.add_hook(msg["target"], msg["kind"], **msg["params"])
        self.summary = {**self.summary, "hooks": payload.hooks(self.trace)}
        self._status(msg["request_id"], "done", f"{msg['kind']} on {msg['target']} added; rerun to apply")

    def _do_remove_hook(self, msg: dict) -> None:
        (self.session or self.trace).remove_hook(msg["target"], msg["kind"])
        self.summary = {**self.summary, "hooks": payload.hooks(self.trace)}
        self._status(msg["request_id"], "done", f"{msg['kind']} on {msg['target']} removed; rerun to apply")

    def _do_rerun(self, msg: dict) -> None:
        self._status(msg["request_id"], "running", "rerunning the traced code")
        start = time.perf_counter()
        before = self.trace
        session = self.session
        after = session.rerun() if session is not None else before.rerun()
        # Compared with the hook-free first run by default (the session's baseline).
        baseline = getattr(session, "baseline", None) or before
        changes = payload.diff(baseline, after)
        self.trace = after
        self.diff = changes
        if session is None:
            self._latest = after  # no session to hold it
        self.summary = payload.summary(after)
        secs = time.perf_counter() - start
        self.send({"type": "trace", "request_id": msg["request_id"], "diff": changes, "seconds": round(secs, 3)})
        self._status(msg["request_id"], "done", f"rerun done in {secs:.2f} s: loss "
                     f"{_fmt(changes['loss_before'])} → {_fmt(changes['loss_after'])}, "
                     f"{len(changes['changed_modules'])} module(s) changed")

    def _repr_mimebundle_(self, **kwargs):
        """The widget view, plus a static HTML snapshot for a front-end that has no model to render
        (export.snapshot): a notebook reopened untrusted, nbconvert, GitHub."""
        bundle = super()._repr_mimebundle_(**kwargs)
        data, meta = bundle if isinstance(bundle, tuple) else (bundle, None)
        if data is None:
            return bundle
        from hookwidget.views.export import snapshot

        try:
            data = {**data, "text/html": snapshot(self.summary, self.diff)}
        except Exception as e:  # the snapshot is a courtesy: never lose the widget over it
            log.warning("hookwidget: no static snapshot: %s", _one_line(e))
        return (data, meta) if meta is not None else data

    def to_html(self, path):
        """Write what is on screen (the latest trace, its hooks and the last rerun's diff) as a standalone page."""
        from hookwidget.views.export import to_html

        return to_html(self.trace, path, diff=self.diff)

    def _status(self, request_id, state: str, text: str) -> None:
        self.send({"type": "status", "request_id": request_id, "state": state, "text": text})


class _ShareProgress:
    """How far the shares are: a "running" status with the fraction done, where they take more than AFTER_S
    seconds (a small model's answer comes before any), then at most one every EVERY_S seconds. The kernel sends it
    while it computes (a comm message goes out at once); the panel shows it in place of its "computing" line."""

    AFTER_S, EVERY_S = 0.5, 0.25

    def __init__(self, widget, request_id):
        self.widget, self.request_id = widget, request_id
        self.start = self.last = time.perf_counter()

    def __call__(self, fraction: float) -> None:
        now = time.perf_counter()
        if now - self.start < self.AFTER_S or now - self.last < self.EVERY_S:
            return
        self.last = now
        self.widget.send({"type": "status", "request_id": self.request_id, "state": "running",
                          "text": f"computing the shares: {fraction:.0%}", "fraction": round(fraction, 3)})


def reply_id(content):
    """The message's request_id to answer with, where it is a sane one (a string or integer of at most 64
    characters), else None: read before the message is validated, so an error reply can still name it."""
    rid = content.get("request_id") if isinstance(content, dict) else None
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return None
    if isinstance(rid, int) and rid.bit_length() > 256:  # too long anyway, and str() of it may be refused
        return None
    return rid if len(str(rid)) <= 64 else None


def check_bounds(content) -> None:
    """MessageError for a message deeper, longer or larger than any the schema allows (MAX_DEPTH, MAX_ITEMS,
    MAX_STRING, MAX_INT_BITS), walked with a stack, not recursion, and stopped at the first item past a bound."""
    stack, seen = [(content, 0)], 0
    while stack:
        obj, depth = stack.pop()
        seen += 1
        if depth > MAX_DEPTH or seen > MAX_ITEMS:
            raise MessageError(f"message too {'deep' if depth > MAX_DEPTH else 'large'}: no message nests more "
                               f"than {MAX_DEPTH} levels or holds more than {MAX_ITEMS} items")
        if isinstance(obj, dict):
            if len(obj) > MAX_ITEMS:
                raise MessageError(f"message too large: an object of {len(obj):,} keys (at most {MAX_ITEMS})")
            stack += [(k, depth + 1) for k in obj] + [(v, depth + 1) for v in obj.values()]
        elif isinstance(obj, (list, tuple)):
            if len(obj) > MAX_ITEMS:
                raise MessageError(f"message too large: a list of {len(obj):,} items (at most {MAX_ITEMS})")
            stack += [(v, depth + 1) for v in obj]
        elif isinstance(obj, (str, bytes, bytearray, memoryview)) and len(obj) > MAX_STRING:
            raise MessageError(f"message too large: a text of {len(obj):,} characters (at most {MAX_STRING})")
        elif isinstance(obj, int) and obj.bit_length() > MAX_INT_BITS:
            raise MessageError(f"message too large: an integer of {obj.bit_length():,} bits")


def check_envelope(content, schema: dict) -> str:
    """The message's type if it is an object with exactly the keys `schema` gives its type (plus type and
    request_id) and a sane request_id, else MessageError naming what is wrong (front-end messages of every
    widget go through it). Its bounds are checked first (check_bounds)."""
    if not isinstance(content, dict):
        raise MessageError(f"expected an object, got {type(content).__name__}")
    check_bounds(content)
    kind = content.get("type")
    if not isinstance(kind, str) or kind not in schema:
        raise MessageError(f"unknown type {str(kind)[:80]!r}; expected one of {', '.join(schema)}")
    expected = schema[kind] | {"type", "request_id"}
    if set(content) != expected:
        extra, missing = set(content) - expected, expected - set(content)
        raise MessageError(f"{kind}: " + "; ".join(
            part for part in (f"unknown key(s) {', '.join(sorted(map(str, extra)))[:200]}" if extra else "",
                              f"missing key(s) {', '.join(sorted(missing))}" if missing else "") if part))
    if reply_id(content) is None:
        raise MessageError(f"{kind}: request_id must be a string or integer of at most 64 characters")
    return kind


def validate(content) -> dict:
    """The message if it follows the schema exactly, else MessageError naming what is wrong."""
    kind = check_envelope(content, SCHEMA)
    for key in ("target", "kind"):
        if key in content and (not isinstance(content[key], str) or not 0 < len(content[key]) <= MAX_TEXT):
            raise MessageError(f"{kind}: {key} must be a non-empty string of at most {MAX_TEXT} characters")
    if "layer" in content and (not isinstance(content["layer"], str) or len(content["layer"]) > MAX_TEXT):
        raise MessageError(f"{kind}: layer must be a layer's name ('' for the whole model) of at most {MAX_TEXT} "
                           "characters")
    if "sample" in content and (isinstance(content["sample"], bool) or not isinstance(content["sample"], int)
                                or content["sample"] < -1):
        raise MessageError(f"{kind}: sample must be an integer >= 0, or -1 for none")
    if "kind" in content:
        from hookwidget.interventions import KINDS

        spec = KINDS.get(content["kind"])
        if spec is None:
            raise MessageError(f"unknown intervention kind {content['kind'][:80]!r}; choose one of: "
                               + ", ".join(k for k, s in KINDS.items() if not s.python_only))
        if spec.python_only and kind == "add_hook":
            raise MessageError(f"{spec.name!r} takes a Python function: set it from Python with t.add_hook(...)")
    if "params" in content:
        params = content["params"]
        if not isinstance(params, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in params.items()):
            raise MessageError(f"{kind}: params must map parameter names to numbers")
    return content


def _one_line(e: BaseException) -> str:
    """The error's first line; the class name only where the message alone would not say what went wrong
    (a bad value or unknown name reads as its message: "grad_clamp: min=1.0 is above max=-1.0")."""
    raw = e.args[0] if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str) else str(e)
    text = raw.strip().splitlines()
    if text and isinstance(e, (ValueError, KeyError, TypeError)):
        return text[0][:500]
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
