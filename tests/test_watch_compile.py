"""hw.watch under torch.compile: a watch installed before compiling records from the compiled code
(its hook is traced into the graph); statistics match plain-PyTorch references from an eager copy
of the model run in the same loop. A model compiled and run before the watch: one warning."""

import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import hookwidget as hw

LAYERS = ["0", "2", "4"]


def make(inplace):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.ReLU(inplace=inplace), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


class Reference:
    """Per-layer statistics of one step computed by hand with plain hooks (eager model, no hookwidget)."""

    def __init__(self, model, layers):
        self.model, self.layers, self.rows, self.cur = model, layers, [], {}
        for name in layers:
            model.get_submodule(name).register_forward_hook(self._fwd(name))

    def _fwd(self, name):
        def hook(mod, inputs, out):
            a = inputs[0].detach().double()
            self.cur[name] = {"a_rms": a.square().mean().sqrt().item(), "a_zero_frac": (a == 0).double().mean().item()}

            def grad_hook(g):
                g = g.double()
                self.cur[name].update(delta_norm=g.norm().item(), delta_max=g.abs().max().item())

            out.register_hook(grad_hook)

        return hook

    def step(self, x, y, opt, loss_fn=F.mse_loss):
        opt.zero_grad()
        self.cur = {}
        loss = loss_fn(self.model(x), y)
        loss.backward()
        row = self.cur
        before = {}
        for name in self.layers:
            ps = list(self.model.get_submodule(name).parameters())
            row[name]["grad_norm"] = torch.cat([p.grad.double().flatten() for p in ps]).norm().item()
            before[name] = torch.cat([p.detach().double().flatten() for p in ps])
            row[name]["weight_norm"] = before[name].norm().item()
        opt.step()
        for name in self.layers:
            after = torch.cat([p.detach().double().flatten() for p in self.model.get_submodule(name).parameters()])
            row[name]["update_ratio"] = ((after - before[name]).norm() / before[name].norm()).item()
        self.rows.append((loss.item(), row))
        return loss


def assert_matches(w, ref, rtol=1e-5, stats=None):
    assert len(w.steps) == len(ref.rows)
    for k, (loss, row) in enumerate(ref.rows):
        assert w.loss[k].item() == pytest.approx(loss, rel=rtol), k
        for name in ref.layers:
            for stat, value in row[name].items():
                if stats is None or stat in stats:
                    got = w.series(name, stat)[k].item()
                    assert got == pytest.approx(value, rel=rtol, abs=1e-9), (k, name, stat)


@pytest.mark.slow
def test_watch_before_compile_records_from_inductor_code():
    torch._dynamo.reset()
    model, ref = make(inplace=True), Reference(make(inplace=False), LAYERS)
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.model.parameters(), lr=0.1)

    def loop(cmodel, opt, out):
        for _ in range(3):
            opt.zero_grad()
            loss = F.mse_loss(cmodel(x), y)
            loss.backward()
            out.append([loss.detach().clone()] + [p.grad.clone() for p in cmodel.parameters()])
            opt.step()

    plain, watched = [], []
    unwatched = make(inplace=True)  # the same compiled loop without hookwidget
    loop(torch.compile(unwatched), torch.optim.SGD(unwatched.parameters(), lr=0.1), plain)
    torch.compiler.reset()  # else Dynamo reuses the code compiled for `unwatched` (same class), hooks unseen
    counters = torch._dynamo.utils.counters
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hw.watch(model, flight_recorder=False) as w:
            cmodel = torch.compile(model)  # Inductor
            loop(cmodel, opt, watched)
    assert all(torch.equal(a, b) for pa, pb in zip(plain, watched) for a, b in zip(pa, pb))  # bitwise, here
    assert not [c for c in caught if "hw.watch" in str(c.message)]  # no "hooks not seen" warning
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # the watch's hook is inside the one compiled graph
    assert w.notes == [] and w.layer_names == LAYERS
    for _ in range(3):  # the same loop, eager and without hookwidget (a backward inside the watch is a step)
        ref.step(x, y, ref_opt)
    assert_matches(w, ref)
    # closed: the compiled code no longer feeds the watch (Dynamo recompiles without the hook)
    out = cmodel(x)
    out.sum().backward()
    assert all(s.grad is None for s in w._stats.sinks)
    assert torch.allclose(out, ref.model(x), atol=1e-5)


def test_compiled_before_watch_warns_once_and_keeps_the_rest():
    torch._dynamo.reset()
    model, ref = make(inplace=False), Reference(make(inplace=False), LAYERS)
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.model.parameters(), lr=0.1)
    cmodel = torch.compile(model, backend="aot_eager")
    cmodel(x)  # compiled without the watch's hooks
    with pytest.warns(UserWarning) as caught:
        with hw.watch(cmodel) as w:  # the compiled wrapper: its layers are named as in the model
            for _ in range(3):
                opt.zero_grad()
                F.mse_loss(cmodel(x), y).backward()
                opt.step()
    mine = [c for c in caught if "hw.watch" in str(c.message)]
    assert len(mine) == 1 and w.notes == [str(mine[0].message)]
    assert "torch.compile" in w.notes[0] and "torch.compiler.reset() before hw.watch(model)" in w.notes[0]
    assert w.layer_names == LAYERS
    assert torch.isnan(w.series("0", "delta_norm")).all()  # not measured, not made up
    for _ in range(3):  # the same loop, eager and without hookwidget (a backward inside the watch is a step)
        ref.step(x, y, ref_opt)
    assert_matches(w, ref, stats={"grad_norm", "weight_norm", "update_ratio"})
    torch._dynamo.reset()


def test_eager_watch_gives_no_compile_note():
    model = make(inplace=False)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hw.watch(model) as w:
            F.mse_loss(model(x), y).backward()
    assert not [c for c in caught if "hw.watch" in str(c.message)]
    assert w.notes == [] and not torch.isnan(w.series("0", "delta_norm")).any()


def test_compiled_with_flight_recorder_still_exact():
    """The flight recorder's Tracer hooks are traced too (graph breaks there); the statistics stay exact."""
    torch._dynamo.reset()
    model, ref = make(inplace=True), Reference(make(inplace=False), LAYERS)
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    opt, ref_opt = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(ref.model.parameters(), 1e-2)
    with hw.watch(model) as w:
        cmodel = torch.compile(model, backend="aot_eager")
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(cmodel(x), y).backward()
            opt.step()
    assert len(w.notes) == 1 and "w.trace" in w.notes[0]  # the kept Traces cannot see inside compiled code
    for _ in range(3):  # the same loop, eager and without hookwidget (a backward inside the watch is a step)
        ref.step(x, y, ref_opt)
    assert_matches(w, ref)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_on_gpu_without_host_sync():
    """Inductor on CUDA: after the first step (compilation), forward, backward and the optimizer step of a
    watched compiled loop make no host sync; statistics equal an eager reference's."""
    torch._dynamo.reset()
    dev = torch.device("cuda")
    model, ref = make(inplace=True).to(dev), Reference(make(inplace=False).to(dev), LAYERS)
    x, y = torch.randn(16, 5, device=dev), torch.randn(16, 3, device=dev)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.model.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        F.mse_loss(cmodel(x), y).backward()
        opt.step()

    with hw.watch(model, flight_recorder=False, batch=64) as w:
        cmodel = torch.compile(model)
        step()  # compiles forward and backward, fills the watch's index caches
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(4):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for _ in range(5):
        ref.step(x, y, ref_opt)
    assert w.notes == [] and w.steps == list(range(5))
    assert_matches(w, ref, rtol=1e-4)
    torch._dynamo.reset()


def test_torchscript_layers_are_named_and_left_out():
    """Module hooks cannot be registered on a ScriptModule: its layers are left out, and the flight recorder
    (a Trace per step) is off; one warning says both."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)
            self.inner = torch.jit.script(nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 1)))

        def forward(self, x):
            return self.inner(self.fc(x))

    model = Mixed()
    x = torch.randn(4, 5)
    with pytest.warns(UserWarning, match="inner.0, inner.2 run as TorchScript") as caught:
        with hw.watch(model) as w:
            model(x).sum().backward()
    assert len([c for c in caught if "hw.watch" in str(c.message)]) == 1
    assert w.layer_names == ["fc"] and len(w.notes) == 1
    want = torch.cat([model.fc.weight.grad.flatten(), model.fc.bias.grad.flatten()]).double().norm()
    assert w.series("fc", "grad_norm")[0].item() == pytest.approx(want.item(), rel=1e-6)
    assert "the flight recorder is off" in w.notes[0]  # hw.trace cannot hook TorchScript modules either
    with pytest.raises(KeyError, match="flight recorder is off"):
        w.trace()
    with pytest.raises(ValueError, match="run as TorchScript"):
        hw.watch(torch.jit.script(nn.Linear(2, 2)))
