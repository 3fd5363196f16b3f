"""One spec per layer type: its rule, when the rule is exact, whether the layer keeps its input.

Like Opacus' register_grad_sampler, but a rule is only ever applied where it is exact: a subclass
that overrides the layer's forward (weight standardisation, its own padding, another layout) gets
no exact rule. Where no exact rule applies, lookup falls back to GENERIC, the torch.func rule of
generic.py, for every module with trainable parameters (its result is checked before it is used);
exact_reason says why no exact rule applied.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from hookwidget._torch.modules import own_parameters
from hookwidget.layers import generic


@dataclass(frozen=True)
class LayerSpec:
    """rule(module, a, delta, state=None) -> list[Factor]: the token factors of one call.
    refuse(module) -> str | None: why the rule is not exact for this instance (e.g. Embedding(sparse=True)).
    keeps_input(module): whether autograd saves the layer's input for its weight gradient, so capture may
    keep `a` by reference (autograd's version check guards it) instead of copying it.
    forward_methods: methods a subclass must not override for the rule to stay exact.
    per_sample(module, state) -> "exact" | "contribution": what a per-sample row is.
    state(module): what the rule needs from forward time besides (a, δ) (BatchNorm: train/eval, statistics).
    norm_sq(factors, x_gram) -> (B,) | None: a cheaper exact norm of all the layer's parameters together.
    tokens: every dimension of its input but the feature ones is a token (Linear, Embedding, LayerNorm), so
    samples folded into the leading dimension ((B, T, d) reshaped to (B·T, d)) can be unfolded exactly."""

    name: str
    rule: Callable
    refuse: Callable = lambda m: None
    keeps_input: Callable = lambda m: True
    forward_methods: tuple = ("forward",)
    params: tuple = ("weight", "bias")
    per_sample: Callable = lambda m, state=None: "exact"
    state: Callable | None = None
    norm_sq: Callable | None = None
    types: tuple = field(default=())
    tokens: bool = False
    generic: bool = False  # the torch.func fallback: needs the call's kept inputs, outputs' δ and parameters


SPECS: dict = {}  # type, or "module.ClassName" for layers of packages not imported here -> LayerSpec

# layer types with parameters that no rule covers, and why (said after "no factor rule for <type>")
NO_RULE = {
    nn.SyncBatchNorm: "its statistics span every process, which one process's (a, δ) do not hold",
}


def register(*types, by_code: bool = False, **spec):
    """Decorator: `rule(module, a, delta, state=None) -> list[Factor]` becomes the rule for these types
    (classes, or "package.module.ClassName" strings matched without importing the package). by_code=True: the
    types are references, classes that define only a forward and the methods it calls; the rule also serves any
    class that defines them with the same code (see same_code) over the same bases, wherever it is defined."""

    def deco(fn):
        name = "/".join(t if isinstance(t, str) else t.__name__ for t in types)
        if by_code:  # a subclass that overrides any of the reference's methods changes what it computes
            spec.setdefault("forward_methods", tuple(sorted({n for t in types for n in _methods(t)})))
        s = LayerSpec(name, fn, types=types, **spec)
        for t in types:
            SPECS[t] = s
            if by_code:
                _BY_CODE[same_code(t.forward)] = t
        _BY_TYPE.clear()
        return fn

    return deco


# A family of packages' classes that copy one forward word for word (transformers' scaled word embeddings: 24
# classes of BART, Gemma, M2M100, ...; its LlamaRMSNorm: 142 classes) is served by one reference class:
# a class gets the reference's rule where its methods' code is the reference's and its bases are the reference's,
# so the rule is applied exactly where the forward computes what the rule assumes, in any package or version.
_BY_CODE: dict = {}  # same_code(reference.forward) -> the reference class


def same_code(fn) -> tuple | None:
    """What makes two functions compute the same: their bytecode, constants, names and arguments (not the file or
    the line they were written at), or None for what is not a Python function."""
    c = getattr(fn, "__code__", None)
    return None if c is None else (c.co_code, c.co_consts, c.co_names, c.co_varnames, c.co_freevars,
                                   c.co_argcount, c.co_kwonlyargcount, c.co_posonlyargcount)


def twin(name: str) -> dict:
    """The reference's methods (name -> function) of the spec called `name` where it is registered by_code, else {}
    (a saved record's stand-in of such a class gets them: record/saved.py)."""
    return next((_methods(ref) for ref in _BY_CODE.values() if SPECS[ref].name == name), {})


def _methods(ref) -> dict:
    """name -> function: what a reference class defines (forward and the methods it calls, as `_norm`)."""
    return {n: f for n, f in vars(ref).items() if callable(f) and not n.startswith("__")}


def _by_code(mro: tuple, i: int):
    """(index in the MRO, spec) of the class among mro[:i] (those before the spec's class at i) that is a reference's
    copy (see register's by_code): the first to define forward, defining each of the reference's methods with the
    same code, over the reference's own bases."""
    j = next((j for j in range(i) if "forward" in vars(mro[j])), None)
    if j is None:
        return None
    ref = _BY_CODE.get(same_code(vars(mro[j])["forward"]))
    if ref is None or ref.__mro__[1:] != mro[j + 1:]:
        return None
    own = vars(mro[j])
    same = all(same_code(own.get(n)) == same_code(f) for n, f in _methods(ref).items())
    return (j, SPECS[ref]) if same else None


def _key(cls):
    return cls if cls in SPECS else f"{cls.__module__}.{cls.__name__}"


# type -> what lookup learns from the type alone (its MRO against SPECS and NO_RULE), so that a lookup, asked
# dozens of times per trace, walks no MRO and formats no names: (len(SPECS), len(NO_RULE), spec or None, the
# classes before the spec's in the MRO (each may override its forward), whether NO_RULE names a class of the
# MRO, and the reason where no spec applies). register() clears it; what depends on the instance (a forward
# replaced on it, parameters, refuse, the generic rule's parameters) is still read on every lookup.
_BY_TYPE: dict = {}


def _type_facts(cls) -> tuple:
    facts = _BY_TYPE.get(cls)
    if facts is None or facts[0] != len(SPECS) or facts[1] != len(NO_RULE):
        mro = cls.__mro__
        i, spec = next(((i, SPECS[k]) for i, k in enumerate(map(_key, mro)) if k in SPECS), (None, None))
        if i != 0 and _BY_CODE:  # a class that defines its own forward before any spec's class (or has none)
            i, spec = _by_code(mro, len(mro) if i is None else i) or (i, spec)
        no_rule = any(c in NO_RULE for c in mro)
        why = None
        if spec is None:
            why = next((NO_RULE[c] for c in mro if c in NO_RULE), None)
            why = f"no factor rule for {cls.__name__}" + (f": {why}" if why else "")
        facts = _BY_TYPE[cls] = (len(SPECS), len(NO_RULE), spec, mro[:i] if spec is not None else (),
                                 mro[i] if spec is not None else None, no_rule, why)
    return facts


def _no_generic_rule(m, a, delta, state=None):
    raise ValueError(f"{type(m).__name__}: the generic rule reruns the module's forward from the call's kept "
                     "inputs and parameters; ask the Trace (t.per_sample_grads), not its (a, δ)")


# modules with parameters and no exact rule: per-sample gradients by torch.func, checked (generic.py)
GENERIC = LayerSpec("generic (torch.func)", _no_generic_rule, keeps_input=lambda m: False, params=(), generic=True)


class _Memo(threading.local):
    table = None  # id(module) -> (module, exact_lookup's answer, lookup's answer or None), while memo() runs


_memo = _Memo()


class memo:
    """`with memo():` lookups on this thread answer each module once for the block. For code that asks about
    the same modules many times and runs none of the user's code in between (a module's first call, a trace's
    attach): nothing can change what a lookup reads there, so the answers are those an uncached lookup gives.
    Nested blocks share the outermost block's answers; `table` is the block's answers (kept after it ends).

    `with memo(table):` answers from a table kept from an earlier block, whatever encloses it: the Tracer keeps
    the answers of each module's first call, and the trace's notes (decided when first read) use them."""

    __slots__ = ("outer", "table")

    def __init__(self, table: dict | None = None):
        self.table = table

    def __enter__(self):
        self.outer = _memo.table
        if self.table is None:
            self.table = self.outer if self.outer is not None else {}
        _memo.table = self.table
        return self

    def __exit__(self, *exc):
        _memo.table = self.outer


def lookup(module: nn.Module, table: dict | None = None):
    """(spec, reason): the spec whose rule is exact for this module, else GENERIC where the generic rule may
    serve it, and None; or None and why no rule applies. `table`: a memo table to use (else memo()'s, if any)."""
    if table is None:
        table = _memo.table
    if table is not None:
        hit = table.get(id(module))
        if hit is not None and hit[0] is module and hit[2] is not None:
            return hit[2]
    facts = _type_facts(type(module))
    exact = spec, reason = _exact(module, facts)
    if spec is None and not facts[5] and generic.may_serve(module):
        spec, reason = GENERIC, None
    if table is not None:
        table[id(module)] = (module, exact, (spec, reason))
    return spec, reason


def exact_lookup(module: nn.Module):
    """(spec, reason): the spec whose rule is exact for this module and None, or None and why not."""
    table = _memo.table
    if table is not None:
        hit = table.get(id(module))
        if hit is not None and hit[0] is module:
            return hit[1]
        exact = _exact(module, _type_facts(type(module)))
        table[id(module)] = (module, exact, None)
        return exact
    return _exact(module, _type_facts(type(module)))


def _exact(module: nn.Module, facts: tuple):
    spec, subs, cls = facts[2], facts[3], facts[4]
    if spec is None:
        return None, facts[6]
    methods = spec.forward_methods
    for sub in subs:
        over = next((m for m in methods if m in vars(sub)), None)
        if over:
            return None, (f"{sub.__name__} overrides {cls.__name__}.{over}: no exact (a, δ) rule; the rule "
                          f"rebuilds {cls.__name__}'s own forward, not what this subclass computes")
    own = vars(module)
    for patched in methods:  # a loop, not next(generator): asked at every module's first call
        if patched in own:
            return None, (f"{type(module).__name__}.{patched} is replaced on this instance: no exact (a, δ) rule; "
                          f"the rule rebuilds {cls.__name__}'s own forward")
    params = own_parameters(module)
    for p in spec.params:
        if p not in params and isinstance(getattr(module, p, None), torch.Tensor):
            return None, (f"{type(module).__name__}.{p} is computed (parametrize, weight_norm or spectral_norm),"
                          f" not a parameter: (a, δ) give the gradient of the computed {p}, not of the "
                          "parameters it is made from")
    reason = spec.refuse(module)
    return (None, reason) if reason else (spec, None)


def spec_for(module: nn.Module) -> LayerSpec | None:
    return lookup(module)[0]


def is_generic(module: nn.Module) -> bool:
    """Whether the generic torch.func rule (not an exact (a, δ) rule) answers for this module."""
    return lookup(module)[0] is GENERIC


def exact_reason(module: nn.Module) -> str | None:
    """Why no exact (a, δ) rule applies to this module (the generic rule may still), or None."""
    return exact_lookup(module)[1]


def unsupported_reason(module: nn.Module) -> str | None:
    """Why no rule answers for this module, or None: an exact (a, δ) rule does, or the generic rule may (its
    check runs per trace; per_sample.left_out names a module it refuses)."""
    return lookup(module)[1]


def needs_input(module: nn.Module) -> bool:
    """Whether the layer's backward holds its input for a trainable parameter's gradient (so capture
    can keep `a` by reference: autograd's version check guards it)."""
    spec = spec_for(module)
    if spec is None or not spec.keeps_input(module):
        return False
    return any(isinstance(p, torch.Tensor) and p.requires_grad
               for p in (own_parameters(module).get(n) for n in spec.params))


def capture_facts(module: nn.Module, table: dict | None = None) -> tuple:
    """(spec or None, needs_input, stateful, keeps_rows): what capture decides at a module's first call, from
    one lookup (needs_input, forward_state(module) is not None, keeps_rows, asked one by one, make five), kept
    in `table` (see lookup)."""
    spec = lookup(module, table)[0]
    if spec is None:
        return None, False, False, _elementwise(type(module))
    needs = False
    if spec.keeps_input(module):
        params = own_parameters(module)
        for n in spec.params:
            p = params.get(n)
            if p is not None and p.requires_grad:
                needs = True
                break
    stateful = spec.state is not None and spec.state(module) is not None
    return spec, needs, stateful, spec.tokens or _elementwise(type(module))


def supported_types() -> list[str]:
    """Names of the layer types with an exact (a, δ) rule, for error messages."""
    return sorted({k.__name__ if isinstance(k, type) else k for k in SPECS})


def per_sample_meaning(module: nn.Module, state=None) -> str | None:
    """"exact", "contribution" (samples share statistics: a row is what that sample's δ and x̂ add to
    .grad; rows sum to .grad), or None where there is no rule."""
    spec = spec_for(module)
    return None if spec is None else spec.per_sample(module, state if state is not None else forward_state(module))


def forward_state(module: nn.Module):
    """What the rule needs from forward time besides (a, δ), or None: capture may store it per call
    (call.state) so that a later model.eval()/train() does not change the answer."""
    spec = spec_for(module)
    return None if spec is None or spec.state is None else spec.state(module)


# parameter-free layers that act on each element (so on each row) alone: exact types, as a subclass may not
ELEMENTWISE = {nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus,
               nn.Hardswish, nn.Hardsigmoid, nn.Identity, nn.Dropout}
ELEMENTWISE_NAMED = {f"transformers.activations.{n}" for n in (
    "GELUActivation", "NewGELUActivation", "FastGELUActivation", "QuickGELUActivation", "GELUTanh", "SiLUActivation",
    "ReLUSquaredActivation", "PytorchGELUTanh")}


def keeps_rows(module: nn.Module) -> bool:
    """Whether each row of its output comes from the same row of its input alone (a token-wise rule's layer,
    an elementwise activation): rows that are folded samples stay so (see per_sample's unfolding)."""
    if _elementwise(type(module)):
        return True
    spec = spec_for(module)
    return spec is not None and spec.tokens


_ELEMENTWISE_TYPES: dict = {}  # type -> whether ELEMENTWISE or ELEMENTWISE_NAMED names it


def _elementwise(cls) -> bool:
    found = _ELEMENTWISE_TYPES.get(cls)
    if found is None:
        found = _ELEMENTWISE_TYPES[cls] = cls in ELEMENTWISE or f"{cls.__module__}.{cls.__name__}" in ELEMENTWISE_NAMED
    return found
