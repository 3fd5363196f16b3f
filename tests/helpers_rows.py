"""References for per-sample rows: each sample's own gradient by autograd on that sample alone, and the
comparison the rule tests share (test_generic_rule.py, test_mha_rule.py)."""

from __future__ import annotations

import torch


def loop_reference(model, loss_of, n: int) -> dict:
    """name -> (n, *shape): each sample's own gradient, by autograd on that sample alone (loss_of(i))."""
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    rows = {k: [] for k, _ in named}
    for i in range(n):
        gs = torch.autograd.grad(loss_of(i), [p for _, p in named], allow_unused=True)
        for (k, p), g in zip(named, gs):
            rows[k].append(torch.zeros_like(p) if g is None else g)
    return {k: torch.stack(v) for k, v in rows.items()}


def close(x, ref, tol=1e-4):
    """x equals ref to tol, relative to ref's largest magnitude."""
    assert x.shape == ref.shape, (x.shape, ref.shape)
    err = float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
    assert err < tol, err
