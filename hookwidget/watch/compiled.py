"""The watch under torch.compile: whether backward reached the watched parameters through code that calls none
of its hooks, and what it tells the user then (the probe that records inside compiled code is capture's:
capture/compiled_stats.py)."""

from __future__ import annotations


def reaches(roots: list, params: list) -> str | None:
    """Does the graph of `roots` reach one of `params`? Returns "compiled" when it passes through
    compiled code, "eager" otherwise, None when no watched parameter is reached."""
    ids = {id(p) for p in params}
    todo = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen, compiled, hit = set(), False, False
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        name = type(fn).__name__
        compiled = compiled or name.startswith("CompiledFunction")
        if id(getattr(fn, "variable", None)) in ids:
            hit = True
        todo.extend(f for f, _ in fn.next_functions)
    return None if not hit else ("compiled" if compiled else "eager")


FLIGHT = ("torch.compile: the kept Traces (w.trace) of compiled steps hold no layer detail (no hook runs inside "
          "compiled code: no a, δ or factors; the graph shows each compiled region as one CompiledFunctionBackward "
          "node); the statistics are complete. For one step in full, run it on the uncompiled model under hw.trace")

NOT_SEEN = {
    "compiled": "hw.watch: backward reached the watched parameters through compiled code that does not call the "
                "watch's hooks: it was compiled before the watch was installed, for this model or another "
                "instance of its class (torch.compile reuses compiled code and does not look for hooks added "
                "later), so only grad_norm, weight_norm, update_ratio and the loss are recorded; call "
                "torch.compiler.reset() before hw.watch(model), then compile: w = hw.watch(model); "
                "cmodel = torch.compile(model)",
    "eager": "hw.watch: backward reached the watched parameters but no layer hook of the watch ran (the model "
             "runs through a wrapper that bypasses module hooks, e.g. torch.jit.script), so only grad_norm, "
             "weight_norm, update_ratio and the loss are recorded; watch the plain nn.Module",
}
