"""The flight recorder costs what the running step already holds: its hooks go on once per watch, a step's record
is assembled only when the step is kept, a dropped step's detail is let go when it is judged, and a kept step is
what the step was even where the code writes tensors in place (in-place ReLU, .grad zeroed in place)."""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn

import hookwidget.record.assemble as assemble_mod
import hookwidget.session as session_mod
from hookwidget.capture.tracer import Tracer
from hookwidget.record.calls import Call
from hookwidget.watch import host, watch


def model_and_data(inplace=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=inplace), nn.Linear(16, 16), nn.ReLU(inplace=inplace),
                          nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)


def loop(model, x, y, steps, set_to_none=True, on_step=None):
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    for k in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        F.mse_loss(model(x), y).backward()
        if on_step is not None:
            on_step(k)
        opt.step()


def test_only_kept_steps_are_assembled(monkeypatch):
    """20 steps, nothing anomalous: the latest step's record is assembled (when the watch closes), no other."""
    built = []
    real = session_mod.assemble

    def counting(rec, **kw):
        built.append(rec)
        return real(rec, **kw)

    monkeypatch.setattr(session_mod, "assemble", counting)
    assert assemble_mod.assemble is real
    model, x, y = model_and_data()
    with watch(model) as w:
        loop(model, x, y, 20)
    assert w.kept == [19] and len(built) == 1
    w.trace(19), w.trace()  # asked again: assembled once
    assert len(built) == 1


def test_recorder_hooks_go_on_once(monkeypatch):
    """One Tracer for the recording of every step (cut at each step's end), not hooks put on and off per step."""
    entered = []
    real = Tracer.__enter__

    def counting(self):
        entered.append(self)
        return real(self)

    monkeypatch.setattr(Tracer, "__enter__", counting)
    model, x, y = model_and_data()
    with watch(model) as w:
        loop(model, x, y, 12)
    assert len(entered) == 2  # the watch's statistics tracer and the recorder's
    assert w.kept == [11]


def test_dropped_steps_are_let_go():
    """What the recorder holds of the steps it dropped is released when they are judged: the calls alive stay
    within the kept Traces', the latest step's and the running one's, whatever the number of steps."""
    model, x, y = model_and_data()
    alive = []

    def calls():
        gc.collect()
        return sum(type(o) is Call for o in gc.get_objects())

    base = calls()  # what earlier tests left alive

    def count(k):
        alive.append(calls() - base)

    running = []  # while the model runs: at the last layer's forward, every call of the running step is open
    model[4].register_forward_hook(lambda *_: running.append(calls() - base))
    with watch(model, keep=lambda step, stats: step == 0) as w:
        loop(model, x, y, 30, on_step=count)
    per_step = 6  # the Sequential and its five layers, one call each
    assert alive[0] == per_step and set(alive[1:]) == {2 * per_step}  # step 0 (kept) and the latest, no other
    # The step before was judged as this forward began (its optimizer step done): step 0 and the running one only.
    assert running[0] == per_step and set(running[1:]) == {2 * per_step}
    assert w.kept == [0, 29]


def test_kept_step_under_in_place_writes():
    """ReLU(inplace=True) rewrites Linear outputs, zero_grad(set_to_none=False) rewrites .grad in place: the kept
    Trace still holds each layer's a and δ and the .grad of its own step, as hand-written hooks cloned them."""
    model, x, y = model_and_data(inplace=True)
    ref = nn.Sequential(*[m for m in model_and_data(inplace=True)[0]])
    seen, steps, grads = {}, {}, {}
    for i in (0, 2, 4):
        def hook(m, inp, out, i=i):
            seen[f"{i}.a"] = inp[0].detach().clone()
            out.register_hook(lambda g: seen.__setitem__(f"{i}.d", g.clone()))
        ref[i].register_forward_hook(hook)

    def on_ref(k):
        steps[k] = dict(seen)
        grads[k] = {n: p.grad.clone() for n, p in ref.named_parameters()}

    loop(ref, x, y, 8, set_to_none=False, on_step=on_ref)
    with watch(model, keep=lambda step, stats: step in (0, 3)) as w:
        loop(model, x, y, 8, set_to_none=False)
    assert w.kept == [0, 3, 7]
    for k in w.kept:
        t = w.trace(k)
        for i in ("0", "2", "4"):
            assert torch.equal(t.layers[i].a, steps[k][i + ".a"]) and torch.equal(t.layers[i].delta, steps[k][i + ".d"])
            assert torch.equal(t.steps[-1].grads[i + ".weight"], grads[k][i + ".weight"])


def test_a_batch_buffer_reused_in_place_is_named_not_copied_every_step():
    """The recorder holds the batch by reference (no copy per step): a loop that copies each batch into one buffer
    (as a static-input loop does) has overwritten it by the time a step is judged, so the kept Trace leaves that
    input out with a note naming the layer; what the loop does not overwrite is kept as hand-written hooks saw it,
    and the latest step (judged at close) keeps its input."""
    model, _, y = model_and_data()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(32, 6, generator=g) for _ in range(6)]
    buffer = torch.empty(32, 6)
    seen = {}
    ref = model_and_data()[0]

    def hook(m, inp, out):  # returns None: a forward hook that returns a tensor replaces the output
        seen[len(seen)] = inp[0].detach().clone()

    ref[2].register_forward_hook(hook)
    opt_ref = torch.optim.SGD(ref.parameters(), 0.05, momentum=0.9)
    for b in batches:
        opt_ref.zero_grad()
        F.mse_loss(ref(b), y).backward()
        opt_ref.step()
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    with watch(model, keep=lambda step, stats: step in (0, 2)) as w:
        for b in batches:
            buffer.copy_(b)
            opt.zero_grad()
            F.mse_loss(model(buffer), y).backward()
            opt.step()
    assert w.kept == [0, 2, 5]
    for k in (0, 2):
        t = w.trace(k)
        assert t.layers["0"].a is None and torch.equal(t.layers["2"].a, seen[k])
        note = next(n for n in t.note_records if n.id == "held_written")
        assert note.layers == ("0",) and "left out, in 0" in str(note)
    last = w.trace(5)
    assert torch.equal(last.layers["0"].a, batches[5]) and not any(n.id == "held_written" for n in last.note_records)


def test_a_layer_frozen_mid_run_is_recorded_as_it_is_now():
    """What the recorder keeps of a module's calls follows the module as it is at each step: layer 0, frozen after
    step 1, no longer has its input saved by autograd, so the recorder copies it (copy-on-write) from then on, and
    the batch buffer that the loop overwrites is kept for step 3, where step 0 (trainable then) leaves it out with
    a note."""
    model, _, y = model_and_data()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(32, 6, generator=g) for _ in range(5)]
    buffer = torch.empty(32, 6)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    with watch(model, keep=lambda step, stats: step in (0, 3)) as w:
        for k, b in enumerate(batches):
            if k == 2:
                model[0].requires_grad_(False)
            buffer.copy_(b)
            opt.zero_grad()
            F.mse_loss(model(buffer), y).backward()
            opt.step()
    assert w.kept == [0, 3, 4]
    first, later = w.trace(0), w.trace(3)
    assert first.layers["0"].a is None and any(n.id == "held_written" for n in first.note_records)
    assert torch.equal(later.layers["0"].a, batches[3]) and not any(n.id == "held_written" for n in later.note_records)


class _RMSNorm(nn.Module):
    """An RMSNorm of another package (Llama's): the generic rule serves it; its weight is a factor of a product."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_the_recorder_takes_no_fast_rule_parts_and_a_kept_step_is_still_exact(monkeypatch):
    """The recorder's steps, dropped unread but for a few, take none of the generic rule's fast-rule parts from their
    graphs (an RMSNorm's product node, self-attention's projections) at each call: a kept step's per-sample rows come
    from the same rules' rerun of the module, equal to hw.trace's of the same step and to an autograd loop."""
    import hookwidget as hw
    from hookwidget.layers import generic

    taken = []
    monkeypatch.setattr(generic, "FAST_CAPTURES",
                        [(a, lambda *args, c=c: taken.append(1) or c(*args)) for a, c in generic.FAST_CAPTURES])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _RMSNorm(8), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, 3, generator=g)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    before = {}

    def step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y, reduction="sum").backward()

    with watch(model, keep=lambda k, stats: k == 2) as w:
        for k in range(4):
            if k == 2:
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
            step()
            opt.step()
    assert not taken and 2 in w.kept
    kept = w.trace(2).per_sample_grad_norms()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    taken.clear()
    t = hw.trace(step, capture="norms")
    assert taken  # hw.trace takes them
    torch.testing.assert_close(kept, t.per_sample_grad_norms(), rtol=1e-5, atol=1e-7)
    rows = []
    for i in range(4):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    torch.testing.assert_close(kept, torch.stack(rows), rtol=1e-5, atol=1e-7)


def test_steps_are_judged_from_their_scalars_while_rows_move_in_batches(monkeypatch):
    """The flight recorder decides each step from its loss, global gradient norm and one non-finite flag; the rows
    still move to the host by the batch. What it keeps and the anomalies listed (their order within a step
    too) are those of a watch that moves every row at once (batch=1), for a loss spike and a NaN step."""
    from hookwidget.watch.core import Watch

    monkeypatch.setattr(host, "FLUSH_SECONDS", 1e9)  # by the batch only
    moves = []
    real = Watch._flush

    def counting(self, upto=None, wait=True):
        moves.append(any(upto is None or s.index <= upto for s in self._rows.pending))
        return real(self, upto, wait)

    monkeypatch.setattr(Watch, "_flush", counting)

    def run(batch):
        model, x, y = model_and_data()
        moves.clear()
        with watch(model, batch=batch, window=5) as w:
            opt = torch.optim.SGD(model.parameters(), 0.01)
            for k in range(40):
                opt.zero_grad()
                scale = 50.0 if k == 17 else float("nan") if k == 29 else 1.0
                (F.mse_loss(model(x), y) * scale).backward()
                if k != 29:
                    opt.step()
            during = sum(moves)
        return w, during

    w1, every_step = run(1)
    w64, batched = run(64)
    assert {17, 29} <= set(w64.kept) and w64.kept == w1.kept
    assert w64.anomalies == w1.anomalies and [a.step for a in w64.anomalies if a.step == 29]
    (nan,) = [a for a in w64.anomalies if a.step == 29]  # one anomaly: the onset, its loss listed first
    assert nan.reason.split(" | ")[1].startswith("non-finite loss") and w64.nonfinite == {29: 0}
    assert every_step >= 38 and batched <= 2  # the NaN step's row moved at once (its layer located), no other
