"""One verdict over ranks: the global figures of a watch whose model is spread over processes (DDP, FSDP2's
fully_shard, DTensor tensor parallelism).

Why: each rank's hooks see only what that rank holds. Under FSDP2 or a DTensor-sharded layer a local `.grad`
or weight is a shard, so a norm taken there is a shard's norm (FSDP2 on 2 ranks: grad_norm 0.18-0.87x the
layer's, weight_norm ~0.71x), a spike in one rank's rows goes unseen on the others, and an empty shard reads 0.
A layer's ‖W.grad‖₂ and ‖W‖₂ are the root of the shards' summed squares; the global gradient norm likewise.

How (no sync of its own on a GPU, no collective outside a step boundary): when a recorded step's backward ends
(every rank passes there, in the same order), the few numbers each rank holds of it (per sharded parameter:
‖grad‖², ‖W‖², its NaN and Inf counts, the ‖ΔW‖² of the recorded step before; per layer the δ and a sums; the
loss) go out in one asynchronous all_gather per process group (`launch`). They are waited on when the step is
judged (the flight recorder, as the next forward begins) or moved to the host (`settle`): each rank then sums
the gathered parts in rank order, so every rank computes the same global row, to the bit, and every rank's
detector flags the same steps. Only after that is the row judged, told to the listeners (log_dir, live view)
and shown as w.stats; each rank's own row is kept beside it (w.local_stats). A step's update ratio needs the
optimizer step after its backward: its ‖ΔW‖² travel with the next recorded step's parts, or at close.

What is global (the note `w.notes` holds says the same):
  grad_norm, weight_norm, grad_nan, grad_inf: exact over shards. A DTensor's Shard placements sum squares over
    their mesh dimension's group; Replicate placements and plain tensors (DDP's all-reduced replicas) are
    counted once, as this rank holds them. update_ratio: global ‖ΔW‖ over global ‖W‖.
  step loss: the mean of the ranks' losses; step grad_norm: the global gradient norm.
  δ and a (data parallel, DDP or FSDP2: each rank its own samples): as one process running the ranks' batches
    together on the mean of the ranks' losses (whose gradient DDP and FSDP2 average) would see them: each
    rank's δ, of its own loss, divided by the world size; delta_norm the root of their summed squares,
    delta_max their largest; a_rms and a_zero_frac over all the ranks' entries; the counts summed. Otherwise
    (tensor parallel: ranks share samples) δ and a norms stay this rank's, labelled so; their NaN/Inf counts
    are summed, so that a non-finite value on any rank is flagged on all.
A parameter that is Partial or sharded over several mesh dimensions stays this rank's, named in the note.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import NamedTuple

import torch
from torch import nn

from hookwidget.capture.stat_rows import F64, NAN, S

TIMEOUT_S = 120.0  # a rank that does not answer a step's gather within this: the figures stay this rank's
MODES = ("global", "local")
_P = 7  # per sharded parameter: ‖grad‖², has a grad, ‖W‖², grad NaN, grad Inf, ‖ΔW‖² (step before), stepped
_L = 10  # per layer: ‖δ‖², max|δ|, δ reached, δ NaN, δ Inf, Σa², zeros of a, entries, a non-finite, a reached

NOTE = ("hw.watch over {world} ranks ({how}): w.stats, w.series, the anomalies, log_dir and the live view show "
        "global figures, the same on every rank: grad_norm, weight_norm, update_ratio and the .grad NaN/Inf "
        "counts of {sharded} are the root of the shards' summed squares (counts summed); the step loss is the "
        "mean of the ranks' losses, the step grad_norm the global gradient norm; {delta}. Each rank's own "
        "figures: w.local_stats, w.local_step_stats, w.series(..., scope='local'). Costs one asynchronous "
        "all_gather of a few numbers per layer per recorded step, waited on when the step is judged or moved.")
DP_DELTA = ("delta_norm, delta_max, a_rms, a_zero_frac and their counts are over all the ranks' samples, δ being "
            "that of the mean of the ranks' losses (each rank's own δ divided by {world}), as one process running "
            "the ranks' batches together would see them")
TP_DELTA = ("delta_norm, delta_max, a_rms and a_zero_frac are this rank's (rank {rank}; ranks share samples "
            "under tensor parallelism), their NaN/Inf counts summed over ranks")
LOCAL_PARAM = ("hw.watch: parameters of {names} are {why}: their figures are this rank's (rank {rank}), not "
               "summed over ranks")
NO_ANSWER = ("hw.watch: the ranks' figures of step {step} did not arrive within {s:g} s ({err}): from that step "
             "on every figure is this rank's (rank {rank}); every rank must open, step and close its watch alike")
ALONE = ("hw.watch: a process group of {world} ranks, but {model} is no DistributedDataParallel, FSDP2 module or "
         "DTensor holder: every figure is this rank's (rank {rank}); watch the wrapped model (hw.watch(ddp_model)) "
         "for figures over ranks")


class Pending(NamedTuple):
    step: object  # the step whose own figures the gather carries (None: close's, the last update only)
    prev: object  # the recorded step before it, whose optimizer update the gather carries (or None)
    local: dict  # this rank's per-parameter vectors, as sent
    works: list  # (group index, outputs, work) per process group


def of(model: nn.Module, params: list, pairs: list, layer_names: list, notes: list, changed, mode: str = "global"):
    """A Ranks for a model spread over ranks (DDP, FSDP2, DTensor parameters) in an initialised process group of
    2 or more, with mode "global"; else None: every figure is this process's, and no collective runs."""
    if mode == "local" or "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    dt, fs = sys.modules.get("torch.distributed.tensor"), sys.modules.get("torch.distributed.fsdp")
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    fsdp = fs is not None and any(isinstance(m, fs.FSDPModule) for m in model.modules())
    dtensors = dt is not None and any(isinstance(p, dt.DTensor) for p in params)
    if not (ddp or fsdp or dtensors):
        notes.append(ALONE.format(world=dist.get_world_size(), model=type(model).__name__, rank=dist.get_rank()))
        return None
    return Ranks(params, pairs, layer_names, notes, changed, data_parallel=(ddp or fsdp) and not _tensor_parallel(
        model, params, fs, dt), how="DDP" if ddp else "FSDP2" if fsdp else "DTensor")


def _tensor_parallel(model, params: list, fs, dt) -> bool:
    """Whether some DTensor parameter lies outside FSDP2's modules, or on a mesh of several dimensions: tensor
    parallelism, where ranks share samples and δ, a are not summed over them."""
    if dt is None:
        return False
    owned = set()
    for m in model.modules():
        if fs is not None and isinstance(m, fs.FSDPModule):
            owned.update(id(p) for p in m.parameters())
    return any(isinstance(p, dt.DTensor) and (id(p) not in owned or p.device_mesh.ndim > 1) for p in params)


def _group(p, world: int):
    """(kind, process group): "whole" (a plain tensor, or a DTensor replicated on every mesh dimension: the local
    tensor is the parameter), "shard" with the group its squares sum over (None: the world), or "local" with
    why (Partial, several sharded dimensions)."""
    import torch.distributed as dist

    dt = sys.modules.get("torch.distributed.tensor")
    if dt is None or not isinstance(p, dt.DTensor):
        return "whole", None
    places = p.placements
    if any(pl.is_partial() for pl in places):
        return "local", "Partial (pending a reduction)"
    dims = [d for d, pl in enumerate(places) if pl.is_shard()]
    if not dims:
        return "whole", None
    if len(dims) > 1:
        return "local", "sharded over several mesh dimensions"
    group = p.device_mesh.get_group(dims[0])
    return "shard", None if dist.get_process_group_ranks(group) == list(range(world)) else group


class Ranks:
    """The global rows of a spread model's steps: `launch` at each recorded step's end, `settle` before the row
    is judged or moved, `finish` at close; `moved` keeps each rank's own rows on the host (local_tables)."""

    def __init__(self, params: list, pairs: list, layer_names: list, notes: list, changed, data_parallel: bool,
                 how: str):
        import torch.distributed as dist

        n_layers = len(layer_names)
        self.dist, self.params, self.pairs, self.L = dist, params, pairs, n_layers
        self.notes, self.changed, self.dp = notes, changed, data_parallel
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.groups: list = [None]  # process groups (None: the world, always first: the loss and δ travel there)
        self.members: list = [[]]  # per group: the indices of the parameters sharded over it
        local: dict = {}
        for i, p in enumerate(params):
            kind, g = _group(p, self.world)
            if kind == "local":
                local.setdefault(g, []).append(i)
            elif kind == "shard":
                at = next((j for j, h in enumerate(self.groups) if h is g), None)
                if at is None:
                    self.groups.append(g)
                    self.members.append([])
                    at = len(self.groups) - 1
                self.members[at].append(i)
        sharded = {i for m in self.members for i in m}
        self.sharded_layers = torch.tensor([any(pi in sharded for li2, pi in pairs if li2 == li)
                                            for li in range(n_layers)])
        self.any_sharded = bool(sharded)
        names = {pi: layer_names[li] for li, pi in reversed(pairs)}  # a parameter by its (first) layer's name
        notes.append(NOTE.format(world=self.world, how=how, sharded="every layer" if len(sharded) == len(params)
                                 else "the layers with sharded parameters (the rest are replicas, exact as held)"
                                 if sharded else "the parameters (replicas on every rank, exact as held)",
                                 delta=(DP_DELTA if data_parallel else TP_DELTA).format(world=self.world,
                                                                                        rank=self.rank)))
        for why, idx in local.items():
            notes.append(LOCAL_PARAM.format(names=", ".join(names[i] for i in idx[:6]), why=why, rank=self.rank))
        self.scope = {n: "global" for n in S}
        self.scope["per_sample_max"] = f"rank {self.rank}"  # (per_sample=True) of this rank's batch
        if not data_parallel:
            for n in ("delta_norm", "delta_max", "a_rms", "a_zero_frac"):
                self.scope[n] = f"rank {self.rank}"
        self.off = False  # a gather went unanswered: every later figure is this rank's
        self._pending: dict = {}  # step index -> Pending (its own figures); None key: close's
        self._carrier: dict = {}  # step index -> the index of the Pending that carries its update
        self._prev = None  # the latest recorded step launched
        self._index: dict = {}  # cached index tensors
        self.local_chunks: list = []  # each rank's own rows on the host, in step order (moved)
        self.local_step_chunks: list = []

    # -- at the end of a recorded step's backward, on every rank --------------------------------------------
    def launch(self, step) -> None:
        """Send this rank's parts of `step` (and the update of the recorded step before) to every rank."""
        if self.off or step.parts is None:
            return
        prev, self._prev = self._prev, step
        dev = step.row.device
        local = self._param_vectors(step, dev)
        if prev is not None:
            local.update(self._update_vectors(prev, dev))
        world = self._layer_vector(step, dev)
        self._pending[step.index] = Pending(step, prev, local, self._send(local, world, dev))
        if prev is not None:
            self._carrier[prev.index] = step.index

    def finish(self) -> None:
        """At close, on every rank: the last recorded step's update (where a sharded parameter makes it a sum)."""
        prev, self._prev = self._prev, None
        if self.off or prev is None or not self.any_sharded:
            return
        dev = prev.row.device if prev.row is not None else self.params[0].device
        local = self._update_vectors(prev, dev)
        self._pending[None] = Pending(None, prev, local, self._send(local, None, dev, only_update=True))
        self._carrier[prev.index] = None

    def _param_vectors(self, step, dev) -> dict:
        """This rank's per-parameter ‖grad‖², has-grad, ‖W‖², [NaN, Inf] (float64 on `dev`), from the row's parts."""
        parts, n = step.parts, len(self.params)
        present = parts.present
        pidx = self._cached(("present", present), present, dev)
        ng = len(present)
        gsq = torch.zeros(n, dtype=F64, device=dev).index_copy_(0, pidx, parts.sq[:ng].to(dev))
        if step.scale is not None:  # the row is unscaled (stat_rows.unscale); its parts are not
            gsq = gsq / step.scale.to(dev, F64).square()
        has = self._cached(("has", present), [1.0 if i in set(present) else 0.0 for i in range(n)], dev, F64)
        counts = torch.zeros(n, 2, dtype=F64, device=dev)
        if parts.counts is not None:
            counts.index_copy_(0, pidx, parts.counts.to(dev, F64))
        return {"gsq": gsq, "has": has, "wsq": parts.sq[ng:].to(dev), "nan": counts[:, 0], "inf": counts[:, 1]}

    def _update_vectors(self, prev, dev) -> dict:
        """This rank's per-parameter ‖ΔW‖² of `prev`'s optimizer step(s), and which parameters they stepped."""
        n = len(self.params)
        usq, stepped = torch.zeros(n, dtype=F64, device=dev), torch.zeros(n, dtype=F64, device=dev)
        for idx, norms in prev.updates:
            at = self._cached(("idx", idx), idx, dev)
            usq.index_add_(0, at, torch.stack([t.to(dev) for t in norms]).double().square())
            stepped.index_fill_(0, at, 1.0)
        prev.updates = []
        return {"usq": usq, "stepped": stepped}

    def _layer_vector(self, step, dev) -> torch.Tensor:
        """Per layer the sums whose total over ranks gives the δ and a statistics (data parallel), or only the
        counts (tensor parallel: the norms stay this rank's); then [loss, has a loss]."""
        row, entries = step.row, step.parts.entries.to(dev, F64)
        dn, dmax, ar, zf = row[:, S["delta_norm"]], row[:, S["delta_max"]], row[:, S["a_rms"]], row[:, S["a_zero_frac"]]
        dr, a_r = ~dn.isnan(), ~ar.isnan()
        z = torch.zeros((), dtype=F64, device=dev)
        cols = [torch.where(dr, dn.square(), z), torch.where(dr, dmax, -torch.inf), dr.double(),
                row[:, S["delta_nan"]].nan_to_num(0.0), row[:, S["delta_inf"]].nan_to_num(0.0),
                torch.where(a_r, ar.square() * entries, z), torch.where(a_r, zf * entries, z),
                torch.where(a_r, entries, z), row[:, S["a_nonfinite"]].nan_to_num(0.0), a_r.double()]
        has = torch.full((), float(step.has_loss), dtype=F64, device=dev)
        loss = torch.where(has > 0, step.step_row[0], z)
        return torch.cat([torch.stack(cols, 1).flatten(), loss.view(1), has.view(1)])

    def _send(self, local: dict, world_part, dev, only_update: bool = False) -> list:
        """One asynchronous all_gather per process group of its parameters' parts (the world's with `world_part`)."""
        keys = ("usq", "stepped") if only_update else ("gsq", "has", "wsq", "nan", "inf", "usq", "stepped")
        works = []
        for gi, (group, members) in enumerate(zip(self.groups, self.members)):
            if not members and (gi or world_part is None):
                continue
            m = self._cached(("members", gi), members, dev)
            zeros = torch.zeros(len(members), dtype=F64, device=dev)
            parts = [local[k].index_select(0, m) if k in local else zeros for k in keys]
            vec = torch.cat(parts + ([world_part] if gi == 0 and world_part is not None else [])).contiguous()
            size = self.world if group is None else self.dist.get_world_size(group)
            outs = [torch.empty_like(vec) for _ in range(size)]
            works.append((gi, outs, self.dist.all_gather(outs, vec, group=group, async_op=True)))
        return works

    # -- before a row is judged or moved: wait, sum in rank order, write the global row -----------------------
    def settle(self, step) -> None:
        """Make `step`'s row global (its own figures; its update ratio too where that gather went out already)."""
        self._settle(step.index)
        if step.index in self._carrier:
            self._settle(self._carrier[step.index])

    def _settle(self, key) -> None:
        p = self._pending.pop(key, None)
        if p is None:
            return
        if p.prev is not None and p.prev.index in self._pending:
            self._settle(p.prev.index)  # its own figures first: the update ratio divides by its global ‖W‖
        if p.prev is not None:
            self._carrier.pop(p.prev.index, None)
        got = self._wait(p)
        if got is None:
            return
        if p.step is not None:
            self._own(p.step, p.local, got)
        if p.prev is not None:
            self._update(p.prev, p.local, got, offset=0 if p.step is None else 5)

    def _wait(self, p: Pending):
        """{group index: (ranks, K) float64} once every gather of `p` arrived (on a GPU: once the current stream
        waits for it, no host sync); None (and every later figure this rank's, said in w.notes) where one did not,
        within TIMEOUT_S on the CPU, within the process group's timeout elsewhere."""
        got = {}
        for gi, outs, work in p.works:
            try:
                if outs[0].device.type == "cpu":  # gloo: the host waits anyway; bounded here
                    work.wait(timedelta(seconds=TIMEOUT_S))
                else:  # NCCL: a wait with a timeout blocks the host (a sync per step); without one the current
                    work.wait()  # stream waits, and the process group's own timeout aborts a collective that hangs
            except Exception as e:  # noqa: BLE001 - a rank gone or late: said in w.notes, never a hang
                self.off = True
                self._pending.clear()
                step = p.step.index if p.step is not None else p.prev.index
                self.notes.append(NO_ANSWER.format(step=step, s=TIMEOUT_S, err=f"{type(e).__name__}: {e}"[:160],
                                                   rank=self.rank))
                return None
            got[gi] = torch.stack(outs)
        return got

    def _global_params(self, local: dict, got: dict, keys: tuple, offset: int) -> dict:
        """The per-parameter vectors with each sharded parameter's entry replaced by its sum over its group's ranks
        (in rank order: the same on every rank)."""
        out = {k: local[k].clone() for k in keys}
        for gi, rows in got.items():
            members = self.members[gi]
            if not members:
                continue
            k = len(members)
            m = self._cached(("members", gi), members, rows.device)
            total = rows.sum(0)
            for j, key in enumerate(keys):
                out[key].index_copy_(0, m, total[(offset + j) * k:(offset + j + 1) * k])
        return out

    def _layers_sum(self, per_param: torch.Tensor) -> torch.Tensor:
        """(layers,) sums of a per-parameter vector over each layer's parameters (a shared one in each layer)."""
        dev = per_param.device
        li = self._cached("pair_layers", [li for li, _ in self.pairs], dev)
        pi = self._cached("pair_params", [pi for _, pi in self.pairs], dev)
        return torch.zeros(self.L, dtype=F64, device=dev).index_add_(0, li, per_param.index_select(0, pi))

    def _own(self, step, local: dict, got: dict) -> None:
        row, step_row = step.row, step.step_row
        step.ranks_local = (row.clone(), step_row.clone())  # this rank's, kept (w.local_stats)
        dev = row.device
        g = self._global_params(local, got, ("gsq", "has", "wsq", "nan", "inf"), 0)
        mask = self._cached("sharded_layers", self.sharded_layers, dev)
        if self.any_sharded:
            has = self._layers_sum(g["has"]) > 0
            grad_norm = torch.where(has, self._layers_sum(g["gsq"]).sqrt(), NAN)  # gsq: 0 where no rank has a .grad
            for col, value in (("grad_norm", grad_norm), ("weight_norm", self._layers_sum(g["wsq"]).sqrt()),
                               ("grad_nan", self._layers_sum(g["nan"])), ("grad_inf", self._layers_sum(g["inf"])),
                               ("update_ratio", torch.full_like(grad_norm, NAN))):  # until its update arrives
                row[:, S[col]] = torch.where(mask, value, row[:, S[col]])
            total = g["gsq"].sum()
            step_row[1] = torch.where(g["has"].sum() > 0, total.sqrt(), NAN)
        n_param = len(self.members[0]) * _P
        world = got[0][:, n_param:]
        per = world[:, :-2].reshape(self.world, self.L, _L)
        s = per.sum(0)
        d_any, a_any = s[:, 2] > 0, s[:, 9] > 0
        row[:, S["delta_nan"]] = torch.where(d_any, s[:, 3], NAN)
        row[:, S["delta_inf"]] = torch.where(d_any, s[:, 4], NAN)
        row[:, S["a_nonfinite"]] = torch.where(a_any, s[:, 8], NAN)
        if self.dp:
            row[:, S["delta_norm"]] = torch.where(d_any, s[:, 0].sqrt() / self.world, NAN)  # the mean loss's δ
            row[:, S["delta_max"]] = torch.where(d_any, per[:, :, 1].amax(0) / self.world, NAN)
            entries = s[:, 7].clamp(min=1)
            row[:, S["a_rms"]] = torch.where(a_any, (s[:, 5] / entries).sqrt(), NAN)
            row[:, S["a_zero_frac"]] = torch.where(a_any, s[:, 6] / entries, NAN)
        losses, has = world[:, -2], world[:, -1]
        step_row[0] = torch.where(has.sum() > 0, losses.sum() / has.sum().clamp(min=1), NAN)

    def _update(self, prev, local: dict, got: dict, offset: int) -> None:
        """prev's update ratio: global ‖ΔW‖ over its global ‖W‖, for the layers with sharded parameters (the
        others' is exact as held: written by the optimizer step, step_stats.after_update)."""
        if not self.any_sharded:
            return
        g = self._global_params(local, got, ("usq", "stepped"), offset)
        touched = self._layers_sum(g["stepped"]) > 0
        usq = self._layers_sum(g["usq"])
        if prev.host is None:
            row = prev.row
            mask = self._cached("sharded_layers", self.sharded_layers, row.device)
            ratio = torch.where(touched, usq.sqrt() / row[:, S["weight_norm"]], NAN)
            row[:, S["update_ratio"]] = torch.where(mask, ratio, row[:, S["update_ratio"]])
        else:  # moved already (read mid-step): written into the host copy, as an optimizer step would
            host, r = prev.host
            ratio = torch.where(touched.cpu(), usq.cpu().sqrt() / host[r, :, S["weight_norm"]], NAN)
            host[r, :, S["update_ratio"]] = torch.where(self.sharded_layers, ratio, host[r, :, S["update_ratio"]])
            self.changed()
        self._local_update(prev)

    def _local_update(self, prev) -> None:
        """This rank's own update ratio of prev (its kept local row): ‖ΔW‖ of its shards over their ‖W‖."""
        if prev.update is None:
            return
        kept = getattr(prev, "ranks_local", None)
        if kept is None:
            return
        if not isinstance(kept[1], int):  # still on the device: (row, step row)
            row = kept[0]
            row[:, S["update_ratio"]] = torch.where(prev.touched, prev.update.sqrt() / row[:, S["weight_norm"]], NAN)
        else:  # on the host already: (chunk, row index)
            chunk, r = kept
            w = chunk[r, :, S["weight_norm"]]
            chunk[r, :, S["update_ratio"]] = torch.where(prev.touched.cpu(), prev.update.cpu().sqrt() / w, NAN)

    # -- each rank's own rows on the host ---------------------------------------------------------------------
    def outgoing(self, take: list) -> list:
        """The steps of `take` are about to move to the host: their own (local) rows as device tensors, to go in
        the same non-blocking transfer (host.py); [] where each step's own row is its global row."""
        own = [getattr(s, "ranks_local", None) for s in take]
        if all(o is None for o in own):
            return []
        dev = next(o for o in own if o is not None)[0].device
        rows = [o[0] if o is not None else s.row for s, o in zip(take, own)]
        step_rows = [o[1] if o is not None else s.step_row for s, o in zip(take, own)]
        return [torch.stack([r.to(dev, F64) for r in rows]).flatten(),
                torch.stack([r.to(dev, F64) for r in step_rows]).flatten()]

    def moved(self, take: list, rows: torch.Tensor, step_rows: torch.Tensor, own=None) -> None:
        """The steps of `take` just moved to the host as `rows`: their own (local) rows are `own` (outgoing's,
        arrived with them, flat) or, where None, the global rows themselves."""
        if own is None:
            local, local_steps = rows.clone(), step_rows.clone()
        else:
            local, local_steps = own[:rows.numel()].view_as(rows), own[rows.numel():].view(len(take), 2)
        for r, s in enumerate(take):
            s.ranks_local = (local, r)
        self.local_chunks.append(local)
        self.local_step_chunks.append(local_steps)

    def local_tables(self, stats: torch.Tensor, step_stats: torch.Tensor) -> tuple:
        """(stats, step_stats) as this rank held them, aligned with the global ones given. The learning rate, and
        the update ratio of layers with no sharded parameter (replicas: exact as held), are the global rows'."""
        if not self.local_chunks:
            return stats, step_stats
        local = torch.cat(self.local_chunks).to(stats.dtype)  # the global rows' dtype (watch/history.py)
        local[:, :, S["lr"]] = stats[:, :, S["lr"]]
        whole = ~self.sharded_layers
        local[:, whole, S["update_ratio"]] = stats[:, whole, S["update_ratio"]]
        return local, torch.cat(self.local_step_chunks)

    def _cached(self, key, data, dev, dtype=torch.long) -> torch.Tensor:
        hit = self._index.get((key, dev))
        if hit is None:
            hit = self._index[(key, dev)] = torch.as_tensor(data, dtype=dtype).to(dev) \
                if not isinstance(data, torch.Tensor) else data.to(dev)
        return hit
