"""Saved records: t.save(path) / hw.load(path). A loaded Trace answers what the live one does (compared query by
query, and against autograd), refuses what needs the code in one line, and the file holds data only."""

import copy
import pickle

import pytest
import torch
from torch import nn

import hookwidget as hw
from hookwidget.views import payload


def outcome(fn):
    """A query's answer, or the error it raised (type and text): live and loaded must agree on both."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001
        return ("error", type(e).__name__, str(e))


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return False
        if x.is_sparse:
            x, y = x.to_dense(), y.to_dense()
        return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu())
    if isinstance(x, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(same(x[k], y[k]) for k in x)
    if isinstance(x, float) and x != x:
        return isinstance(y, float) and y != y
    return x == y


def close(x, y) -> bool:
    """Same kind of answer; tensors equal up to float rounding (a loaded factor sums in the same order, but a
    view stored as its own values may take another kernel path)."""
    if x[0] != y[0]:
        return False
    if x[0] == "error":
        return x == y
    a, b = x[1].cpu(), y[1].cpu()
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def steps_to_ask(t):
    backward = [s for s in t.steps if s.kind == "backward"]
    return [None] if len(backward) <= 1 or t.accumulates else list(range(len(t.steps)))


def check_loaded(t, tmp_path, name="t.pt"):
    """Save t, load it, and compare every query the two answer."""
    path = tmp_path / name
    t.save(path)
    u = hw.load(path)
    assert repr(u) == repr(t)
    assert u.notes == t.notes and u.note_records == t.note_records
    assert u.per_sample_left_out == t.per_sample_left_out
    assert list(u.layers) == list(t.layers)
    for n, layer in t.layers.items():
        loaded = u.layers[n]
        assert loaded.type == layer.type and len(loaded.calls) == len(layer.calls)
        for c, d in zip(layer.calls, loaded.calls):
            assert same(c.a, d.a) and same(c.delta, d.delta) and c.step == d.step
            assert c.a_summary == d.a_summary and c.delta_summary == d.delta_summary
        assert u.supports(n) == t.supports(n)
    assert sorted(u.graph.nodes(data=True)) == sorted(t.graph.nodes(data=True))
    assert sorted(u.graph.edges(data=True)) == sorted(t.graph.edges(data=True))
    assert len(u.steps) == len(t.steps)
    for s, r in zip(t.steps, u.steps):
        assert (s.index, s.kind, s.losses, s.calls) == (r.index, r.kind, r.losses, r.calls)
        assert same(s.grads, r.grads) and same(s.before, r.before)
    assert same(u.param_grads, t.param_grads) and same(u.losses, t.losses) and same(u.params, t.params)
    for n in t.factor_layers:
        assert outcome(lambda n=n: u.storage(n)) == outcome(lambda n=n: t.storage(n))
    assert u.factor_layers == t.factor_layers and u.accumulates == t.accumulates
    assert u.user_hooks == t.user_hooks
    for k in steps_to_ask(t):
        assert close(outcome(lambda k=k: u.per_sample_grad_norms(step=k)),
                     outcome(lambda k=k: t.per_sample_grad_norms(step=k)))
        for n, layer in t.layers.items():
            names = [p for p, _ in layer.module.named_parameters(recurse=False)] or ["weight"]
            for p in names:
                assert close(outcome(lambda n=n, p=p, k=k: u.per_sample_grads(n, p, step=k)),
                             outcome(lambda n=n, p=p, k=k: t.per_sample_grads(n, p, step=k))), (n, p, k)
            assert close(outcome(lambda n=n, k=k: u.weight_grad(n, step=k)),
                         outcome(lambda n=n, k=k: t.weight_grad(n, step=k))), (n, k)
            assert close(outcome(lambda n=n, k=k: u.per_sample_grad_norms(n, step=k)),
                         outcome(lambda n=n, k=k: t.per_sample_grad_norms(n, step=k))), (n, k)
    assert str(u.health()) == str(t.health())
    assert payload.summary(u) == payload.summary(t)
    for n in t.layers:
        (m1, b1), (m2, b2) = payload.detail(t, n), payload.detail(u, n)
        assert m1 == m2 and b1 == b2, n
    return u


def against_autograd(u, names):
    """The loaded trace's rebuilt W.grad is the .grad autograd made."""
    for n in names:
        assert torch.allclose(u.weight_grad(n), u.param_grads[f"{n}.weight"], atol=1e-6), n


def test_mlp_loaded_answers_as_live_and_as_autograd(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    t = hw.trace(lambda: nn.functional.cross_entropy(model(x), y).backward())
    u = check_loaded(t, tmp_path)
    against_autograd(u, ["0", "2"])
    assert u.diff().changed == []  # the hook-free run is its own baseline


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv1d(4, 3, 2, dilation=2)
        self.fc = nn.Linear(3 * 12, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))  # (B, 4, 4, 4)
        h = self.conv2(h.flatten(2))  # (B, 3, 14)
        return self.fc(h[..., :12].flatten(1))


def test_cnn_with_batchnorm(tmp_path):
    torch.manual_seed(0)
    model, x = CNN(), torch.randn(5, 1, 8, 8)
    t = hw.trace(lambda: model(x).pow(2).sum().backward())
    u = check_loaded(t, tmp_path)
    against_autograd(u, ["conv", "bn", "conv2", "fc"])
    assert u.layers["conv"].module.stride == (2, 2) and type(u.layers["bn"].module) is nn.BatchNorm2d


class Gain(nn.Module):
    """A module no exact rule knows: the generic torch.func rule answers for it (live: by rerunning it)."""

    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.g


def test_small_transformer_generic_rules_and_tied_weights(tmp_path):
    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 16)
            self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.gain = Gain(16)
            self.head = nn.Linear(16, 20, bias=False)
            self.head.weight = self.emb.weight  # tied

        def forward(self, idx):
            return self.head(self.gain(self.block(self.emb(idx))))

    model, idx = Tiny(), torch.randint(0, 20, (3, 5))
    t = hw.trace(lambda: nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward())
    assert "gain" in t.factor_layers  # the generic rule served it live
    u = check_loaded(t, tmp_path)
    with pytest.raises(RuntimeError, match="cannot run"):
        u.layers["gain"].module(torch.ones(16))
    assert u.layers["gain"].type == "Gain" and u.layers["block.self_attn"].type == "MultiheadAttention"


class Standardised(nn.Linear):
    """Overrides Linear.forward: no exact rule, the generic rule answers (live by rerunning it)."""

    def forward(self, x):
        w = self.weight
        return nn.functional.linear(x, (w - w.mean()) / (w.std() + 1e-5), self.bias)


class Plain(nn.Linear):
    """A subclass that keeps Linear's forward: the exact rule still answers."""


class ScaledWords(nn.Embedding):
    """A copy of transformers' scaled word embedding: the registry knows it by its forward's code."""

    def __init__(self, n, d):
        super().__init__(n, d)
        self.embed_scale = 3.0

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


def test_subclasses_get_the_answers_they_had(tmp_path):
    from hookwidget.layers import factors as fx

    torch.manual_seed(0)
    model = nn.Sequential(ScaledWords(6, 3), Plain(3, 4), nn.Tanh(), Standardised(4, 2))
    x = torch.randint(0, 6, (5, 2))
    t = hw.trace(lambda: model(x).pow(2).sum().backward())
    u = check_loaded(t, tmp_path)
    for n in ("0", "1", "3"):
        live, loaded = t.layers[n].module, u.layers[n].module
        assert (fx.spec_for(loaded).name, fx.exact_reason(loaded)) == (fx.spec_for(live).name, fx.exact_reason(live))
    assert fx.spec_for(u.layers["0"].module).name == "ScaledLookup"
    assert fx.is_generic(u.layers["3"].module) and isinstance(u.layers["1"].module, nn.Linear)
    with pytest.raises(TypeError):  # the stand-in has the reference's forward, which cannot run on it either
        u.layers["0"].module(x)


def test_tiny_gpt2(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    idx = torch.randint(0, 50, (2, 8))
    t = hw.trace(lambda: model(idx, labels=idx).loss.backward())
    u = check_loaded(t, tmp_path)
    against_autograd(u, ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc"])
    assert u.layers["transformer.h.0.attn.c_attn"].type == "Conv1D"


def test_multi_step_and_accumulation(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = torch.randn(3, 4, 3)

    def train():
        for x in xs:
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()

    def accumulate():
        opt.zero_grad()
        for x in xs[:2]:
            model(x).pow(2).sum().backward()

    t = hw.trace(train)
    u = check_loaded(t, tmp_path, "train.pt")
    assert len(u.steps) == 3
    for k in range(3):
        assert torch.allclose(u.weight_grad("0", step=k), u.steps[k].grad("0.weight"), atol=1e-6)
    a = hw.trace(accumulate)
    v = check_loaded(a, tmp_path, "accumulate.pt")
    assert v.accumulates and v.per_sample_grads("2").shape[0] == 8


@pytest.mark.parametrize("capture", ["norms", "summary"])
def test_other_capture_modes(tmp_path, capture):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), Gain(3))
    x = torch.randn(6, 4)
    t = hw.trace(lambda: model(x).pow(2).sum().backward(), capture=capture)
    u = check_loaded(t, tmp_path)
    assert u.options == t.options


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_trace_loads_on_the_cpu(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).cuda()
    x = torch.randn(6, 4, device="cuda")
    t = hw.trace(lambda: model(x).pow(2).sum().backward())
    path = tmp_path / "cuda.pt"
    t.save(path)
    u = hw.load(path)
    assert u.layers["0"].a.device.type == "cpu" and repr(u) == repr(t) and u.notes == t.notes
    for n in ("0", "2"):
        assert torch.allclose(u.weight_grad(n), t.weight_grad(n).cpu(), atol=1e-6)
        assert torch.allclose(u.per_sample_grads(n), t.per_sample_grads(n).cpu(), atol=1e-6)
    assert torch.allclose(u.per_sample_grad_norms(), t.per_sample_grad_norms().cpu(), atol=1e-6)


def test_read_only_refusals_name_the_file(tmp_path):
    model, x = nn.Linear(2, 2), torch.randn(3, 2)
    t = hw.trace(lambda: model(x).sum().backward())
    t.add_hook("Linear", "grad_scale", factor=2.0)
    r = t.rerun()
    path = tmp_path / "rerun.pt"
    u = check_loaded(r, tmp_path, "rerun.pt")
    for what, call in [("rerun", u.rerun), ("add_hook", lambda: u.add_hook("Linear", "grad_zero")),
                       ("remove_hook", lambda: u.remove_hook("Linear", "grad_scale"))]:
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value).startswith(f"this Trace was loaded from {path}: {what} needs the code that made it")
        assert "\n" not in str(e.value)
    with pytest.raises(AttributeError, match="pass the trace to compare with"):
        u.diff()
    assert u.diff(hw.load(_saved(t, tmp_path))).changed  # the hook made a difference
    assert [str(iv) for iv in u.applied] == [str(iv) for iv in r.applied] == [str(iv) for iv in u.interventions]
    assert payload.hooks(u) == payload.hooks(r) == [{"target": "Linear", "kind": "grad_scale", "params": {"factor": 2}}]
    w = u.widget()  # displays; what needs the code answers one line naming the file
    w.sent = []
    w.send = lambda content, buffers=None: w.sent.append(content)
    w._on_msg(w, {"type": "rerun", "request_id": "r1"}, [])
    assert w.sent[-1]["state"] == "error" and f"loaded from {path}: rerun needs the code" in w.sent[-1]["text"]
    w._on_msg(w, {"type": "detail", "target": "Linear", "request_id": "r2"}, [])
    assert w.sent[-1]["type"] == "detail"
    u.to_html(tmp_path / "u.html")
    assert (tmp_path / "u.html").stat().st_size > 1000


def test_a_users_function_hook_comes_back_by_name(tmp_path):
    model, x = nn.Linear(2, 2), torch.randn(3, 2)
    t = hw.trace(lambda: model(x).sum().backward())

    def halve(g):
        return g / 2

    t.add_hook("Linear", "callable", fn=halve)
    u = check_loaded(t.rerun(), tmp_path)
    assert payload.hooks(u)[0]["params"]["fn"].endswith("halve")
    with pytest.raises(RuntimeError, match="cannot run"):
        u.applied[0].params["fn"](torch.ones(1))


def _saved(t, tmp_path):
    path = tmp_path / "base.pt"
    t.save(path)
    return path


def test_pickle_and_deepcopy_say_to_use_save():
    model, x = nn.Linear(2, 2), torch.randn(3, 2)
    t = hw.trace(lambda: model(x).sum().backward())
    for fn in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"t\.save\(path\)") as e:
            fn(t)
        assert "\n" not in str(e.value)


def test_pickling_a_loaded_trace_names_its_file_not_a_live_model(tmp_path):
    model, x = nn.Linear(2, 2), torch.randn(3, 2)
    u = hw.load(_saved(hw.trace(lambda: model(x).sum().backward()), tmp_path))
    for fn in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError) as e:
            fn(u)
        text = str(e.value)
        assert "live model" not in text and f"hw.load({str(tmp_path / 'base.pt')!r})" in text and "\n" not in text


def test_loading_a_missing_file_is_file_not_found_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        hw.load(tmp_path / "nope.pt")
    text = str(e.value)
    assert text.startswith(f"hw.load: no file or folder {str(tmp_path / 'nope.pt')!r}") and "\n" not in text
    assert "e.g. hw.load('step.pt')" in text and e.value.__cause__ is None and e.value.__context__ is None


def test_file_is_data_only(tmp_path):
    """The file reads back with weights_only=True (no code is unpickled), and names its kind for hw.load."""
    model, x = nn.Linear(2, 2), torch.randn(3, 2)
    t = hw.trace(lambda: model(x).sum().backward())
    t.save(tmp_path / "t.pt")
    raw = torch.load(tmp_path / "t.pt", weights_only=True)
    assert raw["format"] == "hookwidget" and raw["kind"] == "trace"
    raw["kind"] = "something-newer"
    torch.save(raw, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="does not open"):
        hw.load(tmp_path / "other.pt")
    torch.save({"a": torch.ones(1)}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a hookwidget record"):
        hw.load(tmp_path / "plain.pt")


def test_a_view_is_stored_as_its_own_values(tmp_path):
    big = torch.randn(1000, 64)
    model = nn.Linear(64, 2)
    t = hw.trace(lambda: model(big[:4]).sum().backward())
    t.save(tmp_path / "t.pt")
    assert (tmp_path / "t.pt").stat().st_size < 1000 * 64 * 4 / 4  # not the whole (1000, 64) storage


def test_a_file_of_several_traces_dispatches_on_its_kind(tmp_path, monkeypatch):
    """How a watch's file can hold its kept traces: their data nested in one tree, written under its own kind,
    which hw.load dispatches on (api.LOADERS). Traces of one model share its stand-ins and tensors."""
    from hookwidget import api
    from hookwidget.record import saved

    model = nn.Linear(3, 2)
    t1 = hw.trace(lambda: model(torch.randn(4, 3)).sum().backward())
    t2 = hw.trace(lambda: model(torch.randn(5, 3)).sum().backward())
    saved.write(tmp_path / "pair.pt", "pair", {"kept": [t1.to_data(), t2.to_data()]})
    monkeypatch.setitem(api.LOADERS, "pair", lambda path, tree: [hw.Trace.from_data(d, path) for d in tree["kept"]])
    u1, u2 = hw.load(tmp_path / "pair.pt")
    assert u1.layers["Linear"].module is u2.layers["Linear"].module
    assert torch.allclose(u2.per_sample_grads("Linear"), t2.per_sample_grads("Linear"))


def test_a_loaded_trace_shows_the_norms_the_live_one_showed_for_views(tmp_path):
    """Issue 39: a layer fed a permuted view (time-major attention's output) or a strided slice (a chunk) showed
    a norm one float32 ulp off once loaded: the saver stored a contiguous copy, whose reduction sums in another
    order. Permuted layouts are stored as they are and a gapped view's norm is taken of the values stored."""

    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(8, 4)

        def forward(self, x):
            h = self.a(x.transpose(0, 1))  # (T, B, d) as (B, T, d): a permuted view
            return self.b(h.chunk(2, -1)[0])  # a slice with gaps

    torch.manual_seed(0)
    model, x = Views(), torch.randn(128, 8, 16)
    t = hw.trace(lambda: model(x).square().sum().backward())
    assert not t.layers["a"].a.is_contiguous() and not t.layers["b"].a.is_contiguous()
    t.save(tmp_path / "v.pt")
    u = hw.load(tmp_path / "v.pt")
    assert payload.summary(u)["modules"] == payload.summary(t)["modules"]


def test_saved_without_activations_keeps_their_statistics_and_the_norms(tmp_path):
    """Issue 41: t.save(path, activations=False) for a large model: a and δ as statistics, not values. The loaded
    trace shows what the live one showed of them, answers the whole model's per-sample norms (checked against an
    autograd loop), and refuses a factor query in one line that names the fix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50))
    idx = torch.randint(0, 50, (4, 12))

    def loss_of(i):
        return nn.functional.cross_entropy(model(i).flatten(0, 1), i.flatten(), reduction="sum")

    t = hw.trace(lambda: loss_of(idx).backward())
    t.save(tmp_path / "full.pt")
    t.save(tmp_path / "light.pt", activations=False)
    u = hw.load(tmp_path / "light.pt")
    assert (tmp_path / "light.pt").stat().st_size < (tmp_path / "full.pt").stat().st_size
    assert all(c.a is None and c.delta is None for layer in u.layers.values() for c in layer.calls)
    rows = {r["name"]: r for r in payload.summary(t)["modules"]}
    for r in payload.summary(u)["modules"]:
        for side in ("a", "delta"):
            live, loaded = rows[r["name"]][side], r[side]
            assert (live is None) == (loaded is None), r["name"]
            if live is not None:
                assert loaded["shape"] == live["shape"] and loaded["kept"] is False
                assert loaded["norm"] == pytest.approx(live["norm"], rel=1e-6), (r["name"], side)
    ref = []
    for b in range(4):
        model.zero_grad()
        loss_of(idx[b:b + 1]).backward()
        ref.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    assert torch.allclose(u.per_sample_grad_norms(), torch.stack(ref), rtol=1e-5)
    assert torch.equal(u.param_grads["1.weight"], t.param_grads["1.weight"])
    with pytest.raises(ValueError, match="activations=False"):
        u.weight_grad("1")
    with pytest.raises(TypeError, match="True or False"):
        t.save(tmp_path / "x.pt", activations="no")
