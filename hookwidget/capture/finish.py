"""The end of a trace: what is done to the calls recorded before they become the trace's Records.

Calls that torch.utils.checkpoint reran are dropped, what the record holds by reference is made its own, and
what hooks could not see is named in the notes. Functions of the recorded modules (module -> ModuleRecord), for
tracer.Tracer when its block ends.
"""

from __future__ import annotations

import torch

from hookwidget.capture.generic import link_first_delta
from hookwidget.capture.tensors import own


def drop_recomputed_calls(modules: dict, notes: list) -> None:
    """torch.utils.checkpoint reruns forward during backward. Of a layer's calls, the ones that
    got a gradient are the real ones (the first call without reentrant checkpoint, the rerun with)."""
    names = []
    for rec in modules.values():
        if any(c.recomputed for c in rec.calls):
            kept = [c for c in rec.calls if c.delta is not None or c.delta_summary is not None]
            if kept and len(kept) < len(rec.calls):
                names.append(type(rec.module).__name__)
                rec.calls[:] = kept
                for i, c in enumerate(kept):
                    c.index = i
    if names:
        notes.append("torch.utils.checkpoint reran forward during backward for: " + ", ".join(names)
                     + "; only their calls that received a gradient are kept")


def own_what_is_kept(modules: dict, shares_inputs: bool, notes: list) -> None:
    """Make the record immune to what the user does next: an input kept by reference (it was
    guarded by autograd's version check while the trace ran, or kept unguarded by a strategy that
    `shares_inputs`) or a δ that shares memory with a live tensor (a .grad that autograd stole it for)
    is copied, unless the trace alone holds it (tensors.own: memory several calls keep is one copy at most)."""
    slots = []
    for rec in modules.values():
        for call in rec.calls:
            if call._a_version >= 0 and call.a is not None and call.a._version != call._a_version:
                call.a = None
                notes.append(f"{type(rec.module).__name__}: an input was modified in place after "
                             "the call; its activation was not kept")
            if call.a is not None and (call._a_version >= 0 or shares_inputs):
                slots.append((call, "a"))  # (else a copy, the trace's own already)
            call._a_version = -1
            if call.deltas is not None:
                link_first_delta(call)
            slots += [(call, k) for k in ("delta", "bdelta") if getattr(call, k) is not None]
            for parts in (call.deltas, call.rule_parts):
                if parts:
                    slots += [(parts, k) for k, v in (enumerate(parts) if isinstance(parts, list) else
                                                      parts.items()) if v is not None]
    own(slots)


def closing_notes(modules: dict, seen: dict, ddp: bool, *, stepped: bool, used_grad: bool, create_graph: bool,
                  passes_summed: int) -> tuple[list, str]:
    """The notes on the trace's backward passes and on what hooks could not see; and why factors are refused
    ("" where they are not). stepped: a backward ran; used_grad: torch.autograd.grad did; create_graph: a backward
    made a graph of its own; passes_summed: δs added up over backward passes through the same graph."""
    notes = []
    if not stepped:
        notes.append("no gradients captured: the code ran no backward (activations only)")
    if used_grad:
        notes.append("torch.autograd.grad was used: parameters reached only by it keep .grad None")
    notes += unseen_notes(modules, seen, ddp)
    no_factors = ""
    if create_graph:
        no_factors = ("create_graph=True (double backward): .grad then holds terms that (a, δ) do not, and δ "
                      "sums every backward pass; weight_grad and per-sample gradients are refused")
        notes.append(no_factors)
    elif passes_summed:
        notes.append("backward ran through the same graph more than once (retain_graph=True): δ and "
                     "weight_grad are summed over those passes, as .grad is")
    return notes, no_factors


def unseen_notes(modules: dict, seen: dict, ddp: bool) -> list:
    """What hooks could not see (seen: kind -> class names, from the tracer), and DDP's averaged .grad (ddp: a
    DistributedDataParallel module's record was made)."""
    scripted = sorted({type(r.module).__name__ for r in modules.values()
                       if isinstance(r.module, torch.jit.ScriptModule)})
    seen = {k: ", ".join(v) for k, v in seen.items()}
    text = {
        "compiled": f"torch.compile: hooks added after compilation are not honoured, so the layers inside "
                    f"{seen.get('compiled')} are not shown; trace the uncompiled model (model._orig_mod), "
                    "or call torch.compile after tracing",
        "func": f"torch.func transforms (vmap, grad, ...) ran {seen.get('func')}: calls inside a transform "
                "are not captured (hooks see wrapped tensors); trace a plain forward and backward instead",
    }
    notes = [text[k] for k in text if k in seen]
    if scripted:
        notes.append(f"ScriptModule ({', '.join(scripted)}): hooks do not fire inside TorchScript, so its "
                     "layers are not shown; trace the module before torch.jit.script")
    if ddp:
        notes.append("DistributedDataParallel: .grad is averaged over ranks after backward; a, δ, weight_grad "
                     "and per-sample gradients are this rank's own (its samples, before the all-reduce)")
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


def unchanged_grads(grad_state: dict) -> dict:
    """leaf -> whether its .grad is still what the last step left (the same tensor, unwritten since)."""
    return {leaf: state is None and leaf.grad is None or state is not None and state[0]() is leaf.grad
            and leaf.grad is not None and state[1] == leaf.grad._version
            for leaf, state in grad_state.items()}
