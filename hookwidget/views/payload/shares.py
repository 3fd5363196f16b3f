"""The explorer's shares panel: each sample's share of the step's gradient (a signed bar), and for a selected
sample its positions' shares with the text of its tokens (payload_schema.json, "shares_meta").

Why on request and not in the summary: the shares cost about what ghost norms cost, so a panel that is never
opened must not slow the explorer's first paint; they are computed when the panel is opened (or a sample is
clicked) and kept per trace and layer, so clicking samples reuses them.

Token ids are what `t.token_ids()` proves them to be (analysis/tokens.py): the input of the nn.Embedding the
`token_layer` option names, else of the only one whose input holds, in every step, one integer row of the strip's
T positions per sample along the proven samples dim; and as many rows as the attributed samples (so its position
t is the strip's position t). The text comes from the `decode` option
(a function or a tokenizer: user code), sent as text; the front-end never parses it as markup.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import nn

from hookwidget.options import decode_form
from hookwidget.views.payload.numbers import _num

MAX_BARS = 512  # samples in the bar; past it, the MAX_BARS largest by |share|, with a note
MAX_POSITIONS = 4096  # positions in a sample's strip; past it, the first ones, with a note
STATIC_CELLS = 65_536  # samples × positions the standalone page inlines (tokens included); past it, the bar only
STATIC_MACS = 2e9  # multiply-adds of the shares to_html computes (about a second on a CPU); past it, live-only
MAX_TOKEN_TEXT = 40  # characters of one token's text (a decode function may return anything)

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trace -> {layer: (Shares, step, note) or error}


def shares_view(trace, layer: str, sample: int | None, progress=None) -> tuple[dict, list[bytes]]:
    """Meta + buffers for the panel: the shares of layer `layer`'s gradient ("" = every parameter counted), and,
    where `sample` is given, that sample's positions and tokens. Raises ValueError (one line) where the trace
    cannot say (capture='summary', no backward, a layer without parameters). progress: as t.shares', called only
    where they are computed (not cached)."""
    if layer and layer not in trace.layers:
        raise KeyError(f"unknown layer {layer[:80]!r}: give a layer name (t.layers) or '' for the whole model")
    found, step, step_note = _shares(trace, layer, progress)
    n = int(found.samples.shape[0])
    if sample is not None and not 0 <= sample < n:
        raise ValueError(f"sample={sample}: this step has {n} samples (0..{n - 1})")
    out = _Vectors()
    values = found.samples.detach().to("cpu", torch.float64)
    index = torch.arange(n)
    notes = [step_note] if step_note else []
    if n > MAX_BARS:
        index = torch.topk(values.abs(), MAX_BARS).indices.sort().values
        notes.append(f"{MAX_BARS} of {n} samples shown: those with the largest |share|")
    meta = {"scope": layer, "step": step, "n": n, "sum": _num(float(values.sum())),
            "total_sq": _num(found.total_sq), "left_out": len(found.left_out),
            "samples": out.add(values[index], "float64"), "index": out.add(index, "int32"),
            "notes": notes + [str(x).splitlines()[0][:300] for x in found.notes[:8]], "sample": sample}
    if sample is not None:
        meta.update(_strip(trace, found, step, sample, out))
    return meta, out.buffers


def static_shares(trace) -> dict:
    """What the standalone page carries for its default view (the whole model): the bar, and each sample's strip
    where samples × positions <= STATIC_CELLS; else a note that the strips are live-only. Where the shares cost more
    than STATIC_MACS multiply-adds (GPT-2 124M on 4 × 128 tokens: ~6e10, 10-20 s on 2 CPU cores) the page says the
    panel is live-only instead of making to_html that much slower. Never raises: {"error": one line}."""
    macs = shares_macs(trace)
    if macs > STATIC_MACS:
        return {"error": f"the shares panel is live-only for this model (about {macs:.1e} multiply-adds to compute, "
                         "seconds): open the trace in a notebook, or t.sample_shares() in Python"}
    try:
        meta, buffers = shares_view(trace, "", None)
    except (ValueError, KeyError) as e:
        return {"error": str(e).splitlines()[0][:300]}
    found = _cache[trace][""][0]
    T = 0 if found.positions is None else int(found.positions.shape[1])
    n = meta["n"]
    if n * max(T, 1) > STATIC_CELLS or n > MAX_BARS:
        return {"bar": _encoded(meta, buffers), "strips": {},
                "note": f"{n} samples × {T} positions: a sample's positions are shown live only (in a notebook)"}
    strips = {str(b): _encoded(*shares_view(trace, "", b)) for b in range(n)}
    return {"bar": _encoded(meta, buffers), "strips": strips, "note": ""}


def shares_macs(trace) -> float:
    """About what the whole model's shares cost, at most: for every call of a layer that holds parameters of its
    own, its parameters' size times the rows of its input (one product with G per token, layers/shares.py's form;
    an embedding gathers one row a token). The Gram form (layers/share_gram.py) is taken only where it costs less
    (GPT-2 124M on 4 × 128 tokens: its blocks and its tied head). Read from shapes only."""
    total = 0.0
    for layer in trace.layers.values():
        own = sum(p.numel() for p in layer.module.parameters(recurse=False) if p.requires_grad)
        lookup = isinstance(layer.module, nn.Embedding)
        if lookup and own:
            own = layer.module.embedding_dim  # one row gathered per token, not the table
        if not own:
            continue
        for c in layer.calls:
            shape = c.a.shape if c.a is not None else getattr(c.a_summary, "shape", None)
            if shape:  # rows: every id of a lookup, every vector (last dim) of any other input
                total += own * (_numel(shape) if lookup else _numel(shape) // max(1, shape[-1]))
    return total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# -- the strip of one sample -----------------------------------------------------------------------------------
def _strip(trace, found, step, b: int, out) -> dict:
    unplaced = _num(float(found.unplaced[b]))
    if found.positions is None or found.positions.shape[1] == 1:  # (B, 1): a layer on (B, d), no sequence axis
        return {"positions": None, "unplaced": unplaced, "positions_note": "positions not attributed here: no layer "
                "counted is applied per position along a sequence axis (a sample's share is of its whole gradient)",
                "tokens": None, "ids": None, "tokens_note": None, "token_layer": None}
    row = found.positions[b].detach().to("cpu", torch.float64)
    T = int(row.shape[0])
    note = f"first {MAX_POSITIONS} of {T} positions shown" if T > MAX_POSITIONS else None
    row = row[:MAX_POSITIONS]
    ids, layer, tokens_note = token_ids(trace, step, int(found.samples.shape[0]), T)
    texts = None
    if ids is not None:
        sample_ids = [int(i) for i in ids[b, :MAX_POSITIONS].tolist()]
        texts, why = token_texts(_decoder(trace), sample_ids)
        tokens_note = why
    return {"positions": out.add(row, "float64"), "true_positions": T, "unplaced": unplaced,
            "positions_note": note, "ids": sample_ids if ids is not None else None, "tokens": texts,
            "tokens_note": tokens_note, "token_layer": layer}


def token_ids(trace, step: int | None, n: int, T: int) -> tuple[torch.Tensor | None, str | None, str | None]:
    """((n, T) token ids, the layer they are the input of, None), or (None, None, why not): trace.token_ids (its
    proof: the token_layer option's embedding, else the only one whose input is one integer row of T ids per sample
    along the dim capture proved to hold the samples), and n rows: the attributed samples, in the same order."""
    try:
        layer = trace.token_layer(step, positions=T)
        ids = trace.token_ids(step, positions=T)
    except ValueError as e:
        return None, None, str(e).splitlines()[0][:300]
    if ids.shape[0] != n:
        return None, None, f"token ids: {layer}'s inputs hold {ids.shape[0]} rows, not the {n} samples attributed"
    return ids, layer, None


def token_texts(decode, ids: list[int]) -> tuple[list[str] | None, str | None]:
    """(text of each id, None), or (None, why not): `decode` is the option's value (a tokenizer or a function,
    options.decode_form); its output is user data, cut to MAX_TOKEN_TEXT characters each and sent as text."""
    if decode is None:
        return None, "token ids shown: give a decode function or tokenizer for their text, hw.trace(..., decode=tok)"
    form = decode_form(decode)
    try:
        if form == "decode":
            texts = [decode.decode([i]) for i in ids]
        elif form == "tokens":
            texts = list(decode.convert_ids_to_tokens(ids))
        else:
            texts = _called(decode, ids)
    except Exception as e:  # user code: its failure is a note, never a broken panel
        first = (str(e).strip().splitlines() or [""])[0]
        return None, f"decode failed: {type(e).__name__}: {first[:200]}; token ids shown"
    if len(texts) != len(ids):
        return None, f"decode gave {len(texts)} texts for {len(ids)} ids; token ids shown"
    return [_text(x) for x in texts], None


def _called(fn, ids: list[int]) -> list:
    """A function of all ids (-> a list of texts) or of one id (-> its text)."""
    try:
        got = fn(ids)
    except Exception:
        got = None
    if isinstance(got, (list, tuple)) and len(got) == len(ids):
        return list(got)
    return [fn(i) for i in ids]


def _text(x) -> str:
    t = x if isinstance(x, str) else x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
    return t if len(t) <= MAX_TOKEN_TEXT else t[:MAX_TOKEN_TEXT - 1] + "…"


# -- helpers ---------------------------------------------------------------------------------------------------
def _shares(trace, layer: str, progress=None):
    """(Shares, the step they are of or None, a note or None), kept per trace and layer."""
    per_trace = _cache.setdefault(trace, {})
    if layer not in per_trace:
        step, note = _default_step(trace)
        try:
            per_trace[layer] = (trace.shares(layer or None, step=step, progress=progress), step, note)
        except (ValueError, KeyError, TypeError) as e:
            per_trace[layer] = e
    hit = per_trace[layer]
    if isinstance(hit, Exception):
        raise hit
    return hit


def _default_step(trace) -> tuple[int | None, str | None]:
    """None (every backward pass: they accumulate into one optimizer step, or there is one) or the last backward
    pass, with a note, where .grad was reset between them."""
    backward = [s.index for s in trace.steps if s.kind == "backward"]
    if len(backward) > 1 and not trace.accumulates:
        k = backward[-1]
        return k, (f"{len(backward)} backward passes reset .grad between them: shares of the last (step {k}); "
                   "t.shares(step=k) for another")
    return None, None


def _options(trace):
    return getattr(getattr(trace, "session", None), "options", None)


def _decoder(trace):
    return getattr(_options(trace), "decode", None)


def _encoded(meta: dict, buffers: list[bytes]) -> dict:
    import base64

    return {"meta": meta, "buffers": [base64.b64encode(b).decode("ascii") for b in buffers]}


class _Vectors:
    """Exact vectors (not pictures: every value is shown) as little-endian buffers, described by
    {dtype, shape, buffer}."""

    def __init__(self):
        self.buffers: list[bytes] = []

    def add(self, t: torch.Tensor, dtype: str) -> dict:
        arr = np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<f8" if dtype == "float64" else "<i4")
        self.buffers.append(arr.tobytes())
        return {"dtype": dtype, "shape": [int(arr.shape[0])], "buffer": len(self.buffers) - 1}
