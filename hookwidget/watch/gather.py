"""Statistics of every rank on one: each rank's own figures (its replica or shard, its batch: w.local_stats); at
the end one `gather_object` call brings all of them to `dst`. (The global figures, w.stats, are ranks.py's.)
RankViews is the live Watch's side of it: what this rank held, beside the global figures."""

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


class RankViews:
    """A live watch's figures as this rank held them (`w.local_stats`, `w.scope`) and `w.gather()`: a model
    spread over ranks (ranks.py) makes w.stats global; these keep each rank's own. Needs `stats`, `step_stats` and
    `_spread` (ranks.of) of the Watch it is mixed into."""

    @property
    def local_stats(self) -> torch.Tensor:
        """Like w.stats, as this rank held them (a shard's norms under FSDP2/DTensor, its own batch's δ and a);
        w.stats itself where the model is not spread over ranks (w.scope says which figure is whose)."""
        return self._local()[0]

    @property
    def local_step_stats(self) -> torch.Tensor:
        """Like w.step_stats, as this rank held them: its own loss, the norm of its own (local) gradients."""
        return self._local()[1]

    @property
    def scope(self) -> dict:
        """statistic -> whose figure w.stats holds: "global" (over ranks) or "rank r"; {} for one process."""
        return dict(self._spread.scope) if self._spread is not None else {}

    def _local(self) -> tuple:
        stats, step_stats = self.stats, self.step_stats
        return self._spread.local_tables(stats, step_stats) if self._spread is not None else (stats, step_stats)

    def gather(self, dst: int = 0, group=None):
        """Distributed: every rank's own statistics (`w.local_stats`) on rank `dst`, in one `gather_object` call
        at the end of the loop; `w.stats` holds the global figures.

        Each rank's own: δ and a of its own batch; .grad as backward leaves it (DDP: all-reduced; FSDP2: the
        rank's local shard of the reduce-scattered gradient, and ‖W‖ of its local shard). A collective: call it on
        every rank of `group`.

        Args:

        - `dst`: the rank that receives them (default 0).
        - `group`: the process group (default: the default group).

        Returns:

        On rank `dst`, a list indexed by rank of `RankStats` (rank, layer_names, steps, stats, step_stats,
        anomalies, skipped, notes); None on the others.

        Raises:

        - `RuntimeError`: no process group (`torch.distributed.init_process_group` was not called).

        Example:

        ```python
        import tempfile
        import torch.distributed as dist

        # torchrun and init_process_group start one process per rank; here one process is the only rank
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
        with hw.watch(model) as w:
            for xb, yb in loader:
                opt.zero_grad()
                loss_fn(model(xb), yb).backward()
                opt.step()
        ranks = w.gather()                                # on rank 0: [RankStats(rank=0, ...)]
        ranks[0].stats.shape                              # (steps, layers, statistics) of rank 0's own batches
        dist.destroy_process_group()
        ```
        """
        return gather(self, dst, group)
