"""Issue 39: the batch dimension of every call is proven, never guessed from sizes.

Time-major models (Opacus's batch_first=False cases): a Linear on (T, B, d) and (T, B, H, d), an Embedding on
(T, B) ids, a convolution whose model input is time-major; with T != B and T == B, traced in float32 and
float64. The model input's batch dim is declared (hw.trace(batch_dim=1)); each layer's is followed from there.
Where no proof exists (a copy of the data the graph does not see) the layer is left out with a note naming it,
what it received and the fix. An empty batch and a declaration the graph contradicts get one line at the entry
point. Every reference is a float64 autograd loop over the samples, each run alone (never hookwidget).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookwidget as hw

sys.path.insert(0, str(Path(__file__).parent))
from helpers_faults import observe  # noqa: E402


def loop_reference(model, x, dim: int, names):
    """Per-sample gradients {param name: (B, *shape)} of sum(model(x_b)²), x_b the samples of x along `dim`,
    each run alone in float64."""
    m = copy.deepcopy(model).double()
    x = x.double() if x.is_floating_point() else x
    params = dict(m.named_parameters())
    rows = {n: [] for n in names}
    for b in range(x.shape[dim]):
        m.zero_grad(set_to_none=True)
        m(x.narrow(dim, b, 1)).pow(2).sum().backward()
        for n in names:
            g = params[n].grad
            rows[n].append(torch.zeros_like(params[n]) if g is None else g.clone())
    return {n: torch.stack(r) for n, r in rows.items()}


def ref_norms(ref: dict) -> torch.Tensor:
    return torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)


def close(got, ref, what):
    ref = ref.to(got.dtype)
    scale = max(1.0, ref.abs().max().item())
    tol = 1e-4 if got.dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def trace_of(model, x, **options):
    return hw.trace(lambda: model(x).pow(2).sum().backward(), **options)


class TimeMajorMLP(nn.Module):
    """Linear, ReLU, Linear on (T, B, d) or (T, B, H, d): the samples in dim 1 throughout."""

    def __init__(self, d=4, h=5, o=3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, o)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class TimeMajorEmbedding(nn.Module):
    """Embedding on (T, B) ids, then a Linear: Opacus's batch_first=False embedding."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(7, 4), nn.Linear(4, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids))


DTYPES = [torch.float32, torch.float64]
SHAPES = {"T!=B": (2, 3), "T==B": (3, 3)}


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("sizes", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("heads", [None, 2], ids=["(T,B,d)", "(T,B,H,d)"])
def test_time_major_linear_is_exact(dtype, sizes, heads):
    torch.manual_seed(0)
    T, B = SHAPES[sizes]
    model = TimeMajorMLP().to(dtype)
    x = torch.randn(T, B, *(() if heads is None else (heads,)), 4, dtype=dtype)
    names = [n for n, _ in model.named_parameters()]
    ref = loop_reference(model, x, 1, names)
    t = trace_of(model, x, batch_dim=1)
    assert not t.per_sample_left_out
    for n in names:
        layer, p = n.split(".")
        got = t.per_sample_grads(layer) if p == "weight" else t.per_sample_grads(layer, "bias")
        assert got.shape == (B, *ref[n].shape[1:])
        close(got, ref[n], n)
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms")
    tn = trace_of(model, x, batch_dim=1, capture="norms")  # streamed: the same proof, the same rows
    close(tn.per_sample_grad_norms(), ref_norms(ref), "norms (capture='norms')")


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("sizes", list(SHAPES), ids=list(SHAPES))
def test_time_major_embedding_is_exact(dtype, sizes):
    torch.manual_seed(0)
    T, B = SHAPES[sizes]
    model = TimeMajorEmbedding().to(dtype)
    ids = torch.randint(0, 7, (T, B))
    names = [n for n, _ in model.named_parameters()]
    ref = loop_reference(model, ids, 1, names)
    t = trace_of(model, ids, batch_dim=1)
    assert not t.per_sample_left_out
    got = t.per_sample_grads("emb")
    assert got.shape == (B, 7, 4)
    close(got, ref["emb.weight"], "emb.weight")
    close(t.per_sample_grads("fc"), ref["fc.weight"], "fc.weight")
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms")


class CopiedTimeMajor(nn.Module):
    """fc1 sees x; fc2 a copy of x made batch-first (.contiguous() of a transpose of the data: a new storage and
    no graph, so nothing shows where the samples went); fc3 the same steps on fc1's activations (the graph shows
    them)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc1(x).transpose(0, 1).contiguous()
        return self.fc2(x.transpose(0, 1).contiguous()).sum(1) + self.fc3(h).sum(1)


@pytest.mark.parametrize("sizes", list(SHAPES), ids=list(SHAPES))
def test_a_layer_no_proof_reaches_is_left_out_with_a_note(sizes):
    torch.manual_seed(0)
    T, B = SHAPES[sizes]
    model, x = CopiedTimeMajor(), torch.randn(T, B, 4)
    t = trace_of(model, x, batch_dim=1)
    left = t.per_sample_left_out
    assert set(left) == {"fc2.weight", "fc2.bias"}
    why = left["fc2.weight"]
    assert why.startswith(f"fc2: its input ({B}, {T}, 4) holds none of the {B} samples") and "batch_dim=N" in why
    with pytest.raises(ValueError, match=r"^layer 'fc2': its input .* batch_dim=N\)?$") as e:
        t.per_sample_grads("fc2")
    assert "\n" not in str(e.value)
    names = ["fc1.weight", "fc1.bias", "fc3.weight", "fc3.bias"]
    ref = loop_reference(model, x, 1, names)  # the layers proven: exact
    close(t.per_sample_grads("fc3"), ref["fc3.weight"], "fc3.weight")
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms over the proven layers")


class TimeMajorConv(nn.Module):
    """A (T, B, C, L) sequence of frames: conv on each frame x[t] (a view of the data, the batch leading), conv2
    on each frame of conv's activations after a permute (the graph shows the samples' way)."""

    def __init__(self):
        super().__init__()
        self.conv, self.conv2 = nn.Conv1d(2, 3, 3, padding=1), nn.Conv1d(3, 2, 3)

    def forward(self, x):
        h = torch.stack([self.conv(x[t]) for t in range(x.shape[0])])  # (T, B, 3, L)
        h = torch.tanh(h).permute(1, 0, 2, 3)  # (B, T, 3, L)
        return sum(self.conv2(h[:, t]) for t in range(h.shape[1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("sizes", list(SHAPES), ids=list(SHAPES))
def test_a_conv_of_a_time_major_batch_is_exact(dtype, sizes):
    torch.manual_seed(0)
    T, B = SHAPES[sizes]
    model, x = TimeMajorConv().to(dtype), torch.randn(T, B, 2, 5, dtype=dtype)
    names = [n for n, _ in model.named_parameters()]
    ref = loop_reference(model, x, 1, names)
    t = trace_of(model, x, batch_dim=1)
    assert not t.per_sample_left_out
    close(t.per_sample_grads("conv"), ref["conv.weight"], "conv.weight")
    close(t.per_sample_grads("conv2"), ref["conv2.weight"], "conv2.weight")
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms")


def test_a_conv_whose_samples_are_not_its_batch_is_refused():
    """Conv1d on (T, B, L): its channels are the samples, which it mixes; capture proved them in dim 1."""
    torch.manual_seed(0)
    conv, head = nn.Conv1d(3, 2, 1), nn.Linear(4, 1)
    model = nn.Sequential(conv, head)
    x = torch.randn(2, 3, 4)
    t = trace_of(model, x, batch_dim=1)
    assert {"0.weight", "0.bias"} <= set(t.per_sample_left_out)
    with pytest.raises(ValueError, match=r"'0': its input \(2, 3, 4\) holds the 3 samples in dim 1, where its "
                                         r"Conv1d rule needs them first"):
        t.per_sample_grads("0")


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_an_empty_batch_gets_one_line(capture):
    torch.manual_seed(0)

    def build():
        return {"model": nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)), "x": torch.randn(0, 4)}

    out = observe(build, lambda model, x: model(x).sum().backward(), capture=capture)  # neutral
    t = out.trace
    for ask in (t.per_sample_grad_norms, lambda: t.per_sample_grads("0")):
        if capture == "norms" and ask is not t.per_sample_grad_norms:
            continue
        with pytest.raises(ValueError, match=r"^step 0: the model's batch is empty \(0 samples") as e:
            ask()
        assert "\n" not in str(e.value)


def test_the_declared_batch_dim_is_checked_against_the_modules_own():
    """A GRU(batch_first=False) inside: batch_dim=1 agrees with it (exact), and so does no declaration (the GRU's
    own settles the model input's: the pass is placed again under dim 1); batch_dim=0 puts the samples in its dim
    0: one line at the entry point, and a note naming it."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.gru, self.out = nn.Linear(3, 4), nn.GRU(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.gru(self.inp(x))[0])

    model, x = Net(), torch.randn(2, 3, 3)
    ref = loop_reference(model, x, 1, ["inp.weight", "out.weight"])
    for declared in (1, None):
        t = trace_of(model, x, batch_dim=declared)
        assert t.layers["Net"].calls[0].sample_dim == 1
        close(t.per_sample_grads("inp"), ref["inp.weight"], "inp.weight")
        close(t.per_sample_grads("out"), ref["out.weight"], "out.weight")
    for declared in (0,):
        t = trace_of(model, x, batch_dim=declared)
        assert [n.layers for n in t.note_records if n.id == "batch_dim_contradicted"] == [("gru",)]
        for ask in (t.per_sample_grad_norms, lambda t=t: t.per_sample_grads("inp")):
            with pytest.raises(ValueError, match=r"^per-sample gradients: the model input's batch dim.* puts the "
                                                 r"samples in dim 0 of gru, whose batch_first says dim 1") as e:
                ask()
            assert "\n" not in str(e.value)


def test_batch_dim_option_is_checked():
    with pytest.raises(ValueError, match=r"^batch_dim=-1 must be a dim index >= 0"):
        hw.trace(lambda: None, batch_dim=-1)
    with pytest.raises(ValueError, match=r"^batch_dim='1' must be"):
        hw.trace(lambda: None, batch_dim="1")


# -- property: a layer's input dims permuted, the batch anywhere ---------------------------------------------------
ROUTES = ("data", "data view", "graph", "copy")


@st.composite
def layouts(draw):
    sizes = [draw(st.integers(1, 3)) for _ in range(3)]  # (B, T1, T2): equal sizes drawn often
    perm = draw(st.permutations([0, 1, 2]))
    return {"sizes": sizes, "perm": list(perm), "route": draw(st.sampled_from(ROUTES)),
            "dtype": draw(st.sampled_from(DTYPES)), "capture": draw(st.sampled_from(["full", "norms"])),
            "seed": draw(st.integers(0, 2**16))}


class Routed(nn.Module):
    """fc sees the model input x (its dims in `perm` order, the features last) by `route`: as it is ("data"),
    through a permute of the data back to (B, T1, T2) ("data view": no graph, the same storage), through the graph
    (pre, then a permute of its activations: "graph"), or through a copy the graph does not see ("copy")."""

    def __init__(self, route, perm):
        super().__init__()
        self.route, self.inv = route, [perm.index(i) for i in range(3)] + [3]
        self.pre, self.fc = nn.Linear(2, 2), nn.Linear(2, 3)

    def forward(self, x):
        if self.route == "data view":
            x = x.permute(self.inv)
        elif self.route == "graph":
            x = self.pre(x).permute(self.inv)
        elif self.route == "copy":
            x = x.permute(self.inv).clone()
        return self.fc(x)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_any_batch_position_is_exact_or_left_out_with_a_note(spec):
    torch.manual_seed(spec["seed"])
    B = spec["sizes"][0]
    perm = spec["perm"]
    batch_dim = perm.index(0)
    x = torch.randn(*(spec["sizes"][i] for i in perm), 2, dtype=spec["dtype"])  # the dims in perm's order
    model = Routed(spec["route"], perm).to(spec["dtype"])
    names = [n for n, p in model.named_parameters() if spec["route"] == "graph" or not n.startswith("pre.")]
    ref = loop_reference(model, x, batch_dim, names)
    t = trace_of(model, x, batch_dim=batch_dim, capture=spec["capture"])
    left = t.per_sample_left_out
    provable = spec["route"] != "copy" or B == 1
    if provable:
        assert not left, left
    else:  # the layer is named, with what it received
        assert set(left) == {"fc.weight", "fc.bias"} and left["fc.weight"].startswith("fc: its input (")
        names = [n for n in names if not n.startswith("fc.")]
    if spec["capture"] == "full" and "fc.weight" in names:
        close(t.per_sample_grads("fc"), ref["fc.weight"], "fc.weight")
    if names:
        close(t.per_sample_grad_norms(), ref_norms({n: ref[n] for n in names}), "norms")


def test_the_default_is_the_first_dim_and_a_view_of_the_data_follows_it():
    """No declaration: the model input's batch is its dim 0 (torch's convention); a layer that sees a transposed
    view of it has its samples in dim 1, moved to the front for its rule."""
    torch.manual_seed(0)

    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x.transpose(0, 1))

    model, x = T(), torch.randn(4, 4, 3)
    ref = loop_reference(model, x, 0, ["fc.weight", "fc.bias"])
    t = trace_of(model, x)
    assert t.layers["fc"].calls[0].sample_dim == 1
    close(t.per_sample_grads("fc"), ref["fc.weight"], "fc.weight")
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms")


def test_positions_on_arange_stay_unbatched_and_exact_through_the_add():
    """Batch-first tokens plus pos(arange(T)) with T == B: the position table's input is not the batch's (a size
    match is no proof), its per-sample rows come from the add (bdelta) and are exact."""
    torch.manual_seed(0)

    class P(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.fc = nn.Embedding(5, 4), nn.Embedding(3, 4), nn.Linear(4, 1)

        def forward(self, ids):
            return self.fc(F.gelu(self.tok(ids) + self.pos(torch.arange(ids.shape[1]))))

    model, ids = P(), torch.randint(0, 5, (3, 3))
    names = [n for n, _ in model.named_parameters()]
    ref = loop_reference(model, ids, 0, names)
    t = trace_of(model, ids)
    assert t.layers["pos"].calls[0].sample_dim is None
    assert not t.per_sample_left_out
    close(t.per_sample_grads("pos"), ref["pos.weight"], "pos.weight")
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms")


def test_the_watch_follows_the_samples_of_its_first_input():
    """hw.watch(per_sample=True) on a model that runs its middle layer time-major ((T, B, d) with T == B): that
    layer's samples are proven in dim 1 and moved to the front; each step's largest per-sample norm and its sample
    are a float64 loop's."""
    from hookwidget.watch import watch

    torch.manual_seed(0)

    class Mid(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 2)

        def forward(self, x):
            h = torch.tanh(self.a(x)).transpose(0, 1)  # (T, B, 5)
            return self.c(torch.tanh(self.b(h)).transpose(0, 1))

    model, x = Mid(), torch.randn(3, 3, 4)
    ref = loop_reference(model, x, 0, [n for n, _ in model.named_parameters()])
    want = ref_norms(ref)
    with watch(model, per_sample=True, flight_recorder=False) as w:
        model(x).pow(2).sum().backward()
    assert not any("per-sample norms leave out" in n for n in w.notes)
    assert w.per_sample[0, 0].item() == pytest.approx(want.max().item(), rel=1e-5)
    assert int(w.per_sample[0, 1]) == int(want.argmax())


class MaskedAttention(nn.Module):
    """q, k, v projections, F.scaled_dot_product_attention with a boolean causal mask (Hugging Face's default "sdpa"
    attention on the CPU: torch's math path, whose softmax is SafeSoftmaxBackward0, saving dim -1 as an unsigned
    64-bit value), then an output projection. The samples are in dim `batch` of the (…, T, d) input."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        T, d = x.shape[-2], x.shape[-1]
        q, k, v = (t.unflatten(-1, (self.heads, d // self.heads)).transpose(-3, -2)
                   for t in self.qkv(x).chunk(3, -1))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h.transpose(-3, -2).flatten(-2))


@pytest.mark.parametrize("layout", ["(B,T,d)", "(B,G,T,d)"])
def test_masked_sdpa_attention_is_exact(layout):
    """Before: the layers after the attention were left out ("holds none of the samples"): the walk misread the
    softmax's saved dim -1 (18446744073709551615 % ndim) and found no proof."""
    torch.manual_seed(0)
    B, T = 3, 5
    model = MaskedAttention()
    # q, k, v (B, heads, T, d/heads) as Hugging Face's attention lays them out; or (B, G, heads, T, d/heads), whose
    # math path folds (B, G, heads) into bmm's batch and reads transpose(-2, -1) of a 5-dim tensor
    x = torch.randn(B, T, 8) if layout == "(B,T,d)" else torch.randn(B, 2, T, 8)
    names, stack = set(), [model(x).grad_fn]
    while stack:  # a small graph: walked whole, no node skipped
        fn = stack.pop()
        if fn is not None:
            names.add(fn.name())
            stack.extend(n for n, _ in fn.next_functions)
    assert "SafeSoftmaxBackward0" in names or any(n.startswith("ScaledDotProduct") for n in names)
    names = [n for n, _ in model.named_parameters()]
    ref = loop_reference(model, x, 0, names)
    t = trace_of(model, x)
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grads("out"), ref["out.weight"], "out.weight")
    close(t.per_sample_grads("qkv"), ref["qkv.weight"], "qkv.weight")
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms")


class KeywordsModel(nn.Module):
    """A model called with keywords only, as Hugging Face's Trainer calls one (`model(**batch)`): no global forward
    pre-hook sees keywords, so the pass's samples are found once its forward hook gives them."""

    def __init__(self):
        super().__init__()
        self.emb, self.body = nn.Embedding(11, 6), TimeMajorMLP(6, 5, 4)

    def forward(self, input_ids=None, scale=None):
        return self.body(self.emb(input_ids)) * scale


def test_a_model_called_with_keywords_only_is_exact():
    """Before: every layer was left out ("the model's input has no batch dim to follow")."""
    torch.manual_seed(0)
    model, ids = KeywordsModel(), torch.randint(0, 11, (3, 4))
    names = [n for n, _ in model.named_parameters()]

    class Positional(nn.Module):  # the reference loop calls the same model with the ids as its one input
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(input_ids=x, scale=2.0)

    ref = loop_reference(Positional(), ids, 0, [f"m.{n}" for n in names])
    t = hw.trace(lambda: model(input_ids=ids, scale=2.0).pow(2).sum().backward())
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grads("emb"), ref["m.emb.weight"], "emb.weight")
    close(t.per_sample_grads("body.fc1"), ref["m.body.fc1.weight"], "body.fc1.weight")
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms")


def test_a_hugging_face_model_called_with_keywords_covers_what_a_positional_call_does():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 50, (3, 8))
    by_keywords = hw.trace(lambda: model(input_ids=ids, labels=ids).loss.backward())
    model.zero_grad(set_to_none=True)
    positional = hw.trace(lambda: model(ids, labels=ids).loss.backward())
    assert not by_keywords.per_sample_left_out and not positional.per_sample_left_out
    torch.testing.assert_close(by_keywords.per_sample_grad_norms(), positional.per_sample_grad_norms(), rtol=0, atol=0)


class TokenMixer(nn.Module):
    """MLP-Mixer's token mixing on (B, T, d) written with negative dims: x.transpose(-2, -1) puts the T positions
    last, a Linear mixes them, and the transpose back restores (B, T, d). torch saves -2 and -1 as unsigned 64-bit
    values, which read modulo 3 name other dims."""

    def __init__(self, T: int, d: int = 4):
        super().__init__()
        self.mix, self.head = nn.Linear(T, T), nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.mix(x.transpose(-2, -1)).transpose(-2, -1))


@pytest.mark.parametrize("sizes", list(SHAPES), ids=list(SHAPES))
def test_negative_dims_of_a_three_dim_transpose_are_read_as_given(sizes):
    """Before: the transposes were read as swapping dims 2 and 0, so head, after the transpose back, was left out
    ("holds none of the samples"); mix was placed from its input's rows."""
    torch.manual_seed(0)
    T, B = SHAPES[sizes]
    model, x = TokenMixer(T), torch.randn(B, T, 4)
    names = [n for n, _ in model.named_parameters()]
    ref = loop_reference(model, x, 0, names)
    t = trace_of(model, x)
    assert not t.per_sample_left_out, t.per_sample_left_out
    close(t.per_sample_grads("mix"), ref["mix.weight"], "mix.weight")
    close(t.per_sample_grads("head"), ref["head.weight"], "head.weight")
    close(t.per_sample_grad_norms(), ref_norms(ref), "norms")
