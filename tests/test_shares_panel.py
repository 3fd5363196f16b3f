"""The explorer's shares panel (views/payload/shares.py, issue 43): what it sends equals float64 references from
autograd loops (each sample, and each position of each sample, run alone), the token ids come from the embedding
they are proved to feed, their text from the user's decode option, and bad input gets one line."""

import json
import pathlib

import jsonschema
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw
from hookwidget.views.payload import shares as panel
from hookwidget.views.widget import PAYLOAD_SCHEMA, HookWidget, MessageError, validate

SPEC = json.loads(PAYLOAD_SCHEMA.read_text(encoding="utf-8"))
V, D, T, B = 11, 5, 6, 4


pytestmark = pytest.mark.usefixtures("float64_default")


class PerToken(nn.Module):
    """Embedding -> Linear -> tanh -> Linear head, each position on its own: the loss of token (b, t) reaches only
    its own position of every layer, so G_{b,t} is the gradient of that token's loss alone (a loop can make it)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.fc = nn.Linear(D, 7)
        self.head = nn.Linear(7, V)

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.tok(idx))))


def token_losses(model, idx, y):
    return F.cross_entropy(model(idx).reshape(-1, V), y.reshape(-1), reduction="none").reshape(idx.shape)


def setup(decode=None, **options):
    torch.manual_seed(0)
    model = PerToken()
    idx, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    idx[2] = 3  # a run of one token with its own labels: a sample unlike the others
    y[2] = torch.randperm(T) % V

    def step():
        model.zero_grad()
        token_losses(model, idx, y).sum().backward()

    return model, idx, y, hw.trace(step, decode=decode, **options)


def loop_refs(model, idx, y, names=None):
    """(B,) shares and (B, T) position shares over the parameters `names` (default all), from the gradient of each
    token's loss alone (float64 autograd, one backward per token)."""
    params = [(n, p) for n, p in model.named_parameters() if names is None or n in names]
    rows = [[torch.cat([g.reshape(-1) for g in torch.autograd.grad(token_losses(model, idx, y)[b, t],
                                                                   [p for _, p in params])])
             for t in range(T)] for b in range(B)]
    per_token = torch.stack([torch.stack(r) for r in rows])  # (B, T, P)
    G = per_token.sum((0, 1))
    dots = per_token @ G / G.dot(G)
    return dots.sum(1), dots


def decoded(meta, buffers, key):
    info = meta[key]
    return np.frombuffer(buffers[info["buffer"]], dtype="<f8" if info["dtype"] == "float64" else "<i4")


def check(name, instance):
    jsonschema.Draft202012Validator({"$defs": SPEC["$defs"], "$ref": f"#/$defs/{name}"}).validate(
        json.loads(json.dumps(instance)))


VOCAB = [f"<w{i}>" for i in range(V)]


def test_bar_and_strip_equal_per_token_autograd_loops():
    model, idx, y, t = setup(decode=lambda ids: [VOCAB[i] for i in ids])
    samples, positions = loop_refs(model, idx, y)
    for b in range(B):
        meta, buffers = panel.shares_view(t, "", b)
        check("shares_meta", meta)
        order = decoded(meta, buffers, "index")
        np.testing.assert_allclose(decoded(meta, buffers, "samples"), samples[order].numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(decoded(meta, buffers, "positions"), positions[b].numpy(), rtol=1e-9, atol=1e-12)
        assert meta["ids"] == idx[b].tolist() and meta["token_layer"] == "tok"
        assert meta["tokens"] == [VOCAB[i] for i in idx[b].tolist()]  # sent as the user's text; shown as text
        assert meta["unplaced"] == pytest.approx(0, abs=1e-12)
    assert meta["sum"] == pytest.approx(1, abs=1e-9)


def test_a_clicked_layer_shows_its_own_attribution():
    model, idx, y, t = setup()
    samples, positions = loop_refs(model, idx, y, names={"fc.weight", "fc.bias"})
    meta, buffers = panel.shares_view(t, "fc", 1)
    assert meta["scope"] == "fc"
    np.testing.assert_allclose(decoded(meta, buffers, "samples"), samples.numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(decoded(meta, buffers, "positions"), positions[1].numpy(), rtol=1e-9, atol=1e-12)
    assert meta["tokens"] is None and meta["ids"] == idx[1].tolist()  # no decode given: the ids, and why
    assert "decode" in meta["tokens_note"]


class Vocab:
    def __init__(self, with_decode):
        if with_decode:
            self.decode = lambda ids: "".join(VOCAB[i] for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [VOCAB[i] for i in ids]


@pytest.mark.parametrize("decode", [lambda ids: [VOCAB[i] for i in ids], lambda i: VOCAB[i], Vocab(True), Vocab(False)],
                         ids=["ids->list", "id->str", "decode", "convert_ids_to_tokens"])
def test_every_decode_form_gives_each_tokens_text(decode):
    _, idx, _, t = setup(decode=decode)
    meta, _ = panel.shares_view(t, "", 0)
    assert meta["tokens"] == [VOCAB[i] for i in idx[0].tolist()] and meta["tokens_note"] is None


def test_a_hugging_face_tokenizer_built_offline():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers.models import WordLevel

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(
        WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<w0>")))
    _, idx, _, t = setup(decode=tok)
    meta, _ = panel.shares_view(t, "", 3)
    assert meta["tokens"] == [VOCAB[i] for i in idx[3].tolist()]


def test_bad_decode_gets_one_line_at_the_entry_and_a_failing_one_a_note():
    with pytest.raises(ValueError, match=r"^decode=3 must be a function ids -> list\[str\].*e\.g\. decode=tokenizer"):
        hw.trace(lambda: None, decode=3)
    with pytest.raises(ValueError, match="token_layer="):
        hw.trace(lambda: None, token_layer=["tok"])

    def broken(i):
        raise KeyError("no such id")

    _, idx, _, t = setup(decode=broken)
    meta, _ = panel.shares_view(t, "", 0)
    assert meta["tokens"] is None and meta["ids"] == idx[0].tolist()
    assert meta["tokens_note"].startswith("decode failed: KeyError")


class TwoTables(nn.Module):
    """A token table and a segment table, both fed one (B, T) row of ids: which holds the tokens is not provable
    from shapes."""

    def __init__(self):
        super().__init__()
        self.tok, self.seg = nn.Embedding(V, D), nn.Embedding(2, D)
        self.head = nn.Linear(D, V)

    def forward(self, idx, seg):
        return self.head(self.tok(idx) + self.seg(seg))


def test_token_ids_need_one_provable_embedding_or_the_users_name():
    torch.manual_seed(0)
    model = TwoTables()
    idx, seg, y = torch.randint(0, V, (B, T)), torch.randint(0, 2, (B, T)), torch.randint(0, V, (B, T))

    def step():
        model.zero_grad()
        F.cross_entropy(model(idx, seg).reshape(-1, V), y.reshape(-1), reduction="sum").backward()

    meta, _ = panel.shares_view(hw.trace(step, decode=lambda i: VOCAB[i]), "", 0)
    assert meta["ids"] is None and "token_layer='tok'" in meta["tokens_note"] and "seg" in meta["tokens_note"]
    meta, _ = panel.shares_view(hw.trace(step, decode=lambda i: VOCAB[i], token_layer="tok"), "", 0)
    assert meta["ids"] == idx[0].tolist() and meta["tokens"] == [VOCAB[i] for i in idx[0].tolist()]
    meta, _ = panel.shares_view(hw.trace(step, token_layer="head"), "", 0)
    assert meta["ids"] is None and meta["tokens_note"].startswith("token_layer 'head': its input")


def test_without_a_sequence_axis_the_strip_says_so_in_one_line():
    torch.manual_seed(0)
    model, x, y = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), torch.randn(B, 4), torch.randn(B, 2)

    def step():
        model.zero_grad()
        ((model(x) - y) ** 2).sum().backward()

    meta, buffers = panel.shares_view(hw.trace(step), "", 0)
    check("shares_meta", meta)
    assert meta["positions"] is None and meta["positions_note"].startswith("positions not attributed here")
    assert len(meta["positions_note"].splitlines()) == 1


def test_passes_that_reset_grad_show_the_last_step_with_a_note():
    torch.manual_seed(0)
    model = PerToken()
    batches = [(torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))) for _ in range(2)]

    def two_steps():
        for idx, y in batches:
            model.zero_grad()
            token_losses(model, idx, y).sum().backward()

    meta, buffers = panel.shares_view(hw.trace(two_steps), "", 1)
    assert meta["step"] == 1 and "shares of the last (step 1)" in meta["notes"][0]
    samples, positions = loop_refs(model, *batches[1])
    np.testing.assert_allclose(decoded(meta, buffers, "samples"), samples.numpy(), rtol=1e-9, atol=1e-12)
    assert meta["ids"] == batches[1][0][1].tolist()


def test_the_widget_answers_a_shares_request_and_refuses_bad_ones():
    _, _, _, t = setup(decode=lambda i: VOCAB[i])
    w = HookWidget(t)
    sent = []
    w.send = lambda msg, buffers=None: sent.append((msg, buffers))
    w._on_msg(w, {"type": "shares", "request_id": "r1", "layer": "", "sample": 2}, [])
    msg, buffers = sent[-1]
    check("reply_shares", msg)
    assert msg["meta"]["sample"] == 2 and len(buffers) == 3
    w._on_msg(w, {"type": "shares", "request_id": "r2", "layer": "nope", "sample": -1}, [])
    assert sent[-1][0]["state"] == "error" and "unknown layer 'nope'" in sent[-1][0]["text"]
    for bad in (True, -2, "1", 1.5):
        with pytest.raises(MessageError, match="sample must be an integer"):
            validate({"type": "shares", "request_id": "r", "layer": "", "sample": bad})
    with pytest.raises(MessageError, match="layer must be"):
        validate({"type": "shares", "request_id": "r", "layer": 3, "sample": -1})


def test_a_slow_shares_request_reports_its_progress_before_its_reply(monkeypatch):
    from hookwidget.views import widget

    _, _, _, t = setup()
    w = HookWidget(t)
    sent = []
    w.send = lambda msg, buffers=None: sent.append(msg)
    monkeypatch.setattr(widget._ShareProgress, "AFTER_S", 0.0)  # as if every parameter took seconds
    monkeypatch.setattr(widget._ShareProgress, "EVERY_S", 0.0)
    w._on_msg(w, {"type": "shares", "request_id": "r1", "layer": "", "sample": -1}, [])
    running = [m for m in sent if m["type"] == "status"]
    assert sent[-1]["type"] == "shares" and len(running) == 2 * len(t.shares().params)  # checked, then computed
    for m in running:
        check("reply_status", m)
    fractions = [m["fraction"] for m in running]
    assert fractions == sorted(fractions) and 0 < fractions[0] and fractions[-1] == 1.0
    assert running[-1]["request_id"] == "r1" and running[-1]["text"] == "computing the shares: 100%"
    sent.clear()
    w._on_msg(w, {"type": "shares", "request_id": "r2", "layer": "", "sample": 1}, [])
    assert [m["type"] for m in sent] == ["shares"]  # kept: no progress to report
    monkeypatch.setattr(widget._ShareProgress, "AFTER_S", 60.0)
    sent.clear()
    w._on_msg(w, {"type": "shares", "request_id": "r3", "layer": "fc", "sample": -1}, [])
    assert [m["type"] for m in sent] == ["shares"]  # under AFTER_S: the answer alone
    with pytest.raises(TypeError, match="progress=1: pass a function"):
        t.shares(progress=1)


def test_the_standalone_page_carries_the_default_view_within_bounds(monkeypatch):
    _, idx, _, t = setup(decode=lambda i: VOCAB[i])
    page = panel.static_shares(t)
    assert set(page["strips"]) == {str(b) for b in range(B)} and page["note"] == ""
    assert page["strips"]["2"]["meta"]["tokens"] == [VOCAB[i] for i in idx[2].tolist()]
    monkeypatch.setattr(panel, "STATIC_CELLS", B * T - 1)
    panel._cache.clear()
    small = panel.static_shares(t)
    assert small["strips"] == {} and "live only" in small["note"] and small["bar"]["meta"]["n"] == B


def test_a_model_whose_shares_cost_seconds_gets_a_live_only_page(monkeypatch):
    _, _, _, t = setup()
    tokens = B * T
    assert panel.shares_macs(t) == tokens * (D + (D * 7 + 7) + (7 * V + V))  # tok gathers rows; fc; head
    monkeypatch.setattr(panel, "STATIC_MACS", panel.shares_macs(t) - 1)
    page = panel.static_shares(t)
    assert page == {"error": page["error"]} and page["error"].startswith("the shares panel is live-only for this model")


def test_a_trace_that_cannot_attribute_says_why_in_one_line(seed_mlp):
    model, x, y, _ = seed_mlp

    def step():
        model.zero_grad()
        ((model(x) - y) ** 2).sum().backward()

    t = hw.trace(step, capture="summary")
    with pytest.raises(ValueError, match="capture='summary'"):
        panel.shares_view(t, "", None)
    assert "capture='summary'" in panel.static_shares(t)["error"]


def test_the_magic_takes_a_decode_function_by_name():
    from IPython.core.error import UsageError
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "hookwidget")
    torch.manual_seed(0)
    ip.user_ns.update(model=PerToken(), idx=torch.randint(0, V, (B, T)), vocab_of=lambda i: VOCAB[i])
    cell = "model(idx).sum().backward()\n"
    try:
        ip.run_cell_magic("hooktrace", "-o T --no-widget --decode vocab_of --token-layer tok", cell)
        o = ip.user_ns["T"].session.options
        assert o.decode is ip.user_ns["vocab_of"] and o.token_layer == "tok"
        meta, _ = panel.shares_view(ip.user_ns["T"], "", 1)
        assert meta["tokens"] == [VOCAB[i] for i in ip.user_ns["idx"][1].tolist()]
        with pytest.raises(UsageError, match=r"--decode 'tokenizer': no variable of that name"):
            ip.run_cell_magic("hooktrace", "--no-widget --decode tokenizer", cell)
    finally:
        for k in ("T", "model", "idx", "vocab_of", "_hooktrace"):
            ip.user_ns.pop(k, None)


def test_the_panel_benchmark_runs_and_writes_its_table(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "benchmarks.shares_panel", "--tiny", "--rounds", "1", "--seq", "16",
                        "--before", "HEAD", "--out", str(tmp_path)],  # HEAD: in a shallow clone too
                       cwd=pathlib.Path(__file__).parent.parent, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "shares_panel.json").read_text())
    assert data["left_out"] == 0 and data["median"]["page_kib"] > 0
    assert set(data["versus"]["summary"]) == {"open_wall", "open_cpu", "layer_wall", "layer_cpu"}
    text = (tmp_path / "shares_panel.md").read_text()
    assert "| opening the panel" in text and "## Before / after, interleaved in one process" in text


class TimeMajor(nn.Module):
    """Ids as (T, B), as a time-major model reads them: with T == B a shape check alone would transpose them."""

    def __init__(self):
        super().__init__()
        self.tok, self.fc = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, ids_tb):
        return self.fc(self.tok(ids_tb))


def test_time_major_ids_are_read_along_the_proven_samples_dim():
    torch.manual_seed(0)
    model, ids = TimeMajor(), torch.randint(0, V, (B, B))  # (T, B) with T == B
    y = torch.randint(0, V, (B, B))

    def step():
        model.zero_grad()
        F.cross_entropy(model(ids).reshape(-1, V), y.reshape(-1), reduction="sum").backward()

    t = hw.trace(step, batch_dim=1, decode=lambda i: VOCAB[i])
    for b in range(B):
        meta, _ = panel.shares_view(t, "", b)
        assert meta["ids"] == ids[:, b].tolist() and meta["tokens"] == [VOCAB[i] for i in ids[:, b].tolist()]


def test_a_saved_trace_keeps_token_layer_and_shows_ids_without_the_decode_code(tmp_path):
    _, idx, _, t = setup(decode=lambda i: VOCAB[i], token_layer="tok")
    t.save(tmp_path / "step.pt")
    loaded = hw.load(tmp_path / "step.pt")
    assert loaded.options.get("token_layer") == "tok" and "decode" not in loaded.options
    meta, _ = panel.shares_view(loaded, "", 1)
    assert meta["ids"] == idx[1].tolist() and meta["tokens"] is None and "decode" in meta["tokens_note"]
