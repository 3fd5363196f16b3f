"""Graph build time: the iterative walk of grad_fn nodes plus the networkx graph, without backward."""

from __future__ import annotations

import time

import torch

from hookwidget.record import graph

from . import models


def graph_build_times(device: str) -> dict:
    torch.manual_seed(0)
    gpt = models.GPT2(vocab=1000, layers=12).to(device)
    out = gpt(torch.randint(0, 1000, (1, 16), device=device)).sum()
    t_tr, n_tr = _build(out.grad_fn)
    x = torch.randn(2, requires_grad=True, device=device)
    h = x
    for _ in range(40_000):
        h = -h  # one node per op, one input each
    t_chain, n_chain = _build(h.sum().grad_fn)
    return {"transformer": t_tr, "transformer_nodes": n_tr, "chain": t_chain, "chain_nodes": n_chain}


def _build(root) -> tuple[float, int]:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        walk = graph.GraphWalk()
        walk.extend([root])
        g = graph.build(walk, {}, [])
        best = min(best, time.perf_counter() - t0)
    return best, g.number_of_nodes()
