"""capture="norms" and hw.watch(per_sample=True) under activation checkpointing (torch.utils.checkpoint): exact
per-sample norms with reentrant and non-reentrant checkpointing, a layer called twice in a block and in two blocks;
and the memory checkpointing frees stays free: the first forward's inputs of checkpointed layers are not held (the
rerun's are taken), nor is the graph a non-reentrant rerun builds."""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

import hookwidget as hw

B, T, D, H = 4, 6, 8, 32


class Blocks(nn.Module):
    """MLP blocks, each checkpointed (or not); `shared` is called twice in block 0 and once in the others."""

    def __init__(self, reentrant: bool | None, d: int = D, h: int = H, shared: bool = True, blocks: int = 2):
        super().__init__()
        self.reentrant, self.uses_shared = reentrant, shared
        self.up = nn.ModuleList(nn.Linear(d, h) for _ in range(blocks))
        self.down = nn.ModuleList(nn.Linear(h, d) for _ in range(blocks))
        self.shared = nn.Linear(d, d) if shared else None
        self.inp, self.head = nn.Linear(d, d), nn.Linear(d, 3)  # outside the blocks: their inputs need grad
        self.probe = None

    def block(self, i, x):
        h = x + self.down[i](F.gelu(self.up[i](x)))
        if not self.uses_shared:
            return h
        h = self.shared(h)
        return torch.tanh(self.shared(h)) if i == 0 else h

    def forward(self, x):
        x = self.inp(x)
        for i in range(len(self.up)):
            x = x if self.reentrant is None else checkpoint(self.block, i, x, use_reentrant=self.reentrant)
            if self.reentrant is None:
                x = self.block(i, x)
        out = self.head(x)
        if self.probe is not None:
            out.register_hook(lambda g: self.probe())
        return out


def loop_sq(model, x, y) -> dict:
    """Parameter name -> (B,) squared norms of each sample's gradient of it, from a loop of autograd."""
    rows = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        loss_of(model, x[i:i + 1], y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            rows[n].append(p.grad.pow(2).sum())
    return {n: torch.stack(v) for n, v in rows.items()}


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")


def loop_norms(model, x, y, skip=()):
    """Per-sample gradient norms from a loop of autograd over the samples (the parameters not in `skip`)."""
    out = []
    for i in range(x.shape[0]):
        model.zero_grad()
        loss_of(model, x[i:i + 1], y[i:i + 1]).backward()
        out.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if n not in skip]).norm())
    return torch.stack(out)


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, T, D, generator=g), torch.randint(0, 3, (B, T), generator=g)


@pytest.mark.parametrize("reentrant", [False, True, None])
def test_norms_under_checkpointing_equal_an_autograd_loop(reentrant):
    torch.manual_seed(0)
    model = Blocks(reentrant)
    x, y = data()

    def step():
        model.zero_grad()
        loss_of(model, x, y).backward()

    t = hw.trace(step, capture="norms")
    left = t.per_sample_left_out
    if reentrant:  # its first forward runs without grad: gelu/tanh between layers leave no graph to prove samples by
        assert left and all("holds none of the 4 samples" in why for why in left.values())
    else:
        assert left == {}
    torch.testing.assert_close(t.per_sample_grad_norms(), loop_norms(model, x, y, skip=left), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_first_forwards_inputs_of_checkpointed_layers_are_not_held(reentrant):
    """As backward starts (the head's δ), no (B, T, H) tensor is alive: the blocks' hidden activations, which plain
    checkpointing frees after the first forward, are not held for the down projections' norms (their inputs come
    again with the rerun)."""
    torch.manual_seed(0)
    model = Blocks(reentrant)
    x, y = data()
    alive = []

    def probe():
        gc.collect()
        alive.append(sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.shape == (B, T, H)))

    model.probe = probe
    hw.trace(lambda: loss_of(model, x, y).backward(), capture="norms")
    assert alive == [0]


@pytest.mark.parametrize("capture", ["norms", "full"])
def test_a_non_reentrant_rerun_leaves_no_graph_held(capture):
    """Late in backward (every block rerun), the trace holds no node of a rerun's graph: backward never runs that
    graph, and a reference to it would keep its saved tensors until the step ends."""
    from hookwidget.capture.tracer import Tracer

    torch.manual_seed(0)
    model = Blocks(False, blocks=4)
    x, y = data()
    held = []

    def probe(g):
        tracer = next(o for o in gc.get_objects() if type(o) is Tracer and o.run.hooks.active)
        held.append(sum(c.recomputed and c.out_node is not None for c in tracer.run.live))

    def step():
        h = model.inp(x)
        h.register_hook(probe)  # fires after the blocks' backward
        for i in range(len(model.up)):
            h = checkpoint(model.block, i, h, use_reentrant=False)
        F.cross_entropy(model.head(h).flatten(0, 1), y.flatten(), reduction="sum").backward()

    hw.trace(step, capture=capture)
    assert held == [0]


def backward_peak(step) -> int:
    """Bytes the CPU allocator holds at most once backward has begun (the profiler's memory events)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in json.loads(_trace(prof))["traceEvents"]]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    start = min(e["ts"] for e in events if e.get("ph") == "X" and "evaluate_function" in e.get("name", ""))
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem if e["ts"] >= start) - base


def _trace(prof) -> str:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/trace.json")
        return Path(f"{d}/trace.json").read_text()


def test_backward_under_non_reentrant_checkpointing_holds_what_plain_does():
    """The rerun's graph is never run backward; a reference to its outputs' nodes would keep its saved tensors (the
    activations checkpointing recomputes) until the step ends, and holding the first forward's inputs would keep
    what checkpointing freed: backward's peak stays near plain's (within the norms' own small tensors)."""
    torch.manual_seed(0)
    model = Blocks(False, d=32, h=256, shared=False, blocks=8)
    x = torch.randn(16, 32, 32)
    y = torch.randint(0, 3, (16, 32))

    def plain():
        model.zero_grad(set_to_none=True)
        loss_of(model, x, y).backward()

    plain()
    base = backward_peak(plain)
    traced = backward_peak(lambda: hw.trace(plain, capture="norms"))
    assert traced <= 1.1 * base, (traced, base)


@pytest.mark.parametrize("reentrant, shared", [(False, True), (True, False)])
def test_the_watchs_per_sample_maximum_under_checkpointing(reentrant, shared):
    """hw.watch(per_sample=True) over three SGD steps: each step's largest per-sample norm and its sample are the
    autograd loop's (a layer called twice in a block and in two blocks, non-reentrant; each layer once a block,
    reentrant); under non-reentrant checkpointing no (B, T, H) activation is held as backward starts."""
    from hookwidget.watch import watch

    torch.manual_seed(0)
    model = Blocks(reentrant, shared=shared)
    ref = copy.deepcopy(model)  # the per-sample loop runs on a copy stepped alike
    x, y = data()
    opt, ref_opt = torch.optim.SGD(model.parameters(), 0.1), torch.optim.SGD(ref.parameters(), 0.1)
    want, alive = [], []

    def probe():
        gc.collect()
        alive.append(sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.shape == (B, T, H)))

    for _ in range(3):  # the reference first: every backward pass inside the watch is a step of it
        want.append(loop_sq(ref, x, y))
        ref_opt.zero_grad()
        loss_of(ref, x, y).backward()
        ref_opt.step()
    model.probe = probe
    with watch(model, per_sample=True, flight_recorder=False) as w:
        for _ in range(3):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
    # reentrant: the layers whose samples no proof places (its first forward runs without grad) are left out, named
    left = {w.layer_names[li] for li in w._ps.odd}
    assert bool(left) == bool(reentrant) and (not left or any("per-sample norms leave out" in n for n in w.notes))
    want = [torch.stack([v for n, v in sq.items() if n.rsplit(".", 1)[0] not in left]).sum(0).sqrt() for sq in want]
    ps = w.per_sample
    for k in range(3):
        assert ps[k, 0].item() == pytest.approx(want[k].max().item(), rel=1e-5)
        assert int(ps[k, 1]) == int(want[k].argmax())
    assert reentrant or not any("per_sample" in n for n in w.notes)
    if not reentrant:
        assert alive == [0, 0, 0]


def test_the_watch_names_a_layer_reentrant_checkpointing_reruns_in_two_blocks():
    """Reentrant checkpointing reruns each block when backward reaches it: a layer called in two blocks has its
    norms taken after the first block's δ, before the second block's rerun. The step's per-sample maximum is then
    not known (NaN), and w.notes names the layer and the fix, rather than a partial norm."""
    from hookwidget.watch import watch

    torch.manual_seed(0)
    model = Blocks(True)
    x, y = data()
    with watch(model, per_sample=True, flight_recorder=False) as w:
        loss_of(model, x, y).backward()
    assert torch.isnan(w.per_sample).all()
    assert any("reran shared in another block" in n and "use_reentrant=False" in n for n in w.notes)
