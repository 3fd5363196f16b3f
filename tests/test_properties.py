"""Property tests (issue 9): on random small models, observing changes nothing bitwise, weight_grad
equals autograd's .grad, per-sample gradient norms equal torch.func's, and no hook is left behind.

Models are drawn as a stack of blocks: plain Linear, residual, two branches summed, one Linear
reused twice; activations include in-place ReLU; inputs are (B, d) or (B, T, d); LayerNorm
sometimes. The references are a plain run and torch.func, never hookwidget.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookwidget as hw

sys.path.insert(0, str(Path(__file__).parent))  # helpers_faults, whether or not tests/ is a package
from helpers_faults import observe  # noqa: E402

ACTS = {"relu": nn.ReLU, "relu_inplace": lambda: nn.ReLU(inplace=True), "tanh": nn.Tanh, "gelu": nn.GELU,
        "none": nn.Identity}
KINDS = ("linear", "residual", "branch", "reuse")


class Block(nn.Module):
    def __init__(self, kind, d_in, d_out, act, bias, norm):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(d_in, d_out, bias=bias)
        if kind == "branch":
            self.side = nn.Linear(d_in, d_out, bias=not bias)
        self.act = ACTS[act]()
        self.norm = nn.LayerNorm(d_out) if norm else None

    def forward(self, h):
        if self.kind == "linear":
            out = self.act(self.lin(h))
        elif self.kind == "residual":
            out = h + self.act(self.lin(h))
        elif self.kind == "branch":
            out = self.act(self.lin(h) + self.side(h))
        else:  # reuse: the same Linear twice
            out = self.act(self.lin(self.act(self.lin(h))))
        return self.norm(out) if self.norm is not None else out


class RandomNet(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.blocks = nn.ModuleList(Block(*b) for b in spec["blocks"])
        self.head = nn.Linear(spec["width"], spec["d_out"])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@st.composite
def specs(draw):
    d_in = width = draw(st.integers(1, 6))
    blocks = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(KINDS))
        out = draw(st.integers(1, 6)) if kind in ("linear", "branch") else width
        blocks.append((kind, width, out, draw(st.sampled_from(sorted(ACTS))), draw(st.booleans()),
                       draw(st.booleans()) and out > 1))
        width = out
    return {"blocks": blocks, "d_in": d_in, "width": width, "d_out": draw(st.integers(1, 3)),
            "batch": draw(st.integers(1, 4)), "tokens": draw(st.sampled_from([None, 1, 3])),
            "seed": draw(st.integers(0, 2**16)), "capture": draw(st.sampled_from(["full", "norms"]))}


def builder(spec):
    def build():
        torch.manual_seed(spec["seed"])
        lead = (spec["batch"],) if spec["tokens"] is None else (spec["batch"], spec["tokens"])
        return {"model": RandomNet(spec), "x": torch.randn(*lead, spec["d_in"]),
                "y": torch.randn(*lead, spec["d_out"])}

    return build


def step(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y, reduction="sum")
    loss.backward()
    return loss.detach()


def reference_norms(model, x, y) -> torch.Tensor:
    """Per-sample gradient norms over every parameter, by torch.func (sum-reduced loss)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xb, yb):
        return F.mse_loss(torch.func.functional_call(model, p, (xb[None],)), yb[None], reduction="sum")

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))


def close(got, ref, what):
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_random_models(spec):
    # observe(): plain vs traced bitwise (loss, every .grad, buffers, RNG) and hook registries unchanged.
    out = observe(builder(spec), step, seed=spec["seed"], capture=spec["capture"])
    t, model, x, y = out.trace, out.objects["model"], out.objects["x"], out.objects["y"]
    norms = t.per_sample_grad_norms()
    if spec["capture"] == "full":
        for name, layer in t.layers.items():
            if isinstance(layer.module, (nn.Linear, nn.LayerNorm)):
                close(t.weight_grad(name), layer.module.weight.grad, f"{name}.weight")
                if layer.module.bias is not None:
                    close(t.bias_grad(name), layer.module.bias.grad, f"{name}.bias")
        assert set(t.layers) >= {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.LayerNorm))}
    close(norms, reference_norms(model, x, y), "per-sample norms")


# -- the widget's message schema: whatever the front-end sends ----------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats() | st.text(max_size=30)
    | st.sampled_from(["__import__('os').system('echo pwned')", "<img src=x onerror=alert(1)>", "0", "fc1"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
message_types = st.sampled_from(["detail", "add_hook", "remove_hook", "rerun", "eval", "__class__", ""])
kinds = st.sampled_from(["grad_scale", "grad_clamp", "grad_zero", "grad_clip_norm", "out_scale", "out_zero",
                         "callable", "out_callable", "exec", ""])
near_valid = st.fixed_dictionaries(
    {"type": message_types, "request_id": st.one_of(st.integers(-5, 10**70), st.text(max_size=70), json_values)},
    optional={"target": st.one_of(st.sampled_from(["fc1", "fc2", "AccumulateGrad#0", "nope"]), json_values),
              "kind": st.one_of(kinds, json_values),
              "params": st.one_of(st.dictionaries(st.sampled_from(["factor", "min", "max", "max_norm", "fn", "x"]),
                                                  json_values, max_size=3), json_values),
              "extra": json_values})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.one_of(near_valid, json_values))
def test_front_end_messages_are_validated_never_evaluated(content):
    from helpers_faults import Registries

    from hookwidget.interventions import KINDS
    from hookwidget.views.widget import HookWidget

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))
    x = torch.randn(4, 3)

    def cell():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    t = hw.trace(cell)  # the widget holds its trace weakly: the user's reference keeps it
    w = HookWidget(t)
    sent = []
    w.send = lambda msg, buffers=None: sent.append(msg)
    regs = Registries(model, x)
    before = regs.take()
    w._on_msg(w, content, [])  # never raises
    assert regs.take() == before
    assert sent, "every message gets a reply"
    for reply in sent:
        assert reply["type"] in ("status", "detail", "trace")
        if reply["type"] == "status":
            assert reply["state"] in ("running", "done", "error") and "\n" not in reply["text"]
    for iv in w.trace.interventions:  # only registered, front-end settable kinds, with numbers
        assert iv.kind.name in KINDS and not iv.kind.python_only
        assert all(isinstance(v, float) for v in iv.params.values())
