"""Statistics of every rank on one: each rank's own figures (its replica or shard, its batch: w.local_stats); at
the end one `gather_object` call brings all of them to `dst`. (The global figures, w.stats, are ranks.py's.)"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RankStats(NamedTuple):
    rank: int
    layer_names: list
    steps: list
    stats: torch.Tensor  # (recorded steps, layers, statistics), the watch's dtype (w.stats'), on the host
    step_stats: torch.Tensor  # (recorded steps, 2): loss and gradient norm, as this rank saw them
    anomalies: list
    skipped: list
    notes: list


def gather(w, dst: int = 0, group=None):
    """All ranks' statistics on rank `dst` (a list indexed by rank there, None elsewhere). A collective:
    call it on every rank of `group`, once the loop is over."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("w.gather(): no process group; call it on every rank after "
                           "torch.distributed.init_process_group")
    mine = RankStats(dist.get_rank(), list(w.layer_names), w.steps, w.local_stats, w.local_step_stats,
                     [tuple(a[:3]) for a in w.anomalies], list(w.skipped), list(w.notes))
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(mine, out, dst=dst, group=group)
    return out
