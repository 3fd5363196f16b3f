"""A record on disk: `t.save(path)` / `hw.load(path)`. Data only, never pickled code.

One file, written with `torch.save` and read back with `torch.load(weights_only=True)`, which rebuilds tensors,
strings and plain containers and nothing else: {"format": "hookwidget", "kind": "trace", "version", "meta": JSON
text, "tensors": {key: tensor}}. `kind` says what the file holds, so that `hw.load` can dispatch on it (a trace
today; a watch may add its own kind). The JSON tree names each tensor by its key; a tensor met twice (a parameter
several layers hold, a .grad that two steps share) is stored once and comes back as one object, so identity-based
answers (which layers hold a parameter) are the same after loading.

The modules a record names are stored as what the layer rules read of them (their class names along the MRO up to
torch's, plain attributes, parameters, buffers, children) and come back as parameter-bearing stand-ins: torch.nn
classes are rebuilt as themselves (found in torch.nn, never imported from a name in the file), other classes as
empty subclasses with the same names, so the layer registry answers for a stand-in as it did for the module (a
class that overrode forward gets a forward that says the code is not here; one the registry knows by its code gets
the reference's methods, hookwidget's own: _Decoder._class). A stand-in cannot run the file's code.

Floor: record. Imports layers/ (the registry's specs), interventions, options, stats, _torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from pathlib import Path

import torch
from torch import nn

from hookwidget._torch.modules import children, own_buffers, own_parameters
from hookwidget.interventions import KINDS, Intervention
from hookwidget.layers import Factor, registry
from hookwidget.options import Options
from hookwidget.record.calls import Call
from hookwidget.record.notes import Note
from hookwidget.record.run import Layer, LazyGraph, RunRecord, Step
from hookwidget.stats import TensorSummary, summaries

FORMAT, VERSION = "hookwidget", 1

# the classes a file may name as objects: data classes of the record, rebuilt field by field
_CLASSES = {c.__name__: c for c in (Call, Note, Step, TensorSummary)}
_PLAIN = (type(None), bool, int, float, str)
_FRESH = frozenset(vars(nn.Module()))  # what every module has (hooks, parameters, ...): not an attribute of its own


class ReadOnly:
    """The session of a loaded Trace: what it ran with (options), no code. Whatever needs the code (a rerun,
    adding or removing a hook) is refused with one line that says so."""

    fn = None

    def __init__(self, path, options: dict, applied: list):
        self.path = str(path)
        self.options = Options.from_kwargs(**options)
        self.applied = tuple(_intervention(*a) for a in applied)
        self.interventions = list(self.applied)  # the explorer shows the hooks that were on in this run
        self.latest = None
        self._baseline = None  # set by the loader where the saved trace was its session's baseline

    @property
    def baseline(self):
        """The hook-free first run, where it was the trace saved; else AttributeError (getattr's default holds)."""
        if self._baseline is None:
            raise AttributeError(f"this Trace was loaded from {self.path} without the hook-free run it was a rerun "
                                 "of: pass the trace to compare with, t.diff(before)")
        return self._baseline

    @baseline.setter
    def baseline(self, trace) -> None:
        self._baseline = trace

    def refusal(self, what: str) -> str:
        return (f"this Trace was loaded from {self.path}: {what} needs the code that made it; run that code under "
                "hw.trace to get a live Trace")

    def refuse(self, what: str):
        raise RuntimeError(self.refusal(what))

    def no_rerun(self) -> str:
        """Why this session cannot run its code again (Session.no_rerun's question): it has no code."""
        return self.refusal("rerun")

    def rerun(self):
        self.refuse("rerun")

    def add_hook(self, target, kind, **params):
        self.refuse("add_hook")

    def remove_hook(self, target, kind, missing_ok: bool = False):
        self.refuse("remove_hook")

    def on_change(self, callback) -> None:
        """Nothing changes a loaded record: no one is ever told."""


# -- writing -------------------------------------------------------------------------------------------
def write(path, kind: str, tree: dict) -> None:
    """Write `tree` (plain data, tensors, the record's data classes and modules) as a `kind` file."""
    enc = _Encoder()
    meta = json.dumps(enc.enc(tree), allow_nan=True)
    torch.save({"format": FORMAT, "kind": kind, "version": VERSION, "meta": meta, "tensors": enc.tensors,
                "modules": json.dumps(enc.modules)}, Path(path))


def read(path) -> tuple[str, dict]:
    """(kind, tree) of a file `write` made; one line where it is not one."""
    try:
        raw = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (any unreadable file: one line naming it)
        raise ValueError(f"{path}: not a hookwidget record ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                         ) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{path}: not a hookwidget record (t.save(path) writes one)")
    if raw.get("version", 0) > VERSION:
        raise ValueError(f"{path}: written by a newer hookwidget (format {raw['version']}); upgrade hookwidget")
    dec = _Decoder(raw["tensors"], json.loads(raw["modules"]))
    return raw["kind"], dec.dec(json.loads(raw["meta"]))


def trace_tree(record: RunRecord, graph, options: dict, applied, kept: dict, baseline: bool) -> dict:
    """What a Trace's file holds: its record, the graph, how it ran, and `kept`: answers worked out at save time
    that would need the code to work out again (the generic rule's rows, coverage)."""
    norms = None if record.norms is None else [
        (sq, tuple(n for n, layer in record.layers.items() if layer.module in modules)) for sq, modules in record.norms]
    return {
        "layers": [(layer.name, layer.module, [_call(c) for c in layer.calls]) for layer in record.layers.values()],
        "steps": record.steps, "param_grads": record.param_grads, "params": record.params, "losses": record.losses,
        "user_hooks": record.user_hooks, "accumulates": record.accumulates, "notes": record.notes,
        "factor_notes_at": record.factor_notes_at, "no_factors": record.no_factors, "norms": norms,
        "graph": {"nodes": list(graph.nodes(data=True)), "edges": list(graph.edges(data=True))},
        "options": {k: v for k, v in options.items() if isinstance(v, _PLAIN) or (
            isinstance(v, tuple) and all(isinstance(x, str) for x in v))},
        "applied": [(iv.target, iv.kind.name, {k: v if _is_plain(v) else {"function": getattr(
            v, "__qualname__", type(v).__name__)} for k, v in iv.params.items()}) for iv in applied],
        "kept": kept, "baseline": baseline,
    }


NO_ACTIVATIONS = ("saved without a and δ (t.save(path, activations=False)): their statistics are kept, their values "
                  "are not; save the trace with activations=True for factor queries")
_CALL_TENSORS = ("grad_input", "inputs", "params", "deltas", "bdelta", "rule_parts", "join_rows", "state")


def without_activations(tree: dict, norms_sq: list) -> dict:
    """A trace tree whose calls keep each a and δ as its statistics (a TensorSummary), not its values, nor what the
    generic rule kept to rerun a module: the bulk of a large model's file besides its parameters and .grad.
    `norms_sq`: per step, the squared per-sample norms of the whole model taken before (None where there were
    none), kept as capture="norms" keeps its streamed ones, so the loaded trace still answers them."""
    calls = [c for _, _, cs in tree["layers"] for c in cs]
    todo = [(c, attr) for c in calls for attr in ("a", "delta")
            if getattr(c, attr) is not None and getattr(c, attr + "_summary") is None]
    made = dict(zip(((id(c), attr) for c, attr in todo), summaries([getattr(c, attr) for c, attr in todo])))
    for c in calls:
        c.a_summary = c.a_summary or made.get((id(c), "a"))
        c.delta_summary = c.delta_summary or made.get((id(c), "delta"))
        c.a = c.delta = None
        for attr in _CALL_TENSORS:
            setattr(c, attr, None)
    norms = tree["norms"] if tree["norms"] is not None else [(sq, ()) for sq in norms_sq]
    kept = {**tree["kept"], "rows": []}
    return {**tree, "no_factors": tree["no_factors"] or NO_ACTIVATIONS, "norms": norms, "kept": kept}


def trace_record(tree: dict) -> RunRecord:
    """The RunRecord of a trace file's tree (trace_tree's inverse)."""
    import networkx as nx

    layers = {name: Layer(name, module, calls) for name, module, calls in tree["layers"]}
    norms = tree["norms"]
    if norms is not None:
        norms = [(sq, {layers[n].module for n in names}) for sq, names in norms]
    g = nx.DiGraph()
    g.add_nodes_from(tree["graph"]["nodes"])
    g.add_edges_from(tree["graph"]["edges"])
    return RunRecord(layers, tree["steps"], tree["param_grads"], tree["params"], tree["losses"], tree["user_hooks"],
                     tree["accumulates"], tuple(tree["notes"]), tree["factor_notes_at"], tree["no_factors"], norms,
                     {}, LazyGraph.of(g), done=True)


def _call(c: Call) -> Call:
    """The call as stored: autograd's node is gone by the end of a trace (never stored)."""
    return dataclasses.replace(c, out_node=None)


class _Encoder:
    """Plain data to a JSON tree; tensors by key into `tensors` (each object once), modules into `modules`."""

    def __init__(self):
        self.tensors: dict = {}
        self.modules: list = []
        self._seen: dict = {}  # id(object) -> its key (the object kept alive in _keep so ids stay unique)
        self._keep: list = []

    def enc(self, x):
        if isinstance(x, float) and not math.isfinite(x):
            return {"float": repr(x)}
        if isinstance(x, _PLAIN):
            return x
        if isinstance(x, torch.Tensor):
            return {"P" if isinstance(x, nn.Parameter) else "T": self._tensor(x), "rg": bool(x.requires_grad)}
        if isinstance(x, nn.Module):
            return {"M": self._module(x)}
        if isinstance(x, list):
            return [self.enc(v) for v in x]
        if isinstance(x, (tuple, torch.Size)):
            return {"tuple": [self.enc(v) for v in x]}
        if isinstance(x, (set, frozenset)):
            return {"set": [self.enc(v) for v in x]}
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x):
                return {"dict": {k: self.enc(v) for k, v in x.items()}}
            return {"pairs": [[self.enc(k), self.enc(v)] for k, v in x.items()]}
        if isinstance(x, torch.dtype):
            return {"dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"device": str(x)}
        if dataclasses.is_dataclass(x) and type(x).__name__ in _CLASSES:
            return {"obj": type(x).__name__, "fields": {f.name: self.enc(getattr(x, f.name))
                                                        for f in dataclasses.fields(x)}}
        if isinstance(x, Factor) and x.conv is None:  # the generic rule's rows (a fast rule's factors)
            return {"factor": {"param": x.param, "kind": x.kind, "D": self.enc(x.D), "X": self.enc(x._X),
                               "shape": self.enc(tuple(x.shape)), "rows": x.rows, "per_sample": x.per_sample}}
        return {"opaque": f"{type(x).__name__}"}  # what a stand-in does not need (a user's object among inputs)

    def _tensor(self, t: torch.Tensor) -> str:
        key = self._seen.get(id(t))
        if key is None:
            key = self._seen[id(t)] = f"t{len(self.tensors)}"
            self._keep.append(t)
            d = t.detach()
            if d.layout == torch.strided and (not d.is_contiguous() or d.untyped_storage().nbytes() > d.nbytes):
                d = d.clone()  # a view: its own values, not the storage it shares; a dense layout kept (dense_layout)
            self.tensors[key] = d.cpu()
        return key

    def _module(self, m: nn.Module) -> int:
        key = self._seen.get(id(m))
        if key is not None:
            return key
        key = self._seen[id(m)] = len(self.modules)
        self._keep.append(m)
        entry: dict = {}
        self.modules.append(entry)  # before its children, which may name it (a cycle of modules)
        cls = type(m)
        spec_cls = _spec_class(cls)
        methods = ("forward", *(registry.SPECS[spec_cls].forward_methods if spec_cls in registry.SPECS else ()))
        entry.update({
            "mro": [[c.__module__, c.__qualname__, [n for n in methods if n in vars(c)]]
                    for c in cls.__mro__ if c is not nn.Module and issubclass(c, nn.Module)],
            "attrs": {k: self.enc(v) for k, v in vars(m).items() if k not in _FRESH and _is_plain(v)},
            "training": m.training,
            "patched": [n for n in methods if callable(vars(m).get(n))],
            "params": {n: self.enc(p) for n, p in own_parameters(m).items()},
            "buffers": {n: self.enc(b) for n, b in own_buffers(m).items()},
            "transient": [n for n in own_buffers(m) if n not in m.state_dict(keep_vars=True)] if own_buffers(m) else [],
            "children": {n: None if c is None else self._module(c) for n, c in children(m).items()},
            "answer": _answer(m),
        })
        return key


def _is_plain(v) -> bool:
    if isinstance(v, _PLAIN):
        return True
    return isinstance(v, (tuple, list)) and all(_is_plain(x) for x in v)


def _spec_class(cls):
    """The class along cls's MRO that the registry has a spec for (a class or its dotted name), or None."""
    for c in cls.__mro__:
        if c in registry.SPECS:
            return c
        if f"{c.__module__}.{c.__name__}" in registry.SPECS:
            return f"{c.__module__}.{c.__name__}"
    return None


def _answer(m: nn.Module) -> list:
    """What the registry answers for the module: [spec name or None, reason or None]."""
    spec, reason = registry.lookup(m)
    return [None if spec is None else spec.name, reason]


# -- reading -------------------------------------------------------------------------------------------
class _Decoder:
    def __init__(self, tensors: dict, modules: list):
        self.tensors, self.module_data = tensors, modules
        self._objects: dict = {}  # tensor key -> the one object it comes back as
        self._modules: dict = {}
        self._classes: dict = {}  # the MRO as stored -> its stand-in class, one per class per file

    def dec(self, x):
        if isinstance(x, list):
            return [self.dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        (tag, value), *rest = x.items()
        if tag in ("T", "P"):
            obj = self._objects.get(value)
            if obj is None:
                t = self.tensors[value]
                obj = self._objects[value] = nn.Parameter(t, requires_grad=x["rg"]) if tag == "P" else t
            return obj
        if tag == "M":
            return self.module(value)
        if tag == "tuple":
            return tuple(self.dec(v) for v in value)
        if tag == "set":
            return {self.dec(v) for v in value}
        if tag == "dict":
            return {k: self.dec(v) for k, v in value.items()}
        if tag == "pairs":
            return {self.dec(k): self.dec(v) for k, v in value}
        if tag == "float":
            return float(value)
        if tag == "dtype":
            return getattr(torch, value)
        if tag == "device":
            return torch.device(value)
        if tag == "obj":
            return _CLASSES[value](**{k: self.dec(v) for k, v in x["fields"].items()})
        if tag == "factor":
            v = {k: self.dec(w) for k, w in value.items()}
            return Factor(v["param"], v["kind"], v["D"], v["X"], v["shape"], v["rows"], per_sample=v["per_sample"])
        if tag == "opaque":
            return f"<{value}: not saved>"
        raise ValueError(f"unknown entry {tag!r} in a hookwidget record")

    def module(self, key: int) -> nn.Module:
        m = self._modules.get(key)
        if m is not None:
            return m
        data = self.module_data[key]
        m = self._stand_in(data, exact=True)
        self._modules[key] = m
        for n, c in data["children"].items():
            m.add_module(n, None if c is None else self.module(c))
        if data["answer"][0] in (None, registry.GENERIC.name) and _answer(m)[0] != data["answer"][0]:
            # a class the registry answered for by the generic rule or not at all, though its stand-in has an exact
            # rule (a computed weight, say): an empty class of the same names instead, which it answers for alike
            m = self._stand_in(data, exact=False, like=m)
            self._modules[key] = m
        return m

    def _stand_in(self, data: dict, exact: bool, like: nn.Module | None = None) -> nn.Module:
        cls = self._class(data["mro"], exact, registry.twin(data["answer"][0]) if exact else {})
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.__dict__.update({k: self.dec(v) for k, v in data["attrs"].items()})
        m.train(data["training"])
        for n in data["patched"]:
            setattr(m, n, _needs_code)
        for n, p in data["params"].items():
            m.register_parameter(n, self.dec(p))
        for n, b in data["buffers"].items():
            m.register_buffer(n, self.dec(b), persistent=n not in data["transient"])
        for n, c in (like.named_children() if like is not None else ()):
            m.add_module(n, c)
        return m

    def _class(self, mro: list, exact: bool, twin: dict) -> type:
        """The stand-in class; `twin`: the reference's methods the registry matched the class's own to by their code
        (registry.register's by_code), given to the first class that overrides forward, so that the stand-in gets
        the same rule. They are hookwidget's own code, never the file's: where they call super() (the scaled
        embeddings) the stand-in cannot run; an RMSNorm's reads only the attributes the file kept."""
        key = (json.dumps(mro), exact, tuple(twin.values()))
        found = self._classes.get(key)
        if found is not None:
            return found
        i, base = len(mro), nn.Module  # the stand-in's base: the first torch.nn class of the MRO, where exact
        if exact:
            i, base = next(((i, c) for i, c in enumerate(_torch_class(mod, qual) for mod, qual, _ in mro)
                            if c is not None), (i, base))
        own = next((k for k, (_, _, overrides) in enumerate(mro[:i]) if "forward" in overrides), None)
        for k, (mod, qual, overrides) in reversed(list(enumerate(mro[:i]))):
            body = {"__module__": mod, "__qualname__": qual, **dict.fromkeys(overrides, _needs_code)}
            if k == own:
                body.update(twin)
            if not exact:
                body["forward"] = _needs_code
            base = type(qual.rsplit(".", 1)[-1], (base,), body)
        self._classes[key] = base
        return base


def _torch_class(mod: str, qual: str):
    """A torch.nn class by its module and name (only from torch.nn, which torch has imported), or None."""
    if not (mod == "torch.nn" or mod.startswith("torch.nn.")):
        return None
    try:
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, nn.Module) else None


def _intervention(target: str, kind: str, params: dict) -> Intervention:
    """An intervention that was on in the saved run, as data: a user's function comes back as a stand-in of the
    same name that cannot run."""
    params = {k: _function(v["function"]) if isinstance(v, dict) else v for k, v in params.items()}
    return Intervention(target, KINDS[kind], params)


def _function(name: str):
    def stand_in(*args, **kwargs):
        _needs_code()

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


def _needs_code(*args, **kwargs):
    raise RuntimeError("this module was loaded from a saved hookwidget record: it cannot run (the code is not saved)")


def dense_layout(t: torch.Tensor) -> torch.Tensor:
    """t laid out as a saved record stores it: as it is where its elements fill their memory without gaps
    (contiguous or permuted: a clone keeps those strides), else a contiguous copy. A figure reduced from this
    (a norm, whose summation order follows the layout) is then the same, to the bit, live and loaded."""
    if t.layout != torch.strided:
        return t
    step = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != step:
            return t.contiguous()
        step *= size
    return t
