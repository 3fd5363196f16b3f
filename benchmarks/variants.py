"""One step of each variant: plain forward+backward, hookwidget's capture modes, and the
per-sample-norm tools it is compared with. Each `make_*` returns a step() that returns the
(B,) per-sample gradient norms where the variant computes them, else None."""

from __future__ import annotations

import copy

import torch
from torch.func import functional_call, grad, vmap

import hookwidget as hw


class Unavailable(Exception):
    """The variant cannot run on this model here; the message says why."""


def make_plain(model, x, y, loss):
    def step():
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()

    return step


def make_hookwidget(capture: str):
    def make(model, x, y, loss):
        plain = make_plain(model, x, y, loss)

        def step():
            t = hw.trace(plain, capture=capture)
            return t.per_sample_grad_norms() if capture == "norms" else None

        return step

    return make


def make_torch_func(model, x, y, loss):
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def one(p, xi, yi):
        return loss(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))

    def step():
        grads = per_sample(params, x, y)
        return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()

    return step


def make_opacus(model, x, y, loss):
    try:
        from opacus.grad_sample.utils import wrap_model
    except Exception as e:  # noqa: BLE001 - reported in the table
        raise Unavailable(f"opacus does not import: {e}") from e
    wrapped = wrap_model(copy.deepcopy(model), grad_sample_mode="hooks", loss_reduction="sum")
    params = [p for p in wrapped.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad, p.grad_sample = None, None
        loss(wrapped(x), y).backward()
        return torch.stack([p.grad_sample.flatten(1).pow(2).sum(1) for p in params]).sum(0).sqrt()

    return step


def make_backpack(model, x, y, loss):
    try:
        from backpack import backpack, extend
        from backpack.extensions import BatchGrad
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"backpack does not import: {type(e).__name__}: {str(e).splitlines()[0][:80]}") from e
    m = extend(copy.deepcopy(model))
    lossfn = extend(torch.nn.CrossEntropyLoss(reduction="sum") if y.dtype == torch.long and y.dim() == 1
                    else torch.nn.MSELoss(reduction="sum"))
    if y.dim() != 1 or y.dtype != torch.long:
        if y.dtype == torch.long:
            raise Unavailable("BackPACK's losses take (N, C) logits: sequence cross-entropy is not supported")
    params = [p for p in m.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
            if hasattr(p, "grad_batch"):
                del p.grad_batch
        with backpack(BatchGrad()):
            lossfn(m(x), y).backward()
        missing = [p for p in params if not hasattr(p, "grad_batch")]
        if missing:
            raise Unavailable(f"BatchGrad skipped {len(missing)} of {len(params)} parameters "
                              "(unsupported modules, e.g. LayerNorm or custom forward code)")
        return torch.stack([p.grad_batch.flatten(1).pow(2).sum(1) for p in params]).sum(0).sqrt()

    return step


def make_torchlens(model, x, y, loss):
    try:
        import torchlens
        from torchlens.options import CaptureOptions
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"torchlens does not import: {e}") from e

    def step():
        model.zero_grad(set_to_none=True)
        tr = torchlens.trace(model, x, capture=CaptureOptions(layers_to_save="all", save_grads=True))
        out = tr.output if hasattr(tr, "output") else None
        if not isinstance(out, torch.Tensor):
            raise Unavailable("torchlens.trace gave no output tensor to run backward from")
        loss(out, y).backward()

    return step


VARIANTS = {
    "plain": make_plain,
    "hookwidget summary": make_hookwidget("summary"),
    "hookwidget full": make_hookwidget("full"),
    "hookwidget norms": make_hookwidget("norms"),
    "torch.func norms": make_torch_func,
    "Opacus norms": make_opacus,
    "BackPACK norms": make_backpack,
    "TorchLens +grads": make_torchlens,
}
