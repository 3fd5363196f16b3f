"""One training step of each variant: plain forward+backward, hookwidget's three capture modes,
and the per-sample-norm tools it is compared with.

`VARIANTS[name](model, x, y, loss)` returns a `Step`: calling it runs one step and returns the (B,)
per-sample gradient norms where the variant computes them (else None); `reset()` frees what a step
leaves behind (.grad, grad_sample, ...) so memory is measured from the same state for every variant.
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import hookwidget as hw


class Unavailable(Exception):
    """The variant cannot run on this model here; the message says why (it becomes a table note)."""


class Step:
    partial = False  # the norms leave out some parameters (BackPACK's unsupported layers)

    def __init__(self, run, params, note: str = "", extra_reset=None):
        self.run, self.params, self.note, self.extra_reset = run, list(params), note, extra_reset

    def __call__(self):
        return self.run()

    def reset(self) -> None:
        for p in self.params:
            p.grad = None
        if self.extra_reset:
            self.extra_reset()


def make_plain(model, x, y, loss):
    def run():
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()

    return Step(run, model.parameters())


def make_hookwidget(capture: str):
    def make(model, x, y, loss):
        plain = make_plain(model, x, y, loss)

        def run():
            t = hw.trace(plain, capture=capture)
            return t.per_sample_grad_norms() if capture == "norms" else None

        return Step(run, model.parameters())

    return make


def make_hookwidget_full_norms(model, x, y, loss):
    """capture="full", then per_sample_grad_norms() from the kept factors (the generic rule's rows included)."""
    plain = make_plain(model, x, y, loss)

    def run():
        return hw.trace(plain, capture="full").per_sample_grad_norms()

    return Step(run, model.parameters())


def make_torch_func(model, x, y, loss):
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def one(p, xi, yi):
        return loss(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))

    def run():
        grads = per_sample(params, x, y)
        return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()

    return Step(run, [])


def make_opacus(model, x, y, loss, mode="hooks"):
    """mode "hooks": GradSampleModule's per-sample gradients; "ghost": its ghost clipping's norms (get_norm_sample)."""
    try:
        from opacus.grad_sample.utils import wrap_model
        from opacus.validators import ModuleValidator
    except Exception as e:  # noqa: BLE001 - reported in the table
        raise Unavailable(f"opacus does not import: {type(e).__name__}: {e}") from e
    m = copy.deepcopy(model)
    note = ""
    if any(isinstance(mod, nn.MultiheadAttention) for mod in m.modules()):
        fixed = ModuleValidator.fix(m)
        for name, mod in m.named_modules():  # fix() builds DPMultiheadAttention with fresh weights: load ours
            if isinstance(mod, nn.MultiheadAttention):
                fixed.get_submodule(name).load_state_dict(mod.state_dict())
        m, note = fixed, "on a ModuleValidator.fix copy (DPMultiheadAttention, our weights loaded)"
        with torch.no_grad():
            diff = float((fixed(x) - model(x)).abs().max())
        if diff > 1e-4:  # opacus 1.6: DPMultiheadAttention(batch_first=True) mixes up its head/batch layout
            note += (f"; that copy computes another function (outputs differ by up to {diff:.2g}: DPMultiheadAttention "
                     "with batch_first=True), so its norms are not compared")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = wrap_model(m, grad_sample_mode=mode, loss_reduction="sum")
    params = [p for p in wrapped.parameters() if p.requires_grad]

    def clear():
        for p in params:
            p.grad_sample = None

    def run():
        for p in params:
            p.grad, p.grad_sample = None, None
        loss(wrapped(x), y).backward()
        if mode == "ghost":
            return wrapped.get_norm_sample()
        return torch.stack([p.grad_sample.flatten(1).pow(2).sum(1) for p in params]).sum(0).sqrt()

    step = Step(run, params, note, clear)
    step.partial = "not compared" in note
    return step


def make_backpack(model, x, y, loss, extension="BatchGrad"):
    """extension "BatchGrad": per-sample gradients (grad_batch); "BatchL2Grad": their squared norms (batch_l2)."""
    try:
        from backpack import backpack, extend
        from backpack import extensions as ext
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"backpack does not import: {type(e).__name__}: {str(e).splitlines()[0][:100]}") from e
    m = extend(copy.deepcopy(model))
    params = [p for p in m.parameters() if p.requires_grad]
    attr = {"BatchGrad": "grad_batch", "BatchL2Grad": "batch_l2"}[extension]

    def clear():
        for p in params:
            if hasattr(p, attr):
                delattr(p, attr)

    def run():
        for p in params:
            p.grad = None
        clear()
        with backpack(getattr(ext, extension)()):
            loss(m(x), y).backward()
        got = [getattr(p, attr) for p in params if hasattr(p, attr) and getattr(p, attr).shape[0] == x.shape[0]]
        if not got:
            raise Unavailable(f"{extension} computed no per-sample gradient for this model")
        return torch.stack([g.flatten(1).pow(2).sum(1) if g.dim() > 1 else g for g in got]).sum(0).sqrt()

    step = Step(run, params, extra_reset=clear)
    step()  # which parameters does it skip?
    names = {id(p): n for n, p in m.named_parameters()}
    # no grad_batch, or one whose leading dimension is not the batch (a position table called on arange(T))
    missing = [names[id(p)] for p in params if not hasattr(p, attr) or getattr(p, attr).shape[0] != x.shape[0]]
    step.left_out = missing
    if missing:
        kinds = sorted({type(m.get_submodule(n.rpartition(".")[0])).__name__ for n in missing})
        step.note = (f"skips {len(missing)} of {len(params)} parameters ({', '.join(kinds)}): "
                     "time and norms over the rest only")
        step.partial = True
    return step


def make_torchlens(model, x, y, loss):
    try:
        import torchlens
        from torchlens.options import CaptureOptions
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"torchlens does not import: {type(e).__name__}: {e}") from e

    def run():
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = torchlens.trace(model, x, capture=CaptureOptions(layers_to_save="all", save_grads=True))
            out = tr[tr.output_layers[0]].tensor
            tr.log_backward(loss(out, y))

    return Step(run, model.parameters())


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
def without_fast_rules(make):
    """The same variant with the generic rule's fast rules (layers/attention.py) switched off: vmap of each
    module's vjp for every module without an exact (a, δ) rule, as before those rules existed."""

    def wrapped(model, x, y, loss):
        from hookwidget.layers import generic

        step = make(model, x, y, loss)
        inner = step.run

        def run():
            saved = list(generic.FAST_RULES)
            generic.FAST_RULES[:] = []
            try:
                return inner()
            finally:
                generic.FAST_RULES[:] = saved

        step.run = run
        return step

    return wrapped


# not in the default table of run.py: benchmarks/full_coverage.py measures them
EXTRA_VARIANTS = {
    "hookwidget full norms": make_hookwidget_full_norms,
    "hookwidget norms (vmap rule only)": without_fast_rules(make_hookwidget("norms")),
    "hookwidget full norms (vmap rule only)": without_fast_rules(make_hookwidget_full_norms),
}
ALL_VARIANTS = {**VARIANTS, **EXTRA_VARIANTS}
NORM_VARIANTS = ("hookwidget norms", "hookwidget full norms", "torch.func norms", "Opacus norms", "BackPACK norms")


def interleaved(steps: dict, repeats: int, clock=time.perf_counter) -> dict:
    """variant -> step times: one step of each variant in turn per repeat (each step reset after it), so that load
    and drift on a shared machine hit every variant alike."""
    times = {v: [] for v in steps}
    for _ in range(repeats):
        for v, step in steps.items():
            t0 = clock()
            step()
            times[v].append(clock() - t0)
            step.reset()
    return times
