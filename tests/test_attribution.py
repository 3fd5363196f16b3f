"""Gradient shares (issue 43): s_b = ⟨G_b, G⟩ / ‖G‖² per sample and per position, against float64 references:
per-sample gradients from a loop that runs each sample alone, per-position gradients built by hand from a and δ
captured with this file's own hooks (never from hookwidget)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw
from tests.helpers_shares import RNN, mse

pytestmark = pytest.mark.usefixtures("float64_default")


# -- models ----------------------------------------------------------------------------------------------------
class TinyGPT(nn.Module):
    """Token embedding tied to the LM head, a positional table (called on arange, added to every sample: each
    sample's δ reaches it), a LayerNorm and an MLP applied per position, and a gain used by hand (the root
    module's generic rule answers for it: no per-position form)."""

    def __init__(self, V=13, d=6, T=5):
        super().__init__()
        self.wte = nn.Embedding(V, d)
        self.wpe = nn.Embedding(T, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.wte.weight
        self.gain = nn.Parameter(torch.ones(d))  # used by hand in forward: no layer answers for it

    def forward(self, idx):
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        h = h + self.proj(torch.tanh(self.fc(self.ln(h))))
        return self.head(h * self.gain)


def gpt_loss(model, idx, y):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, groups=2)  # grouped: no unfolded input, the convolution form
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))


# -- references ------------------------------------------------------------------------------------------------
def loop_grads(model, loss_fn, x, y, names):
    """{param name: (B, *shape)} each sample run alone through autograd."""
    params = dict(model.named_parameters())
    rows = {n: [] for n in names}
    for b in range(x.shape[0]):
        gs = torch.autograd.grad(loss_fn(model, x[b:b + 1], y[b:b + 1]), [params[n] for n in names])
        for n, g in zip(names, gs):
            rows[n].append(g)
    return {n: torch.stack(r) for n, r in rows.items()}


def ref_shares(per_sample: dict) -> torch.Tensor:
    G = {n: g.sum(0) for n, g in per_sample.items()}
    total = sum(g.square().sum() for g in G.values())
    return sum((g.flatten(1) @ G[n].flatten()) for n, g in per_sample.items()) / total, G, total


class Taps:
    """a and δ of chosen modules, by hand: a forward hook keeps the input and hooks the output's gradient."""

    def __init__(self, model, names):
        self.a, self.d, self.handles = {}, {}, []
        for n in names:
            self.handles.append(model.get_submodule(n).register_forward_hook(self._hook(n)))

    def _hook(self, n):
        def hook(m, args, out):
            self.a[n] = args[0].detach()
            out.register_hook(lambda g: self.d.__setitem__(n, g.detach()))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def gpt_position_refs(model, idx, y):
    """(B, T) ⟨G_{b,t}, G⟩ summed over wte, ln, fc, proj and head (the tied weight: both layers' positions), and
    the total ‖G‖², built from hand-captured a and δ."""
    names = ["wte", "ln", "fc", "proj", "head"]
    taps = Taps(model, names)
    model.zero_grad()
    gpt_loss(model, idx, y).backward()
    taps.remove()
    a, d = taps.a, taps.d
    G = {n: p.grad.clone() for n, p in model.named_parameters()}
    pos = torch.einsum("bto,oi,bti->bt", d["fc"], G["fc.weight"], a["fc"]) + d["fc"] @ G["fc.bias"]
    pos += torch.einsum("bto,oi,bti->bt", d["proj"], G["proj.weight"], a["proj"]) + d["proj"] @ G["proj.bias"]
    pos += torch.einsum("btv,vi,bti->bt", d["head"], G["wte.weight"], a["head"])  # head's part of the tied weight
    pos += (d["wte"] * G["wte.weight"][idx]).sum(-1)  # the embedding's rows idx_t get δ_t
    pos += (d["wte"] * G["wpe.weight"][: idx.shape[1]]).sum(-1)  # row t gets sample b's δ_t (h = wte + wpe)
    x = a["ln"]
    xhat = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + model.ln.eps)
    pos += (d["ln"] * xhat) @ G["ln.weight"] + d["ln"] @ G["ln.bias"]
    total = sum(g.square().sum() for g in G.values())
    norms = {"fc": (d["fc"].square().sum(-1) * (a["fc"].square().sum(-1) + 1)).sqrt(),
             "wte": d["wte"].norm(dim=-1)}
    return pos, total, norms


@pytest.fixture
def gpt():
    torch.manual_seed(0)
    model = TinyGPT()
    idx = torch.randint(0, 13, (4, 5))
    idx[1, 3] = idx[1, 0]  # a token twice in one sample
    y = torch.randint(0, 13, (4, 5))
    return model, idx, y


GPT_PARAMS = ["gain", "wte.weight", "wpe.weight", "ln.weight", "ln.bias", "fc.weight", "fc.bias", "proj.weight",
              "proj.bias"]


def trace_step(model, loss_fn, x, y):
    def step():
        model.zero_grad()
        loss_fn(model, x, y).backward()

    return hw.trace(step)


# -- tests -----------------------------------------------------------------------------------------------------
def test_gpt_sample_and_position_shares_match_loops(gpt):
    model, idx, y = gpt
    t = trace_step(model, gpt_loss, idx, y)
    s = t.shares()
    want, _, _ = ref_shares(loop_grads(model, gpt_loss, idx, y, GPT_PARAMS))
    assert torch.allclose(s.samples, want, atol=1e-10)
    assert abs(float(s.samples.sum()) - 1) < 1e-6
    assert set(s.params) == set(GPT_PARAMS) and not s.left_out
    pos, total, norms = gpt_position_refs(model, idx, y)
    assert torch.allclose(t.position_shares(), pos / total, atol=1e-10)
    gain = loop_grads(model, gpt_loss, idx, y, ["gain"])["gain"]
    assert torch.allclose(s.unplaced, gain @ model.gain.grad / total, atol=1e-10)  # the gain has no positions
    assert any("gain" in n and "not on a position" in n for n in s.notes)
    assert torch.allclose(t.position_norms("fc"), norms["fc"], atol=1e-10)
    assert torch.allclose(t.position_norms("wte"), norms["wte"], atol=1e-10)


def test_parameters_left_out_are_named(gpt):
    model, idx, y = gpt

    def step():
        model.zero_grad()
        gpt_loss(model, idx, y).backward()

    t = hw.trace(step, exclude=["wte"])  # the head alone does not rebuild the tied weight's gradient
    s = t.shares()
    assert "wte.weight" in s.left_out and "wte.weight" not in s.params
    assert any(n.startswith("left out: wte.weight") for n in s.notes)
    assert {"fc.weight", "gain", "wpe.weight"} <= set(s.params)
    names = list(s.params)
    want, _, _ = ref_shares(loop_grads(model, gpt_loss, idx, y, names))
    assert torch.allclose(s.samples, want, atol=1e-10)


def test_gram_form_equals_product_form(gpt):
    from hookwidget.analysis import attribution

    model, idx, y = gpt
    t = trace_step(model, gpt_loss, idx, y)
    by_g = attribution.shares(t, "fc", None, method="grad")
    by_gram = attribution.shares(t, "fc", None, method="gram")
    assert torch.allclose(by_g.samples, by_gram.samples, atol=1e-10)
    assert torch.allclose(by_g.positions, by_gram.positions, atol=1e-10)
    assert torch.allclose(attribution.shares(t, "wte", None, method="gram").samples,  # tied head + embedding
                          attribution.shares(t, "wte", None, method="grad").samples, atol=1e-10)
    with pytest.raises(ValueError, match="method="):
        attribution.shares(t, None, None, method="ghost")


def test_gram_form_in_blocks_matches_loops(gpt, monkeypatch):
    """The Gram form wherever it applies (the tied head and embedding, wpe, fc, proj), in blocks of 3 of the 20
    tokens (the symmetric path, a ragged block), against autograd's per-sample loops and hand-built positions."""
    from hookwidget.analysis import attribution
    from hookwidget.layers import share_gram

    monkeypatch.setattr(share_gram, "BLOCK", 3)
    model, idx, y = gpt
    t = trace_step(model, gpt_loss, idx, y)
    s = attribution.shares(t, None, None, method="gram")
    want, _, _ = ref_shares(loop_grads(model, gpt_loss, idx, y, GPT_PARAMS))
    assert torch.allclose(s.samples, want, atol=1e-10)
    pos, total, _ = gpt_position_refs(model, idx, y)
    assert torch.allclose(s.positions, pos / total, atol=1e-10)
    assert abs(s.total_sq - float(total)) <= 1e-9 * float(total)


def test_tied_weight_shares_count_both_layers(gpt):
    model, idx, y = gpt
    t = trace_step(model, gpt_loss, idx, y)
    g = loop_grads(model, gpt_loss, idx, y, ["wte.weight"])
    want, G, _ = ref_shares(g)
    assert torch.allclose(G["wte.weight"], model.wte.weight.grad)
    for name in ("wte.weight", "wte", "head"):  # the parameter, or either layer that uses it: its whole gradient
        got = t.shares(name)
        assert torch.allclose(got.samples, want, atol=1e-10), name
    # positions of one layer are that layer's contribution; the other's is unplaced
    wte, head = t.shares("wte"), t.shares("head")
    assert torch.allclose(wte.positions.sum(1) + head.positions.sum(1), want, atol=1e-10)
    assert torch.allclose(t.shares("wte.weight").positions, wte.positions + head.positions, atol=1e-10)


def test_per_layer_shares_sum_to_one_and_match(gpt):
    model, idx, y = gpt
    t = trace_step(model, gpt_loss, idx, y)
    want, _, _ = ref_shares(loop_grads(model, gpt_loss, idx, y, ["fc.weight", "fc.bias"]))
    got = t.sample_shares("fc")
    assert torch.allclose(got, want, atol=1e-10)
    assert abs(float(got.sum()) - 1) < 1e-6


def test_cnn_shares_positions_and_norms():
    torch.manual_seed(1)
    model, x, y = CNN(), torch.randn(5, 1, 6, 6), torch.randn(5, 3)
    t = trace_step(model, mse, x, y)
    names = [n for n, _ in model.named_parameters()]
    want, G, total = ref_shares(loop_grads(model, mse, x, y, names))
    assert torch.allclose(t.sample_shares(), want, atol=1e-10)
    taps = Taps(model, ["c1", "c2"])
    model.zero_grad()
    mse(model, x, y).backward()
    taps.remove()
    a, d = taps.a["c1"], taps.d["c1"]
    patches = F.unfold(a, 3, padding=1)  # (B, 9, 36): each output position's input patch
    D = d.flatten(2)  # (B, 4, 36)
    c1 = (torch.einsum("bol,oi,bil->bl", D, G["c1.weight"].flatten(1), patches) + torch.einsum(
        "bol,o->bl", D, G["c1.bias"])) / total
    assert torch.allclose(t.shares().by_layer["c1"], c1, atol=1e-10)
    own = t.shares("c1")
    assert torch.allclose(own.positions * own.total_sq, c1 * total, atol=1e-10)
    norms = (D.square().sum(1) * (patches.square().sum(1) + 1)).sqrt()
    assert torch.allclose(t.position_norms("c1"), norms, atol=1e-10)
    # the grouped convolution: positions by the convolution with weight G
    a2, D2 = taps.a["c2"], taps.d["c2"].flatten(2)
    per_pos = []
    for g in range(2):
        p = F.unfold(a2[:, 2 * g:2 * g + 2], 3, stride=2)
        w = G["c2.weight"][2 * g:2 * g + 2].flatten(1)
        per_pos.append(torch.einsum("bol,oi,bil->bl", D2[:, 2 * g:2 * g + 2], w, p))
    c2 = (sum(per_pos) + torch.einsum("bol,o->bl", D2, G["c2.bias"])) / total
    assert torch.allclose(t.shares().by_layer["c2"], c2, atol=1e-10)
    with pytest.raises(ValueError, match="no per-position gradient form"):
        t.position_norms("c2")
    s = t.shares()  # positions: c1's 36 (the most common length, a tie broken by the longer); c2's 4 and fc's 1 not
    assert torch.allclose(s.positions, c1, atol=1e-10)
    assert torch.allclose(s.unplaced, s.samples - c1.sum(1), atol=1e-10)
    assert any("c2" in n and "fc" in n and "unplaced" in n for n in s.notes)


def test_lstm_shares_match_loop():
    torch.manual_seed(2)
    model, x, y = RNN(), torch.randn(4, 6, 3), torch.randn(4, 2)
    t = trace_step(model, mse, x, y)
    names = [n for n, _ in model.named_parameters()]
    want, _, _ = ref_shares(loop_grads(model, mse, x, y, names))
    s = t.shares()
    assert set(s.params) == set(names), s.left_out
    assert torch.allclose(s.samples, want, atol=1e-10)
    assert abs(float(s.samples.sum()) - 1) < 1e-6
    assert torch.allclose(s.by_layer["lstm"].sum(1), t.sample_shares("lstm") * t.shares("lstm").total_sq
                          / s.total_sq, atol=1e-10)


def test_every_step_of_a_multi_step_trace(gpt):
    model, idx, y = gpt
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = [(idx, y), (idx.roll(1, 0), y.flip(0))]
    states = []

    def train():
        for x_, y_ in batches:
            states.append(copy.deepcopy(model.state_dict()))
            opt.zero_grad()
            gpt_loss(model, x_, y_).backward()
            opt.step()

    t = hw.trace(train)
    assert len(t.steps) == 2
    for k, (x_, y_) in enumerate(batches):
        ref = copy.deepcopy(model)
        ref.load_state_dict(states[k])
        want, _, _ = ref_shares(loop_grads(ref, gpt_loss, x_, y_, GPT_PARAMS))
        assert torch.allclose(t.sample_shares(step=k), want, atol=1e-10), k
    with pytest.raises(ValueError, match="step="):
        t.sample_shares()


def test_accumulation_shares_over_all_micro_batches(gpt):
    model, idx, y = gpt
    parts = [(idx[:2], y[:2]), (idx[2:], y[2:])]

    def accumulate():
        model.zero_grad()
        for x_, y_ in parts:
            gpt_loss(model, x_, y_).backward()

    t = hw.trace(accumulate)
    want, _, _ = ref_shares(loop_grads(model, gpt_loss, idx, y, GPT_PARAMS))
    got = t.shares()
    assert torch.allclose(got.samples, want, atol=1e-10)
    assert abs(float(got.samples.sum()) - 1) < 1e-6
    pos, total, _ = gpt_position_refs(model, idx, y)  # the one batch's positions are the micro-batches' in order
    assert torch.allclose(got.positions, pos / total, atol=1e-10)


def test_planted_sample_ranks_first_with_its_positions():
    torch.manual_seed(3)
    V, T = 13, 5
    model = TinyGPT(V=V, T=T)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(150):  # learn next token = token + 1
        idx = torch.randint(0, V, (16, T))
        opt.zero_grad()
        gpt_loss(model, idx, (idx + 1) % V).backward()
        opt.step()
    idx = torch.randint(0, V, (8, T))
    y = (idx + 1) % V
    planted, wrong = 5, [1, 3]
    y[planted, wrong] = (y[planted, wrong] + 6) % V  # two shuffled labels: a huge loss at those positions
    t = trace_step(model, gpt_loss, idx, y)
    s = t.shares()
    assert s.top(1)[0][0] == planted
    assert s.samples[planted] > 0.5
    top_positions = set(s.positions[planted].topk(2).indices.tolist())
    assert top_positions == set(wrong)


class Twice(nn.Module):
    """A Linear called twice in one forward: its tokens are both calls' (2T), not the sequence's T."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 9)

    def forward(self, idx):
        return self.head(self.fc(torch.tanh(self.fc(self.emb(idx)))))


def test_layer_called_twice_is_exact_and_its_positions_kept_apart():
    torch.manual_seed(4)
    model, idx, y = Twice(), torch.randint(0, 9, (3, 4)), torch.randint(0, 9, (3, 4))
    t = trace_step(model, gpt_loss, idx, y)
    names = [n for n, _ in model.named_parameters()]
    want, _, _ = ref_shares(loop_grads(model, gpt_loss, idx, y, names))
    s = t.shares()
    assert torch.allclose(s.samples, want, atol=1e-10)
    assert s.by_layer["fc"].shape == (3, 8) and s.positions.shape == (3, 4)
    assert torch.allclose(s.unplaced, s.by_layer["fc"].sum(1), atol=1e-10)
    assert any("fc" in n and "unplaced" in n for n in s.notes)


def test_saved_trace_answers_the_same(gpt, tmp_path):
    model, idx, y = gpt
    t = trace_step(model, gpt_loss, idx, y)
    t.save(tmp_path / "t.pt")
    back = hw.load(tmp_path / "t.pt")
    assert torch.allclose(back.sample_shares(), t.sample_shares(), atol=1e-12)
    assert torch.allclose(back.position_shares(), t.position_shares(), atol=1e-12)


def test_bad_input_is_one_clear_line(gpt):
    model, idx, y = gpt
    t = trace_step(model, gpt_loss, idx, y)
    with pytest.raises(KeyError, match="nope"):
        t.shares("nope")
    with pytest.raises(ValueError, match="no per-position gradient form"):
        t.position_norms("TinyGPT")  # the root's generic rule: per-sample rows only
    with pytest.raises(ValueError, match="step="):
        t.shares(step=7)
    with pytest.raises(TypeError):
        t.shares(3)
    for capture in ("norms", "summary"):
        tn = hw.trace(lambda: gpt_loss(model, idx, y).backward(), capture=capture)
        with pytest.raises(ValueError, match="capture='full'"):
            tn.shares()
