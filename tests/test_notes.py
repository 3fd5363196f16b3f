"""Notes are data: each has an id from one catalogue (record/notes.py) and the fields its text is made of; the
text users read (t.notes) is rendered from them, and code (the payload, the front-end) finds a note by id or by
the layers it concerns, never by its text."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookwidget as hw
from hookwidget.analysis.facts import Facts, Refusal
from hookwidget.analysis.generic import generic_rows
from hookwidget.record.notes import TEXT, Note, render
from hookwidget.views import payload


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), torch.randn(5, 4)


def ids(t) -> list:
    return [n.id for n in t.note_records]


def layer_notes(t, name: str) -> list:
    """The notes the explorer shows on a layer (its detail)."""
    return payload.detail(t, name)[0]["notes"]


def check_rendered(t):
    assert t.notes == [render(n) for n in t.note_records] == [str(n) for n in t.note_records]


def test_the_catalogue_renders_each_id_and_refuses_an_unknown_one():
    assert render(Note("no_grads")) == "no gradients captured: the code ran no backward (activations only)"
    assert render(Note("grad_changed_after_backward", {"leaves": ("a", "b", "c", "d", "e")})).startswith(
        "the code changed .grad after its last backward pass (a, b, c and 2 more;")
    assert Note("intervention_not_fired", {"intervention": "x", "layers": ("fc",)}).layers == ("fc",)
    assert Note("no_grads").layers == ()
    assert {"no_grads", "budget_reached", "create_graph", "no_factor_rule", "params_left_out"} <= set(TEXT)
    with pytest.raises(KeyError, match="no note 'nope' in the catalogue"):
        Note("nope")


def test_a_forward_only_run_has_the_no_grads_note_and_the_summary_sends_its_id():
    m, x = _mlp()
    t = hw.trace(lambda: m(x).sum())
    assert ids(t) == ["no_grads"]
    assert t.note_records == (Note("no_grads"),)
    check_rendered(t)
    s = payload.summary(t)
    assert s["note_ids"] == ["no_grads"] and s["notes"] == t.notes


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_capture_notes_carry_their_ids():
    m, x = _mlp()

    def retain():
        m.zero_grad()
        loss = m(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()

    t = hw.trace(retain)  # the second pass reuses the first's calls: per-sample rows would be one pass's
    assert ids(t) == ["retain_graph", "several_passes", "params_left_out"]
    assert t.note_records[1].fields == {"steps": 2, "accumulate": True}
    check_rendered(t)

    t = hw.trace(lambda: m(x).sum().backward(), budget_mb=1e-5)
    assert ids(t)[0] == "budget_reached" and t.note_records[0].fields["dropped"] > 0
    check_rendered(t)

    def double():
        m.zero_grad()
        m(x).pow(2).sum().backward(create_graph=True)

    t = hw.trace(double)
    assert ids(t) == ["create_graph", "params_left_out"]
    assert t.record.no_factors == render(Note("create_graph"))  # the reason its factor queries give
    for p in m.parameters():
        p.grad = None
    t = hw.trace(lambda: torch.autograd.grad(m(x).sum(), list(m[0].parameters())))
    assert "autograd_grad_used" in ids(t)

    big = nn.Sequential(*[nn.Linear(4, 4) for _ in range(80)])
    t = hw.trace(lambda: big(torch.randn(2, 4)).sum().backward())
    assert ids(t) == ["graph_large"] and t.note_records[0].fields["nodes"] > 256


def test_record_notes_carry_their_ids():
    m, x = _mlp()

    def clipped():
        m.zero_grad()
        m(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)

    t = hw.trace(clipped)
    assert ids(t) == ["grad_changed_after_backward"]
    assert set(t.note_records[0].fields["leaves"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}

    def by_hand():
        m.zero_grad()
        m(x).sum().backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad

    t = hw.trace(by_hand)
    assert ids(t) == ["rerun_unrestorable"] and t.notes[0].startswith("rerun: 4 parameters were changed in place")


def test_an_intervention_that_did_not_fire_is_a_note_on_its_layer():
    m, x = _mlp()
    on = {"second": True}

    def cell():
        m.zero_grad()
        h = m[0](x)
        if on["second"]:
            h = m[2](torch.relu(h))
        h.sum().backward()

    t = hw.trace(cell, m)
    t.add_hook("2", "grad_zero")
    on["second"] = False
    t2 = t.rerun()
    assert ids(t2) == ["intervention_not_fired"] and t2.note_records[0].layers == ("2",)
    check_rendered(t2)
    assert "2" not in t2.layers and layer_notes(t2, "0") == []  # (a layer the run did not call has no detail)


def test_coverage_notes_name_their_layers_and_the_payload_finds_them_by_that():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.SyncBatchNorm(3), nn.Linear(3, 1)).eval()
    t = hw.trace(lambda: model(torch.randn(8, 4)).sum().backward())
    assert ids(t) == ["no_factor_rule", "params_left_out"]
    rule, left = t.note_records
    assert rule.layers == ("1",) and rule.fields["reasons"][0][0] == "1"
    assert left.layers == ("1",) and [n for n, _ in left.fields["reasons"]] == ["1.weight", "1.bias"]
    assert dict(left.fields["reasons"]) == t.per_sample_left_out
    check_rendered(t)
    assert layer_notes(t, "1") == t.notes
    assert layer_notes(t, "2") == []  # "2 parameters" in the text does not make it a note on layer 2


class Noisy(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x) * self.weight


def test_a_refused_generic_rule_is_a_typed_refusal_kept_in_the_traces_facts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), Noisy(5), nn.Linear(5, 2)).train()
    x = torch.randn(6, 4)
    t = hw.trace(lambda: model(x).pow(2).sum().backward(), model)
    assert isinstance(t.facts, Facts)
    rows = generic_rows(t, "1", 0)
    assert isinstance(rows, Refusal) and "draws random numbers" in rows.reason and str(rows) == rows.reason
    assert t.facts[("rows", "1", 0)] is rows
    assert rows.reason in t.per_sample_left_out["1.weight"]
    assert ids(t) == ["params_left_out"] and t.note_records[0].layers == ("1",)


def test_a_block_still_running_has_an_empty_record_and_no_notes():
    m, x = _mlp()
    with hw.tracing() as t:
        assert t.layers == {} and t.notes == [] and t.graph.number_of_nodes() == 0 and not t.record.done
        m(x).sum().backward()
    assert t.record.done and "0" in t.layers and t.notes == []


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(checkpoint(lambda t: torch.relu(self.fc1(t)), x, use_reentrant=False))


def test_capture_notes_on_modules_name_their_layers():
    """Capture names the modules a note concerns; the record gives their layer names (explorer: on that layer)."""
    torch.manual_seed(0)
    model = Checkpointed()
    t = hw.trace(lambda: model(torch.randn(3, 4)).sum().backward(), model)
    note = next(n for n in t.note_records if n.id == "checkpoint_recomputed")
    assert note.layers == ("fc1",) and "modules" not in note.fields and note.fields["module_types"] == ("Linear",)
    assert layer_notes(t, "fc1") == [str(note)] and layer_notes(t, "fc2") == []
    check_rendered(t)

    m, x = _mlp()

    def cell():
        a = x.clone()
        m(a).sum().backward()
        a.add_(1)  # after the call: its activation is not kept

    t = hw.trace(cell)
    assert [(n.id, n.layers) for n in t.note_records] == [("input_modified", ("0",)), ("params_left_out", ("0",))]
    assert t.notes[0] == "Linear: an input was modified in place after the call; its activation was not kept"


def test_the_notes_on_unseen_passes_and_empty_filters_are_data_with_short_refusals():
    from hookwidget.record.notes import refusal

    unseen = Note("backward_unseen", {"stepped": False})
    assert render(unseen).startswith("a backward pass ran that hookwidget did not see start")
    assert render(Note("backward_unseen", {"stepped": True})).startswith("besides the passes in t.steps")
    assert "ran no backward" not in render(unseen)
    matched = Note("filters_matched_none", {"given": (("include", ("encoder.*",)),), "ran": ("M", "embed", "encoders")})
    assert render(matched).startswith("include='encoder.*' matched no module that ran")
    assert "did you mean 'encoders'" in render(matched)
    both = Note("filters_matched_none", {"given": (("include", ("a*", "b*")), ("exclude", ("*",))), "ran": ("a",)})
    assert render(both).startswith("include=['a*', 'b*'] and exclude='*' left no module that ran")
    assert refusal([matched], "q", "") == "q: include='encoder.*' matched no module that ran (t.notes has the details)"
    assert "ran unseen" in refusal([unseen], "q", "")
