"""to_html: one self-contained page, strict CSP, user strings and the bundle cannot end a <script>."""

import json
import re

import pytest
import torch
from torch import nn

import hookwidget as hw
from hookwidget.views import export, payload

EVIL = ['<img src=x onerror="__pwned=1">', "</script><script>__pwned=2</script>"]


class Evil(nn.Module):
    """A model whose ModuleDict keys are markup (the XSS test of issues 6 and 9)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({EVIL[0]: nn.Linear(3, 4), EVIL[1]: nn.Linear(4, 2)})

    def forward(self, x):
        for m in self.blocks.values():
            x = m(x)
        return x


def evil_trace():
    torch.manual_seed(0)
    model, x = Evil(), torch.randn(5, 3)
    return hw.trace(lambda: model(x).pow(2).sum().backward())


def _data(html):
    m = re.search(r'<script type="application/json" id="hw-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def test_page_is_self_contained_with_strict_csp(tmp_path, seed_mlp):
    t = hw.trace(seed_mlp[3])
    path = t.to_html(tmp_path / "t.html")
    html = path.read_text()
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert "default-src 'none'" in csp and "script-src 'nonce-" in csp and "unsafe" not in csp
    nonce = re.search(r"'nonce-([^']+)'", csp).group(1)
    assert f'<script nonce="{nonce}">' in html
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", html, re.I)  # nothing fetched
    assert html.lower().count("</script") == 2  # only the two script elements close
    data = _data(html)
    assert data["summary"]["graph"]["id"] == list(t.graph.nodes)
    assert set(data["details"]) >= {"fc1", "fc2"}


def test_user_strings_and_bundle_cannot_close_the_script(tmp_path):
    t = evil_trace()
    names = [n for n in t.layers if n.startswith("blocks.")]
    assert names == [f"blocks.{EVIL[0]}", f"blocks.{EVIL[1]}"]
    html = export.page(t)
    assert html.lower().count("</script") == 2 and "<img" not in html
    data = _data(html)
    assert [m["name"] for m in data["summary"]["modules"]][1:] == names  # round-trips literally


def test_script_escapes_keep_values():
    text = export.json_for_script({"k": "</script><!-- \u2028 & >"})
    assert "<" not in text and ">" not in text and json.loads(text) == {"k": "</script><!-- \u2028 & >"}
    assert export.js_for_script('a="</SCRIPT>";b="<!--"') == 'a="<\\/SCRIPT>";b="<\\!--"'


def test_missing_bundle_names_the_fix(monkeypatch, tmp_path, seed_mlp):
    monkeypatch.setattr(export, "STATIC", tmp_path)
    with pytest.raises(FileNotFoundError, match="npm run build"):
        export.page(hw.trace(seed_mlp[3]))


def test_detail_budget_skips_and_says_so(monkeypatch, seed_mlp):
    monkeypatch.setattr(export, "DETAIL_BUDGET", 600)
    d = export.details(hw.trace(seed_mlp[3]))
    assert d["details_note"] and len(d["details"]) < 3 + 2
    meta, _ = payload.detail(hw.trace(seed_mlp[3]), "fc2")
    assert meta["target"] == "fc2"


def test_a_weight_grad_shown_twice_is_described_once_and_the_same(seed_mlp, monkeypatch):
    t = hw.trace(seed_mlp[3])
    grad = t.param_grads["fc2.weight"]
    seen = []
    real = payload.downsample
    monkeypatch.setattr(payload.tensors, "downsample", lambda x, *a, **k: (seen.append(x is grad), real(x, *a, **k))[1])
    d = export.details(t)["details"]
    assert seen.count(True) == 1  # described for the layer fc2, reused for its parameter node
    node = next(k for k, v in d.items() if v["meta"].get("param") == "fc2.weight")
    layer, param = d["fc2"], d[node]
    a, b = layer["meta"]["tensors"]["grad_autograd"], param["meta"]["tensors"]["grad_autograd"]
    assert a["stats"] == b["stats"] and a["stats"]["numel"] == 6
    assert layer["buffers"][a["buffer"]] == param["buffers"][b["buffer"]]


def test_snapshot_is_plain_escaped_html_of_every_layer(seed_mlp):
    t = evil_trace()
    t.add_hook(f"blocks.{EVIL[0]}", "grad_zero")
    text = export.snapshot(payload.summary(t))
    assert "<img" not in text and "<script" not in text.lower() and "style" not in text
    assert html_unescape_cells(text)[:2] == [f"blocks.{EVIL[0]}", f"blocks.{EVIL[1]}"]
    assert "grad_zero on blocks.&lt;img" in text and "static snapshot" in text
    s = payload.summary(hw.trace(seed_mlp[3]))
    text = export.snapshot(s)
    fc1 = next(m for m in s["modules"] if m["name"] == "fc1")
    assert f"<td>fc1</td><td>Linear</td><td>{export._fmt(fc1['delta']['norm'])}</td>" in text
    assert f"loss {export._fmt(s['loss'])}" in text


def html_unescape_cells(text):
    """The first cell of each body row, unescaped."""
    import html

    return [html.unescape(c) for c in re.findall(r"<tr><td>(.*?)</td>", text)]


def test_a_page_with_a_diff_carries_its_ranking_and_noise_marks(seed_mlp):
    """Issue 25: the standalone page shows the same honest diff as the widget (the same payload, the same JS):
    rows ranked by impact, each with its change, impact and noise mark, and the model's gradient scale."""
    t = hw.trace(seed_mlp[3])
    t.add_hook("fc1", "grad_scale", factor=0.5)
    t2 = t.rerun()
    d = payload.diff(t, t2)
    shown = _data(export.page(t2, diff=d))["diff"]
    assert shown == json.loads(json.dumps(d))
    assert shown["grad_scale"] > 0 and {"change", "impact", "noise"} <= set(shown["params"][0])
    impacts = [p["impact"] for p in shown["params"] if not p["noise"]]
    assert impacts == sorted(impacts, reverse=True)
