"""A fuzz test of the public surface (issue 27): random options, targets, kinds and parameters, random front-end
messages, random magic lines, random orders of calls (trace, add_hook, rerun, remove_hook, diff, queries,
watch open/close). Every call either works or raises one line of a documented exception type, never a raw
TypeError / IndexError / RecursionError from inside hookwidget, and no hook is left on the model.

CI runs a bounded, derandomized number of examples (a few seconds each test); HOOKWIDGET_FUZZ_EXAMPLES=N runs N
random examples per test (the long run).
"""

import importlib
import math
import os
import re
import sys
import tempfile

import pytest
import torch
from helpers_faults import Registries
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import hookwidget as hw
from hookwidget.interventions import KINDS, InterventionError
from hookwidget.views.widget import HookWidget

ww = importlib.import_module("hookwidget.views.watch_widget")  # hookwidget.watch is also the function watch()

LONG = int(os.environ.get("HOOKWIDGET_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=LONG or 25, deadline=None, derandomize=not LONG, database=None,
                suppress_health_check=list(HealthCheck))
DOCUMENTED = (ValueError, TypeError, KeyError, RuntimeError)  # InterventionError is a RuntimeError
# What a raw error from inside reads like (Python's or torch's own words, not a line naming the fix).
RAW = re.compile(r"unhashable type|is not iterable|not subscriptable|has no attribute|expected Tensor as element|"
                 r"unsupported operand|object of type .* has no len|positional argument|Exceeds the limit|"
                 r"maximum recursion|index out of range|not supported between instances|cannot convert|"
                 r"must be real number, not|os.PathLike object|path should be string")
MAX_LINE = 320


def check_line(e: BaseException) -> None:
    """`e` is one documented line naming the fix, not a raw error from inside."""
    assert isinstance(e, DOCUMENTED), f"{type(e).__name__}: {e}"
    assert not isinstance(e, (IndexError, RecursionError, AttributeError)), f"{type(e).__name__}: {e}"
    text = e.args[0] if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str) else str(e)
    assert "\n" not in text and 0 < len(text) <= MAX_LINE, f"{type(e).__name__} ({len(text)} chars): {text[:600]}"
    assert not RAW.search(text), f"raw {type(e).__name__} from inside: {text}"


def attempt(call):
    """Run `call`: its result, or None where it raised one documented line."""
    try:
        return call()
    except InterventionError:
        raise  # a built-in kind's hook never fails on the numbers make() accepted
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        check_line(e)
        return None


# -- the model and its code ---------------------------------------------------------------------------------
def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    opt = torch.optim.SGD(model.parameters(), 0.01)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return model, step


MODEL, STEP = build()
BASE = hw.trace(STEP)
NAMES = [*BASE.layers, *list(BASE.graph.nodes)[:6]]
OTHER = nn.Linear(7, 2)
UNRELATED = hw.trace(lambda: OTHER(torch.randn(2, 7)).sum().backward())

# -- strategies -------------------------------------------------------------------------------------------------
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10),
                    st.integers(min_value=-(10 ** 400), max_value=10 ** 400), st.booleans())
values = st.one_of(numbers, st.none(), st.text(max_size=12), st.binary(max_size=6),
                   st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
targets = st.one_of(st.sampled_from(NAMES), st.text(max_size=16), st.integers(), st.floats(), st.none(),
                    st.lists(st.sampled_from(NAMES), max_size=2), st.binary(max_size=4))
kinds = st.one_of(st.sampled_from(sorted(KINDS)), st.text(max_size=14), st.integers(), st.none(),
                  st.lists(st.sampled_from(sorted(KINDS)), max_size=2))
param_names = st.one_of(st.sampled_from(["factor", "min", "max", "max_norm", "fn"]), st.text(max_size=6))
params = st.dictionaries(param_names, st.one_of(numbers, values, st.just(lambda *a: None)), max_size=3)
option_names = st.one_of(st.sampled_from(["capture", "budget_mb", "include", "exclude", "node_grads",
                                          "show_hook_nodes", "backward_hooks", "restore"]), st.text(max_size=10))
option_values = st.one_of(values, st.sampled_from(["full", "summary", "norms", "0", "2", "*", "encoder.*"]),
                          st.lists(st.sampled_from(["0", "2", "nope*"]), max_size=2), st.just(MODEL))
options = st.dictionaries(option_names, option_values, max_size=3)
watch_args = st.dictionaries(st.sampled_from(["every", "spike", "window", "max_kept", "batch", "trace_budget_mb",
                                              "flight_recorder", "per_sample", "keep", "scaler", "tensorboard"]),
                             st.one_of(numbers, values, st.sampled_from([1, 2, 3, 6.0])), max_size=3)

queries = st.tuples(st.sampled_from(["weight_grad", "bias_grad", "per_sample_grads", "per_sample_grad_norms",
                                     "supports", "layer", "storage"]),
                    st.one_of(targets, st.sampled_from(list(BASE.layers))),
                    st.dictionaries(st.sampled_from(["step", "param", "loss_reduction"]),
                                    st.one_of(values, st.sampled_from(["weight", "bias", "mean", "sum", 0, -1])),
                                    max_size=2))
SAVED = os.path.join(tempfile.gettempdir(), "hw_fuzz_trace.pt")  # what "save" writes and "load" reads back
SAVED_WATCH = os.path.join(tempfile.gettempdir(), "hw_fuzz_watch.pt")

ops = st.one_of(
    st.tuples(st.just("add_hook"), targets, kinds, params),
    st.tuples(st.just("remove_hook"), targets, kinds, st.booleans()),
    st.tuples(st.just("rerun")),
    st.tuples(st.just("diff"), st.sampled_from([None, "base", "latest", "unrelated", 3, "x"])),
    st.tuples(st.just("query"), queries),
    st.tuples(st.just("layers"), targets),
    st.tuples(st.just("watch"), watch_args),
    st.tuples(st.just("step")),
    st.tuples(st.just("close")),
    st.tuples(st.just("kept"), targets, kinds),
    st.tuples(st.just("health"), st.dictionaries(st.one_of(st.sampled_from(["vanishing", "exploding"]),
                                                           st.text(max_size=5)), values, max_size=2)),
    st.tuples(st.just("to_html"), st.one_of(values.filter(lambda v: not isinstance(v, (str, bytes))),
                                            st.just(os.path.join(tempfile.gettempdir(), "hw_fuzz.html")))),
    st.tuples(st.just("save"), st.one_of(values.filter(lambda v: not isinstance(v, (str, bytes))), st.just(SAVED))),
    st.tuples(st.just("load"), st.one_of(values.filter(lambda v: not isinstance(v, (str, bytes))),
                                         st.sampled_from([SAVED, SAVED_WATCH, tempfile.gettempdir(), __file__]))),
)


# -- the tests ---------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def _in_a_scratch_folder(tmp_path_factory):
    """Random paths (tensorboard=, to_html, save) land in a scratch folder, not in the checkout."""
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("fuzz"))
    yield
    os.chdir(here)


@FUZZ
@given(opts=options)
def test_random_options_work_or_raise_one_line(opts):
    regs = Registries(MODEL)
    before = regs.take()
    t = attempt(lambda: hw.trace(STEP, **opts))
    if t is not None:
        attempt(lambda: t.per_sample_grad_norms())
    attempt(lambda: _tracing(opts))
    assert regs.take() == before, "a hook was left"


def _tracing(opts):
    with hw.tracing(**opts) as t:
        STEP()
    return t


@FUZZ
@given(calls=st.lists(ops, min_size=1, max_size=8))
def test_random_orders_of_calls_work_or_raise_one_line(calls):
    regs = Registries(MODEL)
    before = regs.take()
    state = {"t": hw.trace(STEP), "w": None}
    try:
        for call in calls:
            _run(state, call)
    finally:
        if state["w"] is not None:
            state["w"].close()
    assert regs.take() == before, "a hook was left"


def _run(state: dict, call: tuple) -> None:
    t, op = state["t"], call[0]
    if op == "add_hook":
        attempt(lambda: t.add_hook(call[1], call[2], **call[3]))
    elif op == "remove_hook":
        attempt(lambda: t.remove_hook(call[1], call[2], missing_ok=call[3]))
    elif op == "rerun":
        new = attempt(t.rerun)
        state["t"] = new if new is not None else t
    elif op == "diff":
        before = {"base": BASE, "latest": t.session.latest, "unrelated": UNRELATED}.get(call[1], call[1])
        attempt(lambda: t.diff(before))
    elif op == "query":
        method, name, kwargs = call[1]
        attempt(lambda: getattr(t, method)(name, **kwargs))
    elif op == "layers":
        attempt(lambda: t.layers[call[1]])
    elif op == "health":
        attempt(lambda: t.health(**call[1]))
    elif op == "to_html":
        attempt(lambda: t.to_html(call[1]))
    elif op == "save":
        attempt(lambda: t.save(call[1]))
        if state["w"] is not None:
            attempt(lambda: state["w"].save(SAVED_WATCH if call[1] == SAVED else call[1]))
    elif op == "load":
        loaded = attempt(lambda: hw.load(call[1]))
        if isinstance(loaded, hw.Trace):
            state["t"] = loaded  # what follows runs on a read-only Trace: hooks and reruns refused in one line
    elif op == "watch" and state["w"] is None:
        state["w"] = attempt(lambda: hw.watch(MODEL, **call[1]))
    elif op == "step":
        STEP()
    elif op == "close" and state["w"] is not None:
        state["w"].close()
        kept = attempt(state["w"].trace) if state["w"].flight_recorder else None
        if kept is not None:
            attempt(lambda: kept.add_hook("0", "grad_zero"))
            attempt(kept.rerun)
        state["w"] = None
    elif op == "kept" and state["w"] is not None and state["w"].flight_recorder and state["w"].kept:
        kept = state["w"].trace()
        attempt(lambda: kept.add_hook(call[1], call[2]))
        attempt(kept.rerun)


def _deep(depth: int, leaf):
    for _ in range(depth):
        leaf = {"a": leaf} if depth % 2 else [leaf]
    return leaf


json_like = st.recursive(st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20)),
                         lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                 st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                         max_leaves=12)
request_ids = st.one_of(st.text(max_size=80), st.integers(), st.integers(min_value=10 ** 60, max_value=10 ** 6000),
                        json_like)
messages = st.one_of(
    json_like,
    st.builds(lambda kind, rid, target, k, p: {"type": kind, "request_id": rid, "target": target, "kind": k,
                                               "params": p},
              st.just("add_hook"), request_ids, targets, kinds, params),
    st.builds(lambda rid, target: {"type": "detail", "request_id": rid, "target": target}, request_ids, targets),
    st.builds(lambda rid, target, k: {"type": "remove_hook", "request_id": rid, "target": target, "kind": k},
              request_ids, targets, kinds),
    st.builds(lambda rid: {"type": "rerun", "request_id": rid}, request_ids),
    st.builds(lambda kind, rid, have: {"type": kind, "request_id": rid, "have": have, "step": have},
              st.sampled_from(["sync", "open", "detail"]), request_ids, json_like),
    st.builds(lambda kind, depth, size: {"type": kind, "request_id": 1, "target": "0" * size, "x": _deep(depth, 1)},
              st.sampled_from(["detail", "rerun"]), st.integers(0, 20_000), st.integers(0, 10_000)),
    st.builds(lambda text, enc: {"type": "detail", "request_id": 1, "target": text.encode(enc, "replace")},
              st.text(max_size=10), st.sampled_from(["utf-8", "utf-16", "latin-1"])),
)


@FUZZ
@given(msgs=st.lists(messages, min_size=1, max_size=6))
def test_random_widget_messages_get_a_reply_never_an_exception(msgs):
    regs = Registries(MODEL)
    before = regs.take()
    t = hw.trace(STEP)
    w = HookWidget(t)
    sent = []
    w.send = lambda content, buffers=None: sent.append(content)
    for m in msgs:
        sent.clear()
        w._on_msg(w, m, [])  # never raises
        assert sent, m
        for reply in sent:
            assert reply["type"] in ("status", "detail", "trace"), reply
            if reply["type"] == "status":
                assert "\n" not in reply["text"] and len(reply["text"]) <= 600, reply["text"][:800]
                assert not RAW.search(reply["text"]), reply["text"]
    t.session.interventions.clear()
    assert regs.take() == before, "a hook was left"


@FUZZ
@given(msgs=st.lists(messages, min_size=1, max_size=4))
def test_random_watch_widget_messages_get_a_reply(msgs):
    w = _closed_watch()
    widget = ww.WatchWidget(w)
    sent = []
    widget.send = lambda content, buffers=None: sent.append(content)
    for m in msgs:
        sent.clear()
        widget._on_msg(widget, m, [])
        assert sent, m
        for reply in sent:
            if reply["type"] == "status":
                assert "\n" not in reply["text"] and len(reply["text"]) <= 600
                assert not RAW.search(reply["text"]), reply["text"]


_WATCHED = []


def _closed_watch():
    if not _WATCHED:
        with hw.watch(MODEL) as w:
            for _ in range(3):
                STEP()
        _WATCHED.append(w)
    return _WATCHED[0]


flags = st.sampled_from(["--every", "--evry", "--ev", "--budget", "--budget-mb", "--capture", "--include",
                         "--exclude", "-o", "--out", "--no-widget", "--no-flight-recorder", "--node-grads",
                         "--no-node-grads", "--show-hook-nodes", "--backward-hooks", "--restore", "-x", "--"])
tokens = st.one_of(flags, st.sampled_from(["model", "nomodel", "x", "0", "-1", "2", "inf", "nan", "full", "ful",
                                           '"encoder.*"', "'2'", "*", '"', "T"]),
                   st.text(alphabet=st.characters(codec="ascii", exclude_characters="\n\r"), max_size=6))


@pytest.fixture(scope="module")
def ip():
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "hookwidget")
    shell.user_ns.update(model=MODEL, x=torch.randn(5, 4), STEP=STEP)
    yield shell
    for k in ("model", "x", "STEP", "_hooktrace", "_hookwatch", "T"):
        shell.user_ns.pop(k, None)


@FUZZ
@given(magic=st.sampled_from(["hooktrace", "hookwatch"]), words=st.lists(tokens, max_size=6))
def test_random_magic_lines_work_or_give_one_usage_line(ip, magic, words):
    from IPython.core.error import UsageError

    line = " ".join(words) + " --no-widget"
    if magic == "hookwatch" and not words[:1] or magic == "hookwatch" and words[0].startswith("-"):
        line = "model " + line
    regs = Registries(MODEL)
    before = regs.take()
    try:
        ip.run_cell_magic(magic, line, "STEP()\n")
    except UsageError as e:
        assert type(e) is UsageError and "\n" not in str(e) and len(str(e)) <= 400, str(e)
    except BaseException as e:
        check_line(e)
    assert regs.take() == before, "a hook was left"


def test_the_strategies_reach_what_they_should():
    """The fuzz's vocabulary covers the cases of the issue (a guard against a strategy that silently narrows)."""
    assert {"0", "2"} <= set(NAMES) and any("Backward" in n for n in NAMES)
    assert math.isinf(float("inf")) and sys.getrecursionlimit() < 20_000  # the deep messages are deeper than it
