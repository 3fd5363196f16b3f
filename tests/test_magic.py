"""%%hooktrace through a real IPython shell."""

import re

import pytest
import torch
import torch.nn.modules.module as module_mod
from IPython.testing import globalipapp

import hookwidget as hw

CELL = """
model.zero_grad()
loss = 0.5 * ((model(x) - y) ** 2).sum()
loss.backward()
"""


@pytest.fixture
def ip(seed_mlp):
    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "hookwidget")
    model, x, y, _ = seed_mlp
    shell.user_ns.update(model=model, x=x, y=y)
    yield shell
    for k in ("T", "_hooktrace", "loss", "model", "x", "y"):
        shell.user_ns.pop(k, None)


def test_cell_runs_in_user_namespace_and_binds_the_trace(ip):
    ip.run_cell_magic("hooktrace", "-o T --no-widget", CELL)
    t = ip.user_ns["T"]
    assert isinstance(t, hw.Trace)
    assert "loss" in ip.user_ns  # the cell's variables persist
    assert torch.allclose(t.weight_grad("fc1"), ip.user_ns["model"].fc1.weight.grad, atol=1e-6)


def test_model_names_and_filters(ip):
    ip.run_cell_magic("hooktrace", "model --exclude fc2 --no-widget", CELL)
    t = ip.user_ns["_hooktrace"]
    assert list(t.layers) == ["model", "fc1"]


def test_rerun_reexecutes_the_cell(ip):
    ip.run_cell_magic("hooktrace", "-o T --no-widget", CELL)
    t = ip.user_ns["T"]
    t.add_hook("fc2", "grad_zero")
    t2 = t.rerun()
    assert torch.count_nonzero(ip.user_ns["model"].fc1.weight.grad) == 0
    assert t2.loss == t.loss


def test_errors_in_the_cell_propagate_with_hooks_removed(ip):
    before = len(module_mod._global_forward_hooks)
    with pytest.raises(ZeroDivisionError):
        ip.run_cell_magic("hooktrace", "--no-widget", "model(x)\n1 / 0\n")
    assert len(module_mod._global_forward_hooks) == before
    assert torch.autograd.backward.__module__ == "torch.autograd"


@pytest.mark.parametrize("line, message", [
    ("nosuchmodel", "no variable nosuchmodel in your namespace"),
    ("x", "x is a Tensor, not an nn.Module"),
    ("--budget-mb lots", "see %%hooktrace? for the options"),
])
def test_bad_lines_get_one_line_naming_the_fix(ip, line, message):
    from hookwidget.magic import UsageError

    with pytest.raises(UsageError, match=re.escape(message)):
        ip.run_cell_magic("hooktrace", line, CELL)


def test_help_documents_every_option():
    from hookwidget.magic import HookTraceMagics

    doc = HookTraceMagics.hooktrace.__doc__
    for opt in ("-o", "--include", "--exclude", "--budget-mb", "--capture", "--no-widget", "MODEL", "Example"):
        assert opt in doc, opt


def test_seed002_in_a_cell_names_the_leaf_and_shows_20(ip):
    cell = "x = torch.tensor(10.0, requires_grad=True)\ny = x**2\nz = y * 3\nz.backward()\n"
    ip.user_ns["torch"] = torch
    ip.run_cell_magic("hooktrace", "-o T --no-widget", cell)
    t = ip.user_ns["T"]
    assert t.param_grads["x"].item() == 60.0
    t.add_hook("PowBackward0#0", "grad_clamp", min=-1, max=1)
    t2 = t.rerun()
    assert ip.user_ns["x"].grad.item() == 20.0  # the seed says 6; 1 · 2 · 10 = 20
    assert t2.diff(t).param("x").after == 20.0
