"""From what capture saw (`Records`) to the RunRecord a Trace holds: names, layers, steps, .grad, notes.

The one place a record is built, once, when the run ends; what it reads of the live model (names, hooks the
user's code left on) is read here, so that a model changed later does not change the record.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hookwidget._torch.modules import has_module_hooks, module_hooks
from hookwidget._torch.tensors import backward_hooks, post_accumulate_hooks
from hookwidget.record.calls import PREVIOUS, Records
from hookwidget.record.naming import name_filter, qualified_names
from hookwidget.record.notes import REFUSAL, Note
from hookwidget.record.run import Layer, LazyGraph, RunRecord, Step
from hookwidget.stats import TensorSummary


def assemble(rec: Records, *, targets, names=None, include=None, exclude=None, namespace=None, applied=(),
             norms=None, show_hook_nodes: bool = False, unrestorable=()) -> RunRecord:
    """The record of a run. `targets`/`names`: the modules asked for and the user's names of them; `namespace`:
    to name leaf tensors by the user's variables; `applied`: the interventions that were on; `norms`: capture=
    "norms"'s streamed result; `unrestorable`: what a rerun cannot put back (RunState.unrestorable), in words."""
    module_names, params = qualified_names(list(rec.modules), targets, names)
    keep = name_filter(include, exclude)
    layers = {}
    for module, mrec in rec.modules.items():
        name = module_names.get(module)
        if name is not None and mrec.calls and keep(name):
            layers[name] = Layer(name, module, mrec.calls)
    notes = [_named(n, layers) for n in rec.notes]
    no_factors = str(rec.no_factors or "")
    if not layers and (include or exclude):
        ran = [n for m, n in module_names.items() if rec.modules.get(m) is not None and rec.modules[m].calls]
        if ran:  # the filter, not the code, left no layer: say so (factor queries and notes would blame the code)
            given = tuple((k, (v,) if isinstance(v, str) else tuple(v)) for k, v in
                          (("include", include), ("exclude", exclude)) if v)
            matched_none = Note("filters_matched_none", {"given": given, "ran": tuple(ran)})
            notes.insert(0, matched_none)
            no_factors = no_factors or REFUSAL["filters_matched_none"](**matched_none.fields)
    leaf_name = _leaf_namer(rec, {id(p): n for n, p in params.items()}, namespace)
    steps, losses, param_grads, accumulates = _steps(rec, layers, leaf_name)
    if len([s for s in steps if s.kind == "backward"]) > 1:
        notes.append(Note("several_passes", {"steps": len(steps), "accumulate": accumulates}))
    leaves = {leaf_name(leaf): leaf for s in rec.steps for leaf in s.after}
    changed = [leaf_name(leaf) for leaf, same in rec.grads_at_end.items() if not same]
    if changed:
        notes.append(Note("grad_changed_after_backward", {"leaves": tuple(changed)}))
    factor_notes_at = len(notes)
    for iv in applied:
        if isinstance(iv.anchor, nn.Module) and iv.anchor not in rec.modules:
            notes.append(Note("intervention_not_fired", {"intervention": str(iv), "layers": (iv.target,)}))
    notes += [Note("rerun_unrestorable", {"what": n}) for n in unrestorable]
    calls = [(name, c.seq_start, c.seq_end) for name, layer in layers.items() for c in layer.calls]
    graph = LazyGraph(rec.walk, {p: n for n, p in params.items()}, calls, show_hook_nodes)
    return RunRecord(layers, steps, param_grads, params, losses, _user_hooks(layers, leaves), accumulates,
                     tuple(notes), factor_notes_at, no_factors, norms, rec.answers, graph, done=True)


def _named(note: Note, layers: dict) -> Note:
    """A capture note that names the modules it concerns (`modules`), with their layer names instead (`layers`):
    the record holds names, not live modules."""
    modules = note.fields.get("modules")
    if modules is None:
        return note
    names = {id(layer.module): n for n, layer in layers.items()}
    fields = {k: v for k, v in note.fields.items() if k != "modules"}
    return Note(note.id, {**fields, "layers": tuple(names[id(m)] for m in modules if id(m) in names)})


def _steps(rec: Records, layers: dict, leaf_name) -> tuple:
    """(steps, losses, param_grads, accumulates): each backward pass named, and .grad as the last one left it."""
    call_steps: dict = {}
    for name, layer in layers.items():
        for c in layer.calls:
            if c.step is not None:
                call_steps.setdefault(c.step, {}).setdefault(name, []).append(c.index)
    last: dict = {}  # id(leaf) -> (leaf, its .grad as the latest step left it)
    chained = True
    steps, all_losses = [], []
    for s in rec.steps:
        losses = [float(v) for v in s.roots]
        before = {}
        for leaf, b in s.before.items():
            key = id(leaf)
            before[leaf_name(leaf)] = last[key][1] if b is PREVIOUS and key in last else (
                None if b is PREVIOUS else b)
            if s.index and s.kind == "backward" and b is not PREVIOUS and key in last:
                chained = False  # .grad was reset (or changed) since the previous pass
        after = {}
        for leaf, g in s.after.items():
            after[leaf_name(leaf)] = g
            last[id(leaf)] = (leaf, g)
        steps.append(Step(s.index, s.kind, tuple(losses), {n: tuple(ix) for n, ix in
                                                          call_steps.get(s.index, {}).items()}, after, before))
        all_losses += losses
    param_grads = {leaf_name(leaf): g if not isinstance(g, TensorSummary) else None for leaf, g in last.values()}
    return steps, all_losses, param_grads, chained


def _leaf_namer(rec: Records, param_ids: dict, namespace) -> Callable:
    """Leaf tensor -> its name: parameter name (`param_ids`: by id), the user's variable name, or its
    graph node id. Keyed by id(): Tensor.__hash__ is a Python function, and a run of many steps asks
    for the same leaves again and again."""
    var_names = {id(v): k for k, v in (namespace or {}).items()
                 if isinstance(v, torch.Tensor) and not k.startswith("_")}
    walk = rec.walk
    node_ids = None
    cache: dict = {}

    def name(leaf) -> str:
        nonlocal node_ids
        key = id(leaf)
        found = cache.get(key)
        if found is None:
            found = param_ids.get(key) or var_names.get(key)
            if not found:
                if node_ids is None:
                    node_ids = {id(v): walk.ids[i] for i, v in enumerate(walk.variables) if v is not None}
                found = node_ids.get(key) or f"leaf{tuple(leaf.shape)}"
            cache[key] = found
        return found

    return name


def _user_hooks(layers: dict, leaves: dict) -> dict:
    """Hooks the user's code left attached: module hooks by layer name, tensor hooks on the leaves backward
    reached (parameters, inputs) by their names. They change what the trace shows, so the user should see them.
    hookwidget's own are not the user's: the trace's are gone by now, a watch's around it are left out."""
    kinds = {}
    for name, layer in layers.items():
        if has_module_hooks(layer.module):
            kinds[name] = tuple(module_hooks(layer.module).items())
    for name, leaf in leaves.items():
        tensor_hooks = backward_hooks(leaf)
        post = post_accumulate_hooks(leaf)
        if tensor_hooks or post:
            kinds[name] = kinds.get(name, ()) + (("tensor", tensor_hooks or {}), ("post_accumulate_grad", post or {}))
    out = {}
    for name, dicts in kinds.items():
        found = [f"{kind}: {getattr(h, '__qualname__', type(h).__name__)}" for kind, d in dicts for h in d.values()
                 if not (getattr(h, "__module__", None) or "").startswith("hookwidget.")]
        if found:
            out[name] = found
    return out
