"""hw.watch's global figures over ranks (watch/ranks.py), gloo, 2 and 4 CPU processes, against one process running the
ranks' batches together (the mean of the ranks' losses) with hand-written hooks and norms, never hookwidget:
DDP, FSDP2 (fully_shard) and a DTensor tensor-parallel pair of Linears (ColwiseParallel, RowwiseParallel).
The models hold an uneven shard (5 rows over 2 ranks), an empty shard (a 1-row weight, a 1-entry root-held
parameter: nothing on rank 1), a parameter of the root module, and (tensor parallel) a layer mixing a sharded
weight and a replicated bias. A gradient spike confined to rows rank 1 holds is flagged on every rank. Losses and
.grad stay bitwise those of the unwatched loop; every rank ends with the same rows and anomalies; log_dir holds
the global rows; no hang (helpers_dist.spawn's timeout, ranks.TIMEOUT_S)."""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers_dist import spawn
from torch import nn

WORLDS, STEPS, SPIKE_AT, NAN_AT, BOOST, TIMEOUT_S = (2, 4), 7, 5, 6, 1000.0, 240
MODES = ("ddp", "fsdp2", "tp")
NORMS = ("grad_norm", "weight_norm", "update_ratio")
SAMPLES = ("delta_norm", "delta_max", "a_rms", "a_zero_frac")


class Boost(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient of output columns 3 and 4 (the rows of the next
    weight's gradient that rank 1 holds under FSDP2: 5 rows shard as 3 + 2) by `factor`."""

    @staticmethod
    def forward(ctx, h, factor):
        ctx.factor = factor
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        scale = torch.ones(g.shape[-1], dtype=g.dtype)
        scale[3:] = ctx.factor
        return g * scale, None


class Net(nn.Module):
    """a: Linear(6, 5), uneven shards; b: Linear(5, 1), rank 1's shard empty; scale: held by the root module,
    one entry (rank 1's shard empty)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 1)
        self.scale = nn.Parameter(torch.tensor([1.5]))
        self.boost = 1.0

    def forward(self, x):
        return self.b(torch.tanh(Boost.apply(self.a(x), self.boost))) * self.scale


def _tp_net():
    return nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))  # even: a local output shard feeds row-wise


def _batches(mode: str, rank: int):
    """(xs, ys) of `rank`: data parallel, each rank its own; tensor parallel, the same on every rank."""
    g = torch.Generator().manual_seed(100 + (rank if mode != "tp" else 0))
    return torch.randn(STEPS, 4, 6, generator=g), torch.randn(STEPS, 4, 3 if mode == "tp" else 1, generator=g)


def _build(mode: str, world: int):
    """(model to train and watch, the module whose boost the loop sets or None)."""
    torch.manual_seed(0)
    if mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        net = _tp_net()
        mesh = init_device_mesh("cpu", (world,))
        return parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}), None
    net = Net()
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(net), net
    from torch.distributed.fsdp import fully_shard

    fully_shard(net.a)
    fully_shard(net.b)
    return fully_shard(net), net


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _loop(mode, rank, world, watched, out_dir):
    import hookwidget as hw

    model, net = _build(mode, world)
    xs, ys = _batches(mode, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    log = os.path.join(out_dir, f"log-{mode}-rank{rank}")
    w = hw.watch(model, window=4, log_dir=log) if watched else None
    losses, grads = [], []
    try:
        for k in range(STEPS):
            if net is not None:
                net.boost = BOOST if k == SPIKE_AT else 1.0
            x = xs[k]
            if k == NAN_AT and mode != "tp" and rank == world - 1:  # a NaN in the last rank's batch only
                x = x.clone()
                x[0, 0] = math.nan
            opt.zero_grad()
            loss = F.mse_loss(model(x), ys[k])
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([_local(p.grad).clone() for p in model.parameters()])
            opt.step()
    finally:
        if w is not None:
            w.close()
    out = {"losses": losses, "grads": grads}
    if w is not None:
        out.update(stats=w.stats, step_stats=w.step_stats, local_stats=w.local_stats,
                   local_step_stats=w.local_step_stats, steps=w.steps, anomalies=[tuple(a[:3]) for a in w.anomalies],
                   kept=w.kept, notes=[str(n) for n in w.notes], scope=w.scope, layer_names=list(w.layer_names),
                   stat_names=list(w.stat_names), log=hw.load(log).stats, local_series=w.series(
                       w.layer_names[-1], "grad_norm", scope="local"))
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = int(Path(out_dir, "world").read_text())
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        for mode in MODES:
            plain = _loop(mode, rank, world, False, out_dir)
            watched = _loop(mode, rank, world, True, out_dir)
            torch.save({"plain": plain, "watched": watched}, os.path.join(out_dir, f"{mode}-rank{rank}.pt"))
        dist.barrier()  # both ranks tear down together
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{n}ranks" for n in WORLDS])
def runs(request, tmp_path_factory):
    """(the workers' results folder, the world size)."""
    out = tmp_path_factory.mktemp(f"watch_ranks{request.param}")
    (out / "world").write_text(str(request.param))
    spawn(_worker, out, request.param, TIMEOUT_S)
    return out, request.param


def _load(runs, mode):
    """(each rank's watched results, each rank's plain results)."""
    out, world = runs
    got = [torch.load(out / f"{mode}-rank{r}.pt", weights_only=False) for r in range(world)]
    return [g["watched"] for g in got], [g["plain"] for g in got]


# -- the reference: one process, the ranks' batches together, hooks and norms written here ------------------------
def _reference(mode: str, world: int) -> dict:
    torch.manual_seed(0)
    net = _tp_net() if mode == "tp" else Net()
    if mode == "tp":
        xs, ys = _batches(mode, 0)
        layers = {"0": net[0], "2": net[2]}
    else:
        parts = [_batches(mode, r) for r in range(world)]
        xs, ys = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
        layers = {"root": net, "a": net.a, "b": net.b}
    own = {n: list(m.parameters(recurse=False)) for n, m in layers.items()}
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    seen, rows, steps = {}, [], []

    def hook(name):
        def fwd(mod, inputs, out):
            a = inputs[0].detach().double()
            seen[name] = {"a_rms": a.square().mean().sqrt().item(), "a_zero_frac": (a == 0).double().mean().item()}
            out.register_hook(lambda g: seen[name].update(delta_norm=g.double().norm().item(),
                                                          delta_max=g.double().abs().max().item()))
        return fwd

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    try:
        for k in range(STEPS):
            if mode != "tp":
                net.boost = BOOST if k == SPIKE_AT else 1.0
            opt.zero_grad()
            seen.clear()
            loss = F.mse_loss(net(xs[k]), ys[k])
            loss.backward()
            before = {n: torch.cat([p.detach().double().flatten() for p in ps]) for n, ps in own.items()}
            row = {n: dict(seen[n]) for n in layers}
            for n, ps in own.items():
                g = torch.cat([p.grad.double().flatten() for p in ps])
                row[n].update(grad_norm=g.norm().item(), weight_norm=before[n].norm().item())
            total = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
            opt.step()
            for n, ps in own.items():
                after = torch.cat([p.detach().double().flatten() for p in ps])
                row[n]["update_ratio"] = ((after - before[n]).norm() / before[n].norm()).item()
            rows.append(row)
            steps.append({"loss": loss.item(), "grad_norm": total})
    finally:
        for h in handles:
            h.remove()
    return {"rows": rows, "steps": steps, "order": list(layers)}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN included): the values' bit patterns (float32 or float64)."""
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(bits),
                                                                     b.contiguous().view(bits))


def _close(got: float, want: float, rel: float = 2e-5) -> bool:
    return math.isclose(got, want, rel_tol=rel, abs_tol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_global_figures_equal_one_process_by_hand(runs, mode):
    results, plains = _load(runs, mode)
    ref = _reference(mode, runs[1])
    names = results[0]["stat_names"]
    dp = mode != "tp"
    for rank, (r, plain) in enumerate(zip(results, plains)):
        # observing changes nothing, collectives and all
        assert all(_same(a, b) for a, b in zip(plain["losses"], r["losses"])), rank
        assert all(_same(a, b) for ga, gb in zip(plain["grads"], r["grads"]) for a, b in zip(ga, gb)), rank
        assert r["steps"] == list(range(STEPS))
        assert r["scope"]["grad_norm"] == "global"
        assert r["scope"]["delta_norm"] == ("global" if dp else f"rank {rank}")
        assert any(f"hw.watch over {runs[1]} ranks" in n for n in r["notes"]), r["notes"]
        checked = NORMS + (SAMPLES if dp else ("a_rms",) * (mode == "tp"))
        for k, (row, step) in enumerate(zip(ref["rows"][:NAN_AT if dp else STEPS], ref["steps"])):
            assert _close(r["step_stats"][k, 0].item(), step["loss"]), (rank, k, "loss")
            assert _close(r["step_stats"][k, 1].item(), step["grad_norm"]), (rank, k, "global grad_norm")
            for li, n in enumerate(ref["order"]):
                for stat in checked:
                    if mode == "tp" and stat == "a_rms" and n != "0":  # layer 2's input is a shard: this rank's
                        continue
                    got = r["stats"][k, li, names.index(stat)].item()
                    assert _close(got, row[n][stat], rel=1e-4 if stat == "update_ratio" else 2e-5), \
                        (mode, rank, k, n, stat, got, row[n][stat])
                for stat in ("grad_nan", "grad_inf", "delta_nan", "delta_inf", "a_nonfinite"):
                    assert r["stats"][k, li, names.index(stat)].item() == 0, (rank, k, n, stat)
        # the log_dir holds the global rows, as w.stats
        assert _same(r["log"], r["stats"])
    # every rank computed the same global rows and the same verdicts, to the bit
    keep = [i for i, n in enumerate(names) if results[0]["scope"][n] == "global" and n != "lr"]
    for r in results[1:]:
        assert _same(results[0]["stats"][..., keep], r["stats"][..., keep])
        assert _same(results[0]["step_stats"], r["step_stats"])
        assert results[0]["anomalies"] == r["anomalies"] and results[0]["kept"] == r["kept"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("fsdp2", "tp"))
def test_each_rank_keeps_its_shards_labelled_local(runs, mode):
    """w.local_stats: the shards' own norms (an empty shard: 0), whose squares add up to the global figure where
    every parameter of the layer is sharded (tensor parallel: layer 0; layer 2's replicated bias is on every rank)."""
    results, _ = _load(runs, mode)
    col = results[0]["stat_names"].index
    layers = slice(None) if mode == "fsdp2" else slice(0, 1)
    for stat in ("grad_norm", "weight_norm"):
        shards = torch.stack([r["local_stats"][:, layers, col(stat)] for r in results])
        full = results[0]["stats"][:, layers, col(stat)]
        # kept float32 (docs/guide/watch.md), the global figure and each shard's rounded once: float32's tolerance
        assert torch.allclose(shards.double().square().sum(0).sqrt(), full.double(), rtol=1e-6, equal_nan=True), stat
        assert not torch.equal(shards[0], full)  # a shard's, not the layer's
    if mode == "fsdp2":  # b's and the root's scale: the last rank holds nothing of them (of a too, on 4 ranks)
        last = results[-1]
        for li, name in enumerate(last["layer_names"]):
            if name != "a" or runs[1] == 4:
                assert (last["local_stats"][:, li, col("grad_norm")] == 0).all(), name
                assert (last["local_stats"][:, li, col("weight_norm")] == 0).all(), name
            assert not last["stats"][:NAN_AT, li].isnan().any(), name  # global: every figure has its value
        assert torch.equal(results[1]["local_series"], results[1]["local_stats"][:, -1, col("grad_norm")])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("ddp", "fsdp2"))
def test_a_spike_in_one_ranks_shard_is_flagged_on_every_rank(runs, mode):
    results, _ = _load(runs, mode)
    for r in results:
        assert (SPIKE_AT, "grad_norm") in [(s, where) for s, where, _ in r["anomalies"]], r["anomalies"]
        assert SPIKE_AT in r["kept"]
    if mode == "fsdp2":  # rank 0's own gradient norm did not move: only the global one shows the spike
        local = results[0]["local_step_stats"][:, 1]
        assert local[SPIKE_AT] < 3 * local[:SPIKE_AT].max()
        assert results[0]["step_stats"][SPIKE_AT, 1] > 10 * results[0]["step_stats"][:SPIKE_AT, 1].max()


def test_a_gather_left_unanswered_says_so_and_every_later_figure_is_local():
    """A rank that never answers (it closed, crashed, or watched another model): the wait gives up after
    ranks.TIMEOUT_S, says so in w.notes, and the watch stops gathering: no hang."""
    from hookwidget.watch import ranks

    asked = []

    class Late:  # a collective's Work that times out, as gloo's does
        def wait(self, timeout):
            asked.append(timeout)
            raise RuntimeError("Timed out waiting 1000ms for recv operation to complete")

    notes = []
    held = SimpleNamespace(off=False, _pending={4: "a later step's"}, notes=notes, rank=1)
    late = ranks.Pending(SimpleNamespace(index=3), None, {}, [(0, [torch.zeros(1)], Late())])
    assert ranks.Ranks._wait(held, late) is None
    assert held.off and held._pending == {}
    assert asked == [timedelta(seconds=ranks.TIMEOUT_S)]
    assert "step 3 did not arrive" in notes[0] and "rank 1" in notes[0] and "Timed out" in notes[0]


def test_on_a_gpu_the_gather_is_waited_on_by_the_stream_not_the_host():
    """NCCL's wait(timeout) blocks the host until the collective ends (a sync per step); wait() only makes the
    current stream wait. Outputs off the CPU (here on the meta device) are waited on without a timeout."""
    from hookwidget.watch import ranks

    asked = []

    class Work:
        def wait(self, *timeout):
            asked.append(timeout)
            return True

    held = SimpleNamespace(off=False, _pending={}, notes=[], rank=0)
    p = ranks.Pending(SimpleNamespace(index=0), None, {}, [(0, [torch.zeros(2, device="meta")] * 2, Work())])
    got = ranks.Ranks._wait(held, p)
    assert asked == [()] and got[0].shape == (2, 2) and not held.off


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("ddp", "fsdp2"))
def test_a_nan_in_one_ranks_batch_is_flagged_on_every_rank(runs, mode):
    """Step NAN_AT: one NaN entry in the last rank's input only. Every rank counts it (a_nonfinite summed: 1),
    where rank 0's own count is 0, and flags the same onset: the input of the first layer, the mean loss with it."""
    results, _ = _load(runs, mode)
    col = results[0]["stat_names"].index
    first = results[0]["layer_names"][0]  # the root module, whose input the batch is
    for r in results:
        assert r["stats"][NAN_AT, 0, col("a_nonfinite")] == 1
        assert math.isnan(r["step_stats"][NAN_AT, 0])
        onset = [(where, reason) for s, where, reason in r["anomalies"] if s == NAN_AT]  # one, for the onset
        assert len(onset) == 1 and onset[0][0] == first and "loss" in onset[0][1], r["anomalies"]
        assert NAN_AT in r["kept"]
    assert results[0]["local_stats"][NAN_AT, 0, col("a_nonfinite")] == 0
    assert not math.isnan(results[0]["local_step_stats"][NAN_AT, 0])
