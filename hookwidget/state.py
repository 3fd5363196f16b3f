"""What a rerun must put back: the state a cell changes, as it was before the cell ran.

A rerun is a what-if: the same code again, from the same starting point, with only the hooks
different, and afterwards the user's objects as the original run left them. `RunState` notes,
while the original run goes, the state it reaches: every RNG (torch, CUDA, numpy, `random`),
the buffers of every module called (BatchNorm statistics), parameters just before an
optimizer first steps them (and at once for modules named in `restore=`), the optimizers that
step (state and hyper-parameters), LR schedulers and GradScalers the code names, and the .grad
of every leaf backward reaches. A parameter changed in place some other way (a hand-written
update) is named in a note, not restored: copying every parameter up front would double the
memory of every trace. `snapshot()` takes the same things as they are now, `restore()` puts
a snapshot back.

The RNG states are read with each generator's public getter: np.random.get_state(legacy=False) and
random.getstate() copy 624 words each (~36 µs per trace together); reading them out of the objects' memory
would be cheaper, and would break on another interpreter, numpy or a free-threaded build.

Floor: above _torch (its only hookwidget import); imported by session.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator

import torch
from torch import nn

from hookwidget._torch.modules import own_buffers, own_parameters
from hookwidget._torch.tensors import versions

try:
    import numpy as np
except ImportError:  # no numpy: no numpy RNG to put back
    np = None


class RunState:
    def __init__(self, related=()):
        self.rng = _read_rngs()
        self.params: dict = {}  # parameter -> its value before the run changed it
        self.buffers: dict = {}  # buffer tensor -> (owner module, name, value)
        self.optimizers: dict = {}  # optimizer -> (state, hyper-parameters)
        self.others: dict = {}  # scheduler / GradScaler -> state_dict
        self.grads: dict = {}  # leaf -> .grad before its first backward (a copy, None, or a summary: not restorable)
        self.notes: list = []
        self._seen: set = set()
        self._versions: dict = {}  # id(parameter) -> (it, its version when first seen): Tensor.__hash__ is Python
        for obj in related:
            self.add(obj)

    # -- while the original run goes -----------------------------------------------------------
    def add(self, obj, eager: bool = False) -> None:
        """Take note of an object the code uses: module, optimizer, scheduler, scaler, iterator.
        `eager`: copy a module's parameters now (objects named in restore=)."""
        if isinstance(obj, nn.Module):
            self._note_modules(list(obj.modules()), eager)
        elif isinstance(obj, torch.optim.Optimizer):
            self.on_optimizer_step(obj)
        elif (_has_state(obj) or eager and callable(getattr(obj, "state_dict", None))
              and callable(getattr(obj, "load_state_dict", None))) and obj not in self.others:
            self.others[obj] = copy.deepcopy(obj.state_dict())
        elif isinstance(obj, Iterator) and not isinstance(obj, torch.Tensor):
            note = (f"a rerun cannot rewind the iterator {type(obj).__name__}: it draws its next items, "
                    "not the same ones")
            if note not in self.notes:
                self.notes.append(note)

    def on_call(self, module: nn.Module, eager: bool = False) -> None:
        """A module's first call: its buffers now; its parameters' versions (or copies, if eager)."""
        if module not in self._seen or eager:
            self._note_modules((module,), eager)

    def _note_modules(self, modules, eager: bool) -> None:
        """Buffers copied and parameters' versions read (one call for all) of the modules not seen before."""
        params = []
        for module in modules:
            if module in self._seen and not eager:
                continue
            self._seen.add(module)
            for name, b in own_buffers(module).items():
                if b is not None and b not in self.buffers:
                    self.buffers[b] = (module, name, b.detach().clone())
            params += own_parameters(module).values()
        seen = self._versions
        fresh = [p for p in params if p is not None and id(p) not in seen]
        seen.update((id(p), (p, v)) for p, v in zip(fresh, versions(fresh)))
        if eager:
            for p in params:
                if p is not None and p not in self.params:
                    self.params[p] = p.detach().clone()

    def on_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """Before an optimizer's first step in the run: its state, hyper-parameters and parameters."""
        if opt in self.optimizers:
            return
        self.optimizers[opt] = _optimizer_state(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                if p not in self.params:
                    self.params[p] = p.detach().clone()

    def on_grads(self, befores: dict) -> None:
        """.grad of each leaf as its first backward found it (from the steps' records)."""
        for leaf, g in befores.items():
            self.grads.setdefault(leaf, g)

    # -- a rerun -------------------------------------------------------------------------------
    def snapshot(self) -> RunState:
        """The same objects as they are now."""
        now = RunState.__new__(RunState)
        now.rng = _read_rngs()
        now.params = {p: p.detach().clone() for p in self.params}
        now.buffers = {b: (m, n, _current(m, n, b).detach().clone()) for b, (m, n, _) in self.buffers.items()}
        now.optimizers = {opt: _optimizer_state(opt) for opt in self.optimizers}
        now.others = {obj: copy.deepcopy(obj.state_dict()) for obj in self.others}
        now.grads = {leaf: None if leaf.grad is None else leaf.grad.detach().clone() for leaf in self.grads}
        now.notes = []
        return now

    def restore(self) -> None:
        with torch.no_grad():
            for p, value in self.params.items():
                p.copy_(value)
            for b, (m, name, value) in self.buffers.items():
                _current(m, name, b).copy_(value)
        for opt, (state, groups) in self.optimizers.items():
            opt.state.clear()
            opt.state.update({p: _clone(s) for p, s in state.items()})
            for group, saved in zip(opt.param_groups, groups):
                group.update(copy.deepcopy(saved))
        for obj, sd in self.others.items():
            obj.load_state_dict(copy.deepcopy(sd))
        for leaf, g in self.grads.items():
            if g is None or isinstance(g, torch.Tensor):
                leaf.grad = None if g is None else g.clone()
        _write_rngs(self.rng)

    def unrestorable(self) -> list:
        """What a rerun cannot put back, in words."""
        lost = sum(1 for g in self.grads.values() if g is not None and not isinstance(g, torch.Tensor))
        out = list(self.notes)
        kept = list(self._versions.values())
        now = versions([p for p, _ in kept])
        changed = sum(1 for (p, v), n in zip(kept, now) if n != v and p not in self.params)
        if changed:
            out.append(f"{changed} parameters were changed in place outside an optimizer step (a hand-written "
                       "update?): a rerun cannot put them back; pass restore=model to have them copied first")
        if lost:
            out.append(f"{lost} .grad tensors from before the run were kept as summaries only (memory budget): "
                       "a rerun starts from the .grad they have now")
        return out


def code_scope(fn, namespace=None, code=None) -> dict:
    """The objects the code reads by name (its own, its nested functions' and its closure's),
    from `namespace` (a notebook's variables) or else fn's globals and closure."""
    code = code if code is not None else getattr(fn, "__code__", None)
    if code is None:
        return {}
    base = namespace if namespace is not None else getattr(fn, "__globals__", {})  # not copied: a notebook's is large
    cells = {}
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    out = {}
    for name in dict.fromkeys(_names(code)):
        if name in cells:
            out[name] = cells[name]
        elif name in base:
            out[name] = base[name]
    return out


def related_objects(scope: dict) -> list:
    """Objects of the code's scope that a rerun must restore: modules, schedulers, scalers, iterators
    (optimizers are taken when they step)."""
    out, seen = [], set()
    for obj in scope.values():
        if id(obj) not in seen and _worth_restoring(obj):
            seen.add(id(obj))
            out.append(obj)
    return out


def _names(code) -> list:
    names = list(code.co_names) + list(code.co_freevars) + list(code.co_varnames)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names += _names(const)
    return names


def _worth_restoring(obj) -> bool:
    """Modules (their buffers), schedulers, scalers, iterators. Not optimizers: the global pre-step hook
    copies an optimizer's state and parameters only if it steps, which a copy up front would double."""
    return (isinstance(obj, nn.Module) or _has_state(obj)
            or isinstance(obj, Iterator) and not isinstance(obj, (torch.Tensor, str, bytes)))


def _has_state(obj) -> bool:
    """LR schedulers and GradScalers: objects with state_dict / load_state_dict that are not modules."""
    if isinstance(obj, type) or isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        return False
    return (isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or isinstance(obj, torch.amp.GradScaler)
            or type(obj).__name__ == "ReduceLROnPlateau")


def _current(module, name, b):
    """The buffer as the module holds it now (a module may have replaced the tensor)."""
    now = own_buffers(module).get(name)
    return now if now is not None and now.shape == b.shape else b


def _optimizer_state(opt) -> tuple:
    return ({p: _clone(s) for p, s in opt.state.items()},
            [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _clone(state: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


def _read_rngs() -> tuple:
    """Every RNG a cell may draw from: torch's CPU generator, CUDA's (where initialised), numpy's global, random's.
    numpy's as its dict (legacy=False, which set_state takes back): 30 µs, where the legacy tuple costs 43."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, None if np is None else np.random.get_state(legacy=False), random.getstate()


def _write_rngs(states: tuple) -> None:
    """Put back what _read_rngs read."""
    cpu, cuda, np_state, py_state = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if np_state is not None:
        np.random.set_state(np_state)
    random.setstate(py_state)
