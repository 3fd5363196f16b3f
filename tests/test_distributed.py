"""DistributedDataParallel (gloo, 2 CPU processes): capture on each rank changes nothing bitwise,
weight_grad is the rank's own gradient (autograd's, without DDP) and the Trace says so, no hang."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers_dist import spawn
from torch import nn

WORLD = 2
TIMEOUT_S = 120


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Dropout(0.2), nn.Linear(8, 3))


def _step(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y, reduction="sum")
    loss.backward()
    return loss.detach()


def _worker(rank: int, port: int, out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from helpers_faults import Registries

    import hookwidget as hw

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(100 + rank)
        x, y = torch.randn(4, 6), torch.randn(4, 3)
        result = {}
        for traced in (False, True):
            ddp = nn.parallel.DistributedDataParallel(_model())
            torch.manual_seed(7 + rank)
            if traced:
                regs = Registries(ddp, x, y)
                before = regs.take()
                out = []
                t = hw.trace(lambda: out.append(_step(ddp, x, y)))  # noqa: B023
                result["registries_same"] = regs.take() == before
                result["notes"] = t.notes
                result["weight_grad"] = t.weight_grad("module.0")
                result["norms"], result["left_out"] = t.per_sample_grad_norms(), t.per_sample_left_out
                loss = out[0]
            else:
                loss = _step(ddp, x, y)
            result["traced" if traced else "plain"] = {
                "loss": loss, "rng": torch.get_rng_state(),
                "grads": {n: p.grad.clone() for n, p in ddp.named_parameters()}}
        local = _model()  # the rank's own gradient, without DDP's all-reduce
        torch.manual_seed(7 + rank)
        _step(local, x, y)
        result["local_grad"] = local[0].weight.grad.clone()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks tear down together (a rank gone first left gloo's threads to abort the other)
    finally:
        dist.destroy_process_group()




@pytest.mark.slow
def test_ddp_gloo_two_ranks(tmp_path):
    spawn(_worker, tmp_path, WORLD, TIMEOUT_S)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for r in results:
        plain, traced = r["plain"], r["traced"]
        assert r["registries_same"]
        assert torch.equal(plain["loss"], traced["loss"]) and torch.equal(plain["rng"], traced["rng"])
        assert plain["grads"].keys() == traced["grads"].keys()
        assert all(torch.equal(g, traced["grads"][n]) for n, g in plain["grads"].items())
        assert torch.allclose(r["weight_grad"], r["local_grad"], atol=1e-6)
        assert not r["left_out"]  # the averaged .grad is not the factors' sum: exact rules are not checked against it
        assert r["norms"].shape == (4,) and torch.isfinite(r["norms"]).all()
        assert any("DistributedDataParallel" in n for n in r["notes"]), r["notes"]
    # after all-reduce both ranks hold the same .grad, and it is not either rank's own
    g0, g1 = (r["traced"]["grads"]["module.0.weight"] for r in results)
    assert torch.equal(g0, g1)
    assert not torch.allclose(g0, results[0]["local_grad"])
