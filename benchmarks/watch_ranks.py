"""What hw.watch's global figures over ranks cost under FSDP2, on gloo ranks on the CPU, beside the same watch
giving each rank's own figures and beside the unwatched loop.

    python -m benchmarks.watch_ranks [--world 2] [--steps 40] [--repeats 3] [--out benchmarks/results]

The model: the MLP 784-512-512-10 of watch_overhead.py at B=32 per rank, each Linear and the root under
fully_shard (FSDP2), Adam; each rank its own batches. Variants of the loop (zero_grad / forward / backward / step):
  plain        no watch
  local        hw.watch(model, flight_recorder=False, ranks="local"): each rank's own figures, no collective
  global       hw.watch(model, flight_recorder=False): global figures (watch/ranks.py: one asynchronous
               all_gather per recorded step, waited on when the rows move to the host)
  local+fr     hw.watch(model, ranks="local"): the flight recorder on (it judges each step as the next begins)
  global+fr    hw.watch(model): the default; the flight recorder waits on each step's gather as the next begins
Timing: each block builds the model afresh (same seed), runs a fifth of its steps as warm-up, then its timed steps,
reads w.stats and closes the watch. Per step the wall time (the ranks wait on each other in FSDP2's collectives,
so wall time is what a run pays) and this process's CPU time (time.process_time: gloo's threads included), each
the largest over the ranks, medians over the timed steps. The blocks alternate within each of `--repeats` rounds,
the order reversed every other round, so load changes hit all alike; ratios are of the medians to plain's. Each
block's losses are checked bitwise against plain's (observing changes nothing). torch.set_num_threads(1).
Results: <out>/watch_ranks.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"plain": None, "local": dict(flight_recorder=False, ranks="local"),
            "global": dict(flight_recorder=False, ranks="global"), "local+fr": dict(ranks="local"),
            "global+fr": dict(ranks="global")}
TIMEOUT_S = 900  # the whole benchmark: the workers are killed past it


def _model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer)
    return fully_shard(m)


def _block(variant: str, steps: int, rank: int) -> dict:
    """One block of `variant`: per timed step (wall, CPU) seconds on this rank, and every step's loss."""
    import hookwidget as hw

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + rank)
    warm = max(1, steps // 5)
    xs, ys = torch.randn(warm + steps, 32, 784, generator=g), torch.randint(0, 10, (warm + steps, 32), generator=g)
    kwargs = VARIANTS[variant]
    w = hw.watch(model, **kwargs) if kwargs is not None else None
    walls, cpus, losses = [], [], []
    try:
        for k in range(warm + steps):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss = F.cross_entropy(model(xs[k]), ys[k])
            loss.backward()
            opt.step()
            if k >= warm:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            losses.append(loss.detach().clone())
        if w is not None:
            w.stats  # noqa: B018 - what the watch holds brought to the host, as a user reading it would
    finally:
        if w is not None:
            w.close()
    return {"wall": walls, "cpu": cpus, "losses": losses}


def _worker(rank: int, port: int, out: str, world: int, steps: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        _block("plain", steps, rank)  # a process's first loop pays one-off costs: untimed
        times = {v: {"wall": [], "cpu": []} for v in VARIANTS}
        same = {v: True for v in VARIANTS}
        names = list(VARIANTS)
        for r in range(repeats):
            results = {}
            for v in names if r % 2 == 0 else names[::-1]:
                results[v] = _block(v, steps, rank)
            for v, res in results.items():
                # the step's time is the slowest rank's (the others wait for it)
                for key in ("wall", "cpu"):
                    mine = torch.tensor(res[key], dtype=torch.float64)
                    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                    times[v][key].extend(mine.tolist())
                same[v] &= all(torch.equal(a, b) for a, b in zip(results["plain"]["losses"], res["losses"]))
        if rank == 0:
            Path(out, "times.json").write_text(json.dumps({"times": times, "same": same}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, steps: int, repeats: int, work: Path) -> dict:
    for attempt in range(2):  # gloo's teardown aborts a worker now and then on a loaded machine: once more, new port
        ctx = mp.spawn(_worker, args=(_free_port(), str(work), world, steps, repeats), nprocs=world, join=False)
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"the workers did not finish within {TIMEOUT_S} s")
            break
        except mp.ProcessExitedException:
            for p in ctx.processes:
                p.kill()
            if attempt:
                raise
    raw = json.loads((work / "times.json").read_text())
    rows = {}
    plain = {k: statistics.median(raw["times"]["plain"][k]) for k in ("wall", "cpu")}
    for v, t in raw["times"].items():
        med = {k: statistics.median(t[k]) for k in ("wall", "cpu")}
        rows[v] = {"wall_ms": 1e3 * med["wall"], "cpu_ms": 1e3 * med["cpu"], "wall_x": med["wall"] / plain["wall"],
                   "cpu_x": med["cpu"] / plain["cpu"], "steps": len(t["wall"]), "losses_bitwise": raw["same"][v]}
    return {"world": world, "steps": steps, "repeats": repeats, "torch": torch.__version__, "variants": rows}


def markdown(res: dict) -> str:
    lines = [f"# hw.watch over ranks: FSDP2, {res['world']} gloo ranks on the CPU (torch {res['torch']})", "",
             f"MLP 784-512-512-10, B=32 per rank, Adam, each Linear and the root under fully_shard; {res['steps']} "
             f"timed steps per block, {res['repeats']} rounds interleaved; per step the slowest rank's time, "
             "medians. `python -m benchmarks.watch_ranks`.", "",
             "| variant | wall ms/step | × plain | CPU ms/step | × plain | losses bitwise = plain |",
             "|---|---:|---:|---:|---:|:---:|"]
    for v, r in res["variants"].items():
        lines.append(f"| {v} | {r['wall_ms']:.2f} | {r['wall_x']:.2f} | {r['cpu_ms']:.2f} | {r['cpu_x']:.2f} | "
                     f"{'yes' if r['losses_bitwise'] else 'NO'} |")
    v = res["variants"]
    def ratio(a: str, b: str, key: str) -> str:
        return f"{v[a][key] / v[b][key]:.2f}×"

    lines += ["", f"Global figures beside each rank's own: flight recorder off {ratio('global', 'local', 'wall_ms')} "
                  f"wall, {ratio('global', 'local', 'cpu_ms')} CPU; flight recorder on "
                  f"{ratio('global+fr', 'local+fr', 'wall_ms')} wall, {ratio('global+fr', 'local+fr', 'cpu_ms')} CPU."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / ".watch_ranks_work"
    work.mkdir(exist_ok=True)
    res = run(args.world, args.steps, args.repeats, work)
    (work / "times.json").unlink()
    work.rmdir()
    (out / "watch_ranks.json").write_text(json.dumps(res, indent=1))
    (out / "watch_ranks.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
