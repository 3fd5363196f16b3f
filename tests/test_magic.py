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
    for k in ("T", "_hooktrace", "loss", "model", "x", "y", "ran", "h", "scale", "asyncio"):
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
    grads = {n: p.grad.clone() for n, p in ip.user_ns["model"].named_parameters()}
    t.add_hook("fc2", "grad_zero")
    t2 = t.rerun()
    assert torch.count_nonzero(t2.param_grads["fc1.weight"]) == 0  # the cell ran again, with the hook
    assert t2.loss == t.loss
    for n, p in ip.user_ns["model"].named_parameters():  # a what-if: .grad is put back afterwards
        assert torch.equal(p.grad, grads[n]), n


def test_errors_in_the_cell_propagate_with_hooks_removed(ip):
    before = len(module_mod._global_forward_hooks)
    with pytest.raises(ZeroDivisionError):
        ip.run_cell_magic("hooktrace", "--no-widget", "model(x)\n1 / 0\n")
    assert len(module_mod._global_forward_hooks) == before
    assert torch.autograd.backward.__module__ == "torch.autograd"
    assert isinstance(ip.user_ns["_hooktrace"], hw.Trace)  # what ran before the error is still bound
    assert "fc1" in ip.user_ns["_hooktrace"].layers


@pytest.mark.parametrize("line, message", [
    ("nosuchmodel", "no variable nosuchmodel in your namespace"),
    ("x", "x is a Tensor, not an nn.Module"),
    ("--budget-mb lots", "see %%hooktrace? for the options"),
])
def test_bad_lines_get_one_line_naming_the_fix(ip, line, message):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=re.escape(message)) as e:
        ip.run_cell_magic("hooktrace", line, CELL)
    assert type(e.value) is UsageError  # IPython shows only the message for this exact class


@pytest.mark.parametrize("line, message", [
    ("--budget-mb nan", "budget_mb=nan must be a number of megabytes >= 0"),
    ("--budget-mb -3", "budget_mb=-3.0 must be a number of megabytes >= 0"),
    ("--budget-mb lots", "invalid float value: 'lots'"),
    ("--capture ful", "invalid choice: 'ful'"),
    ("--node-grads=maybe", "ignored explicit argument 'maybe'"),
    ("nosuchmodel", "no variable nosuchmodel in your namespace"),
])
def test_usage_errors_print_one_line_and_run_nothing(ip, capsys, line, message):
    result = ip.run_cell(f"%%hooktrace {line}\nran = True\n")
    out, err = capsys.readouterr()
    assert type(result.error_in_exec).__name__ == "UsageError"
    lines = [text for text in (out + err).splitlines() if text.strip()]
    assert len(lines) == 1 and lines[0].startswith("UsageError: %%hooktrace"), lines
    assert message in lines[0]
    assert "ran" not in ip.user_ns


def test_option_flags_reach_the_trace(ip):
    ip.run_cell_magic("hooktrace", "-o T --no-widget --budget-mb inf --capture summary --no-node-grads "
                                   "--backward-hooks --show-hook-nodes --include fc1 --include fc2", CELL)
    o = ip.user_ns["T"].session.options
    assert (o.budget_mb, o.capture, o.node_grads, o.backward_hooks, o.show_hook_nodes, o.include) == (
        float("inf"), "summary", False, True, True, ("fc1", "fc2"))
    ip.run_cell_magic("hooktrace", "-o T --no-widget --node-grads", CELL)
    o = ip.user_ns["T"].session.options
    assert (o.node_grads, o.budget_mb, o.capture, o.backward_hooks) == (True, 512.0, "full", False)


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_an_error_in_the_cell_reads_like_one_in_a_plain_cell(ip, capsys):
    cell = "h = model(x)\nscale = 2\nh.sum() / undefined_name + scale\n"
    ip.run_cell(cell)
    plain = _strip_ansi("".join(capsys.readouterr()))
    result = ip.run_cell("%%hooktrace --no-widget\n" + cell)
    shown = _strip_ansi("".join(capsys.readouterr()))
    assert isinstance(result.error_in_exec, NameError)
    for text in (plain, shown):
        assert "h.sum() / undefined_name + scale" in text
        assert "NameError: name 'undefined_name' is not defined" in text
    assert "line 4" in shown  # the notebook cell's own line numbers: line 1 is %%hooktrace
    assert "Could not get source" not in shown
    assert "hookwidget" not in shown, shown


def test_the_cell_can_await_at_top_level(ip, seed_mlp):
    cell = "import asyncio\nawait asyncio.sleep(0.01)\n" + CELL
    ip.run_cell_magic("hooktrace", "-o T --no-widget", cell)
    t = ip.user_ns["T"]
    model = ip.user_ns["model"]
    assert torch.allclose(t.weight_grad("fc1"), model.fc1.weight.grad, atol=1e-6)
    assert t.rerun().loss == t.loss  # a rerun awaits again


@pytest.fixture
def no_running_loop():
    """A tool of another test (Playwright's sync API) may leave its loop marked running on this thread."""
    import asyncio

    saved = asyncio.events._get_running_loop()
    asyncio.events._set_running_loop(None)
    yield
    asyncio.events._set_running_loop(saved)


def test_await_works_while_an_event_loop_runs_on_this_thread(ip, no_running_loop):
    """As in ipykernel, where the magic is called from inside the kernel's running loop."""
    import asyncio

    async def kernel():
        ip.run_cell_magic("hooktrace", "-o T --no-widget", "await asyncio.sleep(0.01)\n" + CELL)
        return asyncio.get_running_loop()

    ip.user_ns["asyncio"] = asyncio
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(kernel()) is loop  # the kernel's loop is put back
    finally:
        loop.close()
    t = ip.user_ns["T"]
    assert torch.allclose(t.weight_grad("fc2"), ip.user_ns["model"].fc2.weight.grad, atol=1e-6)


def test_the_trace_is_displayed_not_returned(ip, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    result = ip.run_cell("%%hooktrace -o T\n" + CELL)
    assert result.result is None and result.error_in_exec is None
    assert shown == [ip.user_ns["T"]]


def test_out_history_keeps_no_trace(ip):
    import gc
    import weakref

    ip.run_cell("%%hooktrace -o T --no-widget\n" + CELL)
    ref = weakref.ref(ip.user_ns.pop("T"))
    gc.collect()
    assert ref() is None


def test_a_syntax_error_runs_nothing(ip):
    before = len(module_mod._global_forward_hooks)
    result = ip.run_cell("%%hooktrace --no-widget\nran = True\n1 +\n")
    assert isinstance(result.error_in_exec, SyntaxError)
    assert "ran" not in ip.user_ns
    assert len(module_mod._global_forward_hooks) == before


def test_help_documents_every_option():
    from hookwidget.magic import HookTraceMagics

    doc = HookTraceMagics.hooktrace.__doc__
    for opt in ("-o", "--include", "--exclude", "--budget-mb", "--capture", "--no-widget", "MODEL", "Example",
                "--node-grads", "--no-node-grads", "--backward-hooks", "--show-hook-nodes", "--budget-mb inf"):
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


def test_in_a_real_kernel_await_tracebacks_and_usage_errors_behave(monkeypatch):
    """ipykernel runs cells inside its own asyncio loop on the main thread: what globalipapp cannot show."""
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "%load_ext hookwidget",
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\nmodel = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), "
        "nn.Linear(3, 2))\nx = torch.randn(5, 4)",
        "%%hooktrace model -o t --no-widget\nimport asyncio\nawait asyncio.sleep(0.01)\n"
        "model(x).pow(2).sum().backward()",
        "print(sorted(t.layers), torch.allclose(t.weight_grad('0'), model[0].weight.grad, atol=1e-6))",
        "%%hooktrace --no-widget\nscale = 2\nmodel(x).sum() / undefined_name + scale",
        "%%hooktrace --budget-mb nan\nran = True",
        "print('ran' in globals(), asyncio.get_event_loop().is_running())",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    NotebookClient(nb, kernel_name="python3", timeout=60, startup_timeout=60, allow_errors=True).execute()
    out = [c.outputs for c in nb.cells]
    assert not [o for o in out[2] if o.output_type == "error"], out[2]
    assert out[3][0]["text"].strip() == "['0', '1', '2', 'model'] True"
    (error,) = [o for o in out[4] if o.output_type == "error"]
    tb = _strip_ansi("\n".join(error["traceback"]))
    assert error["ename"] == "NameError" and "model(x).sum() / undefined_name + scale" in tb
    assert "In[5], line 3" in tb and "hookwidget" not in tb and "Could not get source" not in tb
    (usage,) = out[5]
    assert usage["text"].startswith("UsageError: %%hooktrace: budget_mb=nan must be a number")
    assert usage["text"].count("\n") == 1
    assert out[6][0]["text"].strip() == "False True"  # nothing ran; the kernel's loop is still running


def test_tasks_the_cell_leaves_running_are_cancelled_and_the_loop_put_back(ip, no_running_loop):
    import asyncio

    ip.user_ns["asyncio"] = asyncio
    cell = ("async def forever():\n    await asyncio.sleep(3600)\n"
            "task = asyncio.create_task(forever())\nawait asyncio.sleep(0)\n" + CELL)
    ip.run_cell_magic("hooktrace", "-o T --no-widget", cell)
    assert ip.user_ns.pop("task").cancelled()
    with pytest.raises(RuntimeError, match="no running event loop"):
        asyncio.get_running_loop()
