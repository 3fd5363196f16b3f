"""hw.watch(per_sample=True): the largest per-sample gradient norm per step and its sample, against a
per-sample autograd loop (one backward per sample) run on a copy of the model in the same loop."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookwidget.watch import watch


def per_sample_reference(model, x, y, loss_fn):
    """(B,) norms of each sample's contribution to .grad of loss_fn(model(x), y) (mean over the batch),
    by one autograd pass per sample, over all parameters."""
    B = x.shape[0]
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(B):
        loss_i = loss_fn(model(x[i:i + 1]), y[i:i + 1]) / B
        gs = torch.autograd.grad(loss_i, params)
        out.append(torch.sqrt(sum(g.double().pow(2).sum() for g in gs)))
    return torch.stack(out)


class Tokens(nn.Module):
    """Linear layers on (B, T, d) inputs (the Gram form) and one on (B, d) (after pooling), LayerNorm between."""

    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2, self.head = nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = self.fc2(F.gelu(self.ln(self.fc1(x))))
        return self.head(h.mean(1))


@pytest.mark.parametrize("kind", ["mlp", "tokens", "narrow"])
def test_largest_per_sample_norm_matches_a_per_sample_loop(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        x = torch.randn(12, 6)
    elif kind == "tokens":
        model = Tokens()
        x = torch.randn(12, 5, 6)
    else:  # per-sample gradients cheaper than the Gram form (T² >= in·out): built in full
        model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 3))
        x = torch.randn(12, 5, 3)
    y = torch.randn(12, 5, 3) if kind == "narrow" else torch.randn(12, 3)
    y[7] += 10  # one sample stands out at first (a large residual)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(ref.parameters(), 1e-2)
    sum_loss = lambda out, t: F.mse_loss(out, t, reduction="sum") / t[0].numel()  # noqa: E731  (mean over a row)
    want = []
    for _ in range(6):
        want.append(per_sample_reference(ref, x, y, sum_loss))
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    with watch(model, per_sample=True, flight_recorder=False) as w:
        for _ in range(6):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    ps = w.per_sample
    assert ps.shape == (6, 2) and ps.dtype == torch.float64
    for k in range(6):
        assert ps[k, 0].item() == pytest.approx(want[k].max().item(), rel=1e-5), k
        assert int(ps[k, 1]) == int(want[k].argmax()), k
    assert int(ps[0, 1]) == 7
    assert torch.equal(w.series("per_sample_max"), ps[:, 0]) and torch.equal(w.series("per_sample_argmax"), ps[:, 1])
    assert not any("per_sample" in n for n in w.notes)


def test_per_sample_changes_nothing_counts_a_tied_head_and_names_what_it_leaves_out():
    """Bitwise neutral; the embedding tied to the head is counted (its norm with the cross term of its two uses),
    a position embedding is left out (its rows are positions, not samples: named in w.notes); every=2 thins it.
    Reference: each sample's own gradient by autograd, over every parameter but the position table."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos, self.fc = nn.Embedding(20, 8), nn.Embedding(4, 8), nn.Linear(8, 8)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(torch.relu(self.fc(self.emb(idx) + self.pos(torch.arange(idx.shape[1])))))

    model = Tied()
    ref = copy.deepcopy(model)
    B, T = 6, 4
    idx = torch.randint(0, 20, (B, T))
    tgt = torch.randint(0, 20, (B, T))
    opt, ref_opt = torch.optim.SGD(model.parameters(), 0.1), torch.optim.SGD(ref.parameters(), 0.1)
    want = []

    def loop(m, o, reference=False):
        out = []
        for _ in range(4):
            if reference:  # each sample's contribution to .grad (the loss is a mean over B·T tokens)
                params = [m.emb.weight, m.fc.weight, m.fc.bias]
                want.append(torch.stack([torch.sqrt(sum(g.double().pow(2).sum() for g in torch.autograd.grad(
                    F.cross_entropy(m(idx[i:i + 1]).reshape(-1, 20), tgt[i], reduction="sum") / (B * T), params)))
                    for i in range(B)]))
            o.zero_grad()
            loss = F.cross_entropy(m(idx).reshape(-1, 20), tgt.reshape(-1))
            loss.backward()
            out.append((loss.detach().clone(), [p.grad.clone() for p in m.parameters()]))
            o.step()
        return out

    unwatched = copy.deepcopy(ref)
    plain = loop(unwatched, torch.optim.SGD(unwatched.parameters(), 0.1))
    loop(ref, ref_opt, reference=True)
    with watch(model, per_sample=True, every=2) as w:
        watched = loop(model, opt)
    for (l1, g1), (l2, g2) in zip(plain, watched):
        assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    notes = " ".join(w.notes)
    assert "pos" in notes and "emb (" not in notes and "head (" not in notes
    ps = w.per_sample
    assert ps.shape == (2, 2) and torch.isfinite(ps).all()
    assert w.steps == [0, 2]
    for r, k in enumerate(w.steps):
        assert ps[r, 0].item() == pytest.approx(want[k].max().item(), rel=1e-5)
        assert int(ps[r, 1]) == int(want[k].argmax())


def test_tied_layers_whose_rows_differ_are_named_not_mixed():
    """A head that reads the tokens flattened ((B·T, d)) shares its table with an embedding that reads (B, T):
    their rows are not the same samples, so the pair is left out and named, and the loop runs on."""
    torch.manual_seed(0)

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(20, 8), nn.Linear(8, 8)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(torch.relu(self.fc(self.emb(idx))).reshape(-1, 8))

    model = Flat()
    idx, tgt = torch.randint(0, 20, (6, 4)), torch.randint(0, 20, (24,))
    with watch(model, per_sample=True, flight_recorder=False) as w:
        for _ in range(2):
            model.zero_grad()
            F.cross_entropy(model(idx), tgt).backward()
    notes = " ".join(w.notes)
    assert "emb" in notes and "head" in notes and "no proof places the samples" in notes
    assert torch.isfinite(w.per_sample).all()  # fc's rows are the batch's


def test_per_sample_off_by_default():
    model = nn.Linear(3, 2)
    with watch(model, flight_recorder=False) as w:
        model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(KeyError, match="per_sample=True"):
        _ = w.per_sample


def test_a_tied_head_lets_its_vocabulary_wide_delta_go_before_the_embeddings_arrives(monkeypatch):
    """Vocabulary 4096 (the ghost form the cheaper): the head's δ (B, T, V) is reduced as it arrives (its ghost
    norm, its bias's norm, its δ at the sample's token ids), so none is alive when the gradient reaches the
    embedding; the largest per-sample norm is the per-sample loop's, and that of a watch holding the δ whole."""
    import gc

    from hookwidget.capture.sample_stats import PerSample

    V, B, T = 4096, 4, 6

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc, self.head = nn.Embedding(V, 8), nn.Linear(8, 8), nn.Linear(8, V)
            self.head.weight = self.emb.weight
            self.probe = None

        def forward(self, idx):
            h = self.emb(idx) * 1.0
            if self.probe is not None:
                h.register_hook(lambda g: self.probe())  # after the head's δ, before the embedding's
            return self.head(torch.tanh(self.fc(h)))

    torch.manual_seed(0)
    model = TiedLM()
    idx, tgt = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    idx[1, 3] = idx[1, 0]
    wide = []

    def probe():
        gc.collect()
        wide.append(sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.shape == (B, T, V)))

    def run():
        model.probe = probe
        with watch(model, per_sample=True, flight_recorder=False) as w:
            model.zero_grad()
            F.cross_entropy(model(idx).reshape(-1, V), tgt.reshape(-1)).backward()
        model.probe = None
        return w.per_sample[0]

    reduced = run()
    monkeypatch.setattr(PerSample, "_head_part", lambda *args: None)
    whole = run()
    assert wide[0] == 0 and wide[1] > 0
    want = per_sample_reference(model, idx, tgt, lambda out, t: F.cross_entropy(out.reshape(-1, V), t.reshape(-1),
                                                                              reduction="sum") / T)
    assert reduced[0].item() == pytest.approx(want.max().item(), rel=1e-5) and int(reduced[1]) == int(want.argmax())
    assert reduced[0].item() == pytest.approx(whole[0].item(), rel=1e-9) and reduced[1] == whole[1]
