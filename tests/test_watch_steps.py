"""Steps as the optimizer counts them (issue 40): gradient accumulation and step(closure) give one row per optimizer
step. The references are hand-written in the same run: the optimizer's own step hooks (register_step_pre_hook /
register_step_post_hook) read ‖p.grad‖ as the step uses it and copy the parameters before and after it; forward hooks
and tensor hooks on the layers' outputs sum ‖δ‖² and Σa² over the micro-batches. Nothing comes from hookwidget."""

import math
import time

import pytest
import torch
from torch import nn

import hookwidget as hw
from hookwidget._torch.modules import module_hooks, optimizer_hooks
from hookwidget.watch import host


def hook_count(model) -> int:
    return (sum(len(d) for m in model.modules() for d in module_hooks(m).values())
            + sum(len(d) for d in module_hooks().values()) + sum(len(d) for d in optimizer_hooks()))


def close(a, b):
    return a == pytest.approx(b, rel=2e-5, abs=1e-12)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


LAYERS = {"0": 0, "2": 2}


class Reference:
    """Hand-written: per optimizer step, ‖W.grad‖ (post-hook), ‖ΔW‖/‖W‖ (copies before and after), and the
    micro-batches' Σ‖δ‖², Σa² and entries of a per layer."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.rows, self.before, self.d2, self.a2, self.n = [], None, {}, {}, {}
        self.handles = [opt.register_step_pre_hook(self.pre), opt.register_step_post_hook(self.post)]
        for name, i in LAYERS.items():
            self.handles.append(model[i].register_forward_hook(self.forward(name)))

    def forward(self, name):
        def hook(m, inputs, out):
            a = inputs[0].detach().double()
            self.a2[name] = self.a2.get(name, 0.0) + a.square().sum().item()
            self.n[name] = self.n.get(name, 0) + a.numel()

            def delta(g):
                self.d2[name] = self.d2.get(name, 0.0) + g.double().square().sum().item()
            out.register_hook(delta)
        return hook

    def layer_norm(self, m, f):
        return math.sqrt(sum(f(p) ** 2 for p in m.parameters(recurse=False)))

    def pre(self, opt, args, kwargs):
        self.before = {name: [p.detach().clone() for p in self.model[i].parameters()] for name, i in LAYERS.items()}

    def post(self, opt, args, kwargs):
        row = {}
        for name, i in LAYERS.items():
            m = self.model[i]
            w = math.sqrt(sum(b.double().square().sum().item() for b in self.before[name]))
            dw = math.sqrt(sum((p.detach() - b).double().square().sum().item()
                               for p, b in zip(m.parameters(), self.before[name])))
            row[name] = {"grad_norm": self.layer_norm(m, lambda p: p.grad.double().norm().item()),
                         "update_ratio": dw / w, "weight_norm": w,
                         "delta_norm": math.sqrt(self.d2.get(name, math.nan)),
                         "a_rms": math.sqrt(self.a2[name] / self.n[name])}
        self.rows.append(row)
        self.d2, self.a2, self.n = {}, {}, {}

    def remove(self):
        for h in self.handles:
            h.remove()


def check(w, ref, stats=("grad_norm", "update_ratio", "weight_norm", "delta_norm", "a_rms")):
    assert w.steps == list(range(len(ref.rows)))
    for k, row in enumerate(ref.rows):
        for name in LAYERS:
            for stat in stats:
                assert close(w.series(name, stat)[k].item(), row[name][stat]), (k, name, stat)


def accumulate(model, opt, steps=4):
    """Two micro-batches per optimizer step, each loss divided by 2; returns the optimizer steps' losses."""
    xs, ys = torch.randn(2 * steps, 4, 6), torch.randn(2 * steps, 4, 3)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(2):
            loss = nn.functional.mse_loss(model(xs[2 * step + micro]), ys[2 * step + micro]) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def test_gradient_accumulation_gives_one_row_per_optimizer_step(monkeypatch):
    monkeypatch.setattr(host, "FLUSH_SECONDS", 1e9)  # a slow first step would move its rows (next test)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = Reference(model, opt)
    try:
        with hw.watch(model) as w:
            losses = accumulate(model, opt)
    finally:
        ref.remove()
    assert w.seen == 8 and not w.notes
    # the first optimizer step shows the watch accumulation: its passes, made steps of their own while they waited
    # on device, are taken back into it
    assert w.micro_batches == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}
    check(w, ref)
    assert w.series("loss").tolist() == pytest.approx(losses, rel=1e-6)
    stats, step_stats = w.micro(2)
    assert stats.shape == (2, 2, len(w.stat_names)) and close(step_stats[:, 0].sum().item(), losses[2])
    assert close(math.sqrt((stats[:, 0, 0] ** 2).sum().item()), ref.rows[2]["0"]["delta_norm"])
    assert hook_count(model) == 0


def test_first_accumulating_step_already_on_the_host_is_said(monkeypatch):
    """Its passes' rows moved to the host before the optimizer step showed the accumulation: they stay steps of their
    own, a note says so and names the fix; the later optimizer steps are one row each."""
    monkeypatch.setattr(host, "FLUSH_SECONDS", 0.0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="count_optimizer_steps"):
        with hw.watch(model) as w:
            accumulate(model, opt)
    assert w.micro_batches == {0: [0], 1: [1], 2: [2, 3], 3: [4, 5], 4: [6, 7]}
    assert "steps 0..1 stay one backward pass each" in w.notes[0]


def test_accumulation_counted_from_the_start():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref = Reference(model, opt)
    xs, ys = torch.randn(9, 4, 6), torch.randn(9, 4, 3)
    losses = []
    try:
        with hw.watch(model) as w:
            w.count_optimizer_steps()
            for step in range(3):
                total = 0.0
                for micro in range(3):
                    loss = nn.functional.mse_loss(model(xs[3 * step + micro]), ys[3 * step + micro]) / 3
                    loss.backward()
                    total += loss.item()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the optimizer sees the clipped .grad
                opt.step()
                opt.zero_grad()
                losses.append(total)
    finally:
        ref.remove()
    check(w, ref)
    assert [close(a, b) for a, b in zip(w.series("loss").tolist(), losses)] == [True] * 3
    assert w.micro_batches == {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 8]}


def test_lbfgs_closure_gives_one_row_per_step():
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    ref = Reference(model, opt)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    first, calls = [], []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        calls.append(loss.item())
        return loss

    try:
        with hw.watch(model) as w:
            for _ in range(3):
                n = len(calls)
                opt.step(closure)
                first.append(calls[n])
    finally:
        ref.remove()
    assert w.seen == len(calls) > 3
    # ‖W.grad‖ as the step left it and the update ratio; δ and a over every closure call
    check(w, ref)
    assert w.series("loss").tolist() == pytest.approx(first, rel=1e-6)
    assert sum(len(p) for p in w.micro_batches.values()) == len(calls)
    assert hook_count(model) == 0


def test_a_plain_loop_is_one_row_per_backward_pass():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = Reference(model, opt)
    try:
        with hw.watch(model) as w:
            for _ in range(4):
                nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
                opt.step()
                opt.zero_grad()
    finally:
        ref.remove()
    check(w, ref)
    assert not w._stats.grouped and not w._rows.micro.ram and all(len(v) == 1 for v in w.micro_batches.values())


def test_passes_no_optimizer_step_used_make_a_step_of_their_own():
    """A GradScaler that finds inf skips optimizer.step, and the loop zero_grads: the next pass starts a new step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = Reference(model, opt)
    xs, ys = torch.randn(6, 4, 6), torch.randn(6, 4, 3)
    try:
        with hw.watch(model) as w:
            w.count_optimizer_steps()
            for step in range(3):
                for micro in range(2):
                    (nn.functional.mse_loss(model(xs[2 * step + micro]), ys[2 * step + micro]) / 2).backward()
                if step != 1:  # step 1: skipped
                    opt.step()
                else:  # the reference's sums start again with the next optimizer step's passes
                    ref.d2, ref.a2, ref.n = {}, {}, {}
                opt.zero_grad()
    finally:
        ref.remove()
    assert w.micro_batches == {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    assert w.series("0", "update_ratio").isnan().tolist() == [False, True, False]
    for k, r in ((0, 0), (2, 1)):
        for stat in ("grad_norm", "update_ratio", "delta_norm"):
            assert close(w.series("0", stat)[k].item(), ref.rows[r]["0"][stat])


def test_without_an_optimizer_each_backward_pass_is_a_step():
    model = mlp()
    with hw.watch(model) as w:
        for _ in range(3):
            model.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
        assert w.steps == [0, 1, 2]  # read while open: the rows held for a first optimizer step move now
        g = model[0].weight.grad.norm().item()
        assert close(w.series("0", "grad_norm")[2].item(), math.sqrt(g ** 2 + model[0].bias.grad.norm().item() ** 2))
    assert w.micro_batches == {0: [0], 1: [1], 2: [2]}


@pytest.mark.parametrize("kind", ["lbfgs", "accumulate"])
def test_optimizer_steps_change_nothing(kind):
    """Bitwise: the losses and the parameters after the loop are those of the loop without the watch."""
    def run(watched):
        model = mlp()
        opt = torch.optim.LBFGS(model.parameters(), max_iter=3) if kind == "lbfgs" else \
            torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(6)]
        losses = []
        w = hw.watch(model) if watched else None
        try:
            for i in range(0, 6, 2):
                if kind == "lbfgs":
                    def closure(i=i):
                        opt.zero_grad()
                        loss = nn.functional.mse_loss(model(data[i][0]), data[i][1])
                        loss.backward()
                        losses.append(loss.detach())
                        return loss
                    opt.step(closure)
                else:
                    for x, y in data[i:i + 2]:
                        loss = nn.functional.mse_loss(model(x), y) / 2
                        loss.backward()
                        losses.append(loss.detach())
                    opt.step()
                    opt.zero_grad()
        finally:
            if w is not None:
                w.close()
        return losses, [p.detach().clone() for p in model.parameters()], w

    (l0, p0, _), (l1, p1, w) = run(False), run(True)
    assert len(w.steps) == 3 and hook_count(w.model) == 0
    assert all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(torch.equal(a, b) for a, b in zip(p0, p1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_sample", [False, True])
def test_optimizer_steps_add_no_host_sync_on_gpu(per_sample):
    """Adding the passes up, reading .grad at the optimizer step and the update ratio: all on device."""
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, ys = torch.randn(8, 4, 6, device="cuda"), torch.randn(8, 4, 3, device="cuda")
    with hw.watch(model, flight_recorder=False, per_sample=per_sample) as w:
        w.count_optimizer_steps()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(4):
                for micro in range(2):
                    (nn.functional.mse_loss(model(xs[2 * step + micro]), ys[2 * step + micro]) / 2).backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert w.steps == [0, 1, 2, 3] and w.series("0", "update_ratio").isfinite().all()


def test_per_sample_maxima_over_the_micro_batches(monkeypatch):
    """per_sample=True: an optimizer step's largest per-sample gradient norm is the largest over its micro-batches;
    the reference differentiates each sample's share of the loss on its own (autograd, no hooks)."""
    monkeypatch.setattr(host, "FLUSH_SECONDS", 1e9)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = torch.randn(4, 4, 6), torch.randn(4, 4, 3)
    want = []
    with hw.watch(model, per_sample=True, flight_recorder=False) as w:
        for step in range(2):
            twin, best = mlp(), (-1.0, -1)  # the reference on a copy: outside the watch
            twin.load_state_dict(model.state_dict())
            for micro in range(2):
                x, y = xs[2 * step + micro], ys[2 * step + micro]
                for i in range(4):  # sample i's share of (mean squared error / 2), differentiated alone
                    share = ((twin(x[i:i + 1]) - y[i:i + 1]) ** 2).sum() / y.numel() / 2
                    g = torch.autograd.grad(share, list(twin.parameters()))
                    best = max(best, (math.sqrt(sum(t.double().square().sum().item() for t in g)), i))
            want.append(best)
            for micro in range(2):
                (nn.functional.mse_loss(model(xs[2 * step + micro]), ys[2 * step + micro]) / 2).backward()
            opt.step()
            opt.zero_grad()
    assert w.steps == [0, 1]
    for k, (n, i) in enumerate(want):
        assert close(w.per_sample[k, 0].item(), n) and w.per_sample[k, 1].item() == i


def test_accumulated_passes_leave_ram_for_the_log_and_read_back_equal(monkeypatch):
    """An optimizer step's passes (w.micro) stay in RAM for the latest MICRO_KEPT steps only, once the log has
    written them: a long accumulating run does not grow the watch's memory by its passes' rows; w.micro of an early
    step reads them back from the log, equal to a watch that kept them all in RAM."""
    from hookwidget.views import watch_log
    from hookwidget.watch import micro

    monkeypatch.setattr(watch_log, "SHARD_SECONDS", 0.0)  # a shard with every rows handed over
    runs = []
    for kept in (3, 10**6):
        monkeypatch.setattr(micro, "MICRO_KEPT", kept)
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hw.watch(model, batch=1) as w:
            w.count_optimizer_steps()
            for k in range(24):  # 12 optimizer steps of 2 passes
                nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
                if k % 2:
                    opt.step()
                    opt.zero_grad()
                    w.sync()
                    for _ in range(5000):  # the log's thread writes the passes of the step before: wait for it
                        if w._log.micro_written >= k // 2 - 1:
                            break
                        time.sleep(0.001)
        runs.append(w)
    small, big = runs
    assert len(small._rows.micro.ram) <= 4 and len(big._rows.micro.ram) == 12  # 3 kept, +1 the log had not yet
    assert small.micro_batches == big.micro_batches == {s: [2 * s, 2 * s + 1] for s in range(12)}
    for s in range(12):
        for a, b in zip(small.micro(s), big.micro(s)):
            assert a.shape[0] == 2 and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # NaN: not measured
    assert small.memory < big.memory
