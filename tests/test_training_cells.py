"""Training cells as people write them: optimizer steps, gradient accumulation, several steps,
what-if reruns, code that keeps going after the trace. References: the same cell run in plain
PyTorch (a deep copy of the model and optimizer), autograd's .grad, torch.func."""

from __future__ import annotations

import copy
import dataclasses
import gc
import random
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import hookwidget as hw
from tests.helpers_faults import Registries


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.3), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n=12, image=False):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 6, 6, generator=g) if image else torch.randn(n, 6, generator=g)
    return x, torch.randint(0, 5 if image else 3, (n,), generator=g)


def state_of(model, opt=None, sched=None) -> dict:
    """Everything a training cell changes, as plain copies."""
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    out |= {f"g.{n}": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    out |= {f"b.{n}": b.clone() for n, b in model.named_buffers()}
    if opt is not None:
        for i, s in enumerate(opt.state.values()):
            out |= {f"o.{i}.{k}": v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        out["lr"] = [g["lr"] for g in opt.param_groups]
    if sched is not None:
        out["sched"] = sched.state_dict()
    out["rng"] = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if k == "rng":
            assert torch.equal(x[0], y[0]) and np.array_equal(x[1], y[1]) and x[2] == y[2], "RNG differs"
        elif torch.is_tensor(x):
            assert torch.equal(x, y), k
        else:
            assert x == y, k


# -- what-if rerun ------------------------------------------------------------------------------
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.Adam(ps, lr=1e-2)], ids=["sgd", "adam"])
def test_a_rerun_without_hooks_changes_nothing_and_leaves_everything_as_the_first_run_did(make_opt):
    model = cnn()
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = data(image=True)

    def cell():
        opt.zero_grad()
        noise = torch.tensor(np.random.rand(1), dtype=torch.float32) + random.random()  # numpy and random draws
        loss = F.cross_entropy(model(x + 0.01 * noise), y)
        loss.backward()
        opt.step()
        sched.step()

    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    plain_model = copy.deepcopy(model)
    plain_opt = make_opt(plain_model.parameters())
    plain_sched = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=1, gamma=0.5)
    plain_opt.load_state_dict(opt.state_dict())

    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    t = hw.trace(cell)
    after_first = state_of(model, opt, sched)
    t2 = t.rerun()
    assert_same(state_of(model, opt, sched), after_first)  # the user's objects: as the first run left them
    d = t2.diff(t)
    assert t2.loss == t.loss
    assert d.changed == [] and all(p.rel_change == 0.0 for p in d.params)
    assert all(torch.equal(t2.param_grads[n], t.param_grads[n]) for n in t.param_grads)

    # the reference: the same cell in plain PyTorch from the same start
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    model2, opt2, sched2 = plain_model, plain_opt, plain_sched

    def plain():
        opt2.zero_grad()
        noise = torch.tensor(np.random.rand(1), dtype=torch.float32) + random.random()
        F.cross_entropy(model2(x + 0.01 * noise), y).backward()
        opt2.step()
        sched2.step()

    plain()
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), n
        assert torch.equal(t.param_grads[n], p2.grad), n


def _every_rng() -> tuple:
    """Each RNG's whole state as its getter gives it (numpy's legacy Gaussian cache and random's gauss_next too)."""
    np_state = np.random.get_state()
    return torch.get_rng_state(), (np_state[0], np_state[1].copy(), *np_state[2:]), random.getstate()


def _same_rngs(a: tuple, b: tuple) -> bool:
    return (torch.equal(a[0], b[0]) and a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1])
            and a[1][2:] == b[1][2:] and a[2] == b[2])


def test_a_rerun_puts_every_rng_back_exactly_with_their_cached_gaussians():
    """An odd number of Gaussian draws leaves numpy's legacy RandomState and random with one cached Gaussian;
    the cell's draws use it, so a rerun must put the cache back with the Twister's state; and afterwards every
    RNG is as the rerun found it."""
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)

    def cell():
        noise = np.random.standard_normal(3).sum() + random.gauss(0, 1) + np.random.rand() + random.random()
        (model(x + float(noise)).sum() + torch.rand(())).backward()
        return noise

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    np.random.standard_normal(), random.gauss(0, 1)
    assert np.random.get_state()[3] == 1 and random.getstate()[2] is not None
    t = hw.trace(cell)
    np.random.standard_normal(), random.gauss(0, 1), torch.rand(())  # the state moves on after the cell
    before_rerun = _every_rng()
    t2 = t.rerun()
    assert _same_rngs(_every_rng(), before_rerun)
    assert t2.loss == t.loss and all(torch.equal(t2.param_grads[n], t.param_grads[n]) for n in t.param_grads)


def test_a_rerun_with_a_hook_changes_only_what_the_hook_changes():
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data(image=True)

    def cell():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    t = hw.trace(cell)
    after_first = state_of(model, opt)
    t.add_hook("5", "grad_zero")
    t2 = t.rerun()
    assert_same(state_of(model, opt), after_first)
    assert all(torch.count_nonzero(t2.param_grads[n]) == 0 for n in t2.param_grads)  # nothing upstream of 5 moves
    assert t2.loss == t.loss  # the hook acts in backward only
    assert t2.diff().loss_before == t.loss  # by default against the hook-free first run
    assert [str(iv) for iv in t.interventions] == [str(iv) for iv in t2.interventions] == ["grad_zero() on '5'"]
    assert t.session.latest is t2 and t.session.baseline is t


def test_a_parameter_updated_by_hand_is_named_not_silently_kept():
    model = mlp()
    x, y = data()

    def cell():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad

    t = hw.trace(cell)
    assert any("changed in place outside an optimizer" in n and "restore=model" in n for n in t.notes)
    model2 = mlp()
    t = hw.trace(cell, restore=model)  # with restore=, the rerun starts from the same weights
    after = state_of(model)
    t2 = t.rerun()
    assert t2.loss == t.loss
    assert_same(state_of(model), after)
    del model2


# -- steps --------------------------------------------------------------------------------------
def test_each_optimizer_step_is_a_step_and_weight_grad_takes_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = data()
    plain_model = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.5)

    def loop(m, o, out=None):
        for xb, yb in zip(x.split(4), y.split(4)):
            o.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            if out is not None:
                out.append(m[0].weight.grad.clone())
            o.step()

    ref = []
    loop(plain_model, plain_opt, ref)
    t = hw.trace(lambda: loop(model, opt))
    assert len(t.steps) == 3 and [s.kind for s in t.steps] == ["backward"] * 3
    assert not t.accumulates
    for k in range(3):
        assert torch.allclose(t.weight_grad("0", step=k), ref[k], atol=1e-6)
        assert torch.equal(t.steps[k].grad("0.weight"), ref[k])
    with pytest.raises(ValueError, match=r"pass step=k") as e:
        t.weight_grad("0")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"step=7"):
        t.weight_grad("0", step=7)
    assert len(t.per_sample_grad_norms(step=1)) == 4


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_gradient_accumulation_over_unequal_micro_batches_has_one_row_per_sample(capture):
    model = mlp()
    x, y = data(14)
    sizes = [4, 4, 4, 2]

    def cell():
        model.zero_grad()
        for xb, yb in zip(x.split(sizes), y.split(sizes)):
            F.cross_entropy(model(xb), yb, reduction="sum").backward()

    t = hw.trace(cell, capture=capture)
    assert len(t.steps) == 4 and t.accumulates and [s.accumulated for s in t.steps] == [False, True, True, True]
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None], reduction="sum")

    g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    ref = torch.cat([v.flatten(1) for v in g.values()], 1).norm(dim=1)
    assert torch.allclose(t.per_sample_grad_norms(), ref, rtol=1e-4)
    if capture == "full":
        assert torch.allclose(t.weight_grad("0"), model[0].weight.grad, atol=1e-5)
        assert torch.allclose(t.per_sample_grads("0"), g["0.weight"], atol=1e-5)
        assert torch.allclose(t.weight_grad("0", step=3), g["0.weight"][12:].sum(0), atol=1e-5)


def test_a_forward_only_call_does_not_block_the_layers_factors():
    model = mlp()
    x, y = data()

    def cell():
        model(x[:2])  # a look at the output, no backward through it
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()

    t = hw.trace(cell)
    assert len(t.layers["0"].calls) == 2 and t.layers["0"].calls[0].step is None
    assert torch.allclose(t.weight_grad("0"), model[0].weight.grad, atol=1e-6)
    assert t.per_sample_grad_norms().shape == (12,)


# -- an immutable record ------------------------------------------------------------------------
def test_what_the_user_does_after_the_trace_changes_nothing_in_it():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    x.requires_grad_(False)

    def cell():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()

    t = hw.trace(cell)
    grads = {n: g.clone() for n, g in t.param_grads.items()}
    a, delta = t.layers["0"].a.clone(), t.layers["2"].delta.clone()
    w = t.weight_grad("0").clone()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # in place on .grad
    opt.zero_grad(set_to_none=False)  # in place again
    with torch.no_grad():
        x.mul_(0)  # the input the first layer read, in place
    F.cross_entropy(model(x), y).backward()
    assert all(torch.equal(t.param_grads[n], grads[n]) for n in grads)
    assert torch.equal(t.layers["0"].a, a) and torch.equal(t.layers["2"].delta, delta)
    assert torch.equal(t.weight_grad("0"), w)


def test_a_cell_that_ends_in_zero_grad_still_shows_its_gradients_and_says_so():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()

    def cell():
        F.cross_entropy(model(x), y).backward()
        ref.update({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()

    ref = {}
    t = hw.trace(cell)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(t.param_grads[n], ref[n]) for n in ref)
    assert any("changed .grad after its last backward" in n for n in t.notes)


# -- memory -------------------------------------------------------------------------------------
def test_dropping_a_trace_frees_it():
    model = mlp()
    x, y = data()
    t = hw.trace(lambda: F.cross_entropy(model(x), y).backward())
    t.rerun()
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None


class Marked(torch.autograd.Function):
    """Identity whose graph node holds a marker: the marker lives exactly as long as the graph."""

    markers: list = []

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        marker = type("Marker", (), {})()
        Marked.markers.append(weakref.ref(marker))
        ctx.marker = marker

    @staticmethod
    def backward(ctx, g):
        return g


class MarkedLayer(nn.Module):
    def forward(self, x):
        return Marked.apply(x)


def test_an_eval_loop_without_no_grad_does_not_keep_every_graph():
    model = nn.Sequential(mlp(), MarkedLayer())
    x, _ = data(40)
    Marked.markers.clear()

    def cell():
        for xb in x.split(4):
            model(xb).sum()  # forgot torch.no_grad(): each batch builds a graph
        gc.collect()
        during.append(sum(r() is not None for r in Marked.markers))

    during = []
    hw.trace(cell)
    gc.collect()
    assert len(Marked.markers) == 10
    assert during[0] <= 4  # while the cell runs: the graphs of the last few forward passes at most
    assert sum(r() is not None for r in Marked.markers) == 0  # after it: none


# -- robust under the user's code ---------------------------------------------------------------
def test_autograd_calls_behave_as_in_plain_torch_for_every_calling_convention():
    model = mlp()
    x, y = data()
    x = x.clone().requires_grad_(True)

    def cell(out):
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        (gx,) = torch.autograd.grad(outputs=loss, inputs=[x], retain_graph=True)  # keywords (WGAN-GP, PINNs)
        out.append(gx)
        torch.autograd.backward(t for t in [loss])  # a generator
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})

    plain, traced = [], []
    cell(plain)
    t = hw.trace(lambda: cell(traced))
    assert torch.equal(plain[0], traced[0])
    assert all(torch.equal(plain[1][n], traced[1][n]) for n in plain[1])
    assert [s.kind for s in t.steps] == ["grad", "backward"]
    assert torch.autograd.backward.__module__ == "torch.autograd"


def test_two_traces_in_two_threads_record_only_their_own_model_and_leave_nothing_patched():
    models = [mlp(), mlp()]
    x, y = data()
    originals = torch.autograd.backward, torch.autograd.grad
    started, results = threading.Barrier(2), [None, None]
    order = threading.Event()

    def work(i):
        def cell():
            started.wait()
            for _ in range(3):
                models[i].zero_grad()
                F.cross_entropy(models[i](x), y).backward()
            if i == 1:
                order.wait(5)  # thread 1 ends after thread 0: traces end in the order they started

        results[i] = hw.trace(cell)
        if i == 0:
            order.set()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert (torch.autograd.backward, torch.autograd.grad) == originals
    for i, t in enumerate(results):
        assert {layer.module for layer in t.layers.values()} <= set(models[i].modules())
        assert len(t.steps) == 3


@pytest.mark.parametrize("modules", [None, "model"])
def test_a_keyboard_interrupt_at_any_registration_step_leaves_no_hook(monkeypatch, modules):
    model = mlp()
    x, y = data()
    regs = Registries(model)
    before = regs.take()
    import torch.nn.modules.module as module_mod
    from torch.optim import optimizer as optim_mod

    from hookwidget.capture import tracer as capture

    targets = [(module_mod, "register_module_forward_pre_hook"), (module_mod, "register_module_forward_hook"),
               (nn.Module, "register_forward_pre_hook"), (nn.Module, "register_forward_hook"),
               (capture, "register_optimizer_step_pre_hook")]
    interrupted = 0
    for owner, name in targets:
        original = getattr(owner, name)
        for n in range(8):
            calls = [0]

            def after_registering(*args, _original=original, _calls=calls, _n=n, **kwargs):
                handle = _original(*args, **kwargs)
                _calls[0] += 1
                if _calls[0] > _n:
                    raise KeyboardInterrupt  # lands after the hook is in, before its handle is kept
                return handle

            monkeypatch.setattr(owner, name, after_registering)
            try:
                hw.trace(lambda: F.cross_entropy(model(x), y).backward(), modules=model if modules else None)
            except KeyboardInterrupt:
                interrupted += 1
            monkeypatch.setattr(owner, name, original)
            assert regs.take() == before, (name, n)
            assert not optim_mod._global_optimizer_pre_hooks
    assert interrupted >= 3


# -- inputs and outputs as Hugging Face passes them --------------------------------------------
@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, *, features):
        h = torch.tanh(self.embed(input=features))
        return Output(logits=self.head(h), hidden=h)


@pytest.mark.parametrize("per_module", [False, True])
def test_keyword_inputs_and_dataclass_outputs_are_seen(per_module):
    torch.manual_seed(0)
    model = KeywordModel()
    x, y = data()
    seen = {}
    # the reference: hand-written hooks with kwargs on the model, a tensor hook on its logits
    h1 = model.register_forward_pre_hook(lambda m, args, kw: seen.update(a=kw["features"].clone()), with_kwargs=True)

    def on_logits(m, args, out):
        out.logits.register_hook(lambda g: seen.update(d=g))

    h2 = model.register_forward_hook(on_logits)
    F.cross_entropy(model(features=x).logits, y, reduction="sum").backward()
    h1.remove(), h2.remove()
    model.zero_grad()
    t = hw.trace(lambda: F.cross_entropy(model(features=x).logits, y, reduction="sum").backward(),
                 modules=model if per_module else None)
    root = next(n for n, layer in t.layers.items() if layer.module is model)
    assert torch.equal(t.layers[root].a, seen["a"])
    assert torch.equal(t.layers[root].delta, seen["d"])
    assert torch.allclose(t.weight_grad("embed"), model.embed.weight.grad, atol=1e-6)
