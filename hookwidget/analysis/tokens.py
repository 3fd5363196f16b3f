"""Which input of the traced model holds the token ids, proved from what capture recorded (Trace.token_ids).

Why a proof and not a guess: the explorer's token strip puts a token's text on each position of a sample's shares,
so the ids must be one row per sample, in the samples' order, along the dim capture proved to hold the samples (a
matching size is no proof: with T == B a shape check alone reads positions as samples). The ids are the input of an
nn.Embedding: the one the `token_layer` option names, else the only one whose input is, in every step asked for,
one integer row per sample (of `positions` positions where the caller knows how many it needs).

Floor: analysis. Reads the record (layers' calls and their proven sample dims) and the options.
"""

from __future__ import annotations

import torch
from torch import nn

from hookwidget.analysis.facts import step_indices
from hookwidget.options import shown


def token_layer(trace, step: int | None, positions: int | None = None) -> str:
    """The layer whose input is the token ids (the `token_layer` option's, else the only nn.Embedding that takes
    one integer row per sample in every step asked for); else ValueError, one line naming the fix."""
    return _found(trace, step, positions)[0]


def token_ids(trace, step: int | None, positions: int | None = None) -> torch.Tensor:
    """(N, T) the token ids of the samples of every step asked for, in order (as the shares order them), on the
    CPU: the input of token_layer's layer, each sample's row along the dim capture proved to hold the samples."""
    return _found(trace, step, positions)[1]


def check_positions(positions) -> int | None:
    if positions is not None and (isinstance(positions, bool) or not isinstance(positions, int) or positions < 1):
        raise ValueError(f"positions={shown(positions, 30)}: pass the number of positions a row of ids must have "
                         "(an int >= 1, e.g. positions=128), or None for any")
    return positions


def _found(trace, step, positions) -> tuple[str, torch.Tensor]:
    check_positions(positions)
    steps = step_indices(trace, step)
    options = getattr(getattr(trace, "session", None), "options", None)
    named = getattr(options, "token_layer", None)
    if named is not None:
        if named not in trace.layers:
            embeddings = [n for n, layer in trace.layers.items() if isinstance(layer.module, nn.Embedding)]
            raise ValueError(f"token_layer={named[:80]!r} is not a layer of this trace: name the nn.Embedding whose "
                             f"input is the token ids ({', '.join(embeddings[:5]) or 'it has none'})")
        ids = _rows(trace, named, steps, positions)
        if isinstance(ids, str):
            raise ValueError(f"token_layer {named!r}: {ids}")
        return named, ids
    found, why_not = {}, {}
    for name, layer in trace.layers.items():
        if isinstance(layer.module, nn.Embedding):
            ids = _rows(trace, name, steps, positions)
            if isinstance(ids, str):
                why_not[name] = ids
            else:
                found[name] = ids
    rows = f"one row of {positions} ids" if positions else "one row of ids"
    if not found:
        said = "; ".join(f"{n}: {w}" for n, w in list(why_not.items())[:3])
        raise ValueError(f"token ids: no nn.Embedding's input is {rows} per sample here{f' ({said})' if said else ''}"
                         "; name the layer whose input they are: hw.trace(..., token_layer='wte')")
    if len(found) > 1:
        raise ValueError(f"token ids: {', '.join(found)} all take {rows} per sample; name the token one: "
                         f"hw.trace(..., token_layer={next(iter(found))!r})")
    return next(iter(found.items()))


def _rows(trace, name: str, steps: list, positions: int | None) -> torch.Tensor | str:
    """Layer `name`'s input as one row of ids per sample over the steps, or why it is not."""
    rows = []
    for k in steps:
        calls = [c for c in trace.layers[name].calls if c.step == k]
        if len(calls) != 1:
            return f"called {len(calls)} times in step {k} (one call a step holds the ids)"
        a, dim = calls[0].a, calls[0].sample_dim  # the dim capture proved to hold the samples (record/calls.py)
        if a is None:
            return "its input was not kept (capture='summary' or the memory budget): raise budget_mb"
        if dim is None or a.dim() != 2:
            return f"its input {tuple(a.shape)} has no proven samples dim (a matching size is no proof)"
        a = a if dim == 0 else a.T  # time-major (T, B) ids: each sample's row
        if a.is_floating_point() or a.is_complex() or a.dtype == torch.bool:
            return f"its input {tuple(a.shape)} is not integer ids ({a.dtype})"
        if positions is not None and a.shape[1] != positions:
            return f"its input {tuple(a.shape)} is not one row of {positions} ids per sample"
        rows.append(a)
    if not rows:
        return "it was not called in the steps asked for"
    if len({r.shape[1] for r in rows}) > 1:
        return "its rows have different numbers of positions in the steps asked for: pass step=k"
    return torch.cat(rows).detach().cpu()
