"""On a CUDA device: observation stays bitwise, and no hook forces a host-device sync.

Skipped without a GPU (CI has none); run on a lent GPU machine with `pytest tests/test_gpu.py`.
"""

import pytest
import torch
from torch import nn

import hookwidget as hw

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def model_and_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                          nn.Dropout(0.2), nn.Flatten(), nn.Linear(16 * 8 * 8, 64), nn.GELU(),
                          nn.LayerNorm(64), nn.Linear(64, 10)).cuda()
    x, y = torch.randn(32, 3, 8, 8, device="cuda"), torch.randint(0, 10, (32,), device="cuda")

    def step():
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return model, step


@pytest.mark.parametrize("capture", ["full", "summary", "norms"])
def test_observation_is_bitwise_on_cuda(capture):
    torch.use_deterministic_algorithms(True)
    try:
        model, step = model_and_step()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(1)
        ref_loss = step().detach()
        ref = [p.grad.clone() for p in model.parameters()]
        ref_rng = torch.cuda.get_rng_state()
        model.load_state_dict(state)
        torch.manual_seed(1)
        t = hw.trace(step, capture=capture)
        assert t.loss == float(ref_loss)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref))
        assert torch.equal(torch.cuda.get_rng_state(), ref_rng)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("capture", ["full", "summary", "norms"])
def test_hooks_never_synchronise_with_the_host(capture):
    model, step = model_and_step()
    step()  # warm-up outside the check
    with hw.tracing(capture=capture) as t:
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert t.loss is not None


def test_factors_and_norms_on_cuda_match_torch_func():
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 4)).cuda()
    x, y = torch.randn(8, 5, 16, device="cuda"), torch.randn(8, 5, 4, device="cuda")
    t = hw.trace(lambda: ((model(x) - y) ** 2).sum().backward())
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return ((functional_call(model, p, (xi[None],)) - yi[None]) ** 2).sum()

    ref = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
    assert torch.allclose(t.per_sample_grad_norms(), norms, rtol=1e-4)
    assert torch.allclose(t.weight_grad("3"), model[3].weight.grad, atol=1e-5)


def test_norms_on_cuda_accumulate_in_float64_without_a_sync():
    """Off the CPU a norm is one float64-accumulating kernel: exact where float32's sum of squares overflows
    (entries of 1e30, each finite), equal to float64's own norm elsewhere, and no host sync."""
    from hookwidget.stats import l2, l2_batch

    torch.manual_seed(0)
    ts = [torch.randn(1000, device="cuda"), torch.full((7,), 1e30, device="cuda"),
          torch.randn(3, 5, device="cuda").half(), torch.zeros(0, device="cuda")]
    l2(ts[0])  # warm-up outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = l2_batch(ts)
        one = [l2(t) for t in ts]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = [torch.linalg.vector_norm(t.cpu().double()) for t in ts]
    for b, o, w in zip(batch, one, want):
        assert b.dtype == o.dtype == torch.float64
        assert torch.isclose(b.cpu(), w, rtol=1e-12) and torch.isclose(o.cpu(), w, rtol=1e-12)
