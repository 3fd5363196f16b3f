"""The payload schema (hookwidget/views/payload_schema.json) holds for what Python really sends: summaries, details,
diffs and the widgets' replies, built from traced models. js/tests/schema.test.js checks the front-end's side
(its fixtures and the messages it sends) against the same file."""

import importlib
import json

import jsonschema
import pytest
import torch
from torch import nn

import hookwidget as hw
from hookwidget.views import payload
from hookwidget.views.widget import PAYLOAD_SCHEMA, SCHEMA, HookWidget

ww = importlib.import_module("hookwidget.views.watch_widget")  # hookwidget.watch is also the function watch()
SPEC = json.loads(PAYLOAD_SCHEMA.read_text(encoding="utf-8"))
# The keywords the front-end's test validator (js/tests/schema.js) knows; the schema uses no other.
KNOWN = {"$schema", "$id", "$defs", "$ref", "title", "description", "x-messages", "type", "properties", "required",
         "additionalProperties", "items", "enum", "const", "anyOf", "minimum", "minLength", "maxLength", "minItems",
         "maxItems"}


def check(name: str, instance) -> None:
    """Validate `instance` against $defs[name]; the error names the path into the instance."""
    schema = {"$defs": SPEC["$defs"], "$ref": f"#/$defs/{name}"}
    jsonschema.Draft202012Validator(schema).validate(json.loads(json.dumps(instance)))  # as it travels: JSON


def test_the_schema_is_valid_and_uses_only_keywords_both_sides_check():
    jsonschema.Draft202012Validator.check_schema(SPEC)
    seen = set()

    def walk(node, in_props=False):
        if isinstance(node, dict):
            if not in_props:
                seen.update(node)
            for k, v in node.items():
                if k in ("properties", "$defs"):
                    for sub in v.values():
                        walk(sub)
                elif k != "x-messages":
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(SPEC)
    assert seen <= KNOWN, seen - KNOWN
    for widget in SPEC["x-messages"].values():
        names = {f"request_{t}" for t in widget["requests"]} | {f"reply_{t}" for t in widget["replies"]}
        assert names <= set(SPEC["$defs"])


def test_the_widgets_accept_exactly_the_requests_the_schema_lists():
    assert SCHEMA == {"detail": {"target"}, "add_hook": {"target", "kind", "params"},
                      "remove_hook": {"target", "kind"}, "rerun": set(), "shares": {"layer", "sample"}}
    assert ww.SCHEMA == {"sync": {"have"}, "open": {"step"}, "window": {"start", "stop", "bins", "stat"}}


class Mixed(nn.Module):
    """A conv (channel maps), a sequence layer (T x d pictures), a layer without a factor rule, a parameter-free one."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.seq = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, img, tokens):
        x = torch.relu(self.conv(img)).mean(dim=(1, 2, 3))
        y = self.norm(self.seq(tokens)).mean(dim=1)
        return self.head(y) + x[:, None]


@pytest.fixture
def traces(seed_mlp):
    torch.manual_seed(0)
    m = Mixed()
    img, tokens = torch.randn(3, 2, 5, 5), torch.randn(3, 6, 4)

    def step():
        m.zero_grad()
        m(img, tokens).pow(2).sum().backward()

    def bad():
        m.zero_grad()
        (m(img, tokens) * float("nan")).sum().backward()

    with torch.no_grad():
        forward_only = hw.trace(lambda: m(img, tokens))
    return [hw.trace(seed_mlp[3]), hw.trace(step), hw.trace(bad), forward_only]


def test_summaries_and_every_detail_follow_the_schema(traces):
    layouts = set()
    for t in traces:
        s = payload.summary(t)
        check("summary", s)
        assert len(s.get("note_ids", s["notes"])) == len(s["notes"])  # one id a note, in the same order
        for target in [*t.layers, *t.graph.nodes]:
            meta, buffers = payload.detail(t, target)
            check("detail_meta", meta)
            assert all(info["buffer"] < len(buffers) for info in meta["tensors"].values())
            layouts |= {info["layout"] for info in meta["tensors"].values()}
    assert layouts == {"matrix", "channels", "sequence"}  # every kind of picture was checked
    assert '"nan"' in json.dumps(payload.summary(traces[2]))  # NaN travels as text: checked against "num" too
    assert payload.summary(traces[3])["has_grads"] is False


def test_the_explorers_replies_and_traits_follow_the_schema(seed_mlp):
    t = hw.trace(seed_mlp[3])
    w = HookWidget(t)
    sent = []
    w.send = lambda content, buffers=None: sent.append(content)
    for content in ({"type": "detail", "target": "fc1", "request_id": "r1"},
                    {"type": "detail", "target": "AccumulateGrad#0", "request_id": 2},
                    {"type": "add_hook", "target": "fc1", "kind": "grad_scale", "params": {"factor": 2},
                     "request_id": "r3"},
                    {"type": "rerun", "request_id": "r4"},
                    {"type": "remove_hook", "target": "fc1", "kind": "grad_scale", "request_id": "r5"},
                    {"type": "detail", "target": "nope", "request_id": "r6"},
                    {"type": "eval", "code": "1", "request_id": "r7"}):
        if content["type"] in SCHEMA:
            check(f"request_{content['type']}", content)
        w._on_msg(w, content, [])
    assert [m["type"] for m in sent] == ["detail", "detail", "status", "status", "trace", "status", "status", "status",
                                         "status"]
    for m in sent:
        check(f"reply_{m['type']}", m)
    check("summary", w.summary)
    check("diff", w.diff)


def test_the_watchs_rows_follow_the_schema():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with hw.watch(model) as w:
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    wid = ww.WatchWidget(w)
    sent = []
    wid.send = lambda content, buffers=None: sent.append(content)
    for content in ({"type": "sync", "have": 1, "request_id": "s1"}, {"type": "open", "step": 2, "request_id": "s2"},
                    {"type": "open", "step": 1, "request_id": "s3"}):  # 2: the latest, kept; 1: not kept
        check(f"request_{content['type']}", content)
        wid._on_msg(wid, content, [])
    assert [(m["type"], m.get("state")) for m in sent] == [("rows", "closed"), ("status", "done"), ("status", "error")]
    for m in sent:
        check(f"reply_{m['type']}", m)


def test_the_schema_refuses_what_the_front_end_would_misread():
    with pytest.raises(jsonschema.ValidationError):
        check("reply_status", {"type": "status", "request_id": "r", "state": "weird", "text": ""})
    with pytest.raises(jsonschema.ValidationError):
        check("request_add_hook", {"type": "add_hook", "request_id": "r", "target": "fc1", "kind": "grad_scale",
                                   "params": {"factor": "2"}})
    with pytest.raises(jsonschema.ValidationError):
        check("request_rerun", {"type": "rerun", "request_id": "r", "code": "x"})
    with pytest.raises(jsonschema.ValidationError):
        check("num", "NaN")  # only "nan", "inf", "-inf"
