"""Compiled models trace (issue 41): a traced step runs eagerly (torch.compiler.set_stance("force_eager")), with the
same loss, .grad and layers, bitwise, as the uncompiled model's run, one note saying so, and the stance put back."""

import pytest
import torch
import torch.nn.functional as F
from IPython.testing import globalipapp
from torch import nn

import hookwidget as hw

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Counter:
    """A torch.compile backend that counts the graphs it is asked to compile (and runs them as they are)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.fixture
def compiled():
    torch.compiler.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    backend = Counter()
    yield model, torch.compile(model, backend=backend), x, y, backend
    torch.compiler.reset()


def step_of(model, call, x, y):
    def step():
        model.zero_grad()
        loss = F.mse_loss(call(x), y, reduction="sum")
        loss.backward()
        return loss

    return step


def eager_run(model, x, y):
    t = hw.trace(step_of(model, model, x, y))
    return t, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_as_eager(t, eager, grads, model):
    assert t.loss == eager.loss  # bitwise: the same ops, op by op
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert list(t.layers) == list(eager.layers) == ["Sequential", "0", "1", "2"]
    for name in ("0", "2"):
        assert torch.equal(t.layers[name].a, eager.layers[name].a)
        assert torch.equal(t.layers[name].delta, eager.layers[name].delta)
        assert torch.equal(t.weight_grad(name), grads[name + ".weight"])
    assert [n.id for n in t.note_records] == ["compiled_eager"]
    assert t.notes == ["torch.compile: Sequential ran eagerly while traced (torch.compiler.set_stance('force_eager')), "
                       "so its layers show; it runs compiled again after the trace"]


@pytest.mark.parametrize("modules", ["none", "compiled", "model"])
def test_a_compiled_model_traces_as_its_eager_run(compiled, modules):
    model, cmodel, x, y, backend = compiled
    eager, grads = eager_run(model, x, y)
    given = {"none": None, "compiled": cmodel, "model": model}[modules]
    t = hw.trace(step_of(model, cmodel, x, y), modules=given)
    assert_same_as_eager(t, eager, grads, model)
    assert backend.graphs == 0  # nothing was compiled while traced
    cmodel(x)
    assert backend.graphs == 1  # the stance was put back: the compiled model compiles, as before the trace


def test_a_model_compiled_before_the_trace_traces_too_and_the_users_stance_is_kept(compiled):
    model, cmodel, x, y, backend = compiled
    cmodel(x)  # compiled before the trace
    assert backend.graphs == 1
    eager, grads = eager_run(model, x, y)
    with torch.compiler.set_stance("force_eager"):  # the user's own stance, not the default, is what comes back
        assert_same_as_eager(hw.trace(step_of(model, cmodel, x, y)), eager, grads, model)
        torch.compiler.reset()
        cmodel(x)
        assert backend.graphs == 1
    cmodel(x)
    assert backend.graphs == 2


def test_a_rerun_of_a_compiled_step_runs_eagerly_too(compiled):
    model, cmodel, x, y, backend = compiled
    t = hw.trace(step_of(model, cmodel, x, y))
    t.add_hook("2", "grad_zero")
    t2 = t.rerun()
    assert t2.weight_grad("2").abs().sum() == 0 and list(t2.layers) == list(t.layers)
    assert backend.graphs == 0


def test_with_tracing_a_compiled_block_runs_eagerly_and_torch_warns_of_no_hooks(compiled):
    """`with hw.tracing()` too; torch's warning that global hooks fire for the wrapper is not shown (the wrapper's call
    is skipped), and the warning filters the code had are as before."""
    import warnings

    model, cmodel, x, y, backend = compiled
    eager, grads = eager_run(model, x, y)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        with hw.tracing() as t:
            step_of(model, cmodel, x, y)()
        assert warnings.filters == filters
    assert not [w for w in seen if "global hooks" in str(w.message)], [str(w.message) for w in seen]
    assert_same_as_eager(t, eager, grads, model)
    assert backend.graphs == 0


@pytest.fixture
def ip(compiled):
    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "hookwidget")
    model, cmodel, x, y, _ = compiled
    shell.user_ns.update(model=model, cmodel=cmodel, x=x, y=y)
    yield shell
    for k in ("T", "loss", "model", "cmodel", "x", "y"):
        shell.user_ns.pop(k, None)


CELL = "model.zero_grad()\nloss = F.mse_loss(cmodel(x), y, reduction='sum')\nloss.backward()\n"


@pytest.mark.parametrize("line", ["cmodel -o T --no-widget", "model -o T --no-widget", "-o T --no-widget"])
def test_the_magic_traces_a_compiled_model_given_either_way(ip, compiled, line, capsys):
    model, _, x, y, backend = compiled
    eager, grads = eager_run(model, x, y)
    ip.user_ns["F"] = F
    ip.run_cell_magic("hooktrace", line, CELL)
    t = ip.user_ns["T"]
    assert t.loss == eager.loss and all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert list(t.layers)[1:] == ["0", "1", "2"] and [n.id for n in t.note_records] == ["compiled_eager"]
    assert backend.graphs == 0


@pytest.mark.filterwarnings("ignore:Using `torch.compile")  # torch's, on the wrapper's call, where it ran compiled
def test_without_set_stance_one_line_says_what_to_do_and_it_works(compiled, monkeypatch):
    """torch < 2.6 has no torch.compiler.set_stance: the note says to call the uncompiled model in the traced code;
    done as written, the layers show."""
    model, cmodel, x, y, _ = compiled
    monkeypatch.delattr(torch.compiler, "set_stance")
    t = hw.trace(step_of(model, cmodel, x, y))
    [note] = [n for n in t.notes if "torch.compile" in n]
    assert "\n" not in note and "call the uncompiled model in the traced code (model(x), not cmodel(x)" in note
    assert list(t.layers) == []
    eager, grads = eager_run(model, x, y)
    followed = hw.trace(step_of(model, model, x, y))  # model(x), not cmodel(x)
    assert list(followed.layers) == ["Sequential", "0", "1", "2"] and followed.notes == []
    assert followed.loss == eager.loss


def test_two_traces_in_two_threads_ending_in_either_order_put_the_stance_back(compiled):
    """The stance is one for the process: trace A begins, trace B begins, A ends, B ends. Each putting back what
    it found left force_eager on for good (B had found A's), and every compiled model after ran eagerly."""
    import threading

    model, cmodel, x, y, backend = compiled
    a_began, b_began, a_ended = threading.Event(), threading.Event(), threading.Event()

    def a():
        with hw.tracing():
            cmodel(x).sum().backward()
            a_began.set()
            b_began.wait(30)
        a_ended.set()

    def b():
        a_began.wait(30)
        with hw.tracing():
            cmodel(x).sum().backward()
            b_began.set()
            a_ended.wait(30)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert backend.graphs == 0  # both ran eagerly
    cmodel(x)
    assert backend.graphs == 1  # and the stance is the one before them: the model compiles again
