"""The notes catalogue: what a trace could not show or keep, as data (`Note(id, fields)`), and its one text.

Code decides with a note's id and fields (the layers it concerns, counts, names); only `render` makes prose
of it, so no code ever parses note text back, and a sentence can change without changing a decision. Every
id and its template live in TEXT below, in one place.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable

from hookwidget.options import suggest


@dataclass(frozen=True)
class Note:
    """One note: a stable `id` from TEXT and the `fields` its text is made of (`layers`: the layer names it
    concerns, where it concerns some; capture's notes name them as `modules`, which record/assemble.py names)."""

    id: str
    fields: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.id not in TEXT:
            raise KeyError(f"no note {self.id!r} in the catalogue (record/notes.py TEXT)")

    @property
    def layers(self) -> tuple:
        return tuple(self.fields.get("layers", ()))

    def __str__(self) -> str:
        return render(self)


def render(note: Note) -> str:
    """The note's text, one line."""
    return _fill(TEXT[note.id], note.fields)


def _few(names, k: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def _pairs(pairs, sep: str) -> str:
    return sep.join(f"{n} ({why})" for n, why in pairs)


def _filters(given) -> str:
    """include= / exclude= as given, and what they did to the modules that ran."""
    keys = {k for k, _ in given}
    did = ("left no module that ran" if len(keys) > 1 else
           "matched no module that ran" if "include" in keys else "excluded every module that ran")
    return " and ".join(f"{k}={v[0]!r}" if len(v) == 1 else f"{k}={list(v)!r}" for k, v in given) + " " + did


def _matched_none(given, ran, **_) -> str:
    pattern = next((v[0] for k, v in given if k == "include"), "")
    plain = pattern.replace("*", "").replace("?", "").strip(".")  # a glob's words, for the close matches
    close = difflib.get_close_matches(plain, ran, n=1, cutoff=0.6)
    example = close[0] if close else next((n for n in ran if "." in n), ran[-1])
    return (f"{_filters(given)}, so no layer is kept: {suggest(plain, ran, 'modules that ran')}"
            f"; include= takes globs on these names, e.g. include='{example}*'")


def _budget(budget_mb, dropped, dropped_grads, **_) -> str:
    parts = [f"{dropped} activations or gradients" if dropped else "",
             f"{dropped_grads} .grad copies of earlier steps" if dropped_grads else ""]
    return (f"memory budget {budget_mb:g} MB reached: " + ", ".join(p for p in parts if p)
            + " kept as summaries only (shape, norm, min/max/mean, NaN/Inf); raise budget_mb to keep them")


# id -> its text: a template that the note's fields fill (str.format: each field by name, the others ignored), or,
# where the text chooses between wordings or lists things, a function of the fields (by keyword, `**_` the rest)
TEXT: dict[str, str | Callable[..., str]] = {
    # -- capture (capture/tracer.py) -----------------------------------------------------------
    "graph_large": ("the graph has {nodes} nodes: gradient norms are shown for layer outputs and parameters only; "
                    "trace with node_grads=True for every node"),
    "budget_reached": _budget,
    "no_grads": "no gradients captured: the code ran no backward (activations only)",
    "backward_unseen": lambda stepped, **_: (
        ("besides the passes in t.steps, a" if stepped else "a") + " backward pass ran that hookwidget did not see "
        "start (`from torch.autograd import grad` before the trace?): δ is kept, but that pass is no step (no loss, "
        "no .grad copy) and weight_grad / per-sample gradients are refused; call torch.autograd.grad(...)"),
    "autograd_grad_used": "torch.autograd.grad was used: parameters reached only by it keep .grad None",
    "compiled": ("torch.compile: this torch cannot run compiled code eagerly (torch.compiler.set_stance needs "
                 "torch >= 2.6), and hooks do not fire inside it, so the layers of {where} are not shown; call the "
                 "uncompiled model in the traced code (model(x), not cmodel(x) where cmodel = torch.compile(model)), "
                 "or upgrade torch"),
    "compiled_eager": ("torch.compile: {where} ran eagerly while traced (torch.compiler.set_stance('force_eager')), "
                       "so its layers show; it runs compiled again after the trace"),
    "torch_func": ("torch.func transforms (vmap, grad, ...) ran {where}: calls inside a transform are not captured "
                   "(hooks see wrapped tensors); trace a plain forward and backward instead"),
    "script_module": lambda classes, **_: (
        f"ScriptModule ({', '.join(classes)}): hooks do not fire inside TorchScript, so its layers are not shown; "
        "trace the module before torch.jit.script"),
    "ddp": ("DistributedDataParallel: .grad is averaged over ranks after backward; a, δ, weight_grad and per-sample "
            "gradients are this rank's own (its samples, before the all-reduce)"),
    "create_graph": ("create_graph=True (double backward): .grad then holds terms that (a, δ) do not, and δ sums every "
                     "backward pass; weight_grad and per-sample gradients are refused"),
    "retain_graph": ("backward ran through the same graph more than once (retain_graph=True): δ and weight_grad are "
                     "summed over those passes, as .grad is"),
    "input_modified": "{module_type}: an input was modified in place after the call; its activation was not kept",
    "held_written": lambda count, layers=(), **_: (
        f"{count} tensors this step held by reference (an input, a δ) were written in place before the step was "
        f"kept (a .grad clipped or zeroed in place, a batch buffer reused): left out, in {_few(layers) or 'no layer'}"),
    "batch_dim_contradicted": lambda layers, proven, declared, batch_dim, **_: (
        f"{_few(layers) or 'a module'} declares its batch in dim {declared} (batch_first={declared == 0}), but the "
        f"samples of the model's input (its batch dim {0 if batch_dim is None else batch_dim}"
        f"{', the default' if batch_dim is None else ''}) reach it in dim {proven}: per-sample gradients are "
        "refused; declare where the model's input holds them, e.g. hw.trace(..., batch_dim=N)"),
    "checkpoint_recomputed": lambda module_types, **_: (
        "torch.utils.checkpoint reran forward during backward for: " + ", ".join(module_types)
        + "; only their calls that received a gradient are kept"),
    # -- the record (record/assemble.py) -------------------------------------------------------
    "filters_matched_none": _matched_none,
    "several_passes": lambda steps, accumulate, **_: (
        f"{steps} backward passes (t.steps): " + (
            "they accumulate into .grad, so factor queries sum them" if accumulate else
            ".grad was reset between them, so factor queries take step=k") + "; the graph shows the last one"),
    "grad_changed_after_backward": lambda leaves, **_: (
        f"the code changed .grad after its last backward pass ({_few(leaves)}; e.g. opt.zero_grad() or "
        "clip_grad_norm_): param_grads show .grad as backward left it"),
    "intervention_not_fired": ("intervention {intervention} did not fire: its module was not called (was the model "
                               "created anew inside the cell?)"),
    "rerun_unrestorable": "rerun: {what}",
    # -- coverage (analysis/coverage.py) -------------------------------------------------------
    "no_factor_rule": lambda reasons, **_: (
        "no (a, δ) factor rule, so no weight_grad / per-sample gradients for: " + _pairs(reasons, ", ")),
    "params_left_out": lambda reasons, lost, total, **_: (
        f"per-sample gradient norms leave out {len(reasons)} parameters ({lost:,} of {total:,} gradient elements): "
        + _pairs(reasons, "; ")),
}

# id -> the short line that starts a refusal a note explains, as in TEXT (`count`: the parameters it leaves out);
# `refusal`
REFUSAL: dict[str, str | Callable[..., str]] = {
    "compiled": "{count} parameters of a compiled model that ran compiled: call the uncompiled model in the code",
    "script_module": "{count} parameters inside TorchScript: trace the module before torch.jit.script",
    "torch_func": "{count} parameters reached inside torch.func transforms: trace a plain forward and backward",
    "no_grads": "the code ran no backward: call loss.backward() inside the trace",
    "batch_dim_contradicted": lambda layers, proven, declared, batch_dim, **_: (
        f"the model input's batch dim{'' if batch_dim is None else f' {batch_dim}'} puts the samples in dim {proven} "
        f"of {_few(layers) or 'a module'}, whose batch_first says dim {declared}: declare it, e.g. "
        "hw.trace(..., batch_dim=N)"),
    "filters_matched_none": lambda given, **_: _filters(given),
    "backward_unseen": ("a backward pass ran unseen (torch.autograd.grad bound before the trace?): call "
                        "torch.autograd.grad(...) in the code"),
}


def _fill(text: str | Callable[..., str], fields: dict, **more) -> str:
    """A TEXT or REFUSAL entry made from these fields (and `more`)."""
    return text(**fields, **more) if callable(text) else text.format(**fields, **more)


def refusal(notes, what: str, otherwise: str, limit: int = 240) -> str:
    """One line for a query refused for what the notes say (its details stay in t.notes): the first note that
    has a REFUSAL line, counting the parameters left out, else the first note's text cut to `limit`, else
    `otherwise`."""
    notes = list(notes)
    left = next((len(n.fields["reasons"]) for n in notes if n.id == "params_left_out"), None)
    count = "all" if left is None else f"{left:,}"
    for n in notes:
        if n.id in REFUSAL:
            return f"{what}: {_fill(REFUSAL[n.id], n.fields, count=count)} (t.notes has the details)"
    if not notes:
        return f"{what}: {otherwise}"
    text = render(notes[0])
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    more = f" and {len(notes) - 1} more note(s)" if len(notes) > 1 else ""
    return f"{what}: {text} (t.notes{more})"
