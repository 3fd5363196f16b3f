"""Every mistake and every odd input gets one clear line (issue 27): each case the issue lists, as a test.

A line is one line of at most ~300 characters that names the argument and the value, raised from the entry
point the user called (a short traceback). Results are checked against plain PyTorch.
"""

import importlib
import traceback

import pytest
import torch
from IPython.testing import globalipapp
from torch import nn
from torch.nn import functional as F

import hookwidget as hw
from hookwidget.views import export
from hookwidget.views.widget import HookWidget

ww = importlib.import_module("hookwidget.views.watch_widget")  # hookwidget.watch is also the function watch()
MAX_LINE = 300


def one_line(excinfo, *words, frames: int = 2) -> str:
    """The exception's text: one line, short, holding `words`; raised at most `frames` frames into hookwidget."""
    text = str(excinfo.value)
    assert "\n" not in text and len(text) <= MAX_LINE, text
    for w in words:
        assert w in text, (w, text)
    inside = [f for f in traceback.extract_tb(excinfo.tb) if "/hookwidget/" in f.filename]
    assert len(inside) <= frames, [f"{f.filename}:{f.lineno} {f.name}" for f in inside]
    return text


def mlp(frozen_first: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    if frozen_first:
        model[0].requires_grad_(False)  # LoRA's base layer, a frozen first half
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))

    def step():
        model.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()

    return model, x, y, step


# -- Python API ------------------------------------------------------------------------------------------------
def test_per_sample_norms_of_a_frozen_layer_are_refused_in_one_line():
    model, x, y, step = mlp(frozen_first=True)
    t = hw.trace(step)
    with pytest.raises(ValueError) as e:
        t.per_sample_grad_norms("0")
    one_line(e, "'0'", "no trainable parameters", "'2'")
    # the trainable layer beside it still answers, as plain PyTorch does sample by sample
    want = []
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        want.append(torch.cat([model[2].weight.grad.flatten(), model[2].bias.grad.flatten()]).norm())
    torch.testing.assert_close(t.per_sample_grad_norms("2"), torch.stack(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target, words", [
    (["0"], ["target must be a string", "list", "['0']"]),
    (None, ["target must be a string", "None"]),
    (3, ["target must be a string", "int 3"]),
    ("nope", ["unknown target 'nope'", "'0'"]),
])
def test_add_hook_targets_get_one_line(target, words):
    t = hw.trace(mlp()[3])
    with pytest.raises((TypeError, KeyError)) as e:
        t.add_hook(target, "grad_zero")
    one_line(e, *words)
    assert t.interventions == []


def test_add_hook_kinds_and_parameters_get_one_line():
    t = hw.trace(mlp()[3])
    with pytest.raises(ValueError) as e:
        t.add_hook("0", "grad_zro")
    one_line(e, "unknown intervention kind 'grad_zro'", "did you mean 'grad_zero'")
    with pytest.raises(TypeError) as e:
        t.add_hook("0", ["grad_zero"])
    one_line(e, "kind must be a string")
    with pytest.raises(ValueError) as e:
        t.add_hook("0", "grad_scale", factr=2)
    one_line(e, "factr", "factor")
    with pytest.raises(TypeError) as e:
        t.remove_hook(["0"], "grad_zero")
    one_line(e, "target must be a string")


def test_layers_keyerror_lists_close_names_first():
    torch.manual_seed(0)
    model = nn.Module()
    model.fc1, model.fc2, model.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)
    x = torch.randn(2, 3)
    t = hw.trace(lambda: model.head(model.fc2(model.fc1(x))).sum().backward(), modules=model)
    with pytest.raises(KeyError) as e:
        t.layers["fc3"]
    text = one_line(e, "no layer 'fc3'", "did you mean", frames=1)
    assert text.index("'fc1'") < text.index("'head'") and text.index("'fc2'") < text.index("'head'")
    assert t.layers["fc1"] is t.layer("fc1") and "fc3" not in t.layers and t.layers.get("fc3") is None
    with pytest.raises(TypeError) as e:
        t.layer(5)
    one_line(e, "name must be a string", "int 5")


def test_many_names_are_cut_to_a_few():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(40)])
    t = hw.trace(lambda: model(torch.randn(1, 2)).sum().backward())
    with pytest.raises(KeyError) as e:
        t.layers["39x"]
    one_line(e, "'39'", "more")


def test_query_arguments_get_one_line():
    t = hw.trace(mlp()[3])
    for call, words in [
        (lambda: t.weight_grad("zz"), ["no layer 'zz'"]),
        (lambda: t.weight_grad("0", step=7), ["step=7"]),
        (lambda: t.per_sample_grads("0", param="w"), ["no trainable w"]),
        (lambda: t.per_sample_grad_norms(3), ["name must be a string"]),
        (lambda: t.per_sample_grad_norms("0", loss_reduction="avg"), ["loss_reduction='avg'"]),
        (lambda: t.diff(3), ["diff(before) takes a Trace", "int 3"]),
        (lambda: t.health(explodng=10), ["health() takes vanishing= and exploding=", "'explodng'"]),
        (lambda: t.health(exploding=-1), ["exploding=-1", "> 0"]),
        (lambda: t.to_html(3), ["to_html(path) takes a file path", "int 3"]),
        (lambda: t.storage("1"), ["layer '1' (ReLU) has no weight", "'0'"]),
    ]:
        with pytest.raises((ValueError, KeyError, TypeError)) as e:
            call()
        one_line(e, *words)


def test_trace_options_and_modules_get_one_line():
    step = mlp()[3]
    with pytest.raises(TypeError) as e:
        hw.trace(step, modules=3)
    one_line(e, "modules=", "int 3", frames=3)
    with pytest.raises(TypeError) as e:
        hw.trace(step, budget=10)  # no prefix: budget is not budget_mb
    one_line(e, "unknown trace option 'budget'", "budget_mb", frames=3)
    with pytest.raises(ValueError) as e:
        hw.trace(step, capture="ful")
    one_line(e, "capture='ful'", frames=3)


def test_include_matching_no_module_is_refused_before_the_run():
    model, x, y, step = mlp()
    ran = []
    with pytest.raises(ValueError) as e:
        hw.trace(lambda: ran.append(step()), modules=model, include="encoder.*")
    one_line(e, "include='encoder.*'", "match no module", "'0'", frames=3)
    assert ran == []
    t = hw.trace(step, modules=model, include="0")  # a glob that matches still runs
    assert list(t.layers) == ["0"]


def test_diff_of_unrelated_traces_is_refused():
    a = hw.trace(mlp()[3])
    other = nn.Sequential(nn.Linear(5, 5))
    b = hw.trace(lambda: other(torch.randn(2, 5)).sum().backward())
    with pytest.raises(ValueError) as e:
        b.diff(a)
    one_line(e, "share no parameter", "t.rerun().diff(t)")
    a.add_hook("2", "grad_zero")
    d = a.rerun().diff(a)  # two runs of the same code: a diff
    assert "0.weight" in d.changed


def test_with_tracing_has_no_rerun_and_no_baseline_diff():
    model, x, y, step = mlp()
    with hw.tracing() as t:
        step()
    with pytest.raises(RuntimeError) as e:
        t.rerun()
    one_line(e, "with hw.tracing()", frames=1)
    with pytest.raises(ValueError) as e:
        t.diff()
    one_line(e, "t2.diff(t1)")


# -- hw.watch ------------------------------------------------------------------------------------------------
def watched_trace():
    model, x, y, step = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with hw.watch(model) as w:
        for _ in range(3):
            step()
            opt.step()
    return w.trace()


def test_a_trace_kept_by_watch_refuses_hooks_and_reruns_with_the_widgets_line():
    t = watched_trace()
    w = ww.KeptTraceWidget(t)
    w.sent = []
    w.send = lambda content, buffers=None: w.sent.append(content)
    w._on_msg(w, {"type": "add_hook", "target": "2", "kind": "grad_zero", "params": {}, "request_id": "r"}, [])
    widget_text = w.sent[-1]["text"].split("failed: ", 1)[1]
    with pytest.raises(ValueError) as e:
        t.add_hook("2", "grad_zero")
    assert one_line(e) == widget_text
    with pytest.raises(RuntimeError) as e:
        t.rerun()
    assert one_line(e, frames=1) == widget_text
    assert "hw.tracing" not in widget_text


@pytest.mark.parametrize("kwargs, kind, words", [
    ({"every": 0}, ValueError, ["every=0", "every=10"]),
    ({"every": 2.5}, ValueError, ["every=2.5"]),
    ({"every": True}, ValueError, ["every=True"]),
    ({"spike": "high"}, ValueError, ["spike='high'"]),
    ({"spike": float("nan")}, ValueError, ["spike=nan"]),
    ({"window": 1}, ValueError, ["window=1"]),
    ({"max_kept": -1}, ValueError, ["max_kept=-1"]),
    ({"batch": 0}, ValueError, ["batch=0"]),
    ({"trace_budget_mb": -5}, ValueError, ["trace_budget_mb=-5"]),
    ({"flight_recorder": "yes"}, ValueError, ["flight_recorder='yes'"]),
    ({"per_sample": 1}, ValueError, ["per_sample=1"]),
    ({"keep": 3}, TypeError, ["keep=3"]),
    ({"scaler": 3}, TypeError, ["scaler=3"]),
    ({"tensorboard": 3}, ValueError, ["tensorboard=3"]),
])
def test_watch_arguments_are_checked_at_the_boundary(kwargs, kind, words):
    model = nn.Linear(2, 2)
    with pytest.raises(kind) as e:
        hw.watch(model, **kwargs)
    one_line(e, *words, frames=2)
    assert not model._forward_hooks  # nothing was put on


def test_watch_of_a_non_module_names_the_value():
    with pytest.raises(TypeError) as e:
        hw.watch("model")
    one_line(e, "nn.Module", "'model'")


# -- the widget's messages -----------------------------------------------------------------------------------
def sent_after(w, content):
    w.sent = []
    w.send = lambda c, buffers=None: w.sent.append(c)
    w._on_msg(w, content, [])
    return w.sent


def deep(n: int, leaf=1):
    d = leaf
    for _ in range(n):
        d = {"a": d}
    return d


def test_widget_rejects_huge_ids_and_deep_messages_in_one_line():
    t = hw.trace(mlp()[3])
    w = HookWidget(t)
    for content in [
        {"type": "detail", "request_id": 10 ** 4999, "target": "0"},
        {"type": "detail", "request_id": 1, "target": "0", "x": deep(100_000)},
        deep(100_000),
        {"type": "add_hook", "request_id": 1, "target": "0", "kind": "grad_scale", "params": deep(100_000)},
        {"type": "detail", "request_id": 1, "target": "0" * 10 ** 6},
        {"type": "rerun", "request_id": [[[[[[1]]]]]]},
        {"type": "detail", "request_id": 1, "target": "0", **{f"k{i}": i for i in range(100_000)}},
    ]:
        [reply] = sent_after(w, content)
        assert reply["type"] == "status" and reply["state"] == "error"
        assert "\n" not in reply["text"] and len(reply["text"]) <= MAX_LINE
        assert reply["request_id"] in (None, 1)
    [reply] = sent_after(w, {"type": "detail", "request_id": 10 ** 60, "target": "0"})  # a large sane id
    assert reply["type"] == "detail" and reply["request_id"] == 10 ** 60


@pytest.mark.parametrize("query", ["weight_grad", "bias_grad", "per_sample_grads", "per_sample_grad_norms"])
def test_a_layer_without_parameters_says_so_not_no_factor_rule(query):
    t = hw.trace(mlp()[3])
    with pytest.raises(ValueError) as e:
        getattr(t, query)("1")  # the ReLU
    text = one_line(e, "layer '1' (ReLU) has no parameters, so no gradient to rebuild", "layers with some", "'0'")
    assert "factor rule" not in text and "requires_grad" not in text


# -- the compiled model --------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Using `torch.compile")  # torch's, on the wrapper's call, where it ran compiled
def test_compiled_model_refusal_is_one_line_and_counts(monkeypatch):
    """Where torch cannot run compiled code eagerly (no torch.compiler.set_stance before torch 2.6)."""
    monkeypatch.delattr(torch.compiler, "set_stance")
    torch.compiler.reset()
    model, x, y, _ = mlp()
    compiled = torch.compile(model, backend="eager")
    t = hw.trace(lambda: F.cross_entropy(compiled(x), y).backward())
    with pytest.raises(ValueError) as e:
        t.per_sample_grad_norms()
    one_line(e, "all parameters of a compiled model that ran compiled: call the uncompiled model in the code",
             "t.notes")
    assert any("torch.compile" in n for n in t.notes)  # the details stay in t.notes


# -- to_html's budget ----------------------------------------------------------------------------------------
def test_detail_budget_counts_what_is_written(monkeypatch):
    t = hw.trace(mlp()[3])
    full = export.details(t)["details"]
    written = {k: sum(map(len, v["buffers"])) + len(export.json_for_script(v["meta"])) for k, v in full.items()}
    budget = sum(written.values()) - 1  # one byte short of all of it, as written
    monkeypatch.setattr(export, "DETAIL_BUDGET", budget)
    d = export.details(t)
    assert d["details_note"]
    assert sum(sum(map(len, v["buffers"])) + len(export.json_for_script(v["meta"]))
               for v in d["details"].values()) <= budget


# -- the magics ------------------------------------------------------------------------------------------------
@pytest.fixture
def ip():
    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "hookwidget")
    model, x, y, _ = mlp()
    shell.user_ns.update(model=model, x=x, y=y, F=F)
    yield shell
    for k in ("model", "x", "y", "F", "ran", "_hooktrace", "_hookwatch"):
        shell.user_ns.pop(k, None)


@pytest.mark.parametrize("line, words", [
    ('%%hooktrace model --include "encoder.*"', ["include='encoder.*'", "match no module", "'0'"]),
    ("%%hooktrace model --budget 10", ["unrecognized arguments: --budget 10"]),
    ("%%hooktrace model --capture-x full", ["unrecognized arguments"]),
    ("%%hookwatch model --evry 5", ["unrecognized arguments: --evry 5"]),
    ("%%hookwatch model --ev 5", ["unrecognized arguments: --ev 5"]),
    ("%%hookwatch model --every 0", ["--every 0", "integer >= 1"]),
    ("%%hookwatch model --every x", ["invalid int value: 'x'"]),
    ("%%hooktrace model -o 1t", ["-o '1t' is not a Python variable name", "e.g. -o t1"]),
    ("%%hooktrace -o class", ["-o 'class' is not a Python variable name"]),
    ("%%hookwatch model -o my-watch", ["%%hookwatch: -o 'my-watch' is not a Python variable name"]),
])
def test_magic_lines_get_one_usage_line_before_the_cell_is_compiled(ip, capsys, line, words):
    cell = "ran = True\nthis is not python\n"  # a SyntaxError, had the cell been compiled
    result = ip.run_cell(f"{line}\n{cell}")
    out, err = capsys.readouterr()
    assert type(result.error_in_exec).__name__ == "UsageError", result.error_in_exec
    lines = [text for text in (out + err).splitlines() if text.strip()]
    assert len(lines) == 1 and lines[0].startswith("UsageError: %%hook"), lines
    assert len(lines[0]) <= MAX_LINE + 40 and "usage:" not in lines[0].split(";")[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "ran" not in ip.user_ns and ": 2;" not in lines[0]  # no argparse exit code


def test_magic_quoted_glob_matches_without_its_quotes(ip):
    ip.run_cell_magic("hooktrace", 'model --include "2" --no-widget',
                      "F.cross_entropy(model(x), y).backward()\n")
    assert list(ip.user_ns["_hooktrace"].layers) == ["2"]


# -- backward passes the stand-in cannot see, and compiled calls --------------------------------------------
def test_grad_imported_before_the_trace_is_named_not_called_no_backward():
    from torch.autograd import grad  # bound now, before the trace: the trace's stand-in is bypassed

    model, x, y, _ = mlp()

    def pinn():
        return grad(F.cross_entropy(model(x), y, reduction="sum"), list(model.parameters()))

    t = hw.trace(pinn)
    assert [n.id for n in t.note_records] == ["backward_unseen"] and t.steps == []
    assert "ran no backward" not in " ".join(t.notes) and "from torch.autograd import grad" in t.notes[0]
    out = model(x)  # δ of the last layer as plain PyTorch gives it
    want = torch.autograd.grad(F.cross_entropy(out, y, reduction="sum"), out)[0]
    torch.testing.assert_close(t.layers["2"].delta, want)
    assert all(p.grad is None for p in model.parameters()) and not t.param_grads  # autograd.grad leaves .grad
    for query in (lambda: t.weight_grad("2"), lambda: t.per_sample_grads("2")):
        with pytest.raises(ValueError) as e:
            query()
        one_line(e, "'2'", "did not see", "torch.autograd.grad(...)", frames=3)
    with pytest.raises(ValueError) as e:
        t.per_sample_grad_norms()
    one_line(e, "ran unseen", "t.notes", frames=3)


def test_grad_imported_before_the_trace_beside_a_seen_backward():
    from torch.autograd import grad

    model, x, y, step = mlp()

    def both():
        step()  # seen: a step
        grad(model(x).sum(), list(model.parameters()))  # not seen

    t = hw.trace(both)
    assert len(t.steps) == 1 and t.note_records[0] == hw.record.notes.Note("backward_unseen", {"stepped": True})
    assert t.notes[0].startswith("besides the passes in t.steps")


@pytest.mark.filterwarnings("ignore:Using `torch.compile")  # torch's, on the wrapper's call, where it ran compiled
def test_the_first_compiled_call_inside_a_trace_is_not_a_backward_pass(monkeypatch):
    """AOTAutograd calls torch.autograd.grad on fake tensors while it compiles: not the user's backward (it compiles
    inside a trace where torch cannot run compiled code eagerly: no torch.compiler.set_stance before torch 2.6)."""
    monkeypatch.delattr(torch.compiler, "set_stance")
    model, x, y, step = mlp()
    torch.compiler.reset()
    compiled = torch.compile(model, backend="aot_eager")
    t = hw.trace(lambda: F.cross_entropy(compiled(x), y, reduction="sum").backward())
    ids = [n.id for n in t.note_records]
    assert "autograd_grad_used" not in ids and "compiled" in ids
    assert [s.kind for s in t.steps] == ["backward"]
    traced = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()  # plain PyTorch
    for g, p in zip(traced, model.parameters()):
        torch.testing.assert_close(g, p.grad)


# -- include / exclude that match no module that ran (no modules given: known only once the code ran) ---------
class _Encoded(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.encoders = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x):
        return self.head(self.encoders(self.embed(x)))


def test_include_matching_no_module_that_ran_says_so_with_close_names_first():
    torch.manual_seed(0)
    model, x = _Encoded(), torch.randn(6, 4)
    t = hw.trace(lambda: model(x).sum().backward(), include="encoder.*")
    assert list(t.layers) == [] and t.note_records[0].id == "filters_matched_none"
    note = t.notes[0]
    assert "include='encoder.*' matched no module that ran" in note and "no layer called as a module" not in note
    assert note.index("'encoders'") < note.index("'embed'")  # the close match first
    assert not any("no layer called as a module" in n for n in t.notes)
    with pytest.raises(ValueError) as e:
        t.per_sample_grad_norms()
    one_line(e, "include='encoder.*' matched no module that ran", frames=3)
    model.zero_grad()
    model(x).sum().backward()  # the run itself is as plain PyTorch's: its .grad is kept
    torch.testing.assert_close(t.param_grads["head.weight"], model.head.weight.grad)
    t = hw.trace(lambda: model(x).sum().backward(), exclude="*")
    assert t.notes[0].startswith("exclude='*' excluded every module that ran")


def test_hooktrace_include_without_a_model_that_matches_nothing_says_so(ip):
    ip.run_cell_magic("hooktrace", '--include "encoder.*" --no-widget', "F.cross_entropy(model(x), y).backward()\n")
    t = ip.user_ns["_hooktrace"]
    assert list(t.layers) == [] and "include='encoder.*' matched no module that ran" in t.notes[0]
    assert "'Sequential', '0', '1'" in t.notes[0]
