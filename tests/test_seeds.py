"""Every example of ../shared/seeds reproduced with hookwidget; references from autograd."""

import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw


# -- seed 003: what the hooks see, (a, δ) rebuild W.grad, node roles, Kronecker, storage -----
def test_seed003_shapes_of_a_and_delta(seed_mlp):
    model, x, y, step = seed_mlp
    t = hw.trace(step)
    assert tuple(t.layers["fc1"].a.shape) == (5, 6, 4)  # L1_a
    assert tuple(t.layers["fc2"].a.shape) == (5, 6, 3)  # L2_a
    assert tuple(t.layers["fc2"].delta.shape) == (5, 6, 2)  # L2_delta
    assert tuple(t.layers["fc1"].delta.shape) == (5, 6, 3)  # L1_delta


def test_seed003_what_the_hooks_see_equals_autograd(seed_mlp):
    model, x, y, step = seed_mlp
    t = hw.trace(step)
    # reference: a₁ and δ₁ by autograd directly
    a1 = model.fc1(x)
    out = model.fc2(F.relu(a1))
    d1 = torch.autograd.grad(0.5 * ((out - y) ** 2).sum(), a1)[0]
    assert torch.equal(t.layers["fc1"].a, x.detach())
    assert torch.allclose(t.layers["fc1"].delta, d1, atol=1e-6)
    assert torch.allclose(t.layers["fc2"].a, F.relu(a1).detach())


def test_seed003_reconstruction_matches_w_grad(seed_mlp):
    model, x, y, step = seed_mlp
    t = hw.trace(step)
    for name in ("fc1", "fc2"):
        w = getattr(model, name).weight
        assert torch.allclose(t.weight_grad(name), w.grad, atol=1e-6)
        ref = torch.einsum("bto,bti->oi", t.layers[name].delta, t.layers[name].a)  # the seed's einsum
        assert torch.allclose(ref, w.grad, atol=1e-6)


def test_seed003_node_roles_of_the_diagram(seed_mlp):
    model, x, y, step = seed_mlp
    t = hw.trace(step)
    roles = {}
    for _, d in t.graph.nodes(data=True):
        roles.setdefault(d["role"], []).append(d)
    assert [d["name"] for d in roles["root"]] == ["MulBackward0"]  # L = 0.5 * (...)
    assert sorted(d["param"] for d in roles["param"]) == ["fc1.weight", "fc2.weight"]  # W₀, W₁: teal
    assert [d["name"] for d in roles["leaf"]] == ["AccumulateGrad"]  # x.requires_grad_(True)
    assert len(roles["input"]) >= 1  # y: gray, no grad
    assert all(d["name"].endswith("Backward0") for d in roles["op"])  # purple
    # gradients flow root -> params: every param node is reachable from the root
    root = next(n for n, d in t.graph.nodes(data=True) if d["role"] == "root")
    import networkx as nx

    reach = nx.descendants(t.graph, root)
    assert all(n in reach for n, d in t.graph.nodes(data=True) if d["role"] == "param")


def test_seed003_kronecker_example():
    delta, a = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
    vec = torch.outer(delta, a).T.reshape(-1)  # vec(δ aᵀ), column by column
    assert torch.equal(vec, torch.kron(a, delta))
    assert vec.tolist() == [3, 6, 4, 8, 5, 10]


def test_seed003_storage_4096():
    layer = nn.Linear(4096, 4096, bias=False)
    x = torch.randn(1, 4096)
    t = hw.trace(lambda: layer(x).sum().backward())
    s = t.storage("Linear")
    assert s["weight_grad_floats"] == 16_777_216
    assert s["factor_floats_per_token"] == 8_192


# -- seed 002: tensor hooks change the gradient flowing into a tensor -------------------------
def _pow_graph(x0, branches=False):
    x = torch.tensor(x0, requires_grad=True)

    def f():
        y = x**2
        z = y * 3
        out = z + y * 2 if branches else z
        out.backward()

    return x, f


def test_seed002_scale_12_to_24():
    x, f = _pow_graph(2.0)
    t = hw.trace(f)
    assert x.grad.item() == 12.0  # 3 * 2 * x
    t.add_hook("PowBackward0#0", "grad_scale", factor=2.0)
    t2 = t.rerun()
    assert t2.param_grads["x"].item() == 24.0
    assert x.grad.item() == 12.0  # a rerun is a what-if: x.grad is as the first run left it


def test_seed002_clamp_gives_20_not_6():
    x, f = _pow_graph(10.0)
    t = hw.trace(f)
    assert x.grad.item() == 60.0
    t.add_hook("PowBackward0#0", "grad_clamp", min=-1.0, max=1.0)
    t2 = t.rerun()
    # reference: the seed's own code with register_hook
    xr = torch.tensor(10.0, requires_grad=True)
    yr = xr**2
    yr.register_hook(lambda g: torch.clamp(g, -1, 1))
    (yr * 3).backward()
    assert t2.param_grads["x"].item() == xr.grad.item() == 20.0  # 1 · 2 · 10; the seed says 6


def test_seed002_aggregated_gradient_10():
    x, f = _pow_graph(2.0, branches=True)
    t = hw.trace(f)
    assert x.grad.item() == 20.0  # (3 + 2) · 2x
    t.add_hook("PowBackward0#0", "grad_scale", factor=0.5)
    t2 = t.rerun()
    assert t2.param_grads["x"].item() == 10.0
    assert t2.graph.nodes["PowBackward0#0"]["grad_norm"] == 2.5  # the hook sees the summed 5, scales it


# -- seed 000/001: forward hooks see activations, and returning a new output changes the gradient
class Seed001Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def test_seed001_forward_hook_sees_activation_shape():
    torch.manual_seed(0)
    net, x = Seed001Net(), torch.randn(1, 10)
    t = hw.trace(lambda: net(x))
    assert tuple(t.layers["fc1"].calls[0].output_shape) == (1, 5)
    assert t.layers["fc1"].delta is None
    assert any("no gradients captured" in n for n in t.notes)
    assert "no_grads" in [n.id for n in t.note_records]


def test_seed000_wrong_forward_hook_returning_output_changes_gradient():
    torch.manual_seed(0)
    net, x, target = Seed001Net(), torch.randn(1, 10), torch.randn(1, 2)

    def step():
        net.zero_grad()
        F.mse_loss(net(x), target).backward()

    t = hw.trace(step)
    plain = net.fc1.weight.grad.clone()
    t.add_hook("fc1", "out_scale", factor=2.0)  # seed 001's `return output * 2`
    t2 = t.rerun()
    # reference: the seed's own hook, plain PyTorch
    h = net.fc1.register_forward_hook(lambda m, i, o: o * 2)
    net.zero_grad()
    F.mse_loss(net(x), target).backward()
    h.remove()
    assert torch.allclose(t2.param_grads["fc1.weight"], net.fc1.weight.grad)
    assert not torch.allclose(t2.param_grads["fc1.weight"], plain)  # it DOES change the gradient
    assert t2.diff(t).param("fc1.weight").rel_change > 0.1
