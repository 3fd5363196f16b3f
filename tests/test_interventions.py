"""Interventions, rerun, diff and health, against the same hooks written by hand in PyTorch."""

import math

import pytest
import torch
from torch import nn

import hookwidget as hw


@pytest.fixture
def net():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(8, 8),
                          nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(10, 6), torch.randn(10, 3)

    def step():
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return model, x, y, step


def reference_grads(model, step, hook_layer=None, tensor_hook=None, forward_hook=None, seed=3):
    """Gradients with the hook written by hand: a tensor hook on the layer's output, or a forward hook."""
    handles = []
    if tensor_hook is not None:
        handles.append(hook_layer.register_forward_hook(lambda m, i, o: o.register_hook(tensor_hook) and None))
    if forward_hook is not None:
        handles.append(hook_layer.register_forward_hook(forward_hook))
    torch.manual_seed(seed)
    loss = step()
    for h in handles:
        h.remove()
    return float(loss), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


CASES = [
    ("grad_scale", {"factor": 3.0}, lambda g: g * 3.0, None),
    ("grad_clamp", {"min": -0.01, "max": 0.01}, lambda g: g.clamp(-0.01, 0.01), None),
    ("grad_zero", {}, lambda g: torch.zeros_like(g), None),
    ("grad_clip_norm", {"max_norm": 0.05}, lambda g: g * min(1.0, 0.05 / (float(g.norm()) + 1e-6)), None),
    ("out_scale", {"factor": 0.5}, None, lambda m, i, o: o * 0.5),
    ("out_zero", {}, None, lambda m, i, o: torch.zeros_like(o)),
]


@pytest.mark.parametrize("kind, params, tensor_hook, forward_hook", CASES, ids=[c[0] for c in CASES])
def test_each_kind_equals_the_hand_written_hook(net, kind, params, tensor_hook, forward_hook):
    model, x, y, step = net
    torch.manual_seed(3)
    t = hw.trace(step)
    t.add_hook("3", kind, **params)
    t2 = t.rerun()
    ref_loss, ref = reference_grads(model, step, model[3], tensor_hook, forward_hook)
    assert t2.loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in ref.items():
        if g is None:  # out_zero cuts the graph: PyTorch leaves upstream .grad None, and so does the trace
            assert t2.param_grads.get(name) is None, name
        else:
            assert torch.allclose(t2.param_grads[name], g, atol=1e-6), name


def test_grad_zero_on_a_layer_zeroes_its_own_and_upstream_grads(net):
    model, x, y, step = net
    t = hw.trace(step)
    t.add_hook("3", "grad_zero")
    t2 = t.rerun()
    for name in ("0.weight", "0.bias", "3.weight", "3.bias"):
        assert torch.count_nonzero(t2.param_grads[name]) == 0, name
    assert torch.count_nonzero(t2.param_grads["5.weight"]) > 0
    assert torch.allclose(t2.weight_grad("3"), t2.param_grads["3.weight"])  # δ seen after the hook


def test_removing_every_intervention_reproduces_the_original_bitwise(net):
    model, x, y, step = net
    torch.manual_seed(3)
    t = hw.trace(step)  # Dropout draws from the RNG: rerun restores its state
    original = {n: g.clone() for n, g in t.param_grads.items()}
    t.add_hook("3", "out_scale", factor=2.0)
    t2 = t.rerun()
    assert t2.diff(t).param("0.weight").rel_change > 0
    t.remove_hook("3", "out_scale")
    t3 = t.rerun()
    assert all(torch.equal(t3.param_grads[n], g) for n, g in original.items())
    assert t3.loss == t.loss
    assert all(p.rel_change == 0.0 for p in t3.diff(t).params)


def test_node_target_prehook_changes_the_gradient_into_that_node(net):
    model, x, y, step = net
    t = hw.trace(step)
    tanh_node = next(n for n, d in t.graph.nodes(data=True) if d["name"] == "TanhBackward0")
    t.add_hook(tanh_node, "grad_scale", factor=0.0)
    t2 = t.rerun()
    assert torch.count_nonzero(t2.param_grads["3.weight"]) == 0
    assert torch.count_nonzero(t2.param_grads["5.weight"]) > 0


def test_user_callables(net):
    model, x, y, step = net
    rng = torch.get_rng_state()
    t = hw.trace(step)
    t.add_hook("3", "callable", fn=lambda g: g * 2)
    t.add_hook("5", "out_callable", fn=lambda m, i, o: o + 1)  # seed 000's `output + 1`
    t2 = t.rerun()
    handles = [model[3].register_forward_hook(lambda m, i, o: o.register_hook(lambda g: g * 2) and None),
               model[5].register_forward_hook(lambda m, i, o: o + 1)]
    torch.set_rng_state(rng)
    loss = step()
    for h in handles:
        h.remove()
    assert t2.loss == float(loss)
    for name, p in model.named_parameters():
        assert torch.equal(t2.param_grads[name], p.grad), name
    assert t2.diff(t).param("0.weight").rel_change > 0  # the forward hook's new output changed the gradient


def test_the_same_kind_twice_replaces_it(net):
    model, x, y, step = net
    t = hw.trace(step)
    t.add_hook("3", "grad_scale", factor=2.0)
    t.add_hook("3", "grad_scale", factor=0.0)
    assert len(t.interventions) == 1
    t2 = t.rerun()
    assert torch.count_nonzero(t2.param_grads["0.weight"]) == 0


@pytest.mark.parametrize("call, message", [
    (lambda t: t.add_hook("3", "grad_double"), "unknown intervention kind 'grad_double'; choose one of: grad_scale"),
    (lambda t: t.add_hook("3", "grad_scale"), "grad_scale needs factor"),
    (lambda t: t.add_hook("3", "grad_scale", factor="big"), "grad_scale: factor must be a number, got 'big'"),
    (lambda t: t.add_hook("3", "grad_scale", factr=2), "got unknown parameter(s) factr"),
    (lambda t: t.add_hook("9", "grad_zero"), "unknown target '9': give a layer name"),
    (lambda t: t.add_hook("3", "grad_clamp", min=1, max=-1), "grad_clamp: min=1.0 is above max=-1.0"),
    (lambda t: t.remove_hook("3", "grad_zero"), "no grad_zero hook on '3' to remove"),
])
def test_bad_input_gets_one_line_naming_the_fix(net, call, message):
    model, x, y, step = net
    t = hw.trace(step)
    with pytest.raises((ValueError, KeyError)) as e:
        call(t)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_raising_callable_names_the_intervention_and_leaves_no_hook(net):
    import torch.nn.modules.module as module_mod

    model, x, y, step = net
    t = hw.trace(step)

    def bad(g):
        raise RuntimeError("my bug")

    t.add_hook("3", "callable", fn=bad)
    with pytest.raises(hw.InterventionError, match="intervention callable\\(\\) on '3' raised RuntimeError: my bug"):
        t.rerun()
    assert not module_mod._global_forward_hooks
    t.remove_hook("3", "callable")
    t2 = t.rerun()  # a rerun after a failed rerun works
    assert all(torch.equal(t2.param_grads[n], g) for n, g in t.param_grads.items())


def test_diff_reports_norms_cosine_and_loss(net):
    model, x, y, step = net
    t = hw.trace(step)
    t.add_hook("5", "grad_scale", factor=2.0)
    d = t.rerun().diff(t)
    p = d.param("5.weight")
    assert p.after == pytest.approx(2 * p.before, rel=1e-6)
    assert p.cosine == pytest.approx(1.0, abs=1e-6)
    assert p.rel_change == pytest.approx(1.0, rel=1e-5)
    assert d.loss_before == d.loss_after
    assert "5.weight" in repr(d) and "loss:" in repr(d)


def test_health_finds_the_first_nan_and_vanishing_layers():
    torch.manual_seed(0)
    deep = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(16, 16), nn.Sigmoid())])
    for m in deep:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.05)
    x = torch.randn(4, 16)
    t = hw.trace(lambda: deep(x).sum().backward())
    h = t.health(vanishing=1e-4)
    assert h.layers["0"].vanishing and not h.layers["22"].vanishing
    assert h.first_nonfinite_node is None

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(2, 3)

    def nan_step():
        model.zero_grad()
        out = model(x)
        (out * torch.tensor(float("nan"))).sum().backward()

    h = hw.trace(nan_step).health()
    assert h.first_nonfinite_node is not None
    assert h.layers["1"].nonfinite > 0 and "nonfinite" in h.layers["1"].flags
    first = hw.trace(nan_step).graph.nodes[h.first_nonfinite_node]
    assert math.isnan(first["grad_max"])
    # out * nan: the NaN first arrives at the output node of layer "1", then flows on to its inputs
    assert (first["name"], first["module"]) == ("AddmmBackward0", "1")


def test_huge_but_finite_gradients_are_exploding_not_nonfinite():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(16)])
    for m in net:
        nn.init.orthogonal_(m.weight, gain=4.0)
    x = torch.randn(4, 16) * 1e3

    def step():
        net.zero_grad()
        net(x).pow(2).sum().backward()

    t = hw.trace(step)
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())  # the reference: autograd's grads
    h = t.health()
    assert h.first_nonfinite_node is None  # a float32 sum of squares would overflow to inf here
    assert h.layers["0"].exploding and not h.layers["0"].nonfinite
    node = t.graph.nodes[next(n for n, d in t.graph.nodes(data=True) if d["param"] == "0.weight")]
    assert node["grad_max"] == float(net[0].weight.grad.abs().max())
