"""Memory of benchmarks/watch_overhead.py's variants, each measured in a process of its own (a process's peak
cannot be reset): the peak resident memory of a block of steps per variant and model, and what a watch holds per
recorded step over a long run (`growth`: bytes reachable from `w`, at a tenth of the steps and at the end).
Run by `python -m benchmarks.watch_overhead` (see its docstring); the functions here run in the child processes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

from benchmarks.watch_overhead import ROOT, build, steps_for, time_loop
from benchmarks.watch_peers import loss_of
from hookwidget.watch import watch


def vm_hwm_mb(pid: int | str = "self") -> float:
    """The resident high-water mark (VmHWM, MiB) of a process: of its memory since exec (ru_maxrss is not: a
    child started by a process that had grown reports its parent's peak), 0 where it has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024


def peak_mb(name: str, variant: str, steps: int) -> str:
    """The peak resident memory (MiB) of this process, plus its child processes' (wandb-core), after `steps` steps
    of `variant` on model `name`, and the steps whose Trace its watch kept (JSON, after the figure): run it in a
    fresh process."""
    import benchmarks.watch_overhead as wo

    model, x, y = build(name)
    time_loop(model, x, y, steps, variant, warmup=max(2, steps // 5))
    me = os.getpid()
    children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
    return f"{vm_hwm_mb() + sum(vm_hwm_mb(pid) for pid in children)} {json.dumps(wo.KEPT.get(variant, []))}"


def in_child(call: str) -> str:
    """The last line `call` (a Python expression on this module, `b`) prints in a fresh process, or raises
    RuntimeError with the last line of its error."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import torch; torch.set_num_threads(1); "
            f"import benchmarks.watch_memory as b; print({call})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError((r.stderr.strip().splitlines() or ["no output"])[-1][:160])
    return r.stdout.split("\n")[-2]


def peaks(models: list, variants: list, steps: int) -> dict:
    out = {}
    print("\npeak resident memory (MiB, VmHWM + child processes's, one process per variant)")
    for name in models:
        n = steps_for(name, steps)
        peaks, errors, kept = {}, {}, {}
        for v in variants:
            try:
                mib, _, steps_kept = in_child(f"b.peak_mb({name!r}, {v!r}, {n})").partition(" ")
                peaks[v], kept[v] = float(mib), json.loads(steps_kept)
            except RuntimeError as e:
                errors[v] = str(e)
        out[name] = {"steps": n, "mib": peaks, "errors": errors, "kept": kept}
        print(f"\n{name} ({n} steps)")
        for v in variants:
            p = peaks.get(v)
            print(f"  {v:<14}" + (f"{p:>10.1f} MiB{p - peaks['plain']:>+10.1f} over plain{p / peaks['plain']:>8.3f}x"
                                  + (f"  kept {kept[v]}" if kept.get(v) else "")
                                  if p is not None else f"fails: {errors[v]}"), flush=True)
    return out


def held_bytes(root) -> int:
    """Bytes reachable from `root`: Python objects (sys.getsizeof) and tensor storages (each once), not crossing
    into modules, parameters, optimizers, classes, Python modules, code, or a function's globals."""
    stop = (nn.Module, nn.Parameter, torch.optim.Optimizer, type, types.ModuleType, types.CodeType)
    seen, storages, total, todo = set(), set(), 0, [root]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, stop):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.data_ptr() not in storages:
                storages.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(o, types.FunctionType):  # its closure and defaults, not the module it was defined in
            todo += [c.cell_contents for c in o.__closure__ or () if c.cell_contents is not None]
            todo += [*(o.__defaults__ or ()), *(o.__kwdefaults__ or {}).values()]
        else:
            todo += gc.get_referents(o)
    return total


def growth(variant: str, steps: int) -> dict:
    """What `variant`'s watch holds after steps // 10 and after `steps` steps of a 3-layer MLP (B 8)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    held, w = {}, watch(model, flight_recorder=variant == "watch+fr")
    t0 = time.process_time()
    with w:
        for i in range(1, steps + 1):
            opt.zero_grad()
            loss_of(model(x), y).backward()
            opt.step()
            if i in (steps // 10, steps):
                held[i] = held_bytes(w)
    first, last = steps // 10, steps
    return {"steps": steps, "layers": len(w.layer_names), "held": held,
            "ms_per_step": (time.process_time() - t0) / steps * 1e3,
            "bytes_per_step": (held[last] - held[first]) / (last - first)}


def growths(steps: int) -> dict:
    out = {}
    print(f"\nwhat a watch holds, 3-layer MLP, {steps:,} steps")
    for v in ("watch", "watch+fr"):
        out[v] = g = json.loads(in_child(f"__import__('json').dumps(b.growth({v!r}, {steps}))"))
        print(f"  {v:<10}{g['bytes_per_step']:>10.1f} B/step  (held: " + ", ".join(
            f"{int(k):,} steps {b / 1e6:.2f} MB" for k, b in g["held"].items()) + f"; {g['ms_per_step']:.2f} ms/step)")
    return out
