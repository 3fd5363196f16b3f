"""Writes the example notebooks from the cells below: `.venv/bin/python examples/_build.py`.

The notebooks are generated so they stay reviewable as plain Python and are committed without
outputs (tests/test_examples.py executes them). Edit the cells here, rerun, commit both.
"""

# ruff: noqa: E501  (cells hold markdown tables and notebook-width code lines)

from __future__ import annotations

import pathlib
import textwrap

import nbformat

HERE = pathlib.Path(__file__).parent

SETUP = """\
import os

SMOKE = os.environ.get("HOOKWIDGET_SMOKE") == "1"  # CI sets it: tiny sizes, same code

import torch
import torch.nn as nn
import torch.nn.functional as F

import hookwidget as hw

%load_ext hookwidget"""


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


def write(name: str, cells: list) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    for i, cell in enumerate(nb.cells):  # stable ids keep the diffs of regenerated notebooks empty
        cell["id"] = f"{name[:2]}-{i:02d}"
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nbformat.validate(nb)
    nbformat.write(nb, HERE / name)


# ---------------------------------------------------------------------------------------------
NB01 = [
    md("""
    # Hooks explained

    This notebook answers the seeds' questions on your own screen: what a forward hook sees,
    what a backward hook sees, what a tensor hook does to a gradient, and why a forward hook
    that returns a new output *does* change the gradient.
    """),
    code(SETUP),
    md("""
    ## The hooks PyTorch gives you

    | Hook | Registration | When it fires | Signature | Returning a value |
    |---|---|---|---|---|
    | Pre-forward | `module.register_forward_pre_hook(fn)` | before `forward()` | `fn(module, args)` | replaces the inputs |
    | Forward | `module.register_forward_hook(fn)` | after `forward()` | `fn(module, args, output)` | replaces the output |
    | Backward pre | `module.register_full_backward_pre_hook(fn)` | during `backward()`, before the module's gradients | `fn(module, grad_output)` | replaces `grad_output` |
    | Backward | `module.register_full_backward_hook(fn)` | during `backward()`, after them | `fn(module, grad_input, grad_output)` | replaces `grad_input` |
    | Tensor | `tensor.register_hook(fn)` | during `backward()`, when the gradient of that tensor is ready | `fn(grad)` | replaces the gradient |

    Every `register_*` call returns a handle; `handle.remove()` takes the hook off. The cell
    below registers all five on one `nn.Linear` and prints what each one received, in the order
    they fired.
    """),
    code("""
    events = []
    lin = nn.Linear(3, 2)
    handles = [
        lin.register_forward_pre_hook(
            lambda m, args: events.append(f"forward pre-hook   args[0] {tuple(args[0].shape)}")),
        lin.register_forward_hook(
            lambda m, args, out: events.append(f"forward hook       output {tuple(out.shape)}, "
                                               f"out.grad_fn={type(out.grad_fn).__name__}")),
        lin.register_full_backward_pre_hook(
            lambda m, gout: events.append(f"backward pre-hook  grad_output[0] {tuple(gout[0].shape)}")),
        lin.register_full_backward_hook(
            lambda m, gin, gout: events.append(f"backward hook      grad_input[0] {tuple(gin[0].shape)}, "
                                               f"grad_output[0] {tuple(gout[0].shape)}")),
    ]
    inp = torch.randn(4, 3, requires_grad=True)
    out = lin(inp)
    out.register_hook(lambda g: events.append(f"tensor hook        grad of out {tuple(g.shape)}"))
    events.append("------------------ out.pow(2).sum().backward()")
    out.pow(2).sum().backward()
    for h in handles:
        h.remove()
    print("\\n".join(events))
    """),
    md("""
    The forward hooks fire while the graph is being built: there is no gradient yet, only
    activations. The gradient of the output (`grad_output`, called δ below) exists only once
    `backward()` reaches the layer.

    ## What the hooks see on a two-layer MLP (seed 003)

    The seed's model and data: a batch of `B` sequences of `T` tokens.
    """),
    code("""
    class MLP(nn.Module):
        def __init__(self, d_in, d_hidden, d_out):
            super().__init__()
            self.fc1 = nn.Linear(d_in, d_hidden, bias=False)
            self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x)))


    d_in, d_hidden, d_out = 4, 3, 2
    B, T = 5, 6
    torch.manual_seed(0)
    x = torch.randn(B, T, d_in).requires_grad_(True)
    y = torch.randn(B, T, d_out)
    model = MLP(d_in, d_hidden, d_out)
    """),
    md("By hand, as in the seed: a forward hook keeps the input `a`, a backward hook keeps `grad_output[0]` = δ."),
    code("""
    captured, hooks = {}, []
    for name, layer in [("L1", model.fc1), ("L2", model.fc2)]:
        hooks.append(layer.register_forward_hook(
            lambda m, inp, out, name=name: captured.__setitem__(f"{name}_a", inp[0].detach().clone())))
        hooks.append(layer.register_full_backward_hook(
            lambda m, gin, gout, name=name: captured.__setitem__(f"{name}_delta", gout[0].detach().clone())))
    model.zero_grad()
    loss = 0.5 * ((model(x) - y) ** 2).sum()
    loss.backward()
    for h in hooks:
        h.remove()
    for k, v in captured.items():
        print(f"  {k:10s} shape {tuple(v.shape)}")
    """),
    md("""
    With hookwidget: the `%%hooktrace` cell magic runs the cell with hooks on every layer of
    `model`, removes them afterwards, binds the `Trace` to `t` and shows the explorer (click a
    layer to see its `a` and δ).
    """),
    code("""
    %%hooktrace model -o t
    model.zero_grad()
    loss = 0.5 * ((model(x) - y) ** 2).sum()
    loss.backward()
    """),
    code("""
    for i, name in [(1, "fc1"), (2, "fc2")]:
        layer = t.layers[name]
        same_a = torch.equal(layer.a, captured[f"L{i}_a"])
        same_delta = torch.equal(layer.delta, captured[f"L{i}_delta"])
        print(f"{name}: a {tuple(layer.a.shape)}, δ {tuple(layer.delta.shape)}; "
              f"equal to the hand-written hooks: a {same_a}, δ {same_delta}")
    """),
    md("""
    `a` and δ are all a linear layer needs for its weight gradient: ∂L/∂W = Σ δ aᵀ, summed over
    batch and tokens. `t.weight_grad(name)` forms that sum; it equals what autograd stored in `.grad`
    (notebook 02 takes this apart per sample and per token).
    """),
    code("""
    for name in ["fc1", "fc2"]:
        w = getattr(model, name).weight
        err = (t.weight_grad(name) - w.grad).abs().max().item()
        print(f"{name}: Σ δ aᵀ equals {name}.weight.grad: {torch.allclose(t.weight_grad(name), w.grad, atol=1e-6)} "
              f"(largest difference {err:.1e})")
    """),
    md("""
    ## The graph: node roles and colours

    `backward()` walks the graph of `grad_fn` nodes from the loss. `t.graph` is that graph as a
    `networkx.DiGraph`; an edge `u → v` means the gradient flows from `u` to `v`. Each node has a
    role, coloured as in seed 003's diagram and in the explorer:

    - `root` (dark purple): where `backward()` started, the loss;
    - `op` (purple): an operation whose output is a non-leaf tensor (a₀, a₁);
    - `param` (teal): `AccumulateGrad` of a parameter: where `.grad` is written (W₀, W₁);
    - `leaf` (light teal): a leaf tensor that requires grad but is no parameter (`x` here, because of
      `requires_grad_(True)`);
    - `input` (gray): an input of an op that needs no gradient (`y`): the gradient towards it is not
      kept.
    """),
    code("""
    import networkx as nx

    COLOURS = {"root": "#6d28d9", "op": "#8b5cf6", "param": "#0d9488", "leaf": "#5eead4", "input": "#9ca3af"}
    nodes = sorted(t.graph.nodes(data=True), key=lambda nd: (nd[1]["order"] is None, nd[1]["order"] or 0))
    print(f"{'node id':24s} {'role':6s} {'module':7s} {'param':11s} {'shape':10s} |gradient arriving|")
    for node, d in nodes:
        norm = "-" if d["grad_norm"] is None else f"{d['grad_norm']:.4g}"
        print(f"{node:24s} {d['role']:6s} {d['module'] or '-':7s} {d['param'] or '-':11s} "
              f"{str(d['shape'] or '-'):10s} {norm}")
    """),
    code("""
    import matplotlib.pyplot as plt

    depth = {}
    for i, generation in enumerate(nx.topological_generations(t.graph)):
        for node in generation:
            depth[node] = i
    pos = {}
    for i in set(depth.values()):
        column = sorted(n for n in depth if depth[n] == i)
        for j, node in enumerate(column):
            pos[node] = (i, (len(column) - 1) / 2 - j)
    labels = {n: d["param"] or d["name"].replace("Backward0", "").replace("AccumulateGrad", "Accumulate\\nGrad")
              for n, d in t.graph.nodes(data=True)}
    fig, ax = plt.subplots(figsize=(15, 3.5))
    nx.draw_networkx(t.graph, pos, ax=ax, node_size=1400, font_size=7, labels=labels,
                     node_color=[COLOURS[t.graph.nodes[n]["role"]] for n in t.graph])
    for role, colour in COLOURS.items():
        ax.scatter([], [], c=colour, s=80, label=role)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("t.graph: gradients flow from the root (left) to the parameters and the leaf x")
    ax.axis("off")
    plt.show()
    """),
    md("""
    ## A forward hook sees activations, not gradients (seed 001)

    Trace a forward pass with no `backward()`: the forward hook sees fc1's output, and there is no
    gradient anywhere: hookwidget says so in `t.notes`.
    """),
    code("""
    class SimpleNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(10, 5)
            self.fc2 = nn.Linear(5, 2)

        def forward(self, x):
            return self.fc2(self.fc1(x))


    torch.manual_seed(0)
    net = SimpleNet()
    inp, target = torch.randn(1, 10), torch.randn(1, 2)
    t_forward = hw.trace(lambda: net(inp))
    print("fc1's output as the forward hook saw it:", t_forward.layers["fc1"].calls[0].output_shape)
    print("δ of fc1:", t_forward.layers["fc1"].delta)
    print("notes:", t_forward.notes)
    """),
    md("""
    To get δ from a forward hook, register a *tensor* hook on the output from inside it: it fires
    when `backward()` reaches that tensor. This is how hookwidget captures δ (it also works when an
    in-place op follows the layer, where `register_full_backward_hook` raises).
    """),
    code("""
    grads = {}


    def keep_delta(module, args, out):
        out.register_hook(lambda g: grads.__setitem__("fc1", g))
        # no return value: a forward hook that returns something replaces the output (see below)


    h = net.fc1.register_forward_hook(keep_delta)
    net.zero_grad()
    F.mse_loss(net(inp), target).backward()
    h.remove()
    t_backward = hw.trace(lambda: (net.zero_grad(), F.mse_loss(net(inp), target).backward()))
    print("δ of fc1 from a tensor hook:", grads["fc1"])
    print("δ of fc1 from hookwidget:   ", t_backward.layers["fc1"].delta)
    """),
    md("""
    ## A tensor hook changes the gradient flowing into its tensor (seed 002)

    `y.register_hook(fn)` receives the gradient of the loss with respect to `y` and may return a
    new one; everything upstream of `y` (here `x`) then receives the changed gradient. Plain
    PyTorch first, the seed's three examples:
    """),
    code("""
    def seed002(x0, hook=None, branches=False):
        x = torch.tensor(x0, requires_grad=True)
        y = x**2
        if hook is not None:
            y.register_hook(hook)
        z = y * 3
        out = z + y * 2 if branches else z
        out.backward()
        return x.grad.item()


    print("x=2, no hook:                  x.grad =", seed002(2.0))
    print("x=2, hook g -> 2g:             x.grad =", seed002(2.0, lambda g: g * 2))
    print("x=10, no hook:                 x.grad =", seed002(10.0))
    print("x=10, hook clamp(g, -1, 1):    x.grad =", seed002(10.0, lambda g: torch.clamp(g, -1, 1)))
    print("x=2, two branches, hook g/2:   x.grad =", seed002(2.0, lambda g: g * 0.5, branches=True))
    """),
    md("""
    With hookwidget you need not edit the code: trace it, find the node in `t.graph`, attach a
    hook to it and `rerun()`. `PowBackward0#0` is the `grad_fn` of `y = x**2`; a `grad_*` hook on
    a node changes the gradient *arriving* at it, exactly like `y.register_hook`. A rerun is a
    what-if: it puts `.grad` and the RNG back first, so the hook is the only difference, and puts
    them back again afterwards, so `x.grad` itself stays as the first run left it; the rerun's
    gradients are in its own trace, `param_grads`.
    """),
    code("""
    x2 = torch.tensor(2.0, requires_grad=True)


    def f():
        y = x2**2
        z = y * 3
        z.backward()


    t2 = hw.trace(f)
    print("nodes:", {n: d["role"] for n, d in t2.graph.nodes(data=True)})
    print("x.grad =", x2.grad.item(), "= 3 · 2x")
    t2.add_hook("PowBackward0#0", "grad_scale", factor=2.0)
    t2_scaled = t2.rerun()
    print("x.grad with grad_scale(factor=2) on PowBackward0#0 =", t2_scaled.param_grads["x2"].item())
    print("x2.grad itself, after the what-if:", x2.grad.item())
    t2_scaled
    """),
    md("""
    **The clamp example.** Seed 002 says the clamped `x.grad` is 6. That is an arithmetic slip:
    the gradient arriving at `y` is 3, clamped to 1, and `dy/dx = 2x = 20` at `x = 10`, so
    `x.grad = 1 · 2 · 10`. PyTorch and hookwidget agree; the cell computes each factor:
    """),
    code("""
    x10 = torch.tensor(10.0, requires_grad=True)


    def f10():
        y = x10**2
        (y * 3).backward()


    t10 = hw.trace(f10)
    print("no hook: x.grad =", x10.grad.item())
    t10.add_hook("PowBackward0#0", "grad_clamp", min=-1.0, max=1.0)
    t10_clamped = t10.rerun()
    arriving = t10.graph.nodes["PowBackward0#0"]["grad_norm"]
    clamped = t10_clamped.graph.nodes["PowBackward0#0"]["grad_norm"]
    print(f"gradient arriving at y: {arriving:g}, after the clamp: {clamped:g}, dy/dx = 2x = {2 * x10.item():g}")
    x10_grad = t10_clamped.param_grads["x10"].item()
    print(f"x.grad with the clamp: hookwidget {x10_grad:g}, plain PyTorch {seed002(10.0, lambda g: g.clamp(-1, 1)):g},"
          f" {clamped:g} · 2 · {x10.item():g} = {clamped * 2 * x10.item():g}  (the seed says 6)")
    assert x10_grad == clamped * 2 * x10.item()
    """),
    md("""
    **The aggregated gradient.** When `y` feeds two branches, the hook receives the *sum* of both
    branches' gradients (3 + 2) once, and scales that:
    """),
    code("""
    xb = torch.tensor(2.0, requires_grad=True)


    def fb():
        y = xb**2
        (y * 3 + y * 2).backward()


    tb = hw.trace(fb)
    print("no hook: x.grad =", xb.grad.item(), "; gradient arriving at y =", tb.graph.nodes["PowBackward0#0"]["grad_norm"])
    tb.add_hook("PowBackward0#0", "grad_scale", factor=0.5)
    tb_half = tb.rerun()
    print("grad_scale(0.5): x.grad =", tb_half.param_grads["xb"].item(), "; gradient at y after the hook =",
          tb_half.graph.nodes["PowBackward0#0"]["grad_norm"])
    """),
    md("""
    ## A forward hook that returns a new output changes the gradient (seed 000 is wrong here)

    Seed 000 says of a forward hook returning `output + 1`: *"The gradient calculation is still
    based on the original forward pass, not the modified output."* It is not. Whatever the hook
    returns replaces the module's output: the next operation (here the loss) receives it, and
    because `output + 1` is computed from `output` with autograd on, the addition becomes part of
    the graph. The loss is Σ(Wx + b + 1)², so ∂L/∂W = 2(Wx + b + 1)xᵀ, not 2(Wx + b)xᵀ. Plain
    PyTorch, the seed's own code:
    """),
    code("""
    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(10, 5)

        def forward(self, x):
            return self.linear(x)


    torch.manual_seed(0)
    m0, inp0 = MyModel(), torch.randn(1, 10)


    def step0():
        m0.zero_grad()
        output = m0(inp0)
        (output**2).sum().backward()
        return output


    plain_out = step0().detach()
    plain_grad = m0.linear.weight.grad.clone()
    h = m0.linear.register_forward_hook(lambda module, args, output: output + 1)
    hooked_out = step0().detach()
    hooked_grad = m0.linear.weight.grad.clone()
    h.remove()
    print("largest change of linear.weight.grad caused by the hook:", (hooked_grad - plain_grad).abs().max().item())
    print("hooked W.grad == 2(Wx+b+1)xᵀ:", torch.allclose(hooked_grad, 2 * torch.outer(plain_out[0] + 1, inp0[0])))
    print("hooked W.grad == 2(Wx+b)xᵀ (the seed's claim):", torch.allclose(hooked_grad, 2 * torch.outer(plain_out[0], inp0[0])))
    """),
    md("""
    With hookwidget: the `out_callable` intervention is that forward hook. The diff shows the
    gradient change, and the rerun's graph has the hook's addition in it.
    """),
    code("""
    t0 = hw.trace(step0)
    t0.add_hook("linear", "out_callable", fn=lambda module, args, output: output + 1)
    t0_hooked = t0.rerun()
    print(t0_hooked.diff(t0))
    names = lambda tr: sorted(d["name"] for _, d in tr.graph.nodes(data=True))
    print("graph without the hook:", names(t0))
    print("graph with the hook:   ", names(t0_hooked))
    """),
    md("""
    Seed 001's version (`return output * 2` on fc1, an MSE loss) says it right: the gradient is
    computed from the modified values. hookwidget's `out_scale` is that hook:
    """),
    code("""
    def step1():
        net.zero_grad()
        F.mse_loss(net(inp), target).backward()


    t1 = hw.trace(step1)
    t1.add_hook("fc1", "out_scale", factor=2.0)
    print(t1.rerun().diff(t1))
    """),
    md("""
    ## What to try next

    - Click a node in the explorer above (`t2_scaled`) and toggle a hook from there; rerun and watch
      `x.grad` in the status line.
    - Put `grad_zero` on `fc2` of the MLP (`t.add_hook("fc2", "grad_zero")`, `t.rerun()`): which
      `.grad`s become zero, and why does `fc1.weight.grad` too?
    - Notebook `02_per_sample_gradients.ipynb` takes the (a, δ) factors apart per sample and per token.
    """),
]

# ---------------------------------------------------------------------------------------------
NB02 = [
    md("""
    # Per-sample gradients from (a, δ)

    This notebook shows that the activations `a` and output gradients δ a hook captures are the
    weight gradient in factored form, how they give per-token and per-sample gradients and their
    norms, and uses those norms to find mislabelled images in a real data set.
    """),
    code(SETUP),
    md("""
    ## Seed 003's MLP: shapes

    Inputs of shape `(B, T, d)`: `B` sequences of `T` tokens. `nn.Linear` treats every leading
    dimension as a batch dimension, so `a` and δ keep both.
    """),
    code("""
    class MLP(nn.Module):
        def __init__(self, d_in, d_hidden, d_out):
            super().__init__()
            self.fc1 = nn.Linear(d_in, d_hidden, bias=False)
            self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x)))


    d_in, d_hidden, d_out = 4, 3, 2
    B, T = 5, 6
    torch.manual_seed(0)
    x = torch.randn(B, T, d_in)
    y = torch.randn(B, T, d_out)
    model = MLP(d_in, d_hidden, d_out)
    """),
    code("""
    %%hooktrace model -o t
    model.zero_grad()
    loss = 0.5 * ((model(x) - y) ** 2).sum()
    loss.backward()
    """),
    code("""
    for name in ["fc1", "fc2"]:
        print(f"{name}: a {tuple(t.layers[name].a.shape)}  δ {tuple(t.layers[name].delta.shape)}")
    """),
    md("""
    ## `W.grad` is Σ δ aᵀ

    In `out = a Wᵀ` each weight `W[i, j]` meets `a[j]` and lands in `out[i]`, so its gradient per
    token is `δ[i] · a[j]`: the outer product δ aᵀ. PyTorch sums those over batch and tokens in one
    matrix product. The seed's einsum, `t.weight_grad` and autograd's `.grad`:
    """),
    code("""
    for name in ["fc1", "fc2"]:
        a, delta = t.layers[name].a, t.layers[name].delta
        by_hand = torch.einsum("bto,bti->oi", delta, a)
        grad = getattr(model, name).weight.grad
        print(f"{name}: einsum == .grad: {torch.allclose(by_hand, grad, atol=1e-6)}, "
              f"t.weight_grad == .grad: {torch.allclose(t.weight_grad(name), grad, atol=1e-6)}")
    """),
    md("""
    ## Per token, per sample

    Keep the token index and you have per-token gradients; sum over tokens only and you have each
    sequence's own gradient: `t.per_sample_grads(name)`, shape `(B, *W.shape)`. They sum to
    `.grad`. The reference comes from `torch.func` (`vmap` of `grad` over the batch), which knows
    nothing of hooks.
    """),
    code("""
    a, delta = t.layers["fc2"].a, t.layers["fc2"].delta
    per_token = torch.einsum("bto,bti->btoi", delta, a)
    per_sample = t.per_sample_grads("fc2")
    print("per-token gradients:", tuple(per_token.shape), " per-sample:", tuple(per_sample.shape))
    print("per-token summed over tokens == per-sample:", torch.allclose(per_token.sum(1), per_sample, atol=1e-6))
    print("per-sample summed over the batch == fc2.weight.grad:",
          torch.allclose(per_sample.sum(0), model.fc2.weight.grad, atol=1e-6))

    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}


    def loss_of_one(p, xb, yb):
        out = functional_call(model, p, (xb.unsqueeze(0),))
        return 0.5 * ((out - yb.unsqueeze(0)) ** 2).sum()


    reference = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)
    for name in ["fc1", "fc2"]:
        err = (t.per_sample_grads(name) - reference[f"{name}.weight"]).abs().max().item()
        print(f"{name}: per-sample gradients equal torch.func's: "
              f"{torch.allclose(t.per_sample_grads(name), reference[f'{name}.weight'], atol=1e-5)} (largest difference {err:.1e})")
    """),
    md("""
    ## Per-sample gradient norms

    Norms are what data attribution and DP-SGD clipping need. `t.per_sample_grad_norms(name)` gives
    them for one layer, `t.per_sample_grad_norms()` over every layer with factors. Where it is
    cheaper, hookwidget computes them without forming the per-sample gradients:
    ‖Σₜ δₜ aₜᵀ‖² = Σₜ,ₜ' (aₜ·aₜ')(δₜ·δₜ').

    These are gradients of a *sum*-reduced loss. With a mean-reduced loss each sample's share carries
    a factor 1/B: pass `loss_reduction="mean"` to get each sample's own gradient back.
    """),
    code("""
    norms = t.per_sample_grad_norms()
    ref_norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in reference.values()]).sum(0).sqrt()
    print("fc2 only:    ", [round(v, 4) for v in t.per_sample_grad_norms("fc2").tolist()])
    print("all layers:  ", [round(v, 4) for v in norms.tolist()])
    print("torch.func:  ", [round(v, 4) for v in ref_norms.tolist()])
    """),
    md("""
    ## Why Kronecker products show up, and what the factors save

    Flatten the outer product δ aᵀ column by column and you get the Kronecker product a ⊗ δ. With
    seed 003's numbers δ = [1, 2] and a = [3, 4, 5]:
    """),
    code("""
    d_small, a_small = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
    print("δ aᵀ =", torch.outer(d_small, a_small).tolist())
    print("vec(δ aᵀ) =", torch.outer(d_small, a_small).T.reshape(-1).tolist())  # column by column
    print("a ⊗ δ     =", torch.kron(a_small, d_small).tolist())
    """),
    md("""
    One token's weight gradient has `d_out · d_in` numbers, but it is fully determined by
    `d_in + d_out` numbers: the factors. `t.storage(name)` gives the figures; for seed 003's
    4096 × 4096 layer:
    """),
    code("""
    big = nn.Linear(4096, 4096, bias=False)
    t_big = hw.trace(lambda: big(torch.randn(1, 4096)).sum().backward())
    s = t_big.storage("Linear")
    print(f"W.grad: {s['weight_grad_floats']:,} floats;  (a, δ) per token: {s['factor_floats_per_token']:,} floats "
          f"({s['weight_grad_floats'] // s['factor_floats_per_token']:,}x fewer)")
    s = t.storage("fc1")
    print(f"seed MLP fc1 over {s['tokens']} tokens: per-token gradients {s['per_token_grad_floats']:,} floats, "
          f"factors {s['factor_floats']:,}")
    del big, t_big
    """),
    md("""
    ## Real data: which training images have the largest gradients?

    scikit-learn ships the 8 × 8 handwritten digits. We mislabel a few percent of the training
    images on purpose, train a small CNN, then rank every training image by the norm of its own
    gradient. A sample the model cannot fit (an odd digit, a wrong label) keeps a large gradient:
    the top of the ranking should be full of the images we mislabelled.
    """),
    code("""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(images), generator=gen)
    if SMOKE:
        order = order[:200]
    n_train = int(0.8 * len(order))
    X_train, X_test = images[order[:n_train]], images[order[n_train:]]
    true_train, Y_test = labels[order[:n_train]], labels[order[n_train:]]

    n_flip = max(2, int(0.04 * n_train))
    flipped = torch.randperm(n_train, generator=gen)[:n_flip]
    Y_train = true_train.clone()
    Y_train[flipped] = (true_train[flipped] + torch.randint(1, 10, (n_flip,), generator=gen)) % 10
    is_flipped = torch.zeros(n_train, dtype=torch.bool)
    is_flipped[flipped] = True
    print(f"{n_train} training images, {n_flip} of them mislabelled; {len(X_test)} test images")
    """),
    code("""
    from tqdm.auto import tqdm

    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )
    opt = torch.optim.Adam(cnn.parameters(), lr=3e-3)
    epochs = 2 if SMOKE else 30
    for epoch in tqdm(range(epochs), desc="training"):
        for idx in torch.randperm(n_train, generator=gen).split(64):
            opt.zero_grad()
            F.cross_entropy(cnn(X_train[idx]), Y_train[idx]).backward()
            opt.step()
    with torch.no_grad():
        test_acc = (cnn(X_test).argmax(1) == Y_test).float().mean().item()
    print(f"test accuracy: {test_acc:.3f}")
    """),
    md("""
    One batch traced with `%%hooktrace`: the explorer shows the convolutions' factors (for a
    convolution `a` is unfolded into patches, one "token" per output position).
    """),
    code("""
    %%hooktrace cnn -o t_batch
    cnn.zero_grad()
    F.cross_entropy(cnn(X_train[:32]), Y_train[:32], reduction="sum").backward()
    """),
    md("""
    Now every training image, batch by batch. `capture="norms"` keeps only the per-sample norms
    (the factors are reduced as soon as δ arrives), so memory stays small. The loss is sum-reduced,
    so each norm is that image's own gradient.
    """),
    code("""
    def grad_norms(xb, yb):
        def step():
            cnn.zero_grad()
            F.cross_entropy(cnn(xb), yb, reduction="sum").backward()

        return hw.trace(step, capture="norms").per_sample_grad_norms()


    norms = torch.cat([grad_norms(X_train[i:i + 128], Y_train[i:i + 128])
                       for i in tqdm(range(0, n_train, 128), desc="per-sample norms")])
    print("norms:", tuple(norms.shape))

    # check the first images against torch.func
    cnn_params = {k: v.detach() for k, v in cnn.named_parameters()}


    def ce_of_one(p, xb, yb):
        return F.cross_entropy(functional_call(cnn, p, (xb.unsqueeze(0),)), yb.unsqueeze(0), reduction="sum")


    ref = vmap(grad(ce_of_one), in_dims=(None, 0, 0))(cnn_params, X_train[:16], Y_train[:16])
    ref_norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
    print("first 16 norms equal torch.func's:", torch.allclose(norms[:16], ref_norms, rtol=1e-4, atol=1e-5))
    """),
    code("""
    k = min(40, n_train)
    ranking = norms.argsort(descending=True)
    top = ranking[:k]
    hits = int(is_flipped[top].sum())
    print(f"of the {k} images with the largest gradient norm, {hits} are mislabelled "
          f"(mislabelled images are {is_flipped.float().mean().item():.1%} of the training set)")
    print(f"median norm: mislabelled {norms[is_flipped].median().item():.3g}, "
          f"correctly labelled {norms[~is_flipped].median().item():.3g}")
    """),
    code("""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 5))
    ax = fig.add_subplot(1, 2, 1)
    bins = torch.logspace(torch.log10(norms.min().clamp_min(1e-6)), torch.log10(norms.max()), 40).numpy()
    ax.hist(norms[~is_flipped].numpy(), bins=bins, alpha=0.7, label="label as given")
    ax.hist(norms[is_flipped].numpy(), bins=bins, alpha=0.7, label="mislabelled on purpose")
    ax.set_xscale("log")
    ax.set_xlabel("per-sample gradient norm")
    ax.set_ylabel("training images")
    ax.legend()
    with torch.no_grad():
        pred = cnn(X_train[top[:12]]).argmax(1)
    for j, i in enumerate(top[:12].tolist()):
        sub = fig.add_subplot(3, 8, 8 * (j // 4) + 5 + j % 4)
        sub.imshow(X_train[i, 0].numpy(), cmap="gray_r")
        sub.set_title(f"label {Y_train[i].item()} pred {pred[j].item()}" + (" *" if is_flipped[i] else ""),
                      fontsize=8, color="crimson" if is_flipped[i] else "black")
        sub.axis("off")
    fig.suptitle("Largest per-sample gradient norms (right; * = mislabelled on purpose)")
    plt.show()
    """),
    md("""
    ## What to try next

    - Rank the *test* images the same way: the largest norms point at digits the model finds hard.
    - Clip each sample's gradient to a fixed norm before averaging (DP-SGD): you have the norms, the
      factors give the clipped sum without per-sample gradients.
    - Add `nn.BatchNorm2d`: per-sample gradients stop being well defined (samples mix in the
      statistics); see what hookwidget reports.
    - Notebook `03_debugging_gradients.ipynb`: what to do when the norms are 0 or NaN.
    """),
]

# ---------------------------------------------------------------------------------------------
NB03 = [
    md("""
    # Debugging gradients

    This notebook finds a vanishing gradient, an exploding one and a NaN with hookwidget's health
    flags, then changes the gradient at one layer with a hook, reruns, and reads the diff.
    """),
    code(SETUP),
    md("""
    ## A vanishing gradient: a deep sigmoid MLP with a small initialisation

    Every sigmoid multiplies the gradient by at most 1/4 and every small weight matrix shrinks it
    further; after enough layers the first layers learn nothing.
    """),
    code("""
    depth = 6 if SMOKE else 16
    width = 16 if SMOKE else 128
    torch.manual_seed(0)
    deep = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Sigmoid())],
                         nn.Linear(width, 10))
    for m in deep:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.05)
    x = torch.randn(64, width)
    y = torch.randint(0, 10, (64,))


    def step():
        deep.zero_grad()
        F.cross_entropy(deep(x), y).backward()


    t = hw.trace(step)
    t
    """),
    md("""
    `t.health()` flags a layer as *vanishing* when its gradient norm is below `vanishing` times its
    weight norm (default 1e-7; we use 1e-4 here, a gradient that moves no weight in 10,000 steps of
    size 1). The explorer shows the same flags on the module tree.
    """),
    code("""
    h = t.health(vanishing=1e-4)
    print(h)
    print()
    print(f"{'layer':6s} {'|grad|':>10s} {'|W|':>8s} {'|grad|/|W|':>11s}")
    for name, lh in h.layers.items():
        print(f"{name:6s} {lh.grad_norm:10.2e} {lh.weight_norm:8.3f} {lh.grad_norm / lh.weight_norm:11.2e}")
    """),
    code("""
    import matplotlib.pyplot as plt


    def plot_grad_norms(traces, labels, title):
        fig, ax = plt.subplots(figsize=(9, 3.5))
        for tr, label in zip(traces, labels):
            hl = tr.health().layers
            names = list(hl)
            ax.semilogy(range(len(names)), [hl[n].grad_norm for n in names], "o-", label=label)
        ax.set_xticks(range(len(names)), names, rotation=90 if len(names) > 20 else 0)
        ax.set_xlabel("layer (input → output)")
        ax.set_ylabel("|weight and bias grad|")
        ax.set_title(title)
        ax.legend()
        plt.show()


    plot_grad_norms([t], ["sigmoid, std 0.05"], "gradient norm per layer")
    """),
    md("""
    A hook can tell a cause from a symptom. Scale the gradient flowing into one layer in the middle
    by 1000: every layer upstream gets exactly 1000 times more (the chain rule is a product), the
    layers downstream nothing. The diff's `rel.change` column shows where the hook acts, and
    `cosine` = 1 that only the size changed, not the direction.
    """),
    code("""
    middle = str(2 * (depth // 2))
    t.add_hook(middle, "grad_scale", factor=1000.0)
    t_scaled = t.rerun()
    print(f"grad_scale(1000) on layer {middle}:")
    print(t_scaled.diff(t))
    t.remove_hook(middle, "grad_scale")
    """),
    md("""
    Scaling gradients by hand is no fix. The fix is in the model: ReLU with He initialisation keeps
    the gradient's size roughly constant from layer to layer.
    """),
    code("""
    torch.manual_seed(0)
    fixed = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())],
                          nn.Linear(width, 10))
    for m in fixed:
        if isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")


    def step_fixed():
        fixed.zero_grad()
        F.cross_entropy(fixed(x), y).backward()


    t_fixed = hw.trace(step_fixed)
    print(t_fixed.health(vanishing=1e-4))
    plot_grad_norms([t, t_fixed], ["sigmoid, std 0.05", "ReLU, He init"], "gradient norm per layer")
    """),
    md("""
    ## An exploding gradient: a deep linear network with a large initialisation

    Without nonlinearities each layer multiplies both the activations and the gradient by about
    `std · √width`; we pick `std = 3 / √width`.
    """),
    code("""
    torch.manual_seed(0)
    explode = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)], nn.Linear(width, 1))
    std = 3 / width**0.5
    for m in explode:
        nn.init.normal_(m.weight, std=std)
    print(f"std · √width = {std * width**0.5:g} per layer, {depth} layers")
    target = torch.randn(64, 1)


    def step_explode():
        explode.zero_grad()
        F.mse_loss(explode(x), target).backward()


    t_exp = hw.trace(step_explode)
    print(t_exp.health())
    """),
    md("""
    Every layer is flagged. A bias gradient is δ summed over the batch, so the bias gradients show
    δ growing from the output back to the input; a weight gradient is δ aᵀ, and since `a` grows
    forward as fast as δ grows backward, the weight gradients are huge at *every* layer.
    """),
    code("""
    bias = [float(t_exp.param_grads[f"{i}.bias"].norm()) for i in range(depth)]
    growth = (bias[0] / bias[-1]) ** (1 / (depth - 1))
    print(f"|bias grad| grows by {growth:.2f}x per layer towards the input")
    print(f"|weight grad| from the first to the last hidden layer: {float(t_exp.param_grads['0.weight'].norm()):.3g} "
          f"... {float(t_exp.param_grads[f'{depth - 1}.weight'].norm()):.3g}")
    """),
    md("""
    `grad_clip_norm` on the last layer clips the gradient flowing into its output to a norm of 1,
    as `clip_grad_norm_` would, but at one point in the graph: every upstream gradient shrinks by
    the same factor (cosine 1) and still grows from layer to layer as before. Clipping bounds the
    step; the growth is in the weights' scale, and the fix is the initialisation.
    """),
    code("""
    last = str(depth)
    t_exp.add_hook(last, "grad_clip_norm", max_norm=1.0)
    t_clipped = t_exp.rerun()
    print(t_clipped.diff(t_exp))
    plot_grad_norms([t_exp, t_clipped], ["no hook", f"grad_clip_norm(1) on layer {last}"], "gradient norm per layer")
    t_clipped
    """),
    md("""
    ## A NaN: a normalisation with its epsilon in the wrong place

    A hand-written RMS normalisation `h / (sqrt(mean(h²)) + eps)` is finite in the forward pass for
    every input, but when a row of `h` is all zeros the derivative of `sqrt` at 0 is infinite, and
    0 · ∞ is NaN. The loss looks fine; the gradients are NaN.
    """),
    code("""
    class RMSNorm(nn.Module):
        def __init__(self, eps=1e-6, eps_inside=False):
            super().__init__()
            self.eps, self.eps_inside = eps, eps_inside

        def forward(self, h):
            if self.eps_inside:
                return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return h / (h.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 32, bias=False)
            self.act = nn.Tanh()
            self.norm = RMSNorm()
            self.fc2 = nn.Linear(32, 2)

        def forward(self, x):
            return self.fc2(self.norm(self.act(self.fc1(x))))


    torch.manual_seed(0)
    net = Net()
    xs, ys = torch.randn(16, 8), torch.randn(16, 2)
    xs[3] = 0.0  # an all-zero input row: padding, a blank image, ...


    def step_nan():
        net.zero_grad()
        F.mse_loss(net(xs), ys).backward()


    t_nan = hw.trace(step_nan)
    print("loss:", t_nan.loss)
    h = t_nan.health()
    print(h)
    """),
    md("""
    The health flags name the layers whose gradients are non-finite; `first_nonfinite_node` names
    the first node of the backward pass where the gradient turned non-finite, and the graph says
    which module that node belongs to: the bug is there, not in the layers flagged.
    """),
    code("""
    node = h.first_nonfinite_node
    d = t_nan.graph.nodes[node]
    print(f"first non-finite gradient: {node} ({d['name']}) in module {d['module']!r}")
    print("its predecessor(s) in the backward pass:",
          [(p, t_nan.graph.nodes[p]["grad_norm"]) for p in t_nan.graph.predecessors(node)])
    t_nan
    """),
    md("""
    A gradient hook cannot repair a NaN after the fact (clamping NaN gives NaN). Fix the module:
    put `eps` inside the square root, trace again and compare.
    """),
    code("""
    net.norm.eps_inside = True
    t_ok = t_nan.rerun()
    print(t_ok.health())
    print(t_ok.diff(t_nan))
    """),
    md("""
    ## A training cell: every backward pass is a step, and a rerun is a what-if

    Real cells step an optimizer, accumulate gradients and loop. Each backward pass is a *step* of
    the trace (`t.steps`: its loss, the calls it reached, the `.grad` it made). Factor queries take
    `step=`; without it they answer for gradient accumulation, and refuse (one line) when `.grad`
    was reset between steps. A rerun puts the weights, the optimizer's state, BatchNorm statistics,
    `.grad` and every RNG back first, and afterwards as they were: it never trains the model again.
    """),
    code("""
    torch.manual_seed(0)
    clf = nn.Sequential(nn.Linear(width, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))
    opt = torch.optim.Adam(clf.parameters(), lr=1e-2)


    def train(steps=3):
        for xb_, yb_ in zip(x.split(16), y.split(16)):
            opt.zero_grad()
            F.cross_entropy(clf(xb_), yb_).backward()
            opt.step()
            steps -= 1
            if not steps:
                break


    t_train = hw.trace(train)
    print([(s.index, round(s.loss, 4)) for s in t_train.steps])
    print("step 1's W.grad rebuilt from (a, δ) equals the .grad it made:",
          torch.allclose(t_train.weight_grad("0", step=1), t_train.steps[1].grad("0.weight"), atol=1e-6))
    weights = clf[0].weight.detach().clone()
    t_again = t_train.rerun()
    print("a rerun without hooks changes nothing:", t_again.diff().changed == [], t_again.loss == t_train.loss)
    t_train.add_hook("4", "grad_scale", factor=0.0)
    t_frozen = t_train.rerun()
    print("with grad_scale(0) on the head, the loss of the last step:", round(t_frozen.loss, 4),
          "instead of", round(t_train.loss, 4))
    print("the model's weights are as the first run left them:", torch.equal(clf[0].weight, weights))
    t_frozen
    """),
    md("""
    ## What to try next

    - In the explorer, select a flagged layer, toggle `grad_clip_norm` or `grad_scale` there and press
      rerun: the diff appears in the widget.
    - Replace the sigmoids by `nn.Tanh()` or add `nn.LayerNorm` between the layers and compare
      `health()`.
    - Use `t.per_sample_grad_norms()` to find *which sample* makes the NaN (notebook 02).
    """),
]

# ---------------------------------------------------------------------------------------------
NB04 = [
    md("""
    # A transformer block under hooks

    This notebook traces a small transformer (embedding, attention, MLP, LayerNorm, residuals),
    collapses its autograd graph to modules, and reads the attention projections' (a, δ) factors and
    per-sample gradient norms.
    """),
    code(SETUP),
    md("""
    Attention is written with four `nn.Linear` projections (q, k, v, o), so hookwidget has the factors
    of each. `nn.MultiheadAttention` keeps its projections as plain parameters: hookwidget sees its
    input and output but has no factor rule for it (see the end of the notebook).
    """),
    code("""
    class Attention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

        def forward(self, x):
            B, T, d = x.shape
            split = lambda z: z.view(B, T, self.heads, d // self.heads).transpose(1, 2)
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            att = scores.masked_fill(mask, float("-inf")).softmax(-1)
            return self.o((att @ v).transpose(1, 2).reshape(B, T, d))


    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
            self.ln2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))  # residual
            return x + self.mlp(self.ln2(x))  # residual


    class TinyLM(nn.Module):
        def __init__(self, vocab, d, heads, layers, T):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
            self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, idx):
            # a position table on arange(T), added to every sample: hookwidget takes each sample's rows of its
            # gradient from that add (an (T, d) table expanded to (B, T) beforehand proves no sample's rows)
            pos = self.pos(torch.arange(idx.shape[1]))
            return self.head(self.ln_f(self.blocks(self.tok(idx) + pos)))


    vocab, T = 16, (8 if SMOKE else 32)
    d, heads, layers = (16, 2, 1) if SMOKE else (64, 4, 2)
    B = 4 if SMOKE else 32
    torch.manual_seed(0)
    lm = TinyLM(vocab, d, heads, layers, T)
    print(f"{sum(p.numel() for p in lm.parameters()):,} parameters")
    """),
    md("""
    The task: the second half of each sequence repeats the first half. Next-token prediction can only
    do better than chance in the second half, by attending back.
    """),
    code("""
    from tqdm.auto import tqdm


    def batch(n):
        half = torch.randint(0, vocab, (n, T // 2))
        seq = torch.cat([half, half], 1)
        return seq[:, :-1], seq[:, 1:]


    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    steps = 3 if SMOKE else 300
    for _ in tqdm(range(steps), desc="training"):
        inp, tgt = batch(64)
        opt.zero_grad()
        F.cross_entropy(lm(inp).flatten(0, 1), tgt.flatten()).backward()
        opt.step()
    torch.manual_seed(1)
    idx, tgt = batch(B)
    T_in = idx.shape[1]
    """),
    code("""
    %%hooktrace lm -o t
    lm.zero_grad()
    loss = F.cross_entropy(lm(idx).flatten(0, 1), tgt.flatten(), reduction="sum")
    loss.backward()
    """),
    code("""
    print(f"loss per token: {t.loss / idx.numel():.3f} (chance: {torch.log(torch.tensor(float(vocab))).item():.3f})")
    print(f"{t.graph.number_of_nodes()} graph nodes, {len(t.layers)} layers")
    """),
    md("""
    ## The module-collapsed graph

    Every node of `t.graph` carries the module it ran in. Grouping the nodes by module (here to two
    levels, `blocks.0.attn`) gives the picture the explorer draws when modules are collapsed; edges
    between groups are the gradient's path, and the residual adds show up as a group with two ways
    out.
    """),
    code("""
    import networkx as nx


    def group(node, depth=3):
        nd = t.graph.nodes[node]
        m = nd["param"].rsplit(".", 1)[0] if nd["role"] == "param" else nd["module"]
        if nd["name"] == "AddBackward0" and m.count(".") == 1:  # a residual add in Block.forward
            return f"{m} + ({node})"
        return ".".join(m.split(".")[:depth]) if m else "(loss)"


    collapsed = nx.DiGraph()
    for n, nd in t.graph.nodes(data=True):
        if nd["role"] != "input":
            g = group(n)
            collapsed.add_node(g)
            collapsed.nodes[g]["size"] = collapsed.nodes[g].get("size", 0) + 1
    for u, v in t.graph.edges():
        gu, gv = group(u), group(v)
        if gu != gv and gu in collapsed and gv in collapsed:
            collapsed.add_edge(gu, gv)
    print(f"{t.graph.number_of_nodes()} nodes -> {collapsed.number_of_nodes()} module groups")
    for g in nx.topological_sort(collapsed):
        print(f"  {g:30s} {collapsed.nodes[g]['size']:3d} nodes -> {', '.join(collapsed.successors(g)) or '-'}")
    """),
    code("""
    import matplotlib.pyplot as plt

    level = {}
    for i, gen in enumerate(nx.topological_generations(collapsed)):
        for n in sorted(gen):
            level[n] = i
    pos = {}
    for i in set(level.values()):
        row = [n for n in level if level[n] == i]
        for j, n in enumerate(row):
            pos[n] = (j - (len(row) - 1) / 2, -i)
    fig, ax = plt.subplots(figsize=(10, 8))
    nx.draw_networkx(collapsed, pos, ax=ax, node_color="#8b5cf6", font_size=7, alpha=0.9,
                     node_size=[150 + 25 * collapsed.nodes[n]["size"] for n in collapsed])
    ax.set_title("autograd graph collapsed to modules (the gradient flows downwards)")
    ax.axis("off")
    plt.show()
    """),
    md("""
    ## The attention projections' factors

    q, k and v read the same input (the output of `ln1`), so their `a` is the same tensor; they
    differ in δ, the gradient each projection's output receives. Each factor pair rebuilds its
    `W.grad`.
    """),
    code("""
    a_q = t.layers["blocks.0.attn.q"].a
    print("q, k and v see the same a:", all(torch.equal(a_q, t.layers[f"blocks.0.attn.{p}"].a) for p in "kv"))
    for p in "qkvo":
        name = f"blocks.0.attn.{p}"
        layer = t.layers[name]
        w = layer.module.weight
        print(f"{name}: a {tuple(layer.a.shape)}, |δ| {layer.delta.norm():.3g}, "
              f"Σ δ aᵀ == .grad: {torch.allclose(t.weight_grad(name), w.grad, rtol=1e-4, atol=1e-6)}")
    s = t.storage("blocks.0.attn.q")
    print(f"q over {s['tokens']} tokens: per-token gradients {s['per_token_grad_floats']:,} floats, "
          f"factors {s['factor_floats']:,}")
    """),
    md("""
    ## Per-sample gradient norms

    With a sum-reduced loss, `t.per_sample_grad_norms()` is each sequence's own gradient norm over
    every layer with factors (Linear, Embedding, LayerNorm): the whole model here. The reference is
    `torch.func`.
    """),
    code("""
    from torch.func import functional_call, grad, vmap

    norms = t.per_sample_grad_norms()
    params = {k: v.detach() for k, v in lm.named_parameters()}


    def loss_of_one(p, i, y):
        return F.cross_entropy(functional_call(lm, p, (i.unsqueeze(0),))[0], y, reduction="sum")


    ref = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, idx, tgt)
    ref_norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
    print("per-sample norms equal torch.func's:", torch.allclose(norms, ref_norms, rtol=1e-4, atol=1e-5))
    with torch.no_grad():
        per_seq_loss = F.cross_entropy(lm(idx).transpose(1, 2), tgt, reduction="none").sum(1)
    for i in norms.argsort(descending=True)[:5].tolist():
        print(f"sequence {i:2d}: |grad| {norms[i]:.3f}, loss {per_seq_loss[i]:.3f}")
    """),
    code("""
    with_params = [n for n, layer in t.layers.items() if any(True for _ in layer.module.parameters(recurse=False))]
    rows = [(name, t.per_sample_grad_norms(name)) for name in with_params if t.supports(name)]
    print(f"{'layer':24s} {'mean per-sample |grad|':>23s}")
    for name, n in sorted(rows, key=lambda r: -r[1].mean().item())[:10]:
        print(f"{name:24s} {n.mean().item():23.4f}")
    """),
    md("""
    ## `nn.MultiheadAttention`

    PyTorch's own attention module keeps q, k, v in one `in_proj_weight`: there is no `nn.Linear`
    to hook, so hookwidget records its input and output but has no factor rule, and says so:
    """),
    code("""
    mha = nn.MultiheadAttention(d, heads, batch_first=True)
    xm = torch.randn(2, 5, d)
    t_mha = hw.trace(lambda: mha(xm, xm, xm)[0].sum().backward())
    print(t_mha.notes)
    """),
    md("""
    ## What to try next

    - In the explorer, collapse and expand `blocks.0` and select `blocks.0.attn.q`: its a and δ
      heatmaps are the factors above.
    - `t.add_hook("blocks.0.attn", "out_zero")` and `t.rerun()`: what does the diff say about the
      residual path?
    - Rank training sequences by `t.per_sample_grad_norms()` as notebook 02 does for images.
    """),
]


# ---------------------------------------------------------------------------------------------
NB05 = [
    md("""
    # Watching a training run until it diverges

    This notebook trains a small network with a learning rate that is too large, under `hw.watch`:
    per-layer gradient statistics every step at little cost, the step where the loss turns
    non-finite located, and that step kept as a full Trace to look into.
    """),
    code(SETUP),
    md("""
    A deep tanh MLP, SGD with momentum, and a learning rate that makes it blow up after a few dozen
    steps. The loop is plain PyTorch; the only change is the `with hw.watch(model) as w:` around it.
    """),
    code("""
    torch.manual_seed(0)
    width = 32 if SMOKE else 128
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.9, momentum=0.9)
    x, y = torch.randn(256, 16), torch.randn(256, 1) * 10
    steps = 60 if SMOKE else 200

    with hw.watch(model) as w:
        for step in range(steps):
            xb, yb = x[(step * 32) % 256:][:32], y[(step * 32) % 256:][:32]
            opt.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            opt.step()

    print(f"{len(w.steps)} steps recorded, {len(w.layer_names)} layers × {len(w.stat_names)} statistics")
    print("statistics:", ", ".join(w.stat_names))
    """),
    md("""
    ## The same run, live

    `%%hookwatch MODEL -o NAME` runs a cell under `hw.watch` and shows the watch explorer before the
    loop starts: a layers × steps heatmap of one statistic (pick it in the menu; a log colour scale
    where the values span decades, NaN magenta, Inf red), a sparkline and the latest value per layer,
    the loss and the global gradient norm, anomalies marked above the heatmap. It grows while the loop
    runs: the watch hands it the rows that reach the host anyway, and it sends the new ones at most
    every 0.5 s. Click a kept step (a button below the heatmap, or its column) to open its full Trace
    underneath, in the same explorer as `%%hooktrace`. `w` as a cell's last line shows a finished
    watch the same way, and `w.to_html(path)` writes the view as one standalone page.
    """),
    code("""
    torch.manual_seed(0)  # the same network and data as above, from scratch
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.9, momentum=0.9)
    x, y = torch.randn(256, 16), torch.randn(256, 1) * 10
    """),
    code("""
    %%hookwatch model -o w_live
    for step in range(steps):
        xb, yb = x[(step * 32) % 256:][:32], y[(step * 32) % 256:][:32]
        opt.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        opt.step()
    """),
    code("""
    # Watching live changed nothing: the same statistics, bitwise (NaN where the first run had NaN).
    same = torch.equal(w_live.stats.isnan(), w.stats.isnan()) and torch.equal(w_live.stats.nan_to_num(), w.stats.nan_to_num())
    print("same statistics as the first run:", same, "· kept steps:", w_live.kept)
    """),
    md("""
    `w.series(layer, stat)` is one statistic over the steps. The loss and the update ratio
    ‖ΔW‖/‖W‖ (how much each step moves the weights relative to their size; around 1e-3 is healthy)
    tell the story: the updates grow until the weights explode.
    """),
    code("""
    import math

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    axes[0].semilogy(w.steps, w.series("loss").abs().clamp_min(1e-12))
    axes[0].set_title("|loss|")
    for name in w.layer_names:
        axes[1].semilogy(w.steps, w.series(name, "update_ratio"), label=name)
    axes[1].set_title("update ratio ‖ΔW‖/‖W‖")
    axes[1].legend()
    for ax in axes:
        ax.set_xlabel("step")
    plt.show()
    """),
    md("""
    `w.anomalies` lists what the watch flagged: spikes of the loss or of the global gradient norm
    against the steps before, and non-finite values, each with where it was found first.
    """),
    code("""
    for a in w.anomalies[:8]:
        print(a)
    first_bad = next((a.step for a in w.anomalies if "non-finite" in a.reason or "nan" in a.reason.lower()), None)
    print("first non-finite step:", first_bad)
    print("kept steps (full Traces):", w.kept)
    """),
    md("""
    The first anomalous step is kept as a full Trace: everything `hw.trace` gives, for that one step.
    Here the loss is already infinite while every gradient is still finite: the weights grew so
    large (the update ratio above) that the squared error overflowed float32. Two steps later δ itself
    turns NaN, first at layer `2` in backward order, as `w.anomalies` says.
    """),
    code("""
    k = first_bad
    t = w.trace(k)
    row = list(w.steps).index(k)
    print(f"step {k}: loss {t.loss:.4g}")
    print(t.health())
    print("‖W‖₂ then:", {n: f"{float(w.series(n, 'weight_norm')[row]):.3g}" for n in w.layer_names},
          "at step 0:", {n: f"{float(w.series(n, 'weight_norm')[0]):.3g}" for n in w.layer_names})
    t
    """),
    md("""
    ## What to try next

    - Lower the learning rate to 0.01 and watch again: `w.anomalies` stays empty, the update ratio
      stays near 1e-3.
    - `hw.watch(model, keep=lambda step, stats: stats["global_grad_norm"] > 100)` keeps the steps your
      own rule picks.
    - Add `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before `opt.step()`: the loss
      still rises, but the updates stay bounded.
    """),
]


NB06 = [
    md("""
    # Which samples carried the step

    This notebook trains a tiny GPT-2 on synthetic text, plants one bad sample in one step, and
    finds it from the step's gradient alone: `t.sample_shares()` names the sample, `t.position_shares()`
    the tokens in it, the explorer shows both, with the text of each token, and a watch names it in the
    anomaly it flags.
    """),
    code(SETUP),
    md("""
    ## The quantity

    A step's gradient is the sum of its samples' gradients, G = Σ_b G_b. So ‖G‖² = Σ_b ⟨G_b, G⟩, and
    each sample's **share** s_b = ⟨G_b, G⟩ / ‖G‖² says exactly how much of the step it carried: the
    shares add up to 1, and a negative one pulled against the step. A layer applied per position splits
    a sample's share over its positions, exactly too. hookwidget computes both from the activations a
    and output gradients δ it captured: no per-sample gradient is built.

    First, a word-level tokenizer made in code (nothing is downloaded) and sentences from a tiny grammar.
    """),
    code("""
    import random

    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    transformers.logging.set_verbosity_error()  # a config made in code: no warnings about its special tokens
    words = "<unk> the a cat dog bird sat ran flew on under over mat log tree . zzz".split()
    vocab = {w: i for i, w in enumerate(words)}
    word_level = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level)

    rng = random.Random(0)
    def sentence():
        pick = rng.choice
        return f"{pick(['the', 'a'])} {pick(['cat', 'dog', 'bird'])} {pick(['sat', 'ran', 'flew'])} {pick(['on', 'under', 'over'])} the {pick(['mat', 'log', 'tree'])} ."

    B, T = 8, 32
    def batch():
        texts = [" ".join((" ".join(sentence() for _ in range(T))).split()[:T]) for _ in range(B)]
        ids = torch.tensor(tok(texts)["input_ids"])
        return ids, ids.clone()   # next-token labels: the model shifts them

    print(tok.decode(batch()[0][0]))
    """),
    md("""
    A GPT-2 of two blocks from `GPT2Config` (random weights, CPU, its default attention), trained a few
    dozen steps.
    """),
    code("""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=T, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def train_step(ids, labels):
        opt.zero_grad()
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        return loss.item()

    k = 40
    for step in range(k):
        loss = train_step(*batch())
    print(f"loss after {k} steps: {loss:.3f}")
    """),
    md("""
    ## Step k, with a planted sample

    Sample 5 of step k gets a long run of one repeated token, `zzz`, at positions 10-29, with its labels
    shuffled there: text the model has never seen, and targets it cannot predict. The step is traced
    with `hw.trace`, and `decode=tok` tells the explorer how to show token ids as text (any function
    `ids -> list[str]` or `id -> str` works too).
    """),
    code("""
    ids, labels = batch()
    planted, run = 5, slice(10, 30)
    ids[planted, run] = vocab["zzz"]
    labels[planted, run] = labels[planted, run][torch.randperm(20, generator=torch.Generator().manual_seed(0))]

    t = hw.trace(lambda: train_step(ids, labels), decode=tok)
    shares = t.sample_shares()
    for b, s in enumerate(shares.tolist()):
        print(f"sample {b}: share {s:+.3f}" + ("   <- planted" if b == planted else ""))
    print(f"sum of the shares: {float(shares.sum()):.6f}; the largest: sample {int(shares.argmax())}")
    assert int(shares.argmax()) == planted  # what this notebook shows; CI runs it
    """),
    md("""
    One sample of eight carried a large part of the step. Which of its tokens? `t.position_shares()`
    is (samples, positions): row 5 splits its share over its 32 positions.
    """),
    code("""
    p = t.position_shares()[planted]
    tokens = tok.convert_ids_to_tokens(ids[planted].tolist())
    top = p.topk(5).indices.sort().values.tolist()
    print("its 5 largest positions:", [(i, tokens[i], round(float(p[i]), 3)) for i in top])
    print(f"positions 10-29 (the zzz run) carry {float(p[run].sum() / p.sum()):.0%} of the sample's share")
    assert all(run.start <= i < run.stop for i in top)
    """),
    md("""
    The same for one layer, and what was left out (nothing here; a layer hookwidget has no exact
    per-sample rule for would be named, never dropped silently):
    """),
    code("""
    print(t.sample_shares("transformer.h.1.mlp.c_fc").argmax().item(), t.shares().left_out)
    """),
    md("""
    ## In the explorer

    Open **Which samples carried the step's gradient** below the explorer: a bar per sample, sorted,
    red where it pulled with the step, blue against it. Click sample 5: its positions show as a strip of
    its tokens, coloured by their shares, the `zzz` run lit. Click a layer in the graph or the list and
    the panel shows that layer's own shares. The shares are computed when the panel opens, not before:
    a large model's explorer opens as fast as without them.
    """),
    code("""
    t
    """),
    md("""
    ## In a watch

    `hw.watch(model, per_sample=True)` records, at every step, the three samples with the largest shares
    of the step's gradient and the top position of the first: on the device, nothing sent to the host per
    step. Twenty more steps under a watch, the same kind of sample planted in the last: the watch flags the
    step (a loss spike), and its anomaly names the sample and a position in the run. The kept Trace of the
    step has every sample's and every position's share.
    """),
    code("""
    last = 20
    with hw.watch(model, per_sample=True, window=10) as w:
        for step in range(last + 1):
            ids, labels = batch()
            if step == last:
                ids[planted, run] = vocab["zzz"]
                labels[planted, run] = labels[planted, run][torch.randperm(20, generator=torch.Generator().manual_seed(1))]
            train_step(ids, labels)

    a = next(a for a in w.anomalies if a.step == last)
    print(a.where, "|", a.samples.text)
    print("the kept Trace's largest share:", int(w.trace(last).sample_shares().argmax()))
    assert a.samples.samples[0][0] == planted and run.start <= a.samples.position < run.stop
    """),
    md("""
    The watch's view lists the anomaly with the samples that carried its step (`w.sample_shares` has every
    step's, `w.top_positions` the first one's top position):
    """),
    code("""
    w
    """),
    md("""
    ## What to try next

    - Plant the run in two samples, or make it shorter: the shares split between them, and the strip
      narrows to the run.
    - Keep the labels of the run instead of shuffling them: a repeated token the model can learn pulls
      much less.
    - `t.shares().top(3)` lists the three samples that carried most of the step; `t.position_norms(layer)`
      gives each position's gradient norm ‖δ‖·‖a‖ for a layer applied per position.
    """),
]


def main() -> None:
    write("01_hooks_explained.ipynb", NB01)
    write("02_per_sample_gradients.ipynb", NB02)
    write("03_debugging_gradients.ipynb", NB03)
    write("04_transformer.ipynb", NB04)
    write("05_watch_training.ipynb", NB05)
    write("06_which_samples.ipynb", NB06)


if __name__ == "__main__":
    main()
