"""The end of a trace: what is done to the calls recorded before they become the trace's Records.

Calls that torch.utils.checkpoint reran are dropped, what the record holds by reference is listed (and let go
where written in place since), and what hooks could not see is named in the notes. Functions of the recorded
modules (module -> ModuleRecord), for recording.Recording when it is settled and finished.
"""

from __future__ import annotations

import torch

from hookwidget._torch.tensors import version
from hookwidget.capture.generic import link_first_delta
from hookwidget.capture.tensors import slot_set
from hookwidget.record.notes import Note


def drop_recomputed_calls(modules: dict, notes: list) -> None:
    """torch.utils.checkpoint reruns forward during backward. Of a layer's calls, the ones that
    got a gradient are the real ones (the first call without reentrant checkpoint, the rerun with)."""
    names = []
    for rec in modules.values():
        if any(c.recomputed for c in rec.calls):
            kept = [c for c in rec.calls if c.delta is not None or c.delta_summary is not None]
            firsts = [c for c in rec.calls if not c.recomputed and all(c is not k for k in kept)]
            for first, rerun in zip(firsts, [c for c in kept if c.recomputed]):  # in order: where its samples are
                rerun.sample_dim, rerun.folded_from, rerun.stated = first.sample_dim, first.folded_from, first.stated
                rerun.in_shape = first.in_shape
            if kept and len(kept) < len(rec.calls):
                names.append(rec.module)
                rec.calls[:] = kept
                for i, c in enumerate(kept):
                    c.index = i
    if names:
        notes.append(Note("checkpoint_recomputed", {"module_types": tuple(type(m).__name__ for m in names),
                                                    "modules": tuple(names)}))


def held_by_reference(modules: dict, shares_inputs: bool, notes: list) -> tuple[list, list]:
    """The slots ((container, key), as tensors.own takes them) of what the record holds by reference: an input
    kept by reference (guarded by autograd's version check while the trace ran, or kept unguarded by a strategy
    that `shares_inputs`), δ and the generic rule's parts. tensors.own then copies those that share memory with a
    live tensor (a .grad that autograd stole a δ for), so that what the user does next cannot change the record.
    An input written in place during the run is let go here, with a note. Returns (slots, the module of each)."""
    slots, owners = [], []
    for rec in modules.values():
        start = len(slots)
        for call in rec.calls:
            if call._a_version >= 0 and call.a is not None and version(call.a) != call._a_version:
                call.a = None
                notes.append(Note("input_modified", {"module_type": type(rec.module).__name__,
                                                     "modules": (rec.module,)}))
            if call.a is not None and (call._a_version >= 0 or shares_inputs):
                slots.append((call, "a"))  # (else a copy, the trace's own already)
            call._a_version = -1
            if call.deltas is not None:
                link_first_delta(call)
            slots += [(call, k) for k in ("delta", "bdelta") if getattr(call, k) is not None]
            for parts in (call.deltas, call.rule_parts):
                if parts:
                    slots += [(parts, k) for k, v in (enumerate(parts) if isinstance(parts, list) else
                                                      parts.items()) if isinstance(v, torch.Tensor)]
        owners += [rec.module] * (len(slots) - start)
    return slots, owners


def drop_written(slots: list, owners: list) -> Note:
    """Slots whose tensor was written in place after the recording was settled, let go (owners: their modules);
    the note that says so."""
    for obj, key in slots:
        slot_set(obj, key, None)
    return Note("held_written", {"count": len(slots), "modules": tuple(dict.fromkeys(owners))})


def closing_notes(modules: dict, seen: dict, ddp: bool, *, stepped: bool, used_grad: bool, create_graph: bool,
                  passes_summed: int, unseen: bool = False) -> tuple[list, Note | None]:
    """The notes on the trace's backward passes and on what hooks could not see; and why factors are refused
    (None where they are not). stepped: a backward ran; used_grad: torch.autograd.grad did; create_graph: a backward
    made a graph of its own; passes_summed: δs added up over backward passes through the same graph; unseen: δ
    arrived while no backward pass seen was running (torch.autograd.grad bound to a name before the trace
    started calls torch's own function, not the stand-in of capture/backward.py). Such δs belong to no step, so
    (a, δ) cannot be matched to a pass's .grad: factors are refused."""
    notes = []
    unseen_note = Note("backward_unseen", {"stepped": stepped}) if unseen else None
    if unseen_note is not None:
        notes.append(unseen_note)
    elif not stepped:
        notes.append(Note("no_grads"))
    if used_grad:
        notes.append(Note("autograd_grad_used"))
    notes += unseen_notes(modules, seen, ddp)
    no_factors = None
    if create_graph:
        no_factors = Note("create_graph")
        notes.append(no_factors)
    elif unseen_note is not None:
        no_factors = unseen_note
    elif passes_summed:
        notes.append(Note("retain_graph"))
    return notes, no_factors


def unseen_notes(modules: dict, seen: dict, ddp: bool) -> list:
    """What hooks could not see (seen: kind -> class names, from the tracer), and DDP's averaged .grad (ddp: a
    DistributedDataParallel module's record was made)."""
    scripted = sorted({type(r.module).__name__ for r in modules.values()
                       if isinstance(r.module, torch.jit.ScriptModule)})
    seen = {k: ", ".join(v) for k, v in seen.items()}
    notes = [Note(i, {"where": seen[k]}) for k, i in (("compiled", "compiled"), ("compiled_eager", "compiled_eager"),
                                                     ("func", "torch_func")) if k in seen]
    if scripted:
        notes.append(Note("script_module", {"classes": tuple(scripted)}))
    if ddp:
        notes.append(Note("ddp"))
    return notes


def outermost_outputs(records) -> list:
    """grad_fn of the outputs of calls that no other recorded call encloses, in call order."""
    calls = sorted((c for r in records for c in r.calls), key=lambda c: (c.seq_start, -c.seq_end))
    out, end = [], -1
    for c in calls:
        if c.seq_start >= end:
            end = c.seq_end
            if c.out_node is not None:
                out.append(c.out_node)
    return out
