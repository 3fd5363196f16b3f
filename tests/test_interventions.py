"""Interventions, rerun, diff and health, against the same hooks written by hand in PyTorch."""

import collections
import dataclasses
import math
import re

import pytest
import torch
from torch import nn

import hookwidget as hw
from hookwidget.interventions import make


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
    ("grad_clamp", {"min": -math.inf, "max": 0.01}, lambda g: g.clamp(max=0.01), None),  # an open end is fine
    ("grad_zero", {}, lambda g: torch.zeros_like(g), None),
    ("grad_clip_norm", {"max_norm": 0.05}, lambda g: g * min(1.0, 0.05 / (float(g.norm()) + 1e-6)), None),
    ("out_scale", {"factor": 0.5}, None, lambda m, i, o: o * 0.5),
    ("out_zero", {}, None, lambda m, i, o: torch.zeros_like(o)),
]


@pytest.mark.parametrize("kind, params, tensor_hook, forward_hook", CASES,
                         ids=[f"{c[0]}{i}" for i, c in enumerate(CASES)])
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
    (lambda t: t.add_hook("3", "grad_scale", factor=math.nan),
     "grad_scale: factor=nan means nothing here, it must be a finite number; e.g. grad_scale(factor=0.5)"),
    (lambda t: t.add_hook("3", "out_scale", factor=-math.inf), "out_scale: factor=-inf means nothing here"),
    (lambda t: t.add_hook("3", "grad_scale", factor=10 ** 400),
     "grad_scale: factor is an integer of 401 digits, too large for a float; e.g. grad_scale(factor=0.5)"),
    (lambda t: t.add_hook("3", "grad_clamp", min=math.nan, max=1),
     "grad_clamp: min=nan means nothing here, it must be a finite number or -inf for no bound; "
     "e.g. grad_clamp(min=-1.0, max=1.0)"),
    (lambda t: t.add_hook("3", "grad_clamp", min=-1, max=-math.inf), "max=-inf means nothing here"),
    (lambda t: t.add_hook("3", "grad_clip_norm", max_norm=math.inf),
     "grad_clip_norm: max_norm=inf means nothing here, it must be a finite number; e.g. grad_clip_norm(max_norm=1.0)"),
    (lambda t: t.add_hook("3", "grad_clip_norm", max_norm=0), "grad_clip_norm: max_norm must be > 0, got 0.0"),
    (lambda t: t.add_hook("3", "grad_scale", factor=True), "grad_scale: factor must be a number, got True"),
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


def test_a_diff_of_two_model_instances_says_the_weights_differ(net):
    """Two instances of one architecture: every gradient differs, and not by a hook; the diff says so first."""
    import copy

    from hookwidget.views import payload

    model, x, y, step = net
    t = hw.trace(step)
    assert t.rerun().diff(t).weights_differ == []  # a rerun runs the same weights
    twin = copy.deepcopy(model)
    same = hw.trace(lambda: nn.functional.mse_loss(twin(x), y).backward())
    assert same.diff(t).weights_differ == []  # another instance with the same values: nothing to say
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    u = hw.trace(lambda: nn.functional.mse_loss(other(x), y).backward())
    d = u.diff(t)
    assert d.weights_differ == ["0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    assert repr(d).splitlines()[0] == ("weights differ: 0.weight, 0.bias, 3.weight and 3 more held other values in "
                                       "the two runs (two model instances, or the model changed between them), so "
                                       "their gradients differ for that reason too, not only by a hook")
    assert payload.diff(t, u)["weights_differ"] == d.weights_differ


def test_a_dropped_trace_is_freed_at_once_and_a_rerun_keeps_its_baseline(net):
    """A trace and its session form no reference cycle: `del t` frees the record and its tensors without the
    garbage collector. A rerun keeps the first run it is compared with (t2.diff()) and is the session's latest."""
    import gc
    import weakref

    model, x, y, step = net
    gc.collect()
    gc.disable()
    try:
        t = hw.trace(step)
        freed, delta = weakref.ref(t), weakref.ref(t.layers["5"].delta)
        del t
        assert freed() is None and delta() is None
        t = hw.trace(step)
        t.add_hook("5", "grad_scale", factor=2.0)
        t2 = t.rerun()
        first = weakref.ref(t)
        del t
        assert first() is not None and t2.session.latest is t2 and t2.session.baseline is first()
        d = t2.diff()
        assert d.param("5.weight").after == pytest.approx(2 * d.param("5.weight").before, rel=1e-6)
    finally:
        gc.enable()


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


# -- out_* on structured outputs: the output's own type comes back, its first tensor changed -----
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class PairData:
    a: torch.Tensor
    b: torch.Tensor


class ModelOutputLike(collections.OrderedDict):
    """Mimics transformers' ModelOutput: a dataclass whose non-None fields are also its dict items."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)


@dataclasses.dataclass
class EncoderOutput(ModelOutputLike):
    loss: torch.Tensor | None = None  # None here: the first *tensor* is `a`
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


def _reads(kind):
    """How the parent reads the two tensors back: by attribute, key or index, as code would."""
    return {"namedtuple": lambda o: (o.a, o.b), "dataclass": lambda o: (o.a, o.b), "dict": lambda o: (o["a"], o["b"]),
            "modeloutput": lambda o: (o.a, o["b"]), "tuple": lambda o: o, "list": lambda o: (o[0], o[1])}[kind]


PACK = {"namedtuple": lambda a, b: Pair(a, b), "dataclass": lambda a, b: PairData(a, b),
        "dict": lambda a, b: {"a": a, "b": b}, "modeloutput": lambda a, b: EncoderOutput(a=a, b=b),
        "tuple": lambda a, b: (a, b), "list": lambda a, b: [a, b]}


class Pack(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(6, 4), kind

    def forward(self, x):
        return PACK[self.kind](self.lin(x), x.tanh())


class Net(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.pack, self.head, self.kind = Pack(kind), nn.Linear(4, 2), kind

    def forward(self, x):
        out = self.pack(x)
        assert type(out) is type(PACK[self.kind](x, x))  # the intervention kept the output's type
        a, b = _reads(self.kind)(out)
        return self.head(a).sum() + (b ** 2).sum()


@pytest.mark.parametrize("container", list(PACK))
@pytest.mark.parametrize("kind, params, by_hand", [
    ("out_scale", {"factor": 0.5}, lambda a: a * 0.5),
    ("out_zero", {}, lambda a: torch.zeros_like(a)),
])
def test_out_kinds_rebuild_the_outputs_own_type(container, kind, params, by_hand):
    torch.manual_seed(0)
    net, x = Net(container), torch.randn(5, 6, requires_grad=True)

    def step():
        net.zero_grad()
        x.grad = None
        loss = net(x)
        loss.backward()
        return loss

    t = hw.trace(step)
    t.add_hook("pack", kind, **params)
    t2 = t.rerun()

    def replace_first_by_hand(m, i, o):
        a, b = _reads(container)(o)
        return PACK[container](by_hand(a), b)

    handle = net.pack.register_forward_hook(replace_first_by_hand)
    loss = step()
    handle.remove()
    assert t2.loss == pytest.approx(float(loss), rel=1e-6)
    assert torch.allclose(t2.param_grads["x"], x.grad)  # x's grad flows through both tensors
    for name, p in net.named_parameters():
        assert (t2.param_grads.get(name) is None) == (p.grad is None), name
        if p.grad is not None:
            assert torch.allclose(t2.param_grads[name], p.grad, atol=1e-6), name


def test_out_scale_on_a_real_transformers_model_output():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    iv = make("enc", "out_scale", {"factor": 2.0})
    h, p = torch.randn(2, 3), torch.randn(2)
    new = iv.on_output(None, (), outputs.BaseModelOutputWithPooling(last_hidden_state=h, pooler_output=p))
    assert type(new) is outputs.BaseModelOutputWithPooling
    assert torch.equal(new.last_hidden_state, h * 2.0) and torch.equal(new["last_hidden_state"], h * 2.0)
    assert new.pooler_output is p


def test_out_kinds_on_an_output_without_tensors_name_the_intervention():
    iv = make("m", "out_zero", {})
    with pytest.raises(hw.InterventionError, match="out_zero\\(\\) on 'm' found no tensor in the layer's str output"):
        iv.on_output(None, (), "text")


# -- a user's callable that returns what autograd cannot take: one line naming it ----------------
@pytest.mark.parametrize("fn, message", [
    (lambda g: g[:2], "returned shape (2, 8); the gradient has shape (10, 8)"),
    (lambda g: g.double(), "returned dtype torch.float64; the gradient has dtype torch.float32"),
    (lambda g: g.to("meta"), "returned a tensor on meta; the gradient is on cpu"),
    (lambda g: 1.0, "returned a float; the gradient is a tensor of shape (10, 8)"),
])
def test_a_callable_returning_the_wrong_gradient_gets_one_line(net, fn, message):
    import torch.nn.modules.module as module_mod

    model, x, y, step = net
    t = hw.trace(step)
    t.add_hook("3", "callable", fn=fn)
    with pytest.raises(hw.InterventionError) as e:
        t.rerun()
    assert str(e.value).startswith("intervention callable() on '3' (fn=<lambda>) " + message)
    assert str(e.value).endswith(": return a tensor of the same shape, dtype and device, or None")
    assert "\n" not in str(e.value)
    assert not module_mod._global_forward_hooks
    tanh = next(n for n, d in t.graph.nodes(data=True) if d["name"] == "TanhBackward0")
    t.remove_hook("3", "callable")
    t.add_hook(tanh, "callable", fn=fn)  # the node pre-hook path checks too
    with pytest.raises(hw.InterventionError, match=re.escape(message)):
        t.rerun()


def test_the_check_fires_on_the_view_shaped_gradient_when_the_hook_sits_on_the_views_base():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True), nn.Linear(3, 2))  # 3-D Linear: a view
    x = torch.randn(5, 6, 4)
    t = hw.trace(lambda: model(x).sum().backward())
    t.add_hook("0", "callable", fn=lambda g: g.reshape(30, 3)[:29])
    with pytest.raises(hw.InterventionError, match=re.escape("returned shape (29, 3); the gradient has shape "
                                                             "(5, 6, 3)")):
        t.rerun()
    t.add_hook("0", "callable", fn=lambda g: g * 2)  # the right shape works on the same path

    t2 = t.rerun()
    model.zero_grad()
    model(x).sum().backward()  # a hook on the view itself would not fire (the in-place ReLU replaces its grad_fn);
    assert torch.allclose(t2.param_grads["0.weight"], 2 * model[0].weight.grad, atol=1e-6)  # W.grad is linear in δ


def test_an_out_callable_returning_a_non_tensor_for_a_tensor_output_gets_one_line(net):
    model, x, y, step = net
    t = hw.trace(step)
    t.add_hook("3", "out_callable", fn=lambda m, i, o: o.tolist())
    with pytest.raises(hw.InterventionError, match=re.escape(
            "intervention out_callable() on '3' (fn=<lambda>) returned a list where the layer returned a tensor: "
            "return a tensor, or None to keep the output")):
        t.rerun()
