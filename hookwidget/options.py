"""The trace options, in one place: `hw.trace(**options)`, `hw.tracing(**options)` and `%%hooktrace`
all go through `Options`, so a bad value gets the same one-line error wherever it is given, before
anything runs, and the magic's flags and help are derived from the fields here."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

CAPTURES = ("full", "summary", "norms")
DEFAULT_BUDGET_MB = 512.0  # megabytes for kept tensors and .grad copies (capture takes its default from here)


def _option(default, help: str, **flag):
    """A field with its help text (shown by %%hooktrace?) and how the magic spells it as a flag."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class Options:
    capture: str = _option("full", "full: keep a and δ; summary: statistics only; norms: per-sample gradient "
                           "norms only", choices=CAPTURES)
    budget_mb: float = _option(DEFAULT_BUDGET_MB, "megabytes for kept tensors and .grad copies (inf: no limit); "
                               "past it, summaries are kept instead", metavar="N")
    include: tuple | None = _option(None, "keep only layers whose name matches the glob (repeatable)", metavar="GLOB")
    exclude: tuple | None = _option(None, "drop layers whose name matches the glob (repeatable)", metavar="GLOB")
    node_grads: bool | None = _option(None, "record the gradient norm at every graph node (default: for graphs "
                                      "of up to 256 nodes)")
    show_hook_nodes: bool = _option(False, "show autograd's hook nodes (BackwardHookFunction) in the graph")
    backward_hooks: bool = _option(False, "also run full module backward hooks, to see grad_input")
    batch_dim: int | None = _option(None, "the dim of the model's inputs that holds the samples (default: the "
                                    "module's batch_first, else 0); each layer's is followed from there through "
                                    "the graph", metavar="N")
    restore: tuple = _option((), "objects a rerun must put back that the code does not name: modules, optimizers, "
                             "LR schedulers, GradScalers", magic=False)
    decode: Any = _option(None, "the text of token ids, for the explorer's token strip: a function ids -> list[str] "
                          "(or id -> str) or a tokenizer (convert_ids_to_tokens or decode); the magic takes the "
                          "name of one in your namespace", metavar="NAME", magic="name")
    token_layer: str | None = _option(None, "the nn.Embedding whose input is the token ids (default: the one "
                                      "whose (samples, positions) input matches the attributed positions)",
                                      metavar="LAYER")

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, _CHECKS[f.name](value))

    @classmethod
    def from_kwargs(cls, **kwargs) -> Options:
        """Options from keyword arguments; TypeError for an unknown name, ValueError for a bad value."""
        key = _cache_key(kwargs) if cls is Options else None
        made = _MADE.get(key) if key is not None else None
        if made is not None:  # immutable: the same options given again are the same object
            return made
        valid = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in valid:
                close = difflib.get_close_matches(name, valid, n=1)
                hint = f"did you mean {close[0]}=? " if close else ""
                raise TypeError(f"unknown trace option {name!r}: {hint}valid options: {', '.join(valid)}")
        made = cls(**kwargs)
        if key is not None and len(_MADE) < _MADE_MAX:
            _MADE[key] = made
        return made

    def as_dict(self) -> dict:
        """The options that differ from their defaults (for a short repr)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def __repr__(self) -> str:
        return "Options(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"


# Options made from plain values (str, number, bool, None, tuples of str), by (name, type, value): a trace runs
# often with the same few options, and checking them costs ~8 µs. Values of other types (restore=[model]) are
# never kept here, so this holds no reference to the user's objects.
_MADE: dict = {}
_MADE_MAX = 64
_PLAIN = (str, int, float, bool, type(None))


def _cache_key(kwargs: dict):
    key = []
    for name, value in kwargs.items():
        if type(value) is tuple and all(type(v) is str for v in value) or type(value) in _PLAIN:
            key.append((name, type(value), value))
        else:
            return None
    return tuple(sorted(key, key=lambda k: k[0]))


# -- one check per field: returns the normalized value or raises one line -----------------------
def _capture(value):
    if value not in CAPTURES:
        raise ValueError(f"capture={shown(value)} must be one of {', '.join(map(repr, CAPTURES))}, "
                         "e.g. capture='summary'")
    return value


def _budget_mb(value):
    fix = 'must be a number of megabytes >= 0, e.g. budget_mb=512 or budget_mb=float("inf") for no limit'
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"budget_mb={shown(value)} {fix}")
    try:
        mb = float(value)
    except OverflowError:  # an int beyond float's range: use inf for no limit
        raise ValueError(f"budget_mb is {shown(value, 20)}, too large for a float; {fix}") from None
    if math.isnan(mb) or mb < 0:
        raise ValueError(f"budget_mb={shown(value)} {fix}")
    return mb


def _globs(name):
    def check(value):
        if value is None:
            return None
        items = (value,) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(g, str) for g in items):
            raise ValueError(f"{name}={shown(value)} must be a glob on layer names or a list of them, "
                             f"e.g. {name}='blocks.*' or {name}=['fc1', 'fc2']")
        return tuple(items) or None  # an empty list filters nothing, like None

    return check


def _tristate(name):
    def check(value):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name}={shown(value)} must be True, False or None (automatic), e.g. {name}=True")
        return value

    return check


def _flag(name):
    def check(value):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={shown(value)} must be True or False, e.g. {name}=True")
        return value

    return check


def _batch_dim(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"batch_dim={shown(value)} must be a dim index >= 0 of the model's inputs (or None: its "
                         "batch_first, else 0), e.g. batch_dim=1 for time-major (T, B, ...) inputs")
    return int(value)


def _restore(value):
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for obj in items:
        if not _restorable(obj):
            raise ValueError(f"restore= takes modules, optimizers, LR schedulers and GradScalers (anything with "
                             f"state_dict and load_state_dict); got a {type(obj).__name__}: e.g. restore=[model, opt]")
    return items


def _restorable(obj: Any) -> bool:
    if isinstance(obj, type):
        return False
    if isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)):
        return True
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _decode(value):
    """None, a tokenizer (decode or convert_ids_to_tokens) or a function: how the explorer reads token ids as text
    (views/payload/shares.py calls it, only when a sample's strip is shown)."""
    if value is None or decode_form(value) is not None:
        return value
    raise ValueError(f"decode={shown(value)} must be a function ids -> list[str] (or id -> str) or a tokenizer with "
                     "convert_ids_to_tokens or decode, e.g. decode=tokenizer or decode=lambda i: vocab[i]")


def decode_form(value) -> str | None:
    """How `value` turns ids into text: "decode" (a tokenizer's decode([id]) per id: readable text), "tokens"
    (convert_ids_to_tokens(ids)), "call" (a function), or None where it does neither. A tokenizer is callable
    too (it encodes text): its methods are looked for first."""
    if isinstance(value, (str, bytes, numbers.Number)):
        return None
    if callable(getattr(value, "decode", None)):
        return "decode"
    if callable(getattr(value, "convert_ids_to_tokens", None)):
        return "tokens"
    return "call" if callable(value) and not isinstance(value, type) else None


def _token_layer(value):
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"token_layer={shown(value)} must be the name of the nn.Embedding whose input is the token "
                         "ids, e.g. token_layer='transformer.wte'")
    return value


_CHECKS = {"capture": _capture, "budget_mb": _budget_mb, "include": _globs("include"), "exclude": _globs("exclude"),
           "node_grads": _tristate("node_grads"), "show_hook_nodes": _flag("show_hook_nodes"),
           "backward_hooks": _flag("backward_hooks"), "batch_dim": _batch_dim, "restore": _restore,
           "decode": _decode, "token_layer": _token_layer}


def shown(value, limit: int = 60) -> str:
    """`value` as an error line quotes it: its repr cut to `limit` characters (a 5000-digit integer, a long list or
    a deep structure stays readable, and no int-to-str limit is hit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = " ".join(repr(value).split())  # one line: a module's repr spans several
    except Exception:  # a broken __repr__, a structure too deep to show
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def suggest(value, names, label: str, k: int = 5) -> str:
    """A few of `names` for an error line, `label` saying what they are: the close matches to `value` first ("did
    you mean"), then the first others, cut to `k` and saying how many there are in all."""
    names = [str(n) for n in names]
    if not names:
        return f"there are no {label}"
    close = difflib.get_close_matches(value, names, n=k, cutoff=0.6) if isinstance(value, str) else []
    few = [*close, *(n for n in names if n not in close)][:k]
    more = f" and {len(names) - len(few)} more" if len(names) > len(few) else ""
    text = ", ".join(map(repr, few)) + more
    return f"did you mean {text}" if close else f"{label}: {text}"


def did_you_mean(value, names) -> str:
    """"; did you mean 'x'?" for the closest of `names` to a mistyped `value`, or "" where none is close."""
    close = difflib.get_close_matches(value, [str(n) for n in names], n=1) if isinstance(value, str) else []
    return f"; did you mean {close[0]!r}?" if close else ""


def check_name(what: str, value, example: str = "'fc1'") -> str:
    """A name argument (a layer, a target, a kind): a string, else TypeError naming the argument and the value."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__} {shown(value)}; e.g. {what}={example}")
    return value


def check_modules(modules):
    """`modules=`: None, an nn.Module or a non-empty list of them, as a list (or None); one line otherwise."""
    if modules is None:
        return None
    if isinstance(modules, nn.Module):
        return [modules]
    items = list(modules) if isinstance(modules, (list, tuple)) else None
    if not items or not all(isinstance(m, nn.Module) for m in items):
        got = "an empty list" if items == [] else f"{type(modules).__name__} {shown(modules)}"
        raise TypeError(f"modules= takes an nn.Module or a list of them, got {got}; e.g. modules=model")
    return items


def check_callable(fn) -> None:
    """hw.trace runs fn() once, on this thread: a module, a non-callable, a generator function or
    a coroutine function would run nothing (or not here), so they get one line naming the fix."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if isinstance(fn, nn.Module) or not callable(fn):
        raise TypeError(f"hw.trace takes a function to run, got {type(fn).__name__}; "
                        "for a block of code use `with hw.tracing() as t:`")
    if inspect.isgeneratorfunction(fn):
        raise TypeError(f"hw.trace runs fn() once and needs a plain function; got a generator function {name}: "
                        f"wrap it, e.g. hw.trace(lambda: list({name}()))")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        kind = "an async generator" if inspect.isasyncgenfunction(fn) else "a coroutine"
        raise TypeError(f"hw.trace runs fn() once and needs a plain function; got {kind} function {name}: "
                        f"trace it as a block instead, e.g. `with hw.tracing() as t: await {name}()` in a notebook")


def check_path(value, what: str, example: str) -> None:
    """A file or folder argument is a str or os.PathLike; else one line naming the argument and an example."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, str) and not value:
        raise TypeError(f"{what} takes a file path (a str or os.PathLike), got {shown(value, 40)}; e.g. {example}")
