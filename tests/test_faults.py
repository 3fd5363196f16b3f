"""The fault matrix (issue 9): whatever the cell does, no hook outlives the trace, no exception is
swallowed, the user's objects are left as the cell left them, and observing changes nothing bitwise.

Every case runs the same cell twice from the same seed, once plainly and once under hw.trace
(helpers_faults.observe), and compares loss, every .grad, buffers and the RNG with torch.equal.
Where (a, δ) factors exist, weight_grad must equal autograd's .grad or the Trace must say why not.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

import hookwidget as hw
from hookwidget.capture import budget
from hookwidget.capture import tracer as capture
from hookwidget.record import graph

sys.path.insert(0, str(Path(__file__).parent))  # helpers_faults, whether or not tests/ is a package
from helpers_faults import Registries, assert_same, observe, run_cell  # noqa: E402


# -- models ------------------------------------------------------------------------------------
def mlp():
    return {"model": nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)),
            "x": torch.randn(5, 6), "y": torch.randn(5, 3)}


def step(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y, reduction="sum")
    loss.backward()
    return loss.detach()


class InPlaceAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        h += 1.0
        h.mul_(0.5)
        return self.fc2(torch.relu_(h))


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.rec, self.head = nn.Linear(6, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 8)
        for _ in range(4):
            h = torch.tanh(self.inp(x) + self.rec(h))
        return self.head(h)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx))).sum(1)


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.fc1, self.fc2, self.reentrant = nn.Linear(6, 8), nn.Linear(8, 3), reentrant

    def forward(self, x):
        h = checkpoint.checkpoint(lambda t: torch.relu(self.fc1(t)), x, use_reentrant=self.reentrant)
        return self.fc2(h)


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return {"logits": self.fc2(torch.relu(self.fc1(x))), "aux": x.sum()}


class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)["logits"]


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.relu(h)), h


class KwargsCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(input=torch.relu(self.fc1(input=x)))


class NormDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.drop, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.4), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.attn = nn.Linear(6, 8), nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = self.proj(x)
        return self.attn(h, h, h, need_weights=False)[0].mean(1)


def seq_build(factory, x_shape=(5, 6), y_shape=(5, 3), train=True, x_grad=False):
    def build():
        model = factory()
        model.train(train)
        return {"model": model, "x": torch.randn(*x_shape).requires_grad_(x_grad), "y": torch.randn(*y_shape)}

    return build


def tied_build():
    return {"model": Tied(), "x": torch.randint(0, 10, (5, 4)), "y": torch.randn(5, 10)}


# -- cells -------------------------------------------------------------------------------------
def forward_only(model, x, y):
    return model(x).detach()


def under_no_grad(model, x, y):
    with torch.no_grad():
        return model(x)


def under_inference_mode(model, x, y):
    with torch.inference_mode():
        return model(x).clone()


def retain_graph_twice(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y, reduction="sum")
    loss.backward(retain_graph=True)
    loss.backward()
    return loss.detach()


def double_backward(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y, reduction="sum")
    loss.backward(create_graph=True)
    penalty = sum((p.grad ** 2).sum() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    penalty.backward()
    return loss.detach(), penalty.detach()


def autograd_grad(model, x, y):
    loss = F.mse_loss(model(x), y, reduction="sum")
    return torch.autograd.grad(loss, list(model.parameters()))


def autocast_cell(dtype):
    def cell(model, x, y):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        loss = F.mse_loss(out.float(), y, reduction="sum")
        loss.backward()
        return loss.detach()

    cell.__name__ = f"autocast_{dtype}"
    return cell


def tuple_step(model, x, y):
    model.zero_grad(set_to_none=True)
    out, h = model(x)
    loss = F.mse_loss(out, y, reduction="sum") + h.pow(2).sum()
    loss.backward()
    return loss.detach()


def script_build():
    torch.manual_seed(0)
    return {"model": torch.jit.script(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))),
            "x": torch.randn(5, 6), "y": torch.randn(5, 3)}


# -- observation: (id, build, cell, trace options, what weight_grad must do) ---------------------
# factors: "exact" (every supported layer's weight_grad equals .grad), "refuse" (a clear ValueError
# and a note naming why), or a function of the traced Outcome doing its own check.
def check_tied(out):
    model, t = out.objects["model"], out.trace
    assert torch.allclose(t.weight_grad("emb") + t.weight_grad("out"), model.emb.weight.grad, atol=1e-6)


def check_autograd_grad(out):
    model, t = out.objects["model"], out.trace
    assert all(p.grad is None for p in model.parameters())
    assert any("autograd.grad" in n for n in t.notes)
    for layer, g in (("0", out.result[0]), ("2", out.result[2])):
        assert torch.allclose(t.weight_grad(layer), g, atol=1e-6)


def check_kwargs_input(out):
    """Layers called with keyword arguments only (how Hugging Face calls them): their input is still `a`."""
    t, x = out.trace, out.objects["x"]
    assert torch.equal(t.layers["fc1"].a, x.detach()), "fc1(input=x): a is x"


def check_dict(out):
    t = out.trace
    assert torch.allclose(t.weight_grad("inner.fc2"), out.objects["model"].inner.fc2.weight.grad, atol=1e-6)
    # a dict output's first tensor is its output: δ is the gradient of "logits", as a hand-written hook sees it
    logits = out.objects["model"].inner(out.objects["x"])["logits"]
    assert t.layers["inner"].delta.shape == logits.shape
    assert torch.allclose(t.layers["inner"].delta, t.layers["inner.fc2"].delta)
    assert not any("returned a dict" in n for n in t.notes), t.notes


def check_autocast(out):
    model, t = out.objects["model"], out.trace
    for name in ("0", "2"):
        ref = getattr(model, name).weight.grad
        assert torch.allclose(t.weight_grad(name).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def check_all_covered(out):
    """MultiheadAttention (no dropout) gets the generic rule: every parameter is in per-sample norms."""
    assert not out.trace.per_sample_left_out, out.trace.per_sample_left_out
    assert out.trace.per_sample_grad_norms().shape == (2,)


def check_notes(*words):
    def check(out):
        text = " ".join(out.trace.notes)
        assert all(w in text for w in words), out.trace.notes

    return check


OBSERVE = [
    ("plain_backward", mlp, step, {}, "exact"),
    ("forward_only", mlp, forward_only, {}, "refuse"),
    ("no_grad", mlp, under_no_grad, {}, "refuse"),
    ("inference_mode", mlp, under_inference_mode, {}, "refuse"),
    ("inplace_relu", seq_build(lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))),
     step, {}, "exact"),
    ("inplace_relu_after_3d_linear", seq_build(lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True),
                                                                      nn.Linear(8, 3)), (5, 4, 6), (5, 4, 3)),
     step, {}, "exact"),
    ("inplace_add", seq_build(InPlaceAdd), step, {}, "exact"),
    ("module_reused_twice", seq_build(Reused), step, {}, "exact"),
    ("module_recurrent", seq_build(Recurrent), step, {}, "exact"),
    ("weight_tying", tied_build, step, {}, check_tied),
    ("checkpoint_reentrant", seq_build(lambda: Checkpointed(True), x_grad=True), step, {},
     lambda out: (_check_factors(out, "exact"), check_notes("checkpoint")(out))),
    ("checkpoint_reentrant_input_without_grad", seq_build(lambda: Checkpointed(True)), step, {}, "exact_or_refuse"),
    ("checkpoint_nonreentrant", seq_build(lambda: Checkpointed(False)), step, {},
     lambda out: (_check_factors(out, "exact"), check_notes("checkpoint")(out))),
    ("retain_graph_two_backwards", mlp, retain_graph_twice, {},
     lambda out: (_check_factors(out, "exact"), check_notes("retain_graph")(out))),
    ("create_graph_double_backward", mlp, double_backward, {},
     lambda out: (_check_factors(out, "refuse"), check_notes("create_graph")(out))),
    ("autograd_grad", mlp, autograd_grad, {}, check_autograd_grad),
    ("dict_output", seq_build(lambda: Wrap(DictOut())), step, {}, check_dict),
    ("tuple_output", seq_build(TupleOut), tuple_step, {}, "exact"),
    ("tensor_kwargs", seq_build(KwargsCall), step, {},
     lambda out: (_check_factors(out, "exact"), check_kwargs_input(out))),
    ("multihead_attention_train", seq_build(Attention, x_shape=(2, 4, 6), y_shape=(2, 8)), step, {},
     lambda out: (_check_factors(out, "exact"), check_all_covered(out))),
    ("multihead_attention_eval_fast_path", seq_build(Attention, x_shape=(2, 4, 6), y_shape=(2, 8), train=False),
     under_no_grad, {}, "refuse"),
    ("batchnorm_dropout_train", seq_build(NormDrop), step, {}, "exact"),
    ("batchnorm_dropout_eval", seq_build(NormDrop, train=False), step, {}, "exact"),
    ("autocast_bfloat16", mlp, autocast_cell(torch.bfloat16), {}, check_autocast),
    ("autocast_float16", mlp, autocast_cell(torch.float16), {}, check_autocast),
    ("script_module", script_build, step, {}, check_notes("ScriptModule")),
    ("capture_summary", mlp, step, {"capture": "summary"}, None),
    ("capture_norms", mlp, step, {"capture": "norms"}, None),
    ("given_modules", mlp, step, {"modules": "model"}, "exact"),
]



@pytest.mark.parametrize("build, cell, options, factors", [c[1:] for c in OBSERVE], ids=[c[0] for c in OBSERVE])
def test_observing_changes_nothing(build, cell, options, factors):
    out = observe(build, cell, **options)
    t = out.trace
    assert t is not None and t.layers
    if factors in ("exact", "exact_or_refuse", "refuse"):
        _check_factors(out, factors)
    elif callable(factors):
        factors(out)


def _check_factors(out, expect: str) -> None:
    """Every layer with a factor rule: weight_grad equals .grad, or a clear ValueError that names why."""
    t = out.trace
    checked = refused = 0
    for name, layer in t.layers.items():
        w = getattr(layer.module, "weight", None)
        if not isinstance(w, torch.Tensor) or not t.supports(name):
            continue
        try:
            got = t.weight_grad(name)
        except ValueError as e:
            refused += 1
            assert expect != "exact", f"{name}: {e}"
            assert "\n" not in str(e) and name in str(e)
            assert t.notes or "no backward reached it" in str(e), "a refusal must say why"
            continue
        assert expect != "refuse", f"{name}: weight_grad returned a number where no backward ran"
        assert w.grad is not None, f"{name}: weight_grad gave a number but autograd left .grad None"
        assert torch.allclose(got, w.grad, rtol=1e-5, atol=1e-6), f"{name}: weight_grad differs from .grad"
        checked += 1
    assert checked + refused > 0


# -- scenarios where hookwidget must say no, or say what it could not see ----------------------
def compiled_build():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return {"model": model, "compiled": torch.compile(model, backend="eager"), "x": torch.randn(5, 6),
            "y": torch.randn(5, 3)}


def compiled_step(model, compiled, x, y):
    return step(compiled, x, y)


@pytest.mark.parametrize("warm", [False, True], ids=["compiled_inside_trace", "compiled_before_trace"])
def test_torch_compile_gets_one_line_and_no_wrong_numbers(warm):
    def build():
        objs = compiled_build()
        if warm:
            compiled_step(**objs)
        return objs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that global hooks also fire for the OptimizedModule
        torch._dynamo.reset()
        plain = run_cell(build, compiled_step, traced=False)
        torch._dynamo.reset()
        traced = run_cell(build, compiled_step, traced=True)
    assert_same(plain, traced)
    t = traced.trace
    notes = [n for n in t.notes if "torch.compile" in n]
    assert len(notes) == 1 and "\n" not in notes[0] and "ran eagerly" in notes[0], t.notes
    assert list(t.layers) == ["Sequential", "0", "1", "2"]  # it ran eagerly: every layer, named as in the model
    for name, layer in t.layers.items():  # whatever is shown must be right
        if t.supports(name) and getattr(layer.module, "weight", None) is not None:
            assert torch.allclose(t.weight_grad(name), layer.module.weight.grad, atol=1e-6)
    torch._dynamo.reset()


def func_build():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return {"model": model, "x": torch.randn(5, 6), "y": torch.randn(5, 3)}


def func_grad_cell(model, x, y):
    params = dict(model.named_parameters())

    def loss(p, xb, yb):
        return F.mse_loss(torch.func.functional_call(model, p, (xb,)), yb, reduction="sum")

    return torch.func.grad(loss)(params, x, y)


def func_vmap_cell(model, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xb, yb):
        return F.mse_loss(torch.func.functional_call(model, p, (xb[None],)), yb[None], reduction="sum")

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)


@pytest.mark.parametrize("cell", [func_grad_cell, func_vmap_cell], ids=["func_grad", "func_vmap_grad"])
def test_torch_func_inside_the_trace_runs_unchanged_and_is_named(cell):
    out = observe(func_build, cell)
    notes = [n for n in out.trace.notes if "torch.func" in n]
    assert len(notes) == 1 and "\n" not in notes[0], out.trace.notes
    assert not any(c.a is not None or c.delta is not None for layer in out.trace.layers.values()
                   for c in layer.calls), "records from inside a torch.func transform would be wrong numbers"


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_trace_inside_a_torch_func_transform_is_refused(transform):
    model = nn.Linear(3, 1)
    regs = Registries(model)
    before = regs.take()

    def f(x):
        hw.trace(lambda: model(x))
        return model(x).sum()

    fn = torch.func.vmap(f) if transform == "vmap" else torch.func.grad(f)
    with pytest.raises(RuntimeError, match="torch.func") as e:
        fn(torch.randn(4, 3))
    assert "\n" not in str(e.value)
    assert regs.take() == before


# -- faults: the cell raises, or a hook raises --------------------------------------------------
class Boom(Exception):
    pass


class RaiseInBackward(torch.autograd.Function):
    exc = Boom

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RaiseInBackward.exc("backward failed")


class Faulty(nn.Module):
    """fc1 -> (maybe raise) -> custom Function -> fc2."""

    def __init__(self, where, exc):
        super().__init__()
        self.fc1, self.fc2, self.where, self.exc = nn.Linear(6, 8), nn.Linear(8, 3), where, exc

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.where == "forward":
            raise self.exc("forward failed")
        if self.where == "backward":
            RaiseInBackward.exc = self.exc
            h = RaiseInBackward.apply(h)
        return self.fc2(h)


def faulty_build(where, exc):
    def build():
        return {"model": Faulty(where, exc), "x": torch.randn(5, 6), "y": torch.randn(5, 3)}

    return build


def user_hook_build(where, exc):
    def build():
        objs = mlp()
        model = objs["model"]

        def forward_hook(module, inputs, output):
            if where == "forward_hook":
                raise exc("user forward hook failed")
            if where == "tensor_hook":
                output.register_hook(lambda g: (_ for _ in ()).throw(exc("user tensor hook failed")))

        model[0].register_forward_hook(forward_hook)
        return objs

    return build


FAULTS = [
    ("exception_in_forward", faulty_build("forward", Boom)),
    ("exception_in_backward", faulty_build("backward", Boom)),
    ("keyboard_interrupt_mid_forward", faulty_build("forward", KeyboardInterrupt)),
    ("keyboard_interrupt_mid_backward", faulty_build("backward", KeyboardInterrupt)),
    ("exception_in_user_forward_hook", user_hook_build("forward_hook", Boom)),
    ("exception_in_user_tensor_hook", user_hook_build("tensor_hook", Boom)),
    ("keyboard_interrupt_in_user_hook", user_hook_build("forward_hook", KeyboardInterrupt)),
]


@pytest.mark.parametrize("build", [f[1] for f in FAULTS], ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("form", ["trace", "with"])
def test_a_failing_cell_fails_the_same_and_leaves_no_hook(build, form):
    plain = run_cell(build, step, traced=False)
    assert plain.exc is not None
    if form == "trace":
        traced = run_cell(build, step, traced=True)
    else:
        traced = _run_with_block(build, step)
    assert_same(plain, traced)


def _run_with_block(build, cell):
    torch.manual_seed(0)
    objects = build()
    torch.manual_seed(1)
    regs = Registries(objects)
    before = regs.take()
    exc = None
    try:
        with hw.tracing() as t:
            cell(**objects)
    except BaseException as e:
        exc = e
    assert regs.take() == before
    assert isinstance(t, hw.Trace)  # what was recorded up to the failure stays readable
    out = run_cell(lambda: objects, lambda **o: None, traced=False, seed=0)
    out.exc, out.rng, out.result = exc, torch.get_rng_state(), None
    return out


# hookwidget's own code raising, at each stage: the error propagates, nothing is left behind.
def _raise(*args, **kwargs):
    raise Boom("hookwidget internal failure")


def _raise_in_backward_only(original):
    def stats(self, t, copy=False):
        if not torch.is_grad_enabled():  # backward hooks run with grad mode off
            raise Boom("hookwidget internal failure")
        return original(self, t, copy)

    return stats


INTERNAL = [
    ("pre_hook", lambda mp: mp.setattr(capture.Tracer, "_open_call", _raise), {}),
    ("forward_hook", lambda mp: mp.setattr(capture, "first_tensor", _raise), {}),
    ("backward_start", lambda mp: mp.setattr(graph.GraphWalk, "extend", _raise), {}),
    ("delta_hook",  # δ's statistics, taken in its hook
     lambda mp: mp.setattr(budget.StatsBatch, "stats", _raise_in_backward_only(budget.StatsBatch.stats)),
     {"capture": "summary"}),
    ("end_of_trace", lambda mp: mp.setattr(budget, "to_summaries", _raise), {"capture": "summary"}),
]


@pytest.mark.parametrize("patch, options", [i[1:] for i in INTERNAL], ids=[i[0] for i in INTERNAL])
def test_a_failing_hookwidget_hook_propagates_and_leaves_no_hook(monkeypatch, patch, options):
    patch(monkeypatch)
    out = run_cell(mlp, step, traced=True, **options)  # asserts the registries
    assert isinstance(out.exc, Boom)


def test_the_cells_own_exception_wins_over_a_failure_while_finishing(monkeypatch):
    monkeypatch.setattr(budget, "to_summaries", _raise)
    out = run_cell(faulty_build("backward", ValueError), step, traced=True, capture="summary")
    assert isinstance(out.exc, ValueError) and "backward failed" in str(out.exc)


# -- interventions under faults -----------------------------------------------------------------
def test_a_raising_out_callable_names_itself_and_a_later_rerun_works():
    objs = mlp()
    model = objs["model"]
    regs = Registries(objs)
    before = regs.take()
    t = hw.trace(lambda: step(**objs))
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}

    def bad(module, inputs, output):
        raise ZeroDivisionError("no")

    t.add_hook("0", "out_callable", fn=bad)
    with pytest.raises(hw.InterventionError, match=r"out_callable\(\) on '0'.*ZeroDivisionError"):
        t.rerun()
    assert regs.take() == before
    t.add_hook("2", "callable", fn=lambda g: g / 0 if False else g.foo())  # raises in backward
    t.remove_hook("0", "out_callable")
    with pytest.raises(hw.InterventionError, match=r"callable\(\) on '2'.*AttributeError"):
        t.rerun()
    assert regs.take() == before
    t.remove_hook("2", "callable")
    t2 = t.rerun()
    assert regs.take() == before
    assert all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters())
    assert torch.equal(torch.tensor(t2.loss), torch.tensor(t.loss))


def test_a_gradient_intervention_fires_when_an_in_place_op_rewrites_a_view_output():
    """A 3-D Linear's output is a view; ReLU(inplace=True) then replaces its grad_fn."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    x, y = torch.randn(5, 4, 6), torch.randn(5, 4, 3)
    t = hw.trace(lambda: step(model, x, y))
    ref = model[0].weight.grad.clone()
    t.add_hook("0", "grad_scale", factor=2.0)
    t2 = t.rerun()
    assert torch.allclose(t2.param_grads["0.weight"], 2 * ref)
    assert torch.equal(model[0].weight.grad, ref)  # a what-if: the model's .grad is as the first run left it


def test_keyboard_interrupt_inside_an_intervention_is_not_wrapped():
    objs = mlp()
    regs = Registries(objs)
    before = regs.take()
    t = hw.trace(lambda: step(**objs))

    def interrupt(g):
        raise KeyboardInterrupt

    t.add_hook("2", "callable", fn=interrupt)
    with pytest.raises(KeyboardInterrupt):
        t.rerun()
    assert regs.take() == before


# -- memory budget --------------------------------------------------------------------------------
def test_over_budget_keeps_summaries_drops_detail_and_stays_within_budget():
    """RSS is read after gc and malloc_trim, so freed blocks the allocator kept do not count.
    Margin: 8 MiB for summaries, graph records and allocator slack. A Trace also holds a copy of
    the .grad its last backward pass made (the record must not change when .grad does): that is
    the one thing the budget never drops, so it is growth beyond the budget."""
    psutil = pytest.importorskip("psutil")
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        pytest.skip("needs glibc's malloc_trim to read RSS without allocator slack")
    torch.manual_seed(0)
    width, batch, depth = 1024, 512, 8  # each a or δ is 2 MiB; full capture would keep ~64 MiB
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])
    x = torch.randn(batch, width)

    def cell():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    def rss_mb():
        gc.collect()
        trim(0)
        return psutil.Process().memory_info().rss / 2**20

    cell()  # warm: the plain run's own allocations and .grad tensors exist before the trace
    budget_mb, margin_mb = 4, 8
    before = rss_mb()
    t = hw.trace(cell, budget_mb=budget_mb)
    grown = rss_mb() - before
    kept = sum(c.numel() * c.element_size() for layer in t.layers.values() for call in layer.calls
               for c in (call.a, call.delta) if c is not None)
    assert kept <= budget_mb * 2**20
    assert any("memory budget" in n and "budget_mb" in n for n in t.notes), t.notes
    calls = [c for layer in t.layers.values() for c in layer.calls]
    assert all(c.a is not None or c.a_summary is not None for c in calls)
    assert all(c.delta is not None or c.delta_summary is not None for c in calls if t.layers)
    assert sum(c.delta_summary is not None for c in calls) > len(calls) // 2
    grads_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert all(torch.equal(t.param_grads[n], p.grad) for n, p in model.named_parameters())
    assert grown <= budget_mb + grads_mb + margin_mb, f"RSS grew {grown:.1f} MiB for a {budget_mb} MiB budget"
