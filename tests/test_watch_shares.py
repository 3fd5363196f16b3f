"""hw.watch(per_sample=True) records which samples carried each step (issue 43): the top samples' shares
s_b = ⟨G_b, G⟩ / ‖G‖² and the top sample's top position, against float64 references: per-sample gradients from
a loop of backward passes over single samples, G from the batch, per-position parts from a and δ captured with
this file's own hooks (never from hookwidget)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw
from tests.helpers_shares import RNN, mse

pytestmark = pytest.mark.usefixtures("float64_default")


class GPT(nn.Module):
    """A token embedding tied to the LM head, a positional table called on arange (its rows are positions, not
    samples: the watch leaves it out and says so), a LayerNorm and an MLP applied per position."""

    def __init__(self, V=11, d=6, T=5):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        self.ln = nn.LayerNorm(d)
        self.fc, self.proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        h = h + self.proj(torch.tanh(self.fc(self.ln(h))))
        return self.head(h)


def gpt_loss(model, idx, y):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")


GPT_COUNTED = ["wte.weight", "ln.weight", "ln.bias", "fc.weight", "fc.bias", "proj.weight", "proj.bias"]


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 4, 3, stride=2)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))


# -- references ------------------------------------------------------------------------------------------------
def loop_shares(model, loss_fn, x, y, names):
    """(B,) ⟨G_b, G⟩ / ‖G‖² over the parameters `names`: G_b by a backward pass over sample b alone, G by the
    batch's; and the cross-term-free ⟨G_b, G_b⟩ / ‖G‖² a wrong rule would give."""
    params = dict(model.named_parameters())
    ps = [params[n] for n in names]
    G = torch.autograd.grad(loss_fn(model, x, y), ps)
    total = sum(g.square().sum() for g in G)
    dots, own = [], []
    for b in range(x.shape[0]):
        gb = torch.autograd.grad(loss_fn(model, x[b:b + 1], y[b:b + 1]), ps)
        dots.append(sum((u * g).sum() for u, g in zip(gb, G)))
        own.append(sum(u.square().sum() for u in gb))
    return torch.stack(dots) / total, torch.stack(own) / total


def gpt_positions(model, idx, y):
    """(B, T) ⟨G_{b,t}, G⟩ / ‖G‖² over GPT_COUNTED, from a and δ taken by this file's hooks."""
    a, d, handles = {}, {}, []
    for n in ("wte", "ln", "fc", "proj", "head"):
        def hook(m, args, out, n=n):
            a[n] = args[0].detach()
            out.register_hook(lambda g: d.__setitem__(n, g.detach()))
        handles.append(model.get_submodule(n).register_forward_hook(hook))
    params = dict(model.named_parameters())
    G = dict(zip(GPT_COUNTED, torch.autograd.grad(gpt_loss(model, idx, y), [params[n] for n in GPT_COUNTED])))
    for h in handles:
        h.remove()
    pos = (d["wte"] * G["wte.weight"][idx]).sum(-1)
    pos = pos + torch.einsum("btv,vi,bti->bt", d["head"], G["wte.weight"], a["head"])
    for n in ("fc", "proj"):
        pos = pos + torch.einsum("bto,oi,bti->bt", d[n], G[f"{n}.weight"], a[n]) + d[n] @ G[f"{n}.bias"]
    x = a["ln"]
    xhat = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + model.ln.eps)
    pos = pos + (d["ln"] * xhat) @ G["ln.weight"] + d["ln"] @ G["ln.bias"]
    return pos / sum(g.square().sum() for g in G.values())


def cnn_positions(model, x, y):
    """(B, 36) ⟨G_{b,l}, G⟩ / ‖G‖² of c1's output positions l: a convolution is linear in its weight, so a
    position's part is Σ_o δ_{b,o,l} (conv(a; G_w) + G_bias)_{o,l}; a and δ from this file's own hooks."""
    got = {}

    def hook(m, args, out):
        got["a"] = args[0].detach()
        out.register_hook(lambda g: got.__setitem__("d", g.detach()))

    h = model.c1.register_forward_hook(hook)
    params = list(model.parameters())
    G = torch.autograd.grad(mse(model, x, y), params)
    h.remove()
    y1 = F.conv2d(got["a"], G[0], G[1], padding=1)
    return (got["d"] * y1).sum(1).flatten(1) / sum(g.square().sum() for g in G)


def run_watch(model, loss_fn, batches, names, lr=0.05, ref=None, **kw):
    """Train on `batches` under hw.watch(per_sample=True); per step, the loop's shares (and own-norm shares) at
    the step's weights, taken before the watch sees the step (by `ref`, the same model without what the loop's
    autograd.grad cannot run through, where given)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref = ref if ref is not None else copy.deepcopy(model)  # made before the watch hooks the model
    refs = []
    with hw.watch(model, per_sample=True, flight_recorder=False, **kw) as w:
        for x, y in batches:
            ref.load_state_dict(model.state_dict())
            refs.append(loop_shares(ref, loss_fn, x, y, names))
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
    return w, refs


def check_top(got, want):
    """The recorded (steps, 3, 2) against the loop's shares per step: the same samples, the same shares."""
    for k, s in enumerate(want):
        values, idx = s.topk(min(3, s.shape[0]))
        assert got[k, :len(idx), 0].tolist() == idx.tolist()
        assert torch.allclose(got[k, :len(idx), 1], values, atol=1e-9), (got[k], s)


# -- tests -----------------------------------------------------------------------------------------------------
def test_gpt_top_samples_and_position_match_loops():
    torch.manual_seed(0)
    model = GPT()
    batches = [(torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))) for _ in range(3)]
    before = [copy.deepcopy(model)]
    w, refs = run_watch(model, gpt_loss, batches, GPT_COUNTED)
    assert any("wpe" in n for n in w.notes)  # left out, named: its rows are positions
    got = w.sample_shares
    assert got.shape == (3, 3, 2)
    check_top(got, [s for s, _ in refs])
    assert torch.allclose(got[:, :, 1].sum(1), torch.ones(3), atol=1e-6)  # B = 3: every sample is recorded
    for (s, own) in refs:  # a rule without the cross terms would not pass check_top
        assert not torch.allclose(s, own, atol=1e-3)
    m = before[0]  # step 0's position: the top sample's largest position share, by hand-written hooks
    pos = gpt_positions(m, *batches[0])
    b = int(refs[0][0].argmax())
    share, t = pos[b].max(0)
    assert w.top_positions[0, 0].item() == t.item()
    assert abs(w.top_positions[0, 1].item() - share.item()) < 1e-9
    assert torch.allclose(pos.sum(1), refs[0][0], atol=1e-9)  # the positions add up to the samples' shares


class CheckpointedGPT(GPT):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, idx):
        from torch.utils.checkpoint import checkpoint

        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        mlp = lambda z: self.proj(torch.tanh(self.fc(self.ln(z))))  # noqa: E731
        return self.head(h + checkpoint(mlp, h, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_is_exact(reentrant):
    """The block's forward rerun in backward: its layers' a from the rerun, their parameters' gradients from the
    hooks (inside the rerun's own backward under reentrant checkpointing)."""
    torch.manual_seed(10)
    model = CheckpointedGPT(reentrant)
    plain = GPT()
    batches = [(torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))) for _ in range(2)]
    # reentrant: the first forward ran without grad, unseen: wte and head are left out (no proof of their
    # samples), named; the shares are then the block's
    counted = GPT_COUNTED if not reentrant else [n for n in GPT_COUNTED if n.split(".")[0] in ("ln", "fc", "proj")]
    w, refs = run_watch(model, gpt_loss, batches, counted, ref=plain)
    assert not reentrant or any("wte, wpe, head" in n for n in w.notes)
    check_top(w.sample_shares, [s for s, _ in refs])
    assert torch.allclose(w.sample_shares[:, :, 1].sum(1), torch.ones(2), atol=1e-6)


def test_cnn_and_lstm_match_loops():
    torch.manual_seed(1)
    cnn = CNN()
    batches = [(torch.randn(3, 1, 6, 6), torch.randn(3, 3)) for _ in range(2)]
    first = copy.deepcopy(cnn)
    w, refs = run_watch(cnn, mse, batches, [n for n, _ in cnn.named_parameters()])
    check_top(w.sample_shares, [s for s, _ in refs])
    assert torch.allclose(w.sample_shares[:, :, 1].sum(1), torch.ones(2), atol=1e-6)
    assert not w.notes
    pos = cnn_positions(first, *batches[0])  # step 0: c1's 36 output positions (c2 has 4: the longer axis wins)
    b = int(refs[0][0].argmax())
    share, t = pos[b].max(0)
    assert w.top_positions[0, 0].item() == t.item() and abs(w.top_positions[0, 1].item() - share.item()) < 1e-9
    rnn = RNN()  # the LSTM has no exact (a, δ) rule in the watch (the generic rule reruns its forward): left
    batches = [(torch.randn(4, 5, 3), torch.randn(4, 2)) for _ in range(2)]  # out, named; the shares are fc's
    w, refs = run_watch(rnn, mse, batches, ["fc.weight", "fc.bias"])
    check_top(w.sample_shares, [s for s, _ in refs])
    assert any("lstm (no exact (a, δ) rule)" in n for n in w.notes)


def test_accumulated_step_leaves_shares_out_and_keeps_norms():
    torch.manual_seed(2)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with hw.watch(model, per_sample=True, flight_recorder=False) as w:
        w.count_optimizer_steps()
        for _ in range(2):
            opt.zero_grad()
            for _ in range(2):  # two backward passes, one optimizer step
                mse(model, torch.randn(3, 1, 6, 6), torch.randn(3, 3)).backward()
            opt.step()
    assert w.steps == [0, 1]
    assert w.sample_shares.isnan().all()  # left out: a pass's shares are not of the optimizer step's gradient
    assert any("shares" in n and "several backward passes" in n for n in w.notes)  # and named
    with hw.watch(model, per_sample=True, flight_recorder=False) as once:  # one such step, the loop's last
        once.count_optimizer_steps()
        opt.zero_grad()
        for _ in range(2):
            mse(model, torch.randn(3, 1, 6, 6), torch.randn(3, 3)).backward()
        opt.step()
    assert once.steps == [0] and any("several backward passes" in n for n in once.notes)
    assert not w.per_sample[:, 0].isnan().any()


def planted_run(k=80, planted=4, wrong=(2, 6), after=None):
    """A small GPT learning next token = token + 1 (Adam), one sample with two wrong labels at step k; `after(step)`
    is called after each optimizer step."""
    torch.manual_seed(3)
    V, T, B = 11, 8, 6
    model = GPT(V=V, T=T)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)

    def run():
        for step in range(k + 1):
            idx = torch.randint(0, V, (B, T))
            y = (idx + 1) % V  # learnable: the next token
            if step == k:
                y[planted, list(wrong)] = (y[planted, list(wrong)] + 5) % V  # two wrong labels in one sample
            opt.zero_grad()
            gpt_loss(model, idx, y).backward()
            opt.step()
            if after is not None:
                after(step)

    return model, run


def test_planted_sample_named_by_the_anomaly_and_its_trace(tmp_path):
    k, planted, wrong = 80, 4, [2, 6]
    model, run = planted_run(k, planted, wrong)
    with hw.watch(model, per_sample=True, window=10, spike=4.0, log_dir=tmp_path / "log") as w:
        run()
    found = [a for a in w.anomalies if a.step == k]
    assert found, w.anomalies
    assert found[0].samples is not None and found[0].samples.samples[0][0] == planted
    assert f"samples {planted} (" in found[0].samples.text
    assert found[0].samples.position in wrong
    assert w.trace(k).shares().top(1)[0][0] == planted  # the kept Trace carries the full attribution
    tensorboard = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    w.to_tensorboard(tmp_path / "tb")  # the exports say it too
    events = tensorboard.EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("anomalies/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert f"({found[0].samples.text})" in text
    saved = tmp_path / "run.pt"
    w.save(saved)
    for loaded in (hw.load(saved), hw.load(tmp_path / "log")):
        again = [a for a in loaded.anomalies if a.step == k][0]
        assert again.samples == found[0].samples
        assert torch.equal(loaded.sample_shares, w.sample_shares)


def test_tied_head_reduced_early_is_exact(monkeypatch):
    """A tied LM head whose vocabulary-wide δ the watch lets go before the embedding's δ comes (sample_stats'
    _head_part): its shares from its own gradient and δ at the embedding's ids, against the loop."""
    from hookwidget.capture.sample_shares import SampleShares

    calls = []
    head = SampleShares.head
    monkeypatch.setattr(SampleShares, "head", lambda self, *a: (calls.append(1), head(self, *a))[1])
    torch.manual_seed(5)
    model = GPT(V=2048, d=8, T=4)
    batches = [(torch.randint(0, 2048, (3, 4)), torch.randint(0, 2048, (3, 4))) for _ in range(2)]
    for idx, _ in batches:
        idx[1, 3], idx[2, 0] = idx[1, 0], idx[0, 2]  # ids met twice, in one sample and across two
    w, refs = run_watch(model, gpt_loss, batches, GPT_COUNTED)
    assert len(calls) == 2  # the early route ran, once a step
    check_top(w.sample_shares, [s for s, _ in refs])
    assert torch.allclose(w.sample_shares[:, :, 1].sum(1), torch.ones(2), atol=1e-6)


def test_norms_only_hooks_no_parameter_and_records_the_same_norms():
    from hookwidget._torch.tensors import backward_hooks

    torch.manual_seed(6)
    batches = [(torch.randn(3, 1, 6, 6), torch.randn(3, 3)) for _ in range(2)]
    got = {}
    for mode in (True, "norms"):
        torch.manual_seed(7)  # the same weights for both
        model = CNN()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with hw.watch(model, per_sample=mode, flight_recorder=False) as w:
            hooked = [n for n, p in model.named_parameters() if backward_hooks(p)]
            for x, y in batches:
                opt.zero_grad()
                mse(model, x, y).backward()
                opt.step()
        got[mode] = (hooked, w.per_sample, w.sample_shares)
    assert len(got[True][0]) == 6 and got["norms"][0] == []  # per_sample=True hooks each parameter; "norms" none
    assert torch.equal(got[True][1], got["norms"][1])
    assert not got[True][2].isnan().any() and got["norms"][2].isnan().all()
    with pytest.raises(ValueError, match="per_sample='shares' must be True, False or 'norms'"):
        hw.watch(CNN(), per_sample="shares")


def test_trainer_callbacks_log_the_anomaly_sample():
    """The callbacks' Fit counts optimizer steps (each step one backward pass here: its shares are known) and logs
    the sample that carried the latest anomaly's step."""
    from hookwidget.integrations.fit import PREFIX, Fit

    fit = Fit({"per_sample": True, "window": 10, "spike": 4.0, "flight_recorder": False}, ())
    model, run = planted_run(after=lambda step: fit.stepped(step + 1))
    fit.open(model, 0)
    try:
        run()
        logs = fit.metrics(81)
    finally:
        fit.close()
    assert logs[f"{PREFIX}/anomaly_step"] == 81 and logs[f"{PREFIX}/anomaly_sample"] == 4


class Wide(nn.Module):
    """Few samples through wide layers: the Gram form (token pairs) is the cheaper there. `reuse`: fc1's weight
    used again outside fc1 (its .grad is then more than fc1's samples' sum)."""

    def __init__(self, reuse=False):
        super().__init__()
        self.fc1, self.fc2, self.reuse = nn.Linear(64, 64), nn.Linear(64, 2), reuse

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.reuse:
            h = h + F.linear(x, self.fc1.weight)
        return self.fc2(h)


def test_gram_form_where_cheaper_matches_loops(monkeypatch):
    from hookwidget.capture import sample_shares

    used = []
    gram = sample_shares.share_gram.position_dots
    monkeypatch.setattr(sample_shares.share_gram, "position_dots", lambda fs: (used.append(1), gram(fs))[1])
    torch.manual_seed(8)
    model = Wide()
    batches = [(torch.randn(3, 64), torch.randn(3, 2)) for _ in range(2)]
    w, refs = run_watch(model, mse, batches, [n for n, _ in model.named_parameters()])
    assert used  # fc1's weight took the Gram form
    check_top(w.sample_shares, [s for s, _ in refs])
    assert torch.allclose(w.sample_shares[:, :, 1].sum(1), torch.ones(2), atol=1e-6)


def test_a_weight_used_outside_its_layer_gives_nan_not_a_wrong_share():
    torch.manual_seed(9)
    model = Wide(reuse=True)
    batches = [(torch.randn(3, 64), torch.randn(3, 2)) for _ in range(2)]
    w, _ = run_watch(model, mse, batches, [n for n, _ in model.named_parameters()])
    assert w.sample_shares.isnan().all()  # Σ_b ⟨G_b, G⟩ ≠ ‖G‖²: the check says not known
