"""hw.watch: hooks across a training loop. References come from plain PyTorch run in the same loop."""

import copy
import gc
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.modules.module as module_mod
import torch.optim.optimizer as optimizer_mod
from torch import nn

from hookwidget.trace import Trace
from hookwidget.watch import STAT_NAMES, host, watch

TORCH_BACKWARD, TORCH_GRAD = torch.autograd.backward, torch.autograd.grad


class Net(nn.Module):
    def __init__(self, d_in=6, d_hidden=16, d_out=3, bn=True, p=0.2):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.bn = nn.BatchNorm1d(d_hidden) if bn else nn.Identity()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        h = self.drop(F.relu(self.bn(self.fc1(x))))
        return self.fc(F.relu(self.fc2(h)))


class PoisonGrad(nn.Module):
    """Identity forward; on step `at` its backward multiplies the gradient by NaN."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        y = x.clone()
        if self.calls == self.at and y.requires_grad:
            y.register_hook(lambda g: g * float("nan"))
        self.calls += 1
        return y


class PoisonOut(nn.Module):
    """Multiplies its input by NaN on forward call `at`."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls - 1 == self.at else x * 1.0


class Chain(nn.Module):
    def __init__(self, mid):
        super().__init__()
        self.fc1, self.fc2, self.mid, self.fc3 = nn.Linear(5, 7), nn.Linear(7, 7), mid, nn.Linear(7, 2)

    def forward(self, x):
        return self.fc3(self.mid(F.relu(self.fc2(F.relu(self.fc1(x))))))


def data(n=32, d_in=6, d_out=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def hook_state(modules):
    """Every hook dict hookwidget could touch, as comparable snapshots."""
    state = {}
    for i, m in enumerate(modules):
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            state[(i, name)] = dict(getattr(m, name, {}))
    for name in dir(module_mod):
        if name.startswith("_global_") and isinstance(getattr(module_mod, name), dict):
            state[name] = dict(getattr(module_mod, name))
    state["opt_pre"] = dict(optimizer_mod._global_optimizer_pre_hooks)
    state["opt_post"] = dict(optimizer_mod._global_optimizer_post_hooks)
    state["flag"] = module_mod._global_is_full_backward_hook
    return state


def assert_no_hooks_left(model, before):
    assert hook_state(list(model.modules())) == before
    assert torch.autograd.backward is TORCH_BACKWARD and torch.autograd.grad is TORCH_GRAD
    for p in model.parameters():
        assert not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None)


def run_loop(model, opt, x, y, steps, on_step=None, scale=None, skip_nonfinite=False):
    """The plain loop; returns per step: loss, each parameter's .grad (copies). skip_nonfinite: no
    optimizer step where a .grad is not finite (as GradScaler does)."""
    out = []
    for k in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if scale is not None and k in scale:
            loss = loss * scale[k]
        loss.backward()
        out.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        if on_step is not None:
            on_step(k)
        if not skip_nonfinite or all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
    return out


# -- observing changes nothing, and no hook outlives the watch -----------------------------------
STEPS = 200


@pytest.mark.parametrize("flight_recorder", [True, False])
def test_bitwise_unchanged_adam_batchnorm_dropout(flight_recorder):
    """200 Adam steps (the issue's figure) with BatchNorm and Dropout: every loss and .grad, the parameters,
    buffers and the RNG stream bitwise those of the same loop without the watch."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x, y = data()
    opt, ref_opt = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(ref.parameters(), 1e-2)
    torch.manual_seed(123)
    plain = run_loop(ref, ref_opt, x, y, STEPS)
    rng_plain = torch.get_rng_state()
    before = hook_state(list(model.modules()))
    torch.manual_seed(123)
    with watch(model, flight_recorder=flight_recorder) as w:
        watched = run_loop(model, opt, x, y, STEPS)
    assert torch.equal(torch.get_rng_state(), rng_plain)
    assert_no_hooks_left(model, before)
    for k, ((l1, g1), (l2, g2)) in enumerate(zip(plain, watched)):
        assert torch.equal(l1, l2), k
        for n in g1:
            assert torch.equal(g1[n], g2[n]), (k, n)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    for b, c in zip(model.buffers(), ref.buffers()):
        assert torch.equal(b, c)
    assert w.steps == list(range(STEPS)) and w.stats.shape == (STEPS, 4, len(STAT_NAMES))
    assert w.layer_names == ["fc1", "bn", "fc2", "fc"]


class Interrupt(nn.Module):
    def __init__(self, at, exc):
        super().__init__()
        self.at, self.exc, self.calls = at, exc, 0

    def forward(self, x):
        self.calls += 1
        if self.calls - 1 == self.at:
            raise self.exc
        return x


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("form", ["with", "close"])
def test_hooks_removed_after_exceptions(exc, form):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Interrupt(5, exc), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x, y = data()
    before = hook_state(list(model.modules()))
    with pytest.raises(type(exc)):
        if form == "with":
            with watch(model):
                run_loop(model, opt, x, y, 10)
        else:
            w = watch(model)
            try:
                run_loop(model, opt, x, y, 10)
            finally:
                w.close()
    assert_no_hooks_left(model, before)
    # the model trains as before: nothing of the watch fires any more
    model[1].at = -1
    out = run_loop(model, opt, x, y, 2)
    assert len(out) == 2


def test_close_form_keeps_hooks_across_steps_then_removes_them():
    torch.manual_seed(0)
    model = Net(bn=False)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    x, y = data()
    before = hook_state(list(model.modules()))
    w = watch(model)
    run_loop(model, opt, x, y, 3)
    assert hook_state(list(model.modules())) != before  # on across steps
    run_loop(model, opt, x, y, 2)
    w.close()
    w.close()  # twice is fine
    assert_no_hooks_left(model, before)
    assert w.steps == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="is closed"):
        w.open()


# -- statistics are exact per step ----------------------------------------------------------------
def reference_stats(model, opt, x, y, steps, layers, after_step=None):
    """Per step, with hand-written hooks in the plain loop: loss, global grad norm, and per layer
    delta_norm, delta_max, a_rms, a_zero_frac, grad_norm, weight_norm, update_ratio, and lr (the learning rate
    of the param group holding the layer's weight, as the optimizer steps). after_step(k): after opt.step()."""
    mods = dict(model.named_modules())
    seen = {}

    def fwd(name):
        def hook(m, inputs, out):
            a = inputs[0].detach()
            seen[name + ".a"] = a.clone()
            out.register_hook(lambda g: seen.__setitem__(name + ".d", g.detach().clone()))
        return hook

    handles = [mods[n].register_forward_hook(fwd(n)) for n in layers]
    rows, step_rows = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        params = {n: list(mods[n].parameters(recurse=False)) for n in layers}
        row = {}
        for n in layers:
            d, a = seen[n + ".d"], seen[n + ".a"]
            g = torch.cat([p.grad.flatten() for p in params[n]])
            wv = torch.cat([p.detach().flatten() for p in params[n]])
            row[n] = {"delta_norm": torch.linalg.vector_norm(d), "delta_max": d.abs().max(),
                      "a_rms": a.pow(2).mean().sqrt(), "a_zero_frac": (a == 0).float().mean(),
                      "grad_norm": torch.linalg.vector_norm(g), "weight_norm": torch.linalg.vector_norm(wv),
                      "w_before": wv.clone()}
        gn = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
        group_lr = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
        opt.step()
        for n in layers:
            wv = torch.cat([p.detach().flatten() for p in params[n]])
            r = row[n]
            r["update_ratio"] = torch.linalg.vector_norm(wv - r["w_before"]) / torch.linalg.vector_norm(r["w_before"])
            r["lr"] = torch.tensor(float(group_lr[id(params[n][0])]), dtype=torch.float64)
        if after_step is not None:
            after_step(len(rows))
        rows.append(row)
        step_rows.append((loss.item(), gn.item()))
    for h in handles:
        h.remove()
    return rows, step_rows


@pytest.mark.parametrize("every", [1, 3])
def test_statistics_exact_per_step(every):
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    ref = copy.deepcopy(model)
    x, y = data()
    opt, ref_opt = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(ref.parameters(), 1e-2)
    layers = ["fc1", "fc2", "fc"]
    rows, step_rows = reference_stats(ref, ref_opt, x, y, 12, layers)
    with watch(model, every=every) as w:
        run_loop(model, opt, x, y, 12)
    assert w.steps == list(range(0, 12, every))
    assert w.layer_names == layers and w.stat_names == STAT_NAMES
    for r, k in enumerate(w.steps):
        for li, n in enumerate(layers):
            for stat, want in rows[k][n].items():
                if stat == "w_before":
                    continue
                got = w.stats[r, li, STAT_NAMES.index(stat)].item()
                assert got == pytest.approx(want.item(), rel=1e-5, abs=1e-7), (k, n, stat)
            for stat in ("delta_nan", "delta_inf", "a_nonfinite", "grad_nan", "grad_inf"):
                assert w.stats[r, li, STAT_NAMES.index(stat)].item() == 0
        assert w.series("loss")[r].item() == step_rows[k][0]  # exact: the same float32 loss
        assert w.series("grad_norm")[r].item() == pytest.approx(step_rows[k][1], rel=1e-6)
    # exact where it is one tensor: ‖δ‖ of the output layer
    for stat in ("delta_norm", "delta_max"):
        assert torch.equal(w.series("fc", stat), torch.stack([rows[k]["fc"][stat] for k in w.steps]).double())
    assert w.anomalies == []


def two_group_sgd(model, lr_fc=0.1):
    """SGD with two param groups: fc1 and fc2 at 0.01, the output layer at `lr_fc`."""
    rest = [p for n, p in model.named_parameters() if not n.startswith("fc.")]
    return torch.optim.SGD([{"params": rest, "lr": 0.01}, {"params": model.fc.parameters(), "lr": lr_fc}],
                           momentum=0.9)


def raise_lr_at(opt, k, times):
    """after_step: the manual change a user makes at step k (every group's LR × times)."""
    def after(step):
        if step == k:
            for g in opt.param_groups:
                g["lr"] *= times
    return after


@pytest.mark.parametrize("every,flight", [(1, True), (1, False), (3, False)])
def test_learning_rate_per_step(every, flight):
    """lr is the LR each layer's param group had at that step's optimizer step: under a StepLR scheduler, with
    two param groups of different LRs, and after a manual change at step 7; exactly as the hand-written hooks."""
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    ref = copy.deepcopy(model)
    x, y = data()
    opt, ref_opt = two_group_sgd(model), two_group_sgd(ref)
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (opt, ref_opt))
    manual, ref_manual = raise_lr_at(opt, 7, 300.0), raise_lr_at(ref_opt, 7, 300.0)
    layers = ["fc1", "fc2", "fc"]
    rows, _ = reference_stats(ref, ref_opt, x, y, 12, layers, lambda k: (ref_sched.step(), ref_manual(k)))
    with watch(model, every=every, flight_recorder=flight) as w:
        for k in range(12):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            manual(k)
    col = STAT_NAMES.index("lr")
    want = torch.tensor([[rows[k][n]["lr"].item() for n in layers] for k in w.steps], dtype=torch.float64)
    assert w.stats.dtype == torch.float32  # the float32 of each rate (docs/guide/watch.md: the storage's dtype)
    assert torch.equal(w.stats[:, :, col], want.float())
    assert w.series("fc", "lr").tolist() == want[:, 2].float().tolist()
    lr = w.stats[:, :, col].double()
    f32 = lambda v: torch.tensor(v, dtype=torch.float64).float().item()  # noqa: E731 - the rate as kept
    assert torch.allclose(lr[:, 2], lr[:, 0] * 10, rtol=1e-7)  # two groups: the output layer's LR is 10× the others'
    if every == 1:
        assert lr[:4, 0].tolist() == [f32(0.01)] * 4 and lr[4, 0].item() == f32(0.005)  # StepLR halves it at step 4
        assert lr[7, 0].item() == f32(0.005) and lr[8, 0].item() == pytest.approx(0.0025 * 300)  # halved, then ×300


def test_learning_rate_tensor_moves_with_the_row(monkeypatch):
    """A learning rate a scheduler keeps as a tensor (capturable optimizers, on device) is not read per step:
    it moves to the host with the row, in the same transfer; a step no optimizer stepped has NaN."""
    from hookwidget.capture import step_stats

    plain = step_stats.learning_rates

    def as_tensors(opt, groups):
        return {li: torch.tensor(float(v), dtype=torch.float64) for li, v in plain(opt, groups).items()}

    monkeypatch.setattr(step_stats, "learning_rates", as_tensors)
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    x, y = data()
    with watch(model, flight_recorder=False, batch=4) as w:
        for k in range(9):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if k != 5:
                opt.step()
            opt.param_groups[0]["lr"] *= 2
    lr = w.stats[:, :, STAT_NAMES.index("lr")]
    want = torch.tensor([0.05 * 2 ** k for k in range(9)], dtype=torch.float64).float().tolist()  # stored float32
    assert lr[:, 0].tolist()[:5] == want[:5] and lr[:, 1].tolist()[6:] == want[6:]
    assert lr[5].isnan().all()  # no optimizer step after backward 5


def test_learning_rate_reaches_the_front_end():
    """The widget's meta and the page's data name lr among the statistics, as the schema's watch_meta says; the
    rows they send carry it (the widget's statistics buffer, the page's base64 full-resolution rows)."""
    import base64
    import importlib
    import json

    import jsonschema

    from hookwidget.views import watch_export
    from hookwidget.views.widget import PAYLOAD_SCHEMA

    ww = importlib.import_module("hookwidget.views.watch_widget")
    spec = json.loads(PAYLOAD_SCHEMA.read_text(encoding="utf-8"))
    assert tuple(spec["$defs"]["watch_meta"]["properties"]["stats"]["items"]["enum"]) == STAT_NAMES
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    opt = two_group_sgd(model)
    x, y = data()
    with watch(model, flight_recorder=False) as w:
        run_loop(model, opt, x, y, 3)
    wid = ww.WatchWidget(w)
    sent = []
    wid.send = lambda content, buffers=None: sent.append((content, buffers))
    wid._on_msg(wid, {"type": "sync", "have": 0, "request_id": "s1"}, [])
    page = watch_export.data(w)
    validate = jsonschema.Draft202012Validator({"$defs": spec["$defs"], "$ref": "#/$defs/watch_meta"}).validate
    for meta in (wid.meta, page["meta"]):
        validate(meta)
    col, K = STAT_NAMES.index("lr"), len(STAT_NAMES)
    for raw in (sent[0][1][0], base64.b64decode(page["segments"][0]["stats"])):  # float32 rows, as the view holds
        got = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(3, -1, K)[:, :, col]
        assert got.tolist() == [torch.tensor([0.01, 0.01, 0.1]).float().tolist()] * 3


def test_series_and_names():
    torch.manual_seed(0)
    model = Net(bn=False)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    x, y = data()
    with watch(model, flight_recorder=False) as w:
        plain = run_loop(model, opt, x, y, 5)
    assert torch.equal(w.series("fc2", "grad_norm"), w.stats[:, 1, STAT_NAMES.index("grad_norm")])
    assert w.series("loss").tolist() == [float(loss) for loss, _ in plain]
    assert torch.equal(w.loss, w.series("loss")) and torch.equal(w.grad_norm, w.series("grad_norm"))
    with pytest.raises(KeyError, match="no layer 'nope'"):
        w.series("nope", "grad_norm")
    with pytest.raises(KeyError, match="no statistic"):
        w.series("fc", "bogus")
    with pytest.raises(KeyError, match="flight recorder is off"):
        w.trace(0)
    assert "5 steps" in repr(w)


def test_autograd_grad_calls_are_not_steps():
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    x, y = data()
    x.requires_grad_(True)
    with watch(model) as w:
        for _ in range(4):
            opt.zero_grad()
            out = model(x)
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = F.mse_loss(out, y) + 1e-3 * gx.pow(2).sum()
            loss.backward()
            opt.step()
    assert w.steps == [0, 1, 2, 3]
    assert all(math.isfinite(v) for v in w.series("fc", "delta_norm").tolist())


# -- flight recorder -------------------------------------------------------------------------------
def test_kept_trace_equals_the_step():
    """w.trace(k) is what hw.trace of step k shows: the (a, δ) of every layer, the .grad of that step and
    weight_grad rebuilt from them, against the plain loop (hand-written hooks) and against hw.trace."""
    from hookwidget.api import trace as hw_trace

    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    ref, ref2 = copy.deepcopy(model), copy.deepcopy(model)
    x, y = data()
    seen = {}
    for n in ("fc1", "fc2", "fc"):
        def hook(m, i, out, n=n):
            seen[n + ".a"] = i[0].detach().clone()
            out.register_hook(lambda g: seen.__setitem__(n + ".d", g.clone()))
        getattr(ref, n).register_forward_hook(hook)
    steps = {}
    plain = run_loop(ref, torch.optim.SGD(ref.parameters(), 0.05, momentum=0.9), x, y, 10,
                     on_step=lambda k: steps.__setitem__(k, dict(seen)))
    opt2 = torch.optim.SGD(ref2.parameters(), 0.05, momentum=0.9)
    traced = {}

    def one_step():
        opt2.zero_grad()
        F.mse_loss(ref2(x), y).backward()

    for k in range(10):  # the same loop, hw.trace around each step's forward and backward
        traced[k] = hw_trace(one_step, ref2)
        opt2.step()
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    with watch(model, keep=lambda step, stats: step in (0, 4)) as w:  # no step is kept for nothing: 0 asked for
        run_loop(model, opt, x, y, 10)
    assert w.kept == [0, 4, 9]
    assert w.anomalies == [(k, "keep", "user predicate keep(step, stats) returned True") for k in (0, 4)]
    for k in w.kept:
        t, h = w.trace(k), traced[k]
        assert isinstance(t, Trace) and len(t.steps) == 1
        loss, grads = plain[k]
        assert t.loss == loss.item() == h.loss
        for n in ("fc1", "fc2", "fc"):
            assert torch.equal(t.layers[n].a, steps[k][n + ".a"]) and torch.equal(t.layers[n].delta, steps[k][n + ".d"])
            assert torch.equal(t.steps[-1].grads[n + ".weight"], grads[n + ".weight"])  # .grad of that step, bitwise
            torch.testing.assert_close(t.weight_grad(n), grads[n + ".weight"], rtol=1e-5, atol=1e-6)
            assert torch.equal(t.weight_grad(n), h.weight_grad(n))
        assert list(t.layers) == list(h.layers)
        assert t.graph.number_of_nodes() == h.graph.number_of_nodes()
        assert sorted(t.graph.nodes) == sorted(h.graph.nodes)
        assert t.user_hooks == {}  # the watch's own hooks are not the user's
    assert w.trace() is w.trace(9)
    with pytest.raises(KeyError, match="step 5 was not kept"):
        w.trace(5)


def test_flight_recorder_makes_no_trace_for_a_step_it_does_not_keep():
    torch.manual_seed(0)
    model = Net(bn=False)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    x, y = data()
    alive = []

    def traces():
        gc.collect()
        return sum(type(o) is Trace for o in gc.get_objects())

    base = traces()

    def count(k):
        alive.append(traces() - base - len(w._flight.kept))

    with watch(model) as w:
        run_loop(model, opt, x, y, 8, on_step=count)
    assert max(alive) == 0  # the latest step's recording is held, unassembled: its Trace is made if it is kept
    assert w.kept == [7]  # nothing anomalous: the latest only


def test_first_non_finite_in_backward_order():
    """On step 3 the gradient turns NaN in the backward of PoisonGrad, between fc2 and fc3: fc3's δ
    (reached first) is finite, fc2's and fc1's are not. The anomaly names fc2."""
    torch.manual_seed(0)
    model = Chain(PoisonGrad(at=3))
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 5), torch.randn(8, 2)
    deltas = []

    def record(name):
        def hook(m, i, out):
            out.register_hook(lambda g: deltas.append((name, int(torch.isnan(g).sum()))))
        return hook

    for n in ("fc1", "fc2", "fc3"):
        getattr(ref, n).register_forward_hook(record(n))
    opt = torch.optim.SGD(ref.parameters(), 0.1)
    run_loop(ref, opt, x, y, 6, skip_nonfinite=True)  # NaN grads do not reach the weights
    step3 = deltas[9:12]
    assert [n for n, _ in step3] == ["fc3", "fc2", "fc1"] and step3[0][1] == 0 and step3[1][1] > 0 and step3[2][1] > 0
    assert all(nan == 0 for _, nan in deltas[:9] + deltas[12:])
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with watch(model) as w:
        run_loop(model, opt, x, y, 6, skip_nonfinite=True)
    (onset,) = w.anomalies  # one anomaly: the onset, where it arose
    assert (onset.step, onset.where) == (3, "fc2") and w.nonfinite == {3: 0}  # step 4 is finite again
    parts = onset.reason.split(" | ")[1:]
    assert parts[0].startswith("fc2: δ") and parts[0].endswith(f"(nan {step3[1][1]}, inf 0); 2 layers in all")
    assert [p.split(" ")[:2] for p in parts[1:]] == [["fc2:", ".grad"]]  # fc2 is also the first with a NaN .grad
    assert w.stats[3, 2, STAT_NAMES.index("delta_nan")].item() == 0  # fc3
    assert w.stats[3, 1, STAT_NAMES.index("delta_nan")].item() == step3[1][1]  # fc2
    assert 3 in w.kept and math.isnan(w.trace(3).layers["fc2"].delta.sum().item())


def test_first_non_finite_in_forward_order():
    """PoisonOut makes the input of layer 3 NaN on step 2, and so that of layer 5 after it: the activation
    anomaly names 3 (the first in forward order; layer 0's input is finite). The loss is NaN, so every δ
    is, and the δ anomaly names 5, reached first in backward order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), PoisonOut(at=2), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 2))
    x, y = torch.randn(8, 5), torch.randn(8, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with watch(model) as w:
        run_loop(model, opt, x, y, 5, skip_nonfinite=True)
    (onset,) = w.anomalies
    assert (onset.step, onset.where) == (2, "5")  # where δ turned non-finite: the loss is NaN, so every δ is
    parts = [p.split(" ")[:2] for p in onset.reason.split(" | ")[1:]]
    assert parts == [["non-finite", "loss"], ["5:", "δ"], ["3:", "input"], ["5:", ".grad"]]
    a_rms = w.stats[2, :, STAT_NAMES.index("a_rms")]
    assert math.isfinite(a_rms[0]) and math.isnan(a_rms[1]) and math.isnan(a_rms[2])
    assert w.kept == [2, 4]


def test_divergence_by_too_large_learning_rate():
    """SGD at lr=30 diverges. The plain loop, with hand-written δ hooks, says at which steps the loss, a
    .grad or a δ is non-finite and which layer's δ is the first non-finite in backward order; the
    watch's anomalies say the same."""
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    ref = copy.deepcopy(model)
    x, y = data()
    arrivals, calls = [], []  # per step: (layer, δ finite) in backward order; (layer, input finite) in forward order
    for n in ("fc1", "fc2", "fc"):
        def hook(m, i, out, n=n):
            calls.append((n, bool(torch.isfinite(i[0]).all())))
            out.register_hook(lambda g: arrivals.append((n, bool(torch.isfinite(g).all()))))
        getattr(ref, n).register_forward_hook(hook)
    plain = run_loop(ref, torch.optim.SGD(ref.parameters(), 30.0), x, y, 25)
    bad_loss = [k for k, (loss, _) in enumerate(plain) if not torch.isfinite(loss)]
    bad_grad = [k for k, (_, g) in enumerate(plain) if not all(torch.isfinite(v).all() for v in g.values())]
    first_bad_delta, first_bad_input = {}, {}
    for k in range(25):
        for seen, first in ((arrivals, first_bad_delta), (calls, first_bad_input)):
            bad = [n for n, finite in seen[3 * k:3 * k + 3] if not finite]
            if bad:
                first[k] = bad[0]
    assert bad_loss and first_bad_delta and first_bad_input  # it diverges
    with watch(model, max_kept=3) as w:
        run_loop(model, torch.optim.SGD(model.parameters(), 30.0), x, y, 25)
    bad = sorted(set(bad_loss + bad_grad + list(first_bad_delta) + list(first_bad_input)))
    onset = bad[0]
    assert bad == list(range(onset, 25))  # once non-finite, it stays so
    # one anomaly for the onset, where it arose (the first non-finite δ in backward order), the steps after it counted
    after = [a for a in w.anomalies if a.step >= onset]
    assert [(a.step, a.where) for a in after] == [(onset, first_bad_delta[onset])]
    assert (onset in bad_loss) == ("non-finite loss" in after[0].reason)
    assert (onset in first_bad_input) == (f"{first_bad_input.get(onset)}: input activation" in after[0].reason)
    assert w.nonfinite == {onset: 24 - onset}
    assert onset in w.kept and all(k <= onset or k == 24 for k in w.kept)  # the onset's Trace, not the stretch's


def test_spikes_and_window():
    torch.manual_seed(0)
    x, y = data()
    for window, expect in ((20, {(30, "loss"), (30, "grad_norm")}), (40, set())):
        torch.manual_seed(0)
        model = Net(bn=False, p=0.0)
        opt = torch.optim.SGD(model.parameters(), 1e-3)
        with watch(model, window=window, flight_recorder=False) as w:
            run_loop(model, opt, x, y, 40, scale={30: 1000.0})
        assert {(a.step, a.where) for a in w.anomalies} == expect
    with watch(model, spike=1e9) as w:
        run_loop(model, opt, x, y, 40, scale={30: 1000.0})
    assert w.anomalies == [] and w.kept == [39]


def test_a_non_finite_step_is_kept_over_earlier_spikes():
    """max_kept=2 filled by two loss spikes: a third spike is not kept, but the first NaN step is, in place of the
    latest kept spike (warnings must not crowd out the step that went wrong; the first warning stays), and a second
    NaN step is not (first come); every anomaly is still listed, and dropped_traces counts the three."""
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    x, y = data()
    scale = {10: 1000.0, 17: 1000.0, 24: 1000.0, 31: float("nan"), 33: float("nan")}
    with watch(model, window=5, max_kept=2) as w:
        run_loop(model, torch.optim.SGD(model.parameters(), 1e-4), x, y, 36, scale=scale, skip_nonfinite=True)
    assert {a.step for a in w.anomalies} == {10, 17, 24, 31, 33}
    assert w.kept == [10, 31, 35] and w.dropped_traces == 3
    assert math.isnan(w.trace(31).loss) and w.trace(10).loss == pytest.approx(w.loss[10].item())
    with pytest.raises(KeyError, match="step 17 was not kept"):
        w.trace(17)


def test_what_a_kept_trace_is_worth():
    """Detector.rank, which the flight recorder keeps by: a non-finite .grad ranks above the user's keep=, which
    ranks above a spike; the same non-finite .grad in a step the GradScaler skipped is the scaler's found-inf
    (a warning, as a spike); an unflagged step has no rank."""
    from hookwidget.watch.detect import ASKED, NONFINITE, WARNING, Detector

    det = Detector(["a", "b"], spike=6.0, window=2, keep=lambda step, stats: step == 3)

    def check(step, nan_grad=False, loss=1.0, skipped=None):
        row = torch.zeros(2, len(STAT_NAMES), dtype=torch.float64)
        row[1, STAT_NAMES.index("grad_nan")] = float(nan_grad)
        det.check(step, row, torch.tensor([loss, 1.0], dtype=torch.float64), {0: 1, 1: 0}, {0: 0, 1: 1},
                  skipped=skipped)

    for k in range(3):
        check(k, loss=1.0 + 0.01 * k)
    check(3)
    check(4, loss=100.0)
    check(5, nan_grad=True)
    check(6, nan_grad=True, skipped="found inf")
    assert [det.rank(k) for k in range(7)] == [None, None, None, ASKED, WARNING, NONFINITE, WARNING]


# -- the magic ------------------------------------------------------------------------------------
def test_hookwatch_magic():
    from IPython.core.error import UsageError
    from IPython.testing import globalipapp

    from hookwidget.magic import hookwatch_magic

    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    shell.register_magic_function(lambda line, cell: hookwatch_magic(shell, line, cell), "cell", "hookwatch")
    torch.manual_seed(0)
    model = Net(bn=False)
    x, y = data()
    before = hook_state(list(model.modules()))
    shell.user_ns.update(model=model, x=x, y=y, opt=torch.optim.SGD(model.parameters(), 0.1), F=F)
    cell = "for i in range(3):\n    opt.zero_grad()\n    F.mse_loss(model(x), y).backward()\n    opt.step()\n"
    try:
        shell.run_cell_magic("hookwatch", "model -o W --every 2", cell)
        w = shell.user_ns["W"]
        assert w.steps == [0, 2] and w.kept == [2]
        assert_no_hooks_left(model, before)
        with pytest.raises(ZeroDivisionError):
            shell.run_cell_magic("hookwatch", "model", cell + "1 / 0\n")
        assert shell.user_ns["_hookwatch"].steps == [0, 1, 2]
        assert_no_hooks_left(model, before)
        with pytest.raises(UsageError, match="no variable 'nomodel'"):
            shell.run_cell_magic("hookwatch", "nomodel", cell)
        with pytest.raises(UsageError, match="is a Tensor, not an nn.Module"):
            shell.run_cell_magic("hookwatch", "x", cell)
        with pytest.raises(UsageError, match="usage: %%hookwatch MODEL"):
            shell.run_cell_magic("hookwatch", "model --every", cell)
    finally:
        shell.magics_manager.magics["cell"].pop("hookwatch", None)
        for k in ("W", "_hookwatch", "model", "x", "y", "opt", "F", "i"):
            shell.user_ns.pop(k, None)


def test_bad_arguments():
    with pytest.raises(TypeError, match="must be an nn.Module"):
        watch(torch.zeros(1))
    with pytest.raises(ValueError, match="every"):
        watch(nn.Linear(2, 2), every=0)
    with pytest.raises(TypeError, match="keep"):
        watch(nn.Linear(2, 2), keep=3)


def test_statistics_move_to_host_in_batches(monkeypatch):
    """Without the flight recorder the statistics stay on device and come over `batch` steps at a time (the live
    view's timed moves, every FLUSH_SECONDS, set aside: on a loaded machine slow steps would add some)."""
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    opt = torch.optim.SGD(model.parameters(), 0.01)
    x, y = data()
    transfers = []
    moving = host.InFlight
    monkeypatch.setattr(host, "InFlight", lambda t: transfers.append(t.shape) or moving(t))  # a row's way home
    monkeypatch.setattr(host, "FLUSH_SECONDS", 1e9)  # on CPU rows also move every FLUSH_SECONDS: not in this test
    w = watch(model, flight_recorder=False, batch=64)
    try:
        run_loop(model, opt, x, y, 150)
        assert len(transfers) == 2  # after 65 steps, then after 130: 64 rows each time
        assert w.stats.shape[0] == 150 and len(transfers) == 3  # reading brings the rest
    finally:
        w.close()  # a watch left open would leave its stand-ins for the tests after this one
    monkeypatch.undo()
    assert w.steps == list(range(150))


def test_rows_that_reach_the_host_alone_equal_rows_moved_in_batches():
    """With the flight recorder on each step's row reaches the host alone: the statistics are those of a watch
    that moved them in batches, and the update ratio of the latest step is still written into its row."""
    MERGE = 64

    torch.manual_seed(0)
    model = Net(bn=False, p=0.0)
    twin = copy.deepcopy(model)
    x, y = data()
    opt, opt2 = torch.optim.Adam(model.parameters(), 1e-3), torch.optim.Adam(twin.parameters(), 1e-3)
    watches = []
    for m, o, fr in ((model, opt, True), (twin, opt2, False)):  # one after the other: a watch sees every backward
        with watch(m, flight_recorder=fr, max_kept=1) as w:
            for _ in range(3 * MERGE + 5):
                o.zero_grad()
                F.mse_loss(m(x), y).backward()
                o.step()
        watches.append(w)
    w, w2 = watches
    assert w.steps == w2.steps == list(range(3 * MERGE + 5))
    assert torch.equal(w.stats.nan_to_num(-1), w2.stats.nan_to_num(-1))
    assert torch.equal(w.step_stats, w2.step_stats)


def test_a_second_watch_on_a_watched_model_warns():
    model = Net(bn=False, p=0.0)
    with watch(model, flight_recorder=False) as w:
        with pytest.warns(UserWarning, match="already watched by an open watch"):
            again = watch(model.fc2, flight_recorder=False)
        again.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch(model, flight_recorder=False).close()  # the first one is closed: no warning
    assert not w.active


def test_a_layer_called_twice_counts_both_calls():
    torch.manual_seed(0)
    lin, head = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"lin": lin, "head": head})
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    deltas, inputs = [], []

    def hook(m, i, o):
        inputs.append(i[0].detach())
        o.register_hook(lambda g: deltas.append(g.clone()))

    ref["lin"].register_forward_hook(hook)

    def loop(m, n):
        for _ in range(n):
            m.zero_grad()
            F.mse_loss(m["head"](m["lin"](torch.tanh(m["lin"](x)))), y).backward()

    loop(ref, 2)
    with watch(model) as w:
        loop(model, 2)
    for k in range(2):
        d, a = deltas[2 * k:2 * k + 2], inputs[2 * k:2 * k + 2]
        want_norm = torch.linalg.vector_norm(torch.cat([t.flatten() for t in d]))
        want_rms = torch.cat([t.flatten() for t in a]).pow(2).mean().sqrt()
        assert w.series("lin", "delta_norm")[k].item() == pytest.approx(want_norm.item(), rel=1e-6)
        assert w.series("lin", "delta_max")[k].item() == max(t.abs().max().item() for t in d)
        assert w.series("lin", "a_rms")[k].item() == pytest.approx(want_rms.item(), rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_sample, flight", [(False, False), (True, False), (False, True), (True, True)])
def test_no_host_sync_per_step_on_gpu(per_sample, flight):
    """Statistics only, per-sample norms, and the flight recorder (its judgement sent ahead in a non-blocking copy:
    tests/test_watch_no_sync.py counts the same on the CPU) run with no host sync a step."""
    torch.manual_seed(0)
    model = Net(bn=True).cuda()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = (t.cuda() for t in data())
    run_loop(model, opt, x, y, 2)  # warm up outside the check
    with watch(model, flight_recorder=flight, batch=64, per_sample=per_sample) as w:
        run_loop(model, opt, x, y, 2)  # the first steps build the watch's index tensors (a copy to the device each)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(18):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert w.stats.shape == (20, 4, len(STAT_NAMES)) and w.anomalies == []
    assert not per_sample or (w.per_sample.shape == (20, 2) and torch.isfinite(w.per_sample).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flight", [False, True])
def test_learning_rate_on_device_without_a_sync(flight):
    """A capturable optimizer's LR is a device tensor, changed in place (as a scheduler does): the watch records it
    per step with no host sync, flight recorder on or off (moved with the rows), as plain PyTorch reads it."""
    torch.manual_seed(0)
    model = Net(bn=False, p=0.0).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=True)
    x, y = (t.cuda() for t in data())
    seen = []
    with watch(model, flight_recorder=flight, batch=64) as w:
        for k in range(20):
            if k == 2:  # the first steps build the watch's index tensors (a copy to the device each, once)
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            finally:
                if k == 19:
                    torch.cuda.set_sync_debug_mode("default")
            seen.append(opt.param_groups[0]["lr"].clone())
            if k == 12:
                opt.param_groups[0]["lr"].mul_(300)
    want = torch.stack(seen).double().cpu()
    got = w.stats[:, :, STAT_NAMES.index("lr")]
    assert torch.equal(got, want.view(-1, 1).expand_as(got))
    assert got[13, 0].item() == pytest.approx(got[12, 0].item() * 300, rel=1e-6)


def test_delta_seen_through_an_in_place_op_after_a_3d_linear():
    """A 3-D Linear's output is a view; ReLU(inplace=True) after it replaces the view's grad_fn. δ still arrives
    (reference: the same model with an out-of-place ReLU and a hand-written tensor hook)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 1))
    ref = copy.deepcopy(model)
    ref[1] = nn.ReLU()
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 1)
    deltas = []

    def hook(m, i, out):
        out.register_hook(deltas.append)

    ref[0].register_forward_hook(hook)
    for m in (ref, model):
        w = watch(model) if m is model else None
        for _ in range(3):
            m.zero_grad()
            F.mse_loss(m(x), y).backward()
        if w is not None:
            w.close()
    want = [torch.linalg.vector_norm(g).double() for g in deltas]
    assert len(want) == 3 and torch.equal(w.series("0", "delta_norm"), torch.stack(want))


@pytest.mark.parametrize("flight_recorder", [True, False])
def test_reading_mid_step_changes_no_statistic(flight_recorder):
    """Reading w.stats between backward and opt.step moves that step's row to the host before its update
    ratio exists; the optimizer step then writes it there. Same statistics as a loop read only at the end."""
    x, y = data()
    results = []
    for read in (False, True):
        torch.manual_seed(0)
        model = Net(bn=False, p=0.0)
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        with watch(model, flight_recorder=flight_recorder) as w:
            run_loop(model, opt, x, y, 6, on_step=(lambda k: w.stats) if read else None)
        results.append(w.stats)
    assert torch.isfinite(results[0][:, :, STAT_NAMES.index("update_ratio")]).all()
    assert torch.equal(results[0], results[1])


class TiedWithIdle(nn.Module):
    """An embedding and a head sharing one weight, a Linear between, and a Linear called but not in the loss."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.idle = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.emb.weight

    def forward(self, idx, poison=None):
        h = self.fc(self.emb(idx))
        if poison is not None:
            h = h * poison
        self.idle(h)  # δ never reaches it
        return self.head(torch.tanh(h))


def test_counts_shared_parameters_and_unreached_layers_exact():
    """NaN/Inf counts of δ, a and .grad, a weight shared by two layers, and a layer backward never reaches,
    against hand-written hooks in the plain loop."""
    torch.manual_seed(0)
    model = TiedWithIdle()
    ref = copy.deepcopy(model)
    ref.head.weight = ref.emb.weight
    idx, tgt = torch.randint(0, 10, (5, 3)), torch.randint(0, 10, (5, 3))
    poison = torch.ones(5, 3, 4)
    poison[1, 0, 2], poison[3, 2, 0] = float("inf"), float("nan")
    seen = {}
    for n in ("fc", "head"):
        def hook(m, i, out, n=n):
            seen[n + ".a"] = i[0].detach().clone()
            out.register_hook(lambda g: seen.__setitem__(n + ".d", g.clone()))
        getattr(ref, n).register_forward_hook(hook)

    def loop(m, opt, on_step=None):
        for k in range(3):
            opt.zero_grad()
            out = m(idx, poison if k == 1 else None)
            F.cross_entropy(out.reshape(-1, 10), tgt.reshape(-1)).backward()
            if on_step is not None:
                on_step(k)
            if k != 1:
                opt.step()

    want = {}

    def record(k):
        grads = {n: torch.cat([p.grad.flatten() for p in getattr(ref, n).parameters()]) for n in ("fc", "head")}
        want[k] = {n: (seen[n + ".d"], seen[n + ".a"], grads[n]) for n in ("fc", "head")}
        want[k]["emb"] = ref.emb.weight.grad.clone()

    loop(ref, torch.optim.SGD(ref.parameters(), 0.1), record)
    with watch(model, flight_recorder=False) as w:
        loop(model, torch.optim.SGD(model.parameters(), 0.1))
    assert w.layer_names == ["emb", "fc", "idle", "head"]
    col = {n: STAT_NAMES.index(n) for n in STAT_NAMES}
    for k in range(3):
        for li, n in ((1, "fc"), (3, "head")):
            d, a, g = want[k][n]
            row = w.stats[k, li]
            assert row[col["delta_nan"]] == torch.isnan(d).sum() and row[col["delta_inf"]] == torch.isinf(d).sum()
            assert row[col["a_nonfinite"]] == (~torch.isfinite(a)).sum()
            assert row[col["grad_nan"]] == torch.isnan(g).sum() and row[col["grad_inf"]] == torch.isinf(g).sum()
            if k != 1:
                assert row[col["grad_norm"]].item() == pytest.approx(torch.linalg.vector_norm(g).item(), rel=1e-6)
                assert row[col["delta_max"]].item() == d.abs().max().item()
        # the shared weight counts in both layers that hold it
        if k != 1:
            emb_norm = w.stats[k, 0, col["grad_norm"]].item()
            assert emb_norm == pytest.approx(torch.linalg.vector_norm(want[k]["emb"]).item(), rel=1e-6)
        idle = w.stats[k, 2]
        for c in ("delta_norm", "delta_max", "delta_nan", "a_rms", "a_zero_frac", "a_nonfinite", "grad_norm"):
            assert math.isnan(idle[col[c]].item()), (k, c)
        assert idle[col["weight_norm"]].item() > 0
    assert w.stats[1, 1, col["a_nonfinite"]] == 0 and w.stats[1, 3, col["a_nonfinite"]] == 1  # tanh(inf) = 1
    (onset,) = [a for a in w.anomalies if a.step == 1]  # the onset: where δ turned non-finite, the loss listed first
    assert onset.where == "head" and onset.reason.split(" | ")[1].startswith("non-finite loss")


def test_layers_returning_a_dict_or_a_dataclass_are_seen():
    """The watch reads a layer's output as capture does (capture/tensors.first_tensor): the first tensor of a
    dict (a Hugging Face ModelOutput) or a dataclass too. Reference: hand-written hooks on the same tensors."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor

    class Layer(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.lin, self.kind = nn.Linear(4, 4), kind

        def forward(self, x):
            y = self.lin(x)
            return {"hidden": y, "extra": None} if self.kind == "dict" else Out(y)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Layer("dict"), Layer("dataclass")

        def forward(self, x):
            return self.b(self.a(x)["hidden"]).hidden.sum()

    torch.manual_seed(0)
    model, x = Model(), torch.randn(3, 4)
    for layer in (model.a, model.b):  # own parameters, so watched as layers: give them one
        layer.scale = nn.Parameter(torch.ones(()))
    seen = {}

    def keep(name):
        def hook(m, i, o):
            (o["hidden"] if isinstance(o, dict) else o.hidden).register_hook(lambda g: seen.setdefault(name, g))

        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in (("a", model.a), ("b", model.b))]
    with watch(model, flight_recorder=False) as w:
        model(x).backward()
    for h in hooks:
        h.remove()
    for n in ("a", "b"):
        assert w.series(n, "delta_norm")[0].item() == pytest.approx(torch.linalg.vector_norm(seen[n]).item())


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_is_seen_in_full(reentrant):
    """Reentrant checkpointing runs the checkpointed layers' first forward without grad, and again inside backward;
    non-reentrant recomputes inside backward what the first forward's graph needs. Either way the statistics equal
    the unchecked run's and the checked run's gradients are the unchecked run's: the watch changes nothing. The
    per-sample maxima too without reentrance; with it, the block's output is an opaque node no proof of where the
    samples are passes, so the layer after it is left out of them, with a note (a size match is no proof)."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3, self.fc = (nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 16),
                                                     nn.Linear(16, 3))

        def forward(self, x, ckpt=True):
            h = F.relu(self.fc1(x))
            block = lambda t: F.relu(self.fc3(F.relu(self.fc2(t))))  # noqa: E731
            h = checkpoint(block, h, use_reentrant=reentrant) if ckpt else block(h)
            return self.fc(h)

    torch.manual_seed(0)
    model, (x, y) = Ckpt(), data()
    plain = copy.deepcopy(model)
    stats, maxima, grads = [], [], []
    for m, ckpt in ((model, True), (plain, False)):
        opt = torch.optim.SGD(m.parameters(), 0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with watch(m, flight_recorder=False, per_sample=True) as w:
                for _ in range(3):
                    opt.zero_grad()
                    F.mse_loss(m(x, ckpt), y, reduction="sum").backward()
                    grads.append([p.grad.clone() for p in m.parameters()])
                    opt.step()
        stats.append(w.stats)
        maxima.append(w.per_sample)
        notes = [*w.notes, *(str(c.message) for c in caught if "hw.watch" in str(c.message))]
        if reentrant and ckpt:  # the block's output comes from an opaque reentrant node: no proof reaches fc
            assert len(w.notes) == 1 and "leave out fc" in w.notes[0] and "no proof places" in w.notes[0], notes
        else:
            assert not notes, notes
    assert not stats[0].isnan()[..., [STAT_NAMES.index(c) for c in ("delta_norm", "a_rms")]].any()
    torch.testing.assert_close(stats[0], stats[1], equal_nan=True)
    if not reentrant:  # reentrant: fc is left out of the per-sample norms (said in the note above)
        torch.testing.assert_close(maxima[0], maxima[1], equal_nan=True)
    for g, h in zip(grads[:3], grads[3:]):
        torch.testing.assert_close(g, h, rtol=0, atol=0)


def test_layers_never_called_are_named_once():
    """nn.MultiheadAttention uses out_proj's weight directly, never calling the module: its δ and activation
    columns are NaN at every step, which one note says (and why), while its weight statistics are recorded."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, norm_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    opt = torch.optim.AdamW(enc.parameters())
    x = torch.randn(3, 5, 16)
    with watch(enc, flight_recorder=False) as w:
        for _ in range(3):
            opt.zero_grad()
            enc(x).pow(2).mean().backward()
            opt.step()
    named = [n for n in w.notes if "no call of" in n]
    assert len(named) == 1 and "layers.0.self_attn.out_proj, layers.1.self_attn.out_proj reached" in named[0]
    out_proj = enc.layers[0].self_attn.out_proj
    assert torch.isnan(w.series("layers.0.self_attn.out_proj", "delta_norm")).all()
    grad_norm = w.series("layers.0.self_attn.out_proj", "grad_norm")
    assert torch.isfinite(grad_norm).all() and grad_norm[-1] > 0 and out_proj.weight.grad is not None
    assert not any("no call of" in n for n in _watched_mlp_notes())


def _watched_mlp_notes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with watch(model) as w:
        model(torch.randn(5, 4)).sum().backward()
    return w.notes
