"""Hand-written exact per-sample gradient norms for benchmarks/per_sample_norms.py's models: the floor.

What an expert writes by hand for these models (nn.Linear, nn.LayerNorm, nn.Embedding, an LM head tied to the token
embedding) with the same kernels hookwidget uses, and nothing else: a forward hook per layer keeps its input and
puts a tensor hook on its output; that hook adds the layer's (B,) squared norms as its δ arrives. Per Linear call
the cheaper of the ghost norm (Gram products, ∝ T²·(d_in + d_out)) and the materialised per-sample gradient
(∝ T·d_in·d_out) by flop count; one Gram of an input several Linear layers read (q, k, v); a LayerNorm's rows from
x̂ recomputed; an embedding's from its ids (Σ over equal ids of δ_t·δ_s); a tied head's norm from the two
contributions and their cross term Σ_{t,s} δ_head[t, id_s] (a_t · δ_emb,s). No generality, no checks, no record:
the cost of the norms themselves plus the least hooking that gets them, so `time / plain` is what any exact
per-layer method pays on these models, and hookwidget's figure minus it is what hookwidget adds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .variants import Step

_LAYERS = (nn.Linear, nn.LayerNorm, nn.Embedding)


def make_ghost_floor(model, x, y, loss):
    layers = [m for m in model.modules() if isinstance(m, _LAYERS)]
    owners = {}
    for m in layers:
        owners.setdefault(id(m.weight), []).append(m)
    tied = {m for ms in owners.values() if len(ms) == 2 for m in ms}  # the head and the token embedding
    if any(len(ms) > 2 for ms in owners.values()):
        raise ValueError("the floor knows one tied pair (an LM head and its token embedding)")

    def run():
        sq, grams, pending = [], {}, {}

        def linear(m, a, d):
            A, D = a.reshape(a.shape[0], -1, a.shape[-1]), d.reshape(d.shape[0], -1, d.shape[-1])
            T, i, o = A.shape[1], A.shape[2], D.shape[2]
            if T * (i + o) > i * o:  # materialised: cheaper than two T×T Grams
                g = torch.bmm(D.transpose(1, 2), A).flatten(1)
                sq.append(g.pow(2).sum(1) + (D.sum(1).pow(2).sum(1) if m.bias is not None else 0))
                return
            key = (a.data_ptr(), a.shape)
            gx = grams.get(key)
            if gx is None:
                gx = grams[key] = torch.bmm(A, A.transpose(1, 2))
            gd = torch.bmm(D, D.transpose(1, 2))
            part = ((gx + 1) if m.bias is not None else gx).flatten(1)
            if m in tied:  # the head's part; the cross term waits for the embedding's δ
                ids = pending["ids"]
                pending["head"] = (A, torch.gather(D, 2, ids.unsqueeze(1).expand(-1, T, -1)))
            sq.append(torch.linalg.vecdot(part, gd.flatten(1)))

        def layer_norm(m, a, d):
            xhat = F.layer_norm(a, m.normalized_shape, None, None, m.eps)
            B = a.shape[0]
            rows = (d * xhat).reshape(B, -1, m.weight.numel()).sum(1)
            sq.append(rows.pow(2).sum(1) + d.reshape(B, -1, m.weight.numel()).sum(1).pow(2).sum(1))

        def embedding(m, ids, d):
            same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(d.dtype)
            sq.append(torch.linalg.vecdot(same.flatten(1), torch.bmm(d, d.transpose(1, 2)).flatten(1)))
            if m in tied:
                A, head_at_ids = pending.pop("head")
                sq.append(2 * (head_at_ids * torch.bmm(A, d.transpose(1, 2))).sum((1, 2)))

        rules = {nn.Linear: linear, nn.LayerNorm: layer_norm, nn.Embedding: embedding}

        def forward_hook(m, inputs, out):
            a = inputs[0].detach()
            if isinstance(m, nn.Embedding) and m in tied:
                pending["ids"] = a
            out.register_hook(lambda d, m=m, a=a: rules[type(m)](m, a, d.detach()))

        handles = [m.register_forward_hook(forward_hook) for m in layers]
        try:
            model.zero_grad(set_to_none=True)
            loss(model(x), y).backward()
        finally:
            for h in handles:
                h.remove()
        return torch.stack(sq).sum(0).sqrt()

    return Step(run, model.parameters())
