"""Options: the one place trace options are checked, before anything runs, with one line naming the fix."""

import dataclasses
import functools
import math

import pytest
import torch
from torch import nn

import hookwidget as hw
from hookwidget.options import Options, check_callable


def test_defaults_and_normalized_values():
    o = Options()
    assert (o.capture, o.budget_mb, o.include, o.exclude, o.node_grads, o.show_hook_nodes, o.backward_hooks,
            o.restore) == ("full", 512.0, None, None, None, False, False, ())
    model = nn.Linear(2, 2)
    o = Options.from_kwargs(budget_mb=100, include="fc*", exclude=["a", "b.*"], restore=model, node_grads=False)
    assert o.budget_mb == 100.0 and isinstance(o.budget_mb, float)
    assert o.include == ("fc*",) and o.exclude == ("a", "b.*")
    assert o.restore == (model,) and o.node_grads is False
    assert Options(budget_mb=float("inf")).budget_mb == math.inf
    assert Options(budget_mb=0).budget_mb == 0.0


def test_as_dict_holds_only_what_differs_from_the_defaults():
    assert Options().as_dict() == {}
    assert Options(capture="norms", budget_mb=512, include=["x"]).as_dict() == {"capture": "norms", "include": ("x",)}
    assert repr(Options(capture="summary")) == "Options(capture='summary')"


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Options().budget_mb = 1.0


BAD = [
    (dict(budget_mb="100"), 'budget_mb=\'100\' must be a number of megabytes >= 0, e.g. budget_mb=512 or '
                            'budget_mb=float("inf") for no limit'),
    (dict(budget_mb=float("nan")), "budget_mb=nan must be a number of megabytes >= 0"),
    (dict(budget_mb=-1), "budget_mb=-1 must be a number of megabytes >= 0"),
    (dict(budget_mb=True), "budget_mb=True must be a number"),
    (dict(budget_mb=10 ** 400), "too large for a float"),
    (dict(capture="ful"), "capture='ful' must be one of 'full', 'summary', 'norms', e.g. capture='summary'"),
    (dict(include=5), "include=5 must be a glob on layer names or a list of them, e.g. include="),
    (dict(exclude=["fc1", 2]), "exclude=['fc1', 2] must be a glob"),
    (dict(node_grads="no"), "node_grads='no' must be True, False or None"),
    (dict(show_hook_nodes=1), "show_hook_nodes=1 must be True or False"),
    (dict(backward_hooks="yes"), "backward_hooks='yes' must be True or False"),
    (dict(restore=torch.zeros(2)), "restore= takes modules, optimizers, LR schedulers and GradScalers"),
    (dict(restore=[nn.Linear(1, 1), "opt"]), "got a str: e.g. restore=[model, opt]"),
    (dict(restore=nn.Linear), "got a type"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(BAD)])
def test_bad_values_get_one_line_naming_option_value_and_example(kwargs, message):
    for make in (Options.from_kwargs, Options):  # __post_init__ checks, so the constructor does too
        with pytest.raises(ValueError) as e:
            make(**kwargs)
        assert message in str(e.value)
        assert "\n" not in str(e.value)


def test_unknown_names_list_the_valid_ones_and_suggest_a_close_one():
    with pytest.raises(TypeError) as e:
        Options.from_kwargs(budgetmb=3)
    text = str(e.value)
    assert "unknown trace option 'budgetmb'" in text and "did you mean budget_mb=?" in text
    assert all(f.name in text for f in dataclasses.fields(Options)) and "\n" not in text
    with pytest.raises(TypeError, match="unknown trace option 'zzz': valid options"):
        Options.from_kwargs(zzz=1)


def test_restore_takes_what_has_a_state_to_put_back():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    scaler = torch.amp.GradScaler("cpu")

    class Custom:
        def state_dict(self):
            return {}

        def load_state_dict(self, d):
            pass

    custom = Custom()
    assert Options(restore=[model, opt, sched, plateau, scaler, custom]).restore == (
        model, opt, sched, plateau, scaler, custom)


def test_every_field_has_help_for_the_magic():
    for f in dataclasses.fields(Options):
        assert f.metadata.get("help"), f.name


def _gen():
    yield 1


async def _coro():
    return 1


async def _agen():
    yield 1


@pytest.mark.parametrize("fn, message", [
    (nn.Linear(2, 2), "hw.trace takes a function to run, got Linear; for a block of code use `with hw.tracing()"),
    (3, "hw.trace takes a function to run, got int"),
    (_gen, "got a generator function _gen: wrap it, e.g. hw.trace(lambda: list(_gen()))"),
    (_coro, "got a coroutine function _coro: trace it as a block instead, e.g. `with hw.tracing() as t: await"),
    (_agen, "got an async generator function _agen"),
    (functools.partial(_gen), "got a generator function"),
])
def test_check_callable_names_the_fix(fn, message):
    with pytest.raises(TypeError) as e:
        check_callable(fn)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_plain_callables_pass():
    check_callable(lambda: None)
    check_callable(functools.partial(print, "x"))
    check_callable(Options)  # a class is callable and runs once


def test_trace_checks_options_and_fn_before_running_anything():
    ran = []

    def step():
        ran.append(1)

    with pytest.raises(ValueError, match="budget_mb='100'"):
        hw.trace(step, budget_mb="100")
    with pytest.raises(TypeError, match="did you mean budget_mb"):
        hw.trace(step, budgt_mb=1)
    with pytest.raises(TypeError, match="got a generator function"):
        hw.trace(_gen)
    with pytest.raises(ValueError, match="capture='x'"):
        with hw.tracing(capture="x"):
            ran.append(2)
    assert ran == []
