"""hw.watch under DistributedDataParallel and FSDP2 (fully_shard), gloo, 2 CPU processes: with ranks="local"
each rank records its own statistics (the global ones, the default: test_watch_ranks.py), equal to hand-written
plain-PyTorch ones from the same loop run without hookwidget; losses and .grad bitwise unchanged; no collective
added (process-group sequence numbers); w.gather(dst=0) brings every rank's statistics to rank 0; no hang."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers_dist import spawn
from torch import nn

WORLD, STEPS, TIMEOUT_S = 2, 4, 150
LAYERS = ["0", "2", "4"]


def _wrapped(mode):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(m), m
    from torch.distributed.fsdp import fully_shard

    for name in LAYERS:
        fully_shard(m.get_submodule(name))
    return fully_shard(m), m


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _collectives() -> int:
    return sum(pg._get_sequence_number_for_group() for pg in dist.distributed_c10d._world.pg_map)


def _loop(mode, xs, ys, watched, flight_recorder):
    """The training loop; unwatched, with hand-written hooks computing the reference statistics."""
    import hookwidget as hw

    model, inner = _wrapped(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows, cur, handles = [], {}, []
    if not watched:
        for name in LAYERS:
            def fwd(mod, inputs, out, name=name):
                a = inputs[0].detach().double()
                cur[name] = {"a_rms": a.square().mean().sqrt().item()}
                out.register_hook(lambda g: cur[name].update(delta_norm=g.double().norm().item(),
                                                             delta_max=g.abs().max().item()))
            handles.append(inner.get_submodule(name).register_forward_hook(fwd))
    w = hw.watch(model, flight_recorder=flight_recorder, ranks="local") if watched else None
    losses, grads = [], []
    start = _collectives()
    for k in range(STEPS):
        opt.zero_grad()
        cur.clear()
        loss = F.mse_loss(model(xs[k]), ys[k])
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([_local(p.grad).clone() for p in model.parameters()])
        before = {n: [_local(p).detach().double().clone() for p in inner.get_submodule(n).parameters()]
                  for n in LAYERS}
        opt.step()
        if not watched:
            row = {n: dict(cur[n]) for n in LAYERS}
            for n in LAYERS:
                ps = list(inner.get_submodule(n).parameters())  # local shards under FSDP2
                gcat = torch.cat([_local(p.grad).double().flatten() for p in ps])
                wcat = torch.cat([b.flatten() for b in before[n]])
                after = torch.cat([_local(p).detach().double().flatten() for p in ps])
                row[n].update(grad_norm=gcat.norm().item(), weight_norm=wcat.norm().item(),
                              update_ratio=((after - wcat).norm() / wcat.norm()).item())
            rows.append(row)
    used = _collectives() - start
    for h in handles:
        h.remove()
    if w is not None:
        w.close()
    return {"losses": losses, "grads": grads, "rows": rows, "collectives": used}, w


CASES = [("ddp", True), ("fsdp2", False), ("fsdp2", True)]  # (wrapper, flight recorder), one process group


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        xs, ys = torch.randn(STEPS, 4, 6, generator=g), torch.randn(STEPS, 4, 3, generator=g)
        for mode, flight_recorder in CASES:
            plain, _ = _loop(mode, xs, ys, watched=False, flight_recorder=False)
            watched, w = _loop(mode, xs, ys, watched=True, flight_recorder=flight_recorder)
            gathered = w.gather(dst=0)
            result = {"plain": plain, "watched": watched, "gathered": gathered, "layer_names": w.layer_names,
                      "stats": w.stats, "step_stats": w.step_stats, "steps": w.steps, "stat_names": w.stat_names}
            torch.save(result, os.path.join(out_dir, f"{mode}-{flight_recorder}-rank{rank}.pt"))
        dist.barrier()  # both ranks tear down together (a rank gone first left gloo's threads to abort the other)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The workers' results (see helpers_dist.spawn)."""
    out = tmp_path_factory.mktemp("watch_dist")
    spawn(_worker, out, WORLD, TIMEOUT_S)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode,flight_recorder", CASES)
def test_each_rank_records_its_own_and_rank0_gathers(runs, mode, flight_recorder):
    results = [torch.load(runs / f"{mode}-{flight_recorder}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    prefix = "module." if mode == "ddp" else ""
    for rank, r in enumerate(results):
        plain, watched = r["plain"], r["watched"]
        assert all(torch.equal(a, b) for a, b in zip(plain["losses"], watched["losses"])), rank
        assert all(torch.equal(a, b) for ga, gb in zip(plain["grads"], watched["grads"]) for a, b in zip(ga, gb))
        assert watched["collectives"] == plain["collectives"] > 0  # the watch adds no collective
        assert r["steps"] == list(range(STEPS)) and r["layer_names"] == [prefix + n for n in LAYERS]
        names = r["stat_names"]
        for k, row in enumerate(plain["rows"]):
            assert r["step_stats"][k, 0].item() == pytest.approx(plain["losses"][k].item(), rel=1e-6)
            for li, n in enumerate(LAYERS):
                for stat, value in row[n].items():
                    got = r["stats"][k, li, names.index(stat)].item()
                    assert got == pytest.approx(value, rel=1e-5, abs=1e-9), (rank, k, n, stat)
    # rank 0 holds every rank's statistics, exactly; the others get None; one gather_object
    gathered = results[0]["gathered"]
    assert results[1]["gathered"] is None and [g.rank for g in gathered] == [0, 1]
    for rank, g in enumerate(gathered):
        assert torch.equal(g.stats, results[rank]["stats"]) and g.steps == results[rank]["steps"]
        assert torch.equal(g.step_stats, results[rank]["step_stats"])
    # δ is each rank's own (its own batch); .grad is DDP's all-reduced one, or FSDP2's local shard
    s0, s1 = results[0]["stats"], results[1]["stats"]
    col = results[0]["stat_names"].index
    assert not torch.allclose(s0[..., col("delta_norm")], s1[..., col("delta_norm")])
    same_grad = torch.equal(s0[..., col("grad_norm")], s1[..., col("grad_norm")])
    assert same_grad == (mode == "ddp")


@pytest.mark.slow
def test_fsdp2_shard_norms_add_up_to_the_full_gradient(runs):
    """FSDP2's grad_norm is of the rank's local shard: the shards' norms, squared and summed over ranks,
    give the norm of the full averaged gradient, which DDP (same model, same batches) holds on each rank."""
    load = [torch.load(runs / f"{m}-rank{r}.pt", weights_only=False) for m in ("ddp-True", "fsdp2-True")
            for r in range(WORLD)]
    ddp, fsdp = load[:WORLD], load[WORLD:]
    col = ddp[0]["stat_names"].index
    for stat in ("grad_norm", "weight_norm"):
        full = ddp[0]["stats"][..., col(stat)]
        shards = torch.stack([r["stats"][..., col(stat)] for r in fsdp])
        assert torch.allclose(shards.square().sum(0).sqrt(), full, rtol=1e-5), stat
        assert (shards < full).all()  # each a part
