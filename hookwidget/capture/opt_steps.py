"""One row per optimizer step where an optimizer steps after several backward passes (gradient accumulation) or
runs backward inside `step(closure)` (Lightning, L-BFGS, SAM): the micro-batches' rows added up exactly.

How the boundary is learnt: from the global optimizer step hooks (torch.optim's public
register_optimizer_step_pre_hook / register_optimizer_step_post_hook, which the tracer holds anyway for the update
ratio). They see every torch.optim optimizer, wrapped ones included (accelerate's and Lightning's wrappers call the
inner optimizer's step), need no argument from the user, and cost nothing at backward time. A backward pass that
begins between an optimizer's pre- and post-hook runs inside its step(closure); an optimizer step whose pre-hook
comes after two or more backward passes accumulated them. Either turns the watch's steps into optimizer steps for
the rest of the run (step_stats.StatsKeep.grouped); the callbacks say so before the first pass (they know a trainer
steps an optimizer), where a plain loop's first accumulated step is only seen at its pre-hook.

What a merged row holds (all on device, no host sync):
- delta_*, a_* over all its backward passes: ‖δ‖² and Σa² summed (then the root), max|δ| the maximum, the zeros and
  entries of a summed, NaN/Inf counts summed; a layer no pass reached stays NaN;
- grad_norm, grad_nan, grad_inf and the global gradient norm of .grad as the optimizer's post-hook finds it: the
  gradient the step used (accumulated, clipped, unscaled by a GradScaler, the last closure call's);
- weight_norm of the first pass (W before the step), update_ratio and lr of the step (step_stats.after_update);
- the loss as the trainer reports it: the sum of the passes' losses (each micro-batch's loss is the trainer's loss
  divided by the accumulation steps); of the passes inside one step(closure) only the first counts (L-BFGS and SAM
  call the closure again on the same batch, and return the first loss);
- per_sample: the largest per-sample norm over the passes, its index in its own micro-batch; the samples' shares
  those of its one pass, or NaN (not known) for two passes or more: a pass's are of its own gradient, and the
  optimizer step's G is known only after the last pass, when the earlier passes' a and δ are gone (hw.trace of
  the whole optimizer step has them: t.shares()).
"""

from __future__ import annotations

import torch

from hookwidget.capture.stat_rows import F64, NAN, S

_D2, _ASQ, _ZEROS, _ENTRIES = range(4)


def _total(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over the passes (dim 0) where `mask`; NaN where no pass has it."""
    return torch.where(mask.any(0), torch.where(mask, x, 0.0).sum(0), NAN)


def merge(group: list, grads, total):
    """The optimizer step's (row, step_row, order, a_order, has_loss, per-sample maxima) from its recorded passes
    `group` (step_stats.Step, in order; each with .row, .step_row, .sums, .scale, .inside, .order, .a_order,
    .has_loss, .ps), and `grads`, `total` (stat_rows.Rows.grads) or None: then the last pass's .grad columns."""
    rows = torch.stack([s.row for s in group])  # (passes, layers, stats), unscaled already
    sums = torch.stack([torch.stack(s.sums) for s in group])  # (passes, 4, layers), as backward saw them
    for p, s in enumerate(group):
        if s.scale is not None:  # ‖δ‖² of loss · scale: divided by scale² (a power of two: exact)
            sums[p, _D2] /= s.scale.to(sums.device, F64).square()
    d_seen, a_seen = ~rows[..., S["delta_nan"]].isnan(), ~rows[..., S["a_nonfinite"]].isnan()
    row = rows[-1].clone()
    row[:, S["delta_norm"]] = _total(sums[:, _D2], d_seen).sqrt()
    dmax = torch.where(d_seen, rows[..., S["delta_max"]], -torch.inf).amax(0)
    row[:, S["delta_max"]] = torch.where(d_seen.any(0), dmax, NAN)
    for c in ("delta_nan", "delta_inf"):
        row[:, S[c]] = _total(rows[..., S[c]], d_seen)
    entries = _total(sums[:, _ENTRIES], a_seen)
    row[:, S["a_rms"]] = (_total(sums[:, _ASQ], a_seen) / entries).sqrt()
    row[:, S["a_zero_frac"]] = _total(sums[:, _ZEROS], a_seen) / entries
    row[:, S["a_nonfinite"]] = _total(rows[..., S["a_nonfinite"]], a_seen)
    row[:, S["weight_norm"]] = rows[0, :, S["weight_norm"]]
    row[:, S["update_ratio"]] = row[:, S["lr"]] = NAN  # the optimizer step's (step_stats.after_update)
    if grads is not None:
        row[:, S["grad_norm"]], row[:, S["grad_nan"]], row[:, S["grad_inf"]] = grads.unbind(1)
    else:
        total = group[-1].step_row[1]
    counted = [s for i, s in enumerate(group) if not s.inside or i == 0 or not group[i - 1].inside]
    has_loss = all(s.has_loss for s in counted)
    loss = torch.stack([s.step_row[0] for s in counted]).sum() if has_loss else torch.full((), NAN, dtype=F64,
                                                                                               device=row.device)
    order, a_order = {}, {}
    for s in group:
        for li in sorted(s.order, key=s.order.get):
            order.setdefault(li, len(order))
        for li in sorted(s.a_order, key=s.a_order.get):  # forward order within a pass, passes one after another
            a_order.setdefault(li, len(a_order))
    ps = None
    if group[0].ps is not None:
        maxima = torch.stack([s.ps for s in group])
        ps = maxima.index_select(0, maxima[:, 0].nan_to_num(-1.0).argmax().view(1)).view(-1)  # no sync: no .item()
        if len(group) > 1:  # shares: each pass's are of its own gradient, not of the optimizer step's (left out)
            ps[2:] = NAN
    return row, torch.stack([loss, total.to(row.device, F64)]), order, a_order, has_loss, ps
