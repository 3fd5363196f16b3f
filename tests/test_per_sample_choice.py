"""The per-layer choice of per-sample norm method (layers/cost.py) and tied parameters (layers/shared.py):
both methods give the same exact norms, the choice follows the shapes, and a tied embedding + LM head gets
torch.func's per-sample norms from its two contributions and their cross term."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import hookwidget as hw
from hookwidget.layers import cost
from hookwidget.layers import factors as fx
from hookwidget.layers.base import Factor

F64 = torch.float64


def ref_norms(model, x, y, loss):
    """torch.func's per-sample gradient norms over every parameter (a tied one counted once)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.stack([v.flatten(1).pow(2).sum(1) for v in g.values()]).sum(0).sqrt()


@pytest.mark.parametrize("T, d_in, d_out", [(4, 16, 16), (64, 256, 10), (64, 256, 1024), (3, 12, 2), (50, 4, 3)])
def test_ghost_and_materialised_norms_are_the_same_whichever_is_chosen(T, d_in, d_out):
    torch.manual_seed(0)
    f = Factor("weight", "outer", torch.randn(3, T, d_out, dtype=F64), torch.randn(3, T, d_in, dtype=F64),
               (d_out, d_in))
    ref = torch.einsum("bto,bti->boi", f.D, f.X).flatten(1).pow(2).sum(1)
    for method in ("ghost", "grad", None):
        assert torch.allclose(fx.per_sample_norm_sq(f, method=method), ref, rtol=1e-10), method


def test_the_choice_follows_the_shapes():
    def chosen(T, d_in, d_out, kind="outer", rows=0):
        X = torch.empty(1, T, dtype=torch.long) if kind == "onehot" else None
        return cost.method(Factor("weight", kind, torch.empty(1, T, d_out), X, (rows or d_out, d_in), rows=rows))

    assert chosen(64, 256, 1024) == "ghost"  # the token MLP's wide layers: T² ≪ d_in·d_out
    assert chosen(64, 256, 10) == "grad"  # its classifier: the gradient is smaller than the Gram products
    assert chosen(256, 192, 4096) == "grad"  # long sequences: T² grows past the weight
    assert chosen(64, 192, 4096) == "ghost"  # the small GPT's LM head
    assert chosen(64, 192, 4096, kind="onehot", rows=4096) == "ghost"  # an embedding: a sample's rows are its tokens
    assert chosen(64, 10, 4, kind="onehot", rows=10) == "grad"  # a tiny table: scatter it
    assert cost.method(Factor("weight", "diag", torch.empty(1, 3, 4), None, (4,))) == "grad"  # no ghost form


class TinyGPT(nn.Module):
    """Token embedding, one Linear in between, LM head: tied or not."""

    def __init__(self, vocab=50, d=8, tied=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.tok(idx))))


def ce(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


@pytest.mark.parametrize("capture", ["norms", "full"])
@pytest.mark.parametrize("tied", [True, False])
def test_tied_embedding_and_head_norms_equal_torch_func(capture, tied):
    torch.manual_seed(0)
    model = TinyGPT(tied=tied)
    idx, y = torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4, 6))
    idx[1, 4] = idx[1, 0]  # a token twice in one sample: its embedding row adds up

    def step():
        model.zero_grad()
        ce(model(idx), y).backward()

    t = hw.trace(step, capture=capture)
    assert torch.allclose(t.per_sample_grad_norms(), ref_norms(model, idx, y, ce), rtol=1e-5)


class ProbedGPT(TinyGPT):
    """TinyGPT that calls `probe()` as the gradient reaches the embedding's output, before the embedding's δ."""

    probe = None

    def forward(self, idx):
        h = self.tok(idx) * 1.0
        if self.probe is not None:
            h.register_hook(lambda g: self.probe())
        return self.head(torch.tanh(self.mid(h)))


def test_a_tied_head_lets_its_vocabulary_wide_delta_go_before_the_embeddings_arrives(monkeypatch):
    """capture="norms" on a tied LM whose ghost form is the cheaper (vocabulary 4096): the head's δ (B, T, V) is
    reduced as it arrives (its ghost norm, its input, its δ at the sample's token ids), so no (B, T, V) tensor is
    alive when the embedding's δ comes; the norms are bitwise those of the whole factors and torch.func's."""
    import gc

    from hookwidget.capture.norms import StreamingNorms

    torch.manual_seed(0)
    vocab = 4096
    model = ProbedGPT(vocab=vocab, d=16)
    idx, y = torch.randint(0, vocab, (4, 8)), torch.randint(0, vocab, (4, 8))
    idx[2, 5] = idx[2, 1]
    wide = []

    def probe():
        gc.collect()
        wide.append(sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.shape[-1:] == (vocab,)
                        and o.dim() == 3))

    def step():
        model.zero_grad()
        ce(model(idx), y).backward()

    model.probe = probe
    reduced = hw.trace(step, capture="norms").per_sample_grad_norms()
    monkeypatch.setattr(StreamingNorms, "_head_part", lambda *args: None)
    whole = hw.trace(step, capture="norms").per_sample_grad_norms()
    assert wide[0] == 0 and wide[1] > 0  # reduced; then held whole
    assert torch.equal(reduced, whole)
    model.probe = None
    assert torch.allclose(reduced, ref_norms(model, idx, y, ce), rtol=1e-5)


def test_a_head_part_pairs_only_with_the_ids_it_was_reduced_at():
    """shared.HeadPart keeps the head's δ at one set of token ids: with the embedding's factor at those ids it
    gives the ghost terms' norms; at other ids it refuses (capture/norms.py then leaves the weight out, named)."""
    from hookwidget.layers import shared

    torch.manual_seed(0)
    model = TinyGPT(vocab=30, d=6).double()
    idx, y = torch.randint(0, 30, (3, 5)), torch.randint(0, 30, (3, 5))
    emb, head = _tied_contributions(model, idx, y)
    part = shared.HeadPart(head, emb.X)
    assert torch.equal(fx.shared_norm_sq([part, emb]), fx.shared_norm_sq([head, emb], method="ghost"))
    other = Factor(emb.param, "onehot", emb.D, (emb.X + 1) % 30, emb.shape, rows=emb.rows)
    with pytest.raises(ValueError, match="other token ids"):
        fx.shared_norm_sq([part, other])


def _tied_contributions(model, idx, y):
    t = hw.trace(lambda: ce(model(idx), y).backward())
    rows = [fx.factors(model.get_submodule(n), [c for c in t.layers[n].calls]) for n in ("tok", "head")]
    return [next(f for f in fs if f.param == "weight") for fs in rows]


def test_shared_ghost_terms_and_the_summed_gradient_agree():
    torch.manual_seed(0)
    model = TinyGPT(vocab=30, d=6).double()
    idx, y = torch.randint(0, 30, (3, 5)), torch.randint(0, 30, (3, 5))
    fs = _tied_contributions(model, idx, y)
    assert [f.kind for f in fs] == ["onehot", "outer"]
    ghost, grad_ = fx.shared_norm_sq(fs, method="ghost"), fx.shared_norm_sq(fs, method="grad")
    assert torch.allclose(ghost, grad_, rtol=1e-10)
    assert torch.allclose(fx.shared_norm_sq(fs[::-1], method="ghost"), grad_, rtol=1e-10)  # either order


class Pair(nn.Module):
    """Two layers of one kind holding one weight, reading the sequence forwards and backwards."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b
        b.weight = a.weight

    def forward(self, x):
        return (self.a(x).sin() * self.b(x.flip(1))).sum((1, 2))


@pytest.mark.parametrize("kind", ["outer", "onehot"])
def test_cross_terms_of_two_layers_of_one_kind(kind):
    """Two Linear layers (or two embeddings) holding one weight: outer·outer and onehot·onehot cross terms."""
    torch.manual_seed(0)
    if kind == "outer":
        model = Pair(nn.Linear(5, 4, bias=False), nn.Linear(5, 4, bias=False)).double()
        x = torch.randn(3, 6, 5, dtype=F64)
    else:
        model = Pair(nn.Embedding(9, 4), nn.Embedding(9, 4)).double()
        x = torch.randint(0, 9, (3, 6))
        x[0, 1] = x[0, 4]  # one row read by both layers in one sample
    t = hw.trace(lambda: model(x).sum().backward())
    fs = [fx.factors(model.get_submodule(n), list(t.layers[n].calls))[0] for n in ("a", "b")]
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(grad(lambda p, xi: functional_call(model, p, (xi.unsqueeze(0),)).sum()), in_dims=(None, 0))(params, x)
    ref = g["a.weight"].flatten(1).pow(2).sum(1)
    for method in ("ghost", "grad", None):
        assert torch.allclose(fx.shared_norm_sq(fs, method=method), ref, rtol=1e-10), method


def test_the_tied_small_gpt_takes_the_ghost_terms():
    """vocabulary 4096, d=192, T=64: the cross term costs T² · d, the summed gradient 4096 · 192 · T per sample."""
    emb = Factor("weight", "onehot", torch.empty(1, 64, 192), torch.empty(1, 64, dtype=torch.long), (4096, 192),
                 rows=4096)
    head = Factor("weight", "outer", torch.empty(1, 64, 4096), torch.empty(1, 64, 192), (4096, 192))
    assert cost.shared_method([emb, head]) == "ghost"
    assert cost.shared_method([emb, Factor("weight", "outer", torch.empty(1, 4096, 4096), torch.empty(1, 4096, 192),
                                           (4096, 192))]) == "grad"  # a 4096-token sequence


class ForeignRMSNorm(nn.Module):
    """An RMSNorm as another package writes it (no exact rule: the generic rule serves it); gemma: (1 + w)."""

    def __init__(self, d, gemma=False):
        super().__init__()
        self.weight, self.gemma = nn.Parameter(torch.randn(d) * 0.1 + (0 if gemma else 1)), gemma

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h * (1 + self.weight) if self.gemma else self.weight * h


class Scale2d(nn.Module):
    """A layer scale of shape (C, 1, 1) on an image (torchvision's CNBlock), and one that reads its vector reversed
    (not elementwise per output position: the vector rule's rows are wrong and the vmap rule must answer)."""

    def __init__(self, c, flipped=False):
        super().__init__()
        self.gamma, self.flipped = nn.Parameter(torch.randn(c, 1, 1)), flipped

    def forward(self, x):
        return x * (self.gamma.flip(0) if self.flipped else self.gamma)


class LayerNorm2d(nn.LayerNorm):
    """torchvision's LayerNorm2d: F.layer_norm over channels of an image, its weight passed in its own shape (B copies
    do not broadcast there: the forward is vmapped over samples and copies instead)."""

    def forward(self, x):
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


@pytest.mark.parametrize("from_nodes", [True, False], ids=["affine-nodes", "copies"])
@pytest.mark.parametrize("make", [lambda: ForeignRMSNorm(6), lambda: ForeignRMSNorm(6, gemma=True),
                                  lambda: Scale2d(3), lambda: Scale2d(3, flipped=True), lambda: LayerNorm2d(3)],
                         ids=["rmsnorm", "gemma", "scale2d", "flipped", "layernorm2d"])
def test_vector_parameters_of_generic_modules_are_exact(make, from_nodes, monkeypatch):
    """A module's own vector parameters: rows from the call's own backward nodes where each is a factor of a product
    (as it is, viewed, or plus a constant: gemma's 1 + w) or one of a norm's affine pair (layers/affine_nodes.py);
    else (flipped, or with that rule off) from layers/batch_copies.vector_params: B copies broadcast against the output
    (one backward), or the forward vmapped over samples and copies (layernorm2d), checked against a sample rerun
    alone; where the forward does not use them elementwise (flipped) the vmap rule answers. Either way the norms
    equal torch.func's."""
    from hookwidget.analysis import generic as checked
    from hookwidget.layers import affine_nodes, batch_copies, generic

    if not from_nodes:
        monkeypatch.setattr(generic, "FAST_RULES", [(a, r) for a, r in generic.FAST_RULES
                                                    if r is not affine_nodes.affine_rows])
    torch.manual_seed(0)
    norm = make().double()
    image = isinstance(norm, (Scale2d, LayerNorm2d))
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), norm) if image else nn.Sequential(nn.Linear(4, 6), norm)
    model = model.double()
    x = torch.randn(4, 2, 5, 5, dtype=F64) if image else torch.randn(4, 7, 4, dtype=F64)
    y = torch.randn(4, 3, 5, 5, dtype=F64) if image else torch.randn(4, 7, 6, dtype=F64)

    def loss(out, y):
        return ((out - y) ** 2).sum()

    def step():
        model.zero_grad()
        loss(model(x), y).backward()

    assert batch_copies.has_vector_params(norm)
    served = []
    rule = checked._fast_rule_rows

    def spy(r, module, *a):
        rows = rule(r, module, *a)
        served.append((r.__name__, rows is not None))
        return rows

    monkeypatch.setattr(checked, "_fast_rule_rows", spy)
    t = hw.trace(step, capture="norms")
    norms = t.per_sample_grad_norms()
    elementwise = not getattr(norm, "flipped", False)
    if from_nodes and elementwise:
        assert served == [("affine_rows", True)]
    else:
        assert served == [("affine_rows", False)] * from_nodes + [("vector_params", elementwise)]
    assert torch.allclose(norms, ref_norms(model, x, y, loss), rtol=1e-10)
