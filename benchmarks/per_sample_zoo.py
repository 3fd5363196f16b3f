"""Per-sample gradient norms on every zoo model: hookwidget against torch.func, Opacus and BackPACK (issue 24).

    python -m benchmarks.per_sample_zoo                        # all 46 models (tests/zoo.py + tests/zoo_real.py)
    python -m benchmarks.per_sample_zoo --part torch   # or transformers, real: one part, merged into the results
    python -m benchmarks.per_sample_zoo --models gpt2,vit --repeats 3
    python -m benchmarks.per_sample_zoo --device cuda          # on a GPU: per_sample_zoo_cuda.json and .md
    python -m benchmarks.per_sample_zoo --batch 32 --models gpt2,vit   # another batch: per_sample_zoo_b32.json and .md

Each zoo case (a tiny model, a batch of B=3, a sum-reduced loss) becomes one module of the sample indices
(`Sampled`: forward(idx) = the case's loss on those samples), so benchmarks/variants.py's steps run it unchanged:
plain forward+backward, hookwidget (hw.trace(step, capture="norms") + per_sample_grad_norms()), torch.func
(vmap of grad), Opacus (GradSampleModule's per-sample gradients, and its ghost clipping's norms) and BackPACK
(BatchL2Grad). Time: medians of interleaved repeats (one step of each variant in turn), as ratios to plain.
Peak memory: the most the CPU allocator holds during one step above the state before it (the profiler's memory
events; benchmarks/run.py's peak RSS cannot resolve a B=3 step, below a page), as ratios to plain; on a GPU, the
CUDA allocator's peak above its count before the step. On a GPU each timed step ends with a synchronisation.
Exactness: each method's max relative difference to a loop of autograd over the samples, over the parameters
that method covers (a peer that skips parameters is compared on the rest, and the table says so).
Opacus hooks only modules in training mode: its copy has its parameter-holding layers in training mode
(the zoo's models have no dropout; BatchNorm is refused by Opacus anyway).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import hookwidget as hw

from .run import RESULTS, cuda_peak_mb, write_results
from .variants import Step, Unavailable, interleaved, make_backpack, make_opacus, make_plain, make_torch_func

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import zoo  # noqa: E402

PEERS = ("torch.func", "Opacus", "Opacus ghost", "BackPACK")
HW = "hookwidget"


class Sampled(nn.Module):
    """A zoo case as a module of sample indices: forward(idx) is the case's sum-reduced loss on those samples,
    so a variant's `loss(model(x), y)` with x = arange(B) is the case's step (and vmap over x gives one sample)."""

    def __init__(self, case):
        super().__init__()
        self.inner, self.batch, self.case_loss = case.model, case.batch, case.loss

    def forward(self, idx):
        return self.case_loss(self.inner, tuple(t[idx] for t in self.batch))


def _loss(out, y):
    return out


def _on_the_case(model, x, y, loss):
    """The case's own step, its model called on the batch itself: hookwidget follows the samples from the model's
    inputs (Sampled's forward gathers them by index, a copy autograd does not record: no proof). The plain step
    of Sampled with x = arange(B) computes the same."""
    def run():
        model.zero_grad(set_to_none=True)
        model.case_loss(model.inner, model.batch).backward()

    return Step(run, model.parameters())


def _hookwidget(model, x, y, loss):
    plain = _on_the_case(model, x, y, loss)

    def run():
        return hw.trace(plain, capture="norms").per_sample_grad_norms()

    return Step(run, model.parameters())


def _trained_for_opacus(make):
    """Opacus hooks a layer only in training mode: its deep copy is made with the layers that hold parameters in
    training mode (BatchNorm aside: Opacus refuses it, and its statistics would change), the model restored after."""

    def wrapped(model, x, y, loss):
        flip = [m for m in model.modules() if not m.training and any(True for _ in m.parameters(recurse=False))
                and not isinstance(m, nn.modules.batchnorm._BatchNorm)]
        for m in flip:
            m.training = True
        try:
            return make(model, x, y, loss)
        finally:
            for m in flip:
                m.training = False

    return wrapped


MAKERS = {
    "plain": make_plain,
    HW: _hookwidget,
    "torch.func": make_torch_func,
    "Opacus": _trained_for_opacus(make_opacus),
    "Opacus ghost": _trained_for_opacus(functools.partial(make_opacus, mode="ghost")),
    "BackPACK": functools.partial(make_backpack, extension="BatchL2Grad"),
}


def keys(part: str) -> list:
    import zoo_real

    torch_keys = [b.__name__ for b in zoo.TORCH]
    hf = [b.__name__ for b in zoo.TRANSFORMERS]
    real = list(zoo_real.BUILDERS)
    return {"torch": torch_keys, "transformers": hf, "real": real, "all": torch_keys + hf + real}[part]


def build(key: str, device: str = "cpu"):
    """(case, (Sampled model, x, y, loss)) for a key of tests/zoo.py or tests/zoo_real.py, on `device`."""
    if key in zoo.BUILDERS:
        case = zoo.build(key)
    else:
        import zoo_real

        case = zoo_real.build(key)
    case.model.to(device)
    if device != "cpu":  # cuDNN's RNN backward runs only in training mode (the zoo's RNNs have no dropout)
        for m in case.model.modules():
            if isinstance(m, nn.RNNBase):
                m.train()
    case.batch = tuple(t.to(device) for t in case.batch)
    model = Sampled(case)
    n = case.batch[0].shape[0]
    return case, (model, torch.arange(n, device=device), torch.zeros(n, device=device), _loss)


# models whose samples-run-alone reference torch gets wrong (tests/test_zoo_real.py KNOWN: BatchNorm2d eval backward
# for a size-1 batch with a channels-last grad_output): their reference is each sample's contribution in the batch
BATCHED_REFERENCE = {"timm_efficientformer_l1"}


def reference(case, key: str) -> dict:
    """id(parameter) -> (B,) squared per-sample gradient norms from a loop of autograd over the samples (a
    parameter whose backward mixes samples, a frequency-scaled embedding: each sample's contribution)."""
    model = case.model
    params = [p for p in model.parameters() if p.requires_grad]
    mixing = {id(p) for p in (params if key in BATCHED_REFERENCE else zoo._mixing_in_backward(model))}
    alone, shared = [p for p in params if id(p) not in mixing], [p for p in params if id(p) in mixing]
    out = {id(p): [] for p in params}
    for i in range(case.batch[0].shape[0]):
        loss_i = case.loss(model, zoo._take(case.batch, i)) if alone else None
        gs = list(torch.autograd.grad(loss_i, alone, allow_unused=True)) if alone else []
        gs += zoo._contribution(case, shared, i) if shared else []
        for p, g in zip(alone + shared, gs):
            out[id(p)].append(0.0 if g is None else float(g.double().pow(2).sum()))
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def _rel(norms, ref_sq: dict, ids) -> float:
    ref = sum(ref_sq[i] for i in ids).sqrt()
    return float(((norms.double().cpu() - ref).abs() / ref.clamp_min(1e-30)).max())


def covered(v: str, step, sampled, hw_left: set) -> tuple[list, str]:
    """The parameters (ids of the zoo model's) whose norms method `v` includes, and a note where it skips some."""
    params = {n.removeprefix("inner."): p for n, p in sampled.named_parameters() if p.requires_grad}
    if v == HW:
        left = [n for n, p in params.items() if id(p) in hw_left]
    else:
        left = [n.removeprefix("inner.") for n in getattr(step, "left_out", [])]
    ids = [id(p) for n, p in params.items() if n not in left]
    return ids, (f"skips {len(left)} of {len(params)} parameters: {', '.join(left[:3])}"
                 + (", ..." if len(left) > 3 else "") if left else "")


def _spread(times: dict) -> float:
    """The largest median / minimum over the variants: 1 for steady timings, more where other jobs intervened."""
    return max(statistics.median(ts) / min(ts) for ts in times.values())


def _clock(device: str):
    """The interleaved timer's clock: on a GPU it waits for the device, so that a step's time is its kernels'."""
    if device == "cpu":
        return time.perf_counter

    def synchronised():
        torch.cuda.synchronize()
        return time.perf_counter()

    return synchronised


def bench(key: str, repeats: int, device: str = "cpu") -> dict:
    case, built = build(key, device)
    sampled = built[0]
    res = {"name": case.name, "family": case.family, "B": int(built[1].shape[0]), "refused": {}, "notes": {},
           "max_rel_diff": {}}
    steps = {}
    for v, make in MAKERS.items():
        try:
            steps[v] = make(*built)
            steps[v]()  # warm-up, and a first check that it runs here
            steps[v].reset()
        except Exception as e:  # noqa: BLE001 - a refusal is a cell of the table
            msg = str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            res["refused"][v] = msg[:160]
            steps.pop(v, None)
    if "plain" not in steps:
        raise RuntimeError(f"the plain step fails: {res['refused']['plain']}")
    times = interleaved(steps, repeats, _clock(device))
    if _spread(times) > 1.5:  # a neighbour's burst hit this model's timing: once more, the steadier of the two kept
        again = interleaved(steps, repeats, _clock(device))
        times = min(times, again, key=_spread)
        res["retimed"] = True
    med = {v: statistics.median(ts) for v, ts in times.items()}
    res["median_s"] = med
    res["spread"] = round(_spread(times), 2)
    res["ratio"] = {v: m / med["plain"] for v, m in med.items()}
    # exactness against the autograd loop, over what each method covers
    ref_sq = reference(case, key)
    t = hw.trace(_on_the_case(*built), capture="norms")
    hw_left = {id(t.params[n]) for n in t.per_sample_left_out}
    for v, step in steps.items():
        if v == "plain":
            continue
        try:
            norms = t.per_sample_grad_norms() if v == HW else step()
            step.reset()
            ids, note = covered(v, step, sampled, hw_left)
            if note:
                res["notes"][v] = note
            res["max_rel_diff"][v] = _rel(norms, ref_sq, ids)
        except Exception as e:  # noqa: BLE001
            res["notes"][v] = f"not compared: {type(e).__name__}: {str(e)[:80]}"
    res["peak_mb"] = {v: (peak_mb if device == "cpu" else _cuda_peak_mb)(step) for v, step in steps.items()}
    res["peak_ratio"] = {v: m / max(res["peak_mb"]["plain"], 1e-9) for v, m in res["peak_mb"].items()}
    if getattr(steps.get("Opacus"), "partial", False):
        res["notes"]["Opacus"] = steps["Opacus"].note
    return res


def peak_mb(step) -> float:
    """Peak MB a step allocates above the state before it (its .grad included), from the CPU allocator's own count
    (the profiler's memory events): exact at any size, where a B=3 step's peak RSS is below a page's resolution."""
    step.reset()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    step.reset()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/trace.json")
        events = json.loads(Path(f"{d}/trace.json").read_text())["traceEvents"]
    mem = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not mem:
        return 0.0
    # the profiler's running total starts where the previous profiled step left it (what that step allocated and
    # freed only after profiling ended, its .grad, stays counted): the step's own peak is above its first event's
    base = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    return max(0, max(m["Total Allocated"] for m in mem) - base) / 2**20


def _cuda_peak_mb(step) -> float:
    """Peak MB a step allocates on the GPU above the allocator's count before it (its .grad reset first)."""
    step.reset()
    gc.collect()
    peak = cuda_peak_mb(step)
    step.reset()
    return max(0.0, peak)


# -- the table ---------------------------------------------------------------------------------------
def _fair(r: dict, v: str) -> bool:
    """The peer covers every parameter and its norms agree with the reference (≤ 1e-4 relative)."""
    return "skips" not in r["notes"].get(v, "") and r["max_rel_diff"].get(v, 1.0) <= 1e-4


def verdict(r: dict, fair: bool = False) -> tuple[float | None, str | None]:
    """hookwidget's time over the fastest peer's (< 1: hookwidget faster), and that peer; fair: among the peers
    that cover every parameter with norms that agree with the reference."""
    peers = {v: r["ratio"][v] for v in PEERS if v in r["ratio"] and (not fair or _fair(r, v))}
    if HW not in r["ratio"] or not peers:
        return None, None
    best = min(peers, key=peers.get)
    return r["ratio"][HW] / peers[best], best


def _cell(r: dict, v: str) -> str:
    if v in r["refused"]:
        return "refuses¹" if v != HW else "fails"
    mark = "*" if "skips" in r["notes"].get(v, "") else ""
    mark += "†" if r["max_rel_diff"].get(v, 0.0) > 1e-4 else ""
    mem = r.get("peak_ratio", {}).get(v)
    return f"{r['ratio'][v]:.2f}×{mark}" + (f" / {mem:.2f}×" if mem is not None else "")


def _count(models: dict, fair: bool, limit: float) -> tuple[int, int]:
    judged = [verdict(r, fair)[0] for r in models.values()]
    judged = [x for x in judged if x is not None]
    return sum(x <= limit for x in judged), len(judged)


# a peer's error message -> the short reason the table gives (the JSON keeps the message)
SHORT = [
    ("layer with buffers", "a layer with buffers (BatchNorm, a buffer-holding module)"),
    ("Parameter tying is not supported", "tied parameters"),
    ("stack expects each tensor to be equal size", "a table called on positions (rows that are not samples)"),
    ("deepcopy protocol", "the model cannot be deep-copied (non-leaf tensors)"),
    ("Only padding_idx=None", "an Embedding with padding_idx"),
    ("Only scale_grad_by_freq=False", "an Embedding with scale_grad_by_freq"),
    ("only num_layers = 1", "an LSTM of several layers"),
    ("calling .item()", "data-dependent control flow under vmap"),
    ("BackwardHookFunction is a view", "an in-place op on a hooked module output"),
    ("has no attribute 'detach'", "a module called with a non-tensor argument"),
    ("expected device meta", "tensors on the meta device inside the model"),
    ("doesn't match the broadcast shape", "vmap cannot batch the recurrent layer's hidden state"),
    ("has no attribute 'output'", "a module called twice per step"),
    ("has no attribute '_norm_sample'", "a parameter of a layer it has no norm rule for"),
    ("can be converted to an index", "its LSTM wrapper fails on this LSTM"),
    ("as child module 'output'", "a module with a child named 'output' (where it keeps its own)"),
    ("not enough values to unpack", "EmbeddingBag (no grad sampler)"),
]


def short(msg: str) -> str:
    return next((why for key, why in SHORT if key in msg), msg[:90])


def markdown(res: dict) -> str:
    models = res["models"]
    (never, judged), (within, _) = _count(models, False, 1.0), _count(models, False, 1.1)
    (fair_never, fair_judged) = _count(models, True, 1.0)
    out = [f"# Per-sample gradient norms across the zoo (issue 24)\n\n{res['device']}, torch {res['torch']}, "
           f"{res['threads']} threads, B = {res.get('batch', 3)} per model, {res['repeats']} interleaved repeats "
           "after a warm-up; "
           f"load average {res['load_average']} → {res.get('load_average_end')}.\n",
           f"**hookwidget is never slower than every peer (as fast as the fastest or faster) on {never} of {judged} "
           f"models** where at least one peer runs ({within} within 1.1×); counting only peers that cover every "
           f"parameter with norms that agree with the reference: {fair_never} of {fair_judged}.\n",
           "Cells: time / peak memory of one step, as ratios to plain forward+backward (median of interleaved "
           f"repeats; peak of what the {'CPU' if res['device'].startswith('CPU') else 'CUDA'} allocator holds during "
           "one step, above the state before it). "
           "hookwidget: hw.trace(step, capture='norms') + per_sample_grad_norms(); torch.func: vmap(grad); "
           "Opacus: GradSampleModule (hooks), Opacus ghost: its "
           "ghost clipping (get_norm_sample); BackPACK: BatchL2Grad. * skips parameters (timed on less work; compared "
           "on the rest); † norms differ from the reference by more than 1e-4; ¹ refuses (reasons below). Max rel "
           "diff: to a loop of autograd over the samples, over the parameters each method covers. A model whose "
           "timings spread (a median over 1.5× its minimum) is timed twice, the steadier run kept.", "",
           "| model | plain ms | hookwidget | torch.func | Opacus | Opacus ghost | BackPACK | hookwidget vs fastest "
           "peer | max rel diff (hw / tf / op / og / bp) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in models.values():
        ratio, best = verdict(r)
        vs = "no peer runs" if ratio is None else f"{ratio:.2f}× ({best})"
        if ratio is not None and ratio > 1.0:
            vs = f"**{vs}**"
        diffs = " / ".join("–" if v not in r["max_rel_diff"] else f"{r['max_rel_diff'][v]:.0e}"
                           for v in (HW,) + PEERS)
        cells = " | ".join(_cell(r, v) for v in (HW,) + PEERS)
        out.append(f"| {r['name']} | {r['median_s']['plain'] * 1e3:.1f} | {cells} | {vs} | {diffs} |")
    out += ["", "## Refusals and skipped parameters", ""]
    for r in models.values():
        items = [f"{v} refuses: {short(why)}" for v, why in r["refused"].items()]
        items += [f"{v}: {n}" for v, n in r["notes"].items()]
        if items:
            out.append(f"- **{r['name']}**: " + "; ".join(items))
    for key, why in res.get("failed", {}).items():
        out.append(f"- **{key}**: not run here: {why}")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", choices=("torch", "transformers", "real", "all"))
    ap.add_argument("--models", default="", help="comma-separated zoo keys (instead of --part)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch", type=int, default=zoo.B, help="samples per case (the zoo's cases are written for 3)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run on a GPU machine or use --device cpu")
    if args.device == "cuda":  # float32 products, as the autograd loop's reference: TF32 would differ by ~1e-3
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(args.threads)
    chosen = [k for k in args.models.split(",") if k] or keys(args.part)
    written_for = zoo.B
    if args.batch != written_for:  # every case builds its batch from the zoo's B when built
        import zoo_real

        zoo.B = zoo_real.B = args.batch
    stem = ("per_sample_zoo" + ("" if args.device == "cpu" else "_cuda")
            + ("" if args.batch == written_for else f"_b{args.batch}"))
    path = Path(args.out) / f"{stem}.json"
    res = json.loads(path.read_text()) if path.exists() else {"models": {}}  # a part is merged into the last run
    where = (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)" if args.device == "cpu"
             else torch.cuda.get_device_name())
    res.update({"device": where, "batch": args.batch,
                "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
                "load_average": [round(v, 2) for v in os.getloadavg()]})
    order = keys("all")
    try:  # a fresh process's first steps run slow: the first model's timing would pay it
        bench(chosen[0], 3, args.device)
    except Exception:  # noqa: BLE001, S110 - its failure is named when it is run below
        pass
    res["failed"] = {}
    for key in chosen:
        try:
            r = bench(key, args.repeats, args.device)
        except Exception as e:  # noqa: BLE001 - a model that cannot be built or stepped here is named, the rest run
            res["failed"][key] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            print(key, "failed:", res["failed"][key], flush=True)
            traceback.print_exc()
            continue
        res["models"][key] = r
        print(key, {v: round(x, 2) for v, x in r["ratio"].items()}, r["max_rel_diff"], flush=True)
    res["models"] = {k: res["models"][k] for k in order if k in res["models"]}
    write_results(res, args.out, stem, markdown)


if __name__ == "__main__":
    main()
