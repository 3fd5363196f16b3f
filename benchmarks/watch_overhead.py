"""What hw.watch costs per training step, beside the hand-written floor and its peers, on CPU with one thread.

    python -m benchmarks.watch_overhead [--steps 100] [--repeats 3] [--models mlp,transformer,nn_encoder,gpt2]
        [--variants plain,floor,watch,watch+fr,per_sample,wandb1,wandb100,torchlens,torchlens_all,cockpit]
        [--memory] [--growth 100000] [--out benchmarks/results]

Variants of the loop (Adam; zero_grad / forward / backward / step):
  plain        no hooks
  floor        hand-written hooks that compute the watch's 12 statistics per layer every step (`Floor`): what
               hw.watch's statistics cost at the least, measured in the same run
  watch        hw.watch(model, flight_recorder=False): statistics only, every step
  watch+fr     hw.watch(model): the default, statistics and the flight recorder
  per_sample   hw.watch(model, flight_recorder=False, per_sample=True): also the largest per-sample
               gradient norm of each step and its sample (ghost norms)
  wandb1, wandb100, torchlens, torchlens_all, cockpit: the peers (benchmarks/watch_peers.py)
Models: the MLP 784-512-512-10 at B=32; a small pre-norm encoder written by hand (d=128, 2 blocks, 4 heads, T=32,
B=16); the issue's nn.TransformerEncoder (d=256, 4 heads, FFN 1024, 4 layers, batch_first, norm_first, T=64,
B=16; it runs a quarter of --steps: 0.25 s a step on CPU); a GPT-2-shaped decoder (vocabulary 2048, tied
embedding and head, learned positions, d=128, 2 causal blocks, 4 heads, T=64, B=8, GPT-2's initialisation).
Timing: CPU time (time.process_time, plus the CPU time of child processes: wandb-core) per step, since the
machine may be shared and wall time is not reliable there; torch.set_num_threads(1); glibc's heap trimming off
(MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_ set, the script re-executes itself; --default-malloc keeps
glibc's defaults, under which page faults add ~1 ms of system time to some MLP steps and not others). An
untimed plain loop comes first (a process's first loop pays one-off costs that would be charged to plain).
Each variant runs a block: set up, a fifth of its steps as warm-up, its timed steps, what it holds brought
to the host, torn down, and the model checked for hooks left behind (an error if any). The blocks alternate
within each of `--repeats` rounds (the order reversed every other round, so load changes hit all alike); the
median per-step time is reported with its ratio to plain's and to the floor's medians. A variant that fails
on a model (Cockpit: no BackPACK rule for a layer) is reported with its reason.
Peak memory (after the timing, or alone with --memory): each variant in a process of its own, the resident
set's high-water mark (VmHWM, plus that of child processes) after its steps, with its excess over plain.
Growth (--growth N, 0 to skip): the bytes a watch holds (everything reachable from `w` but the model and the
optimizer: row tensors, host buffers, kept Traces) after N/10 and after N steps of a 3-layer MLP, in a process
of its own, with and without the flight recorder: bytes per recorded step between the two.
Results: <out>/watch_overhead.json and .md (what was measured in this call replaces that part of the file).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from benchmarks.watch_peers import LABELS as PEER_LABELS
from benchmarks.watch_peers import PEERS, Monitor, loss_of, missing  # noqa: F401 - watch_gpu.py imports loss_of here
from hookwidget._torch import host_reads
from hookwidget.watch import watch

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mlp": "784-512-512-10 MLP, B 32", "transformer": "small encoder (d 128 × 2, T 32, B 16)",
          "nn_encoder": "nn.TransformerEncoder d 256 × 4, T 64, B 16", "gpt2": "GPT-2-shaped (d 128 × 2, T 64, B 8)"}
STEP_SHARE = {"nn_encoder": 0.25}  # of --steps: its steps take 15-60× the others'
LABELS = {"plain": "plain", "floor": "hand-written hooks, the same 12 statistics (the floor)",
          "watch": "`hw.watch(model, flight_recorder=False)`",
          "watch+fr": "`hw.watch(model)` (default: flight recorder on)",
          "per_sample": "`hw.watch(model, flight_recorder=False, per_sample=True)`",
          "per_sample_norms": "`hw.watch(model, flight_recorder=False, per_sample=\"norms\")`", **PEER_LABELS}


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Encoder(nn.Module):
    def __init__(self, d=128, heads=4, layers=2, classes=10):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, heads, 4 * d) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.ln(self.blocks(x)).mean(1))


class GPT2(nn.Module):
    """GPT-2's shape, small: token and position embeddings, pre-norm causal blocks, final LayerNorm,
    a head tied to the token embedding."""

    def __init__(self, vocab=2048, d=128, heads=4, layers=2, T=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.Sequential(*[Block(d, heads, 4 * d, causal=True) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        # GPT-2's initialisation. With nn.Embedding's N(0, 1) the tied head's logits reach ±50 and softmax's
        # gradient underflows to denormals: a step took 7× longer on CPU, all of it in denormal arithmetic.
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))


class TorchEncoder(nn.Module):
    """The issue's transformer as a user writes it: nn.TransformerEncoder, d 256, 4 heads, FFN 1024, 4 layers,
    batch_first and norm_first, a linear head on the mean over positions."""

    def __init__(self, d=256, heads=4, layers=4, classes=10):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def build(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        x = torch.randn(32, 784)
        return model, x, torch.randint(0, 10, (32,))
    if name == "transformer":
        model = Encoder()
        x = torch.randn(16, 32, 128)
        return model, x, torch.randint(0, 10, (16,))
    if name == "nn_encoder":
        model = TorchEncoder()
        return model, torch.randn(16, 64, 256), torch.randint(0, 10, (16,))
    if name == "gpt2":
        model = GPT2()
        idx = torch.randint(0, 2048, (8, 65))
        return model, idx[:, :-1], idx[:, 1:]
    raise ValueError(name)


class Floor:
    """The floor: hand-written hooks for the watch's 12 statistics per layer, at its cadence. In the forward hook
    of each layer with parameters ‖a‖ and its nonzero entries, and a tensor hook on its output for ‖δ‖ and
    min/max δ; NaN/Inf (of a, δ and each .grad) counted only where a norm is not finite on the CPU (reading it
    there is free, as the watch does), always on a GPU (reading it would wait for the device); at the optimizer
    step one multi-tensor norm for ‖W.grad‖ and ‖W‖, a copy of W before it and ‖ΔW‖ after; the step's
    (layers, 12) row put together on the model's device (the layer of each call and its size go there once per
    pattern of calls, as the watch's index tensors do); rows to the host every 64 steps."""

    def __init__(self, model):
        from hookwidget._torch.norms import foreach_copy_, foreach_norm, foreach_sub_

        self.norm, self.copy_, self.sub_ = foreach_norm, foreach_copy_, foreach_sub_
        self.layers = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
        self.params = [p for m in self.layers for p in m.parameters(recurse=False)]
        self.device = self.params[0].device
        self.on_host = host_reads.free(self.device)  # reading a value is free (the CPU)
        owner = [i for i, m in enumerate(self.layers) for _ in m.parameters(recurse=False)]
        self.owner, self.L = torch.tensor(owner, device=self.device), len(self.layers)
        self.copies = [torch.empty_like(p) for p in self.params]
        self.calls, self.pending, self.rows, self.index = [], [], [], {}
        self.handles = [m.register_forward_hook(self._forward(i)) for i, m in enumerate(self.layers)]
        self.handles += [register_optimizer_step_pre_hook(self._pre),
                         register_optimizer_step_post_hook(self._post)]

    def _counted(self, n) -> bool:
        return not self.on_host or not torch.isfinite(n)

    def _forward(self, i):
        def hook(module, inputs, out):
            out = out[0] if isinstance(out, tuple) and out else out  # nn.MultiheadAttention: (output, weights)
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                return
            a = inputs[0].detach()
            a = a if a.is_floating_point() else a.float()
            n = torch.linalg.vector_norm(a)
            bad = a.numel() - torch.isfinite(a).sum() if self._counted(n) else n.new_zeros(())
            entry = [i, n, a.bool().sum(), a.numel(), bad]
            self.calls.append(entry)

            def delta(g):
                lo, hi = torch.aminmax(g)
                gn = torch.linalg.vector_norm(g)
                counts = (torch.stack([torch.isnan(g).sum(), torch.isinf(g).sum()]).double()
                          if self._counted(gn) else g.new_zeros(2, dtype=torch.float64))
                entry.append((gn, torch.maximum(lo.abs(), hi.abs()), counts))

            out.register_hook(delta)

        return hook

    def _pre(self, opt, args, kwargs):
        self.copy_(self.copies, [p.detach() for p in self.params])

    def _post(self, opt, args, kwargs):
        calls, self.calls = [c for c in self.calls if len(c) == 6], []
        f64, L = torch.float64, self.L
        key = tuple((c[0], c[3]) for c in calls)
        if key not in self.index:
            self.index[key] = (torch.tensor([c[0] for c in calls], device=self.device),
                               torch.tensor([float(c[3]) for c in calls], dtype=f64, device=self.device))
        li, numel = self.index[key]
        d = torch.stack([torch.stack([c[5][0].double() ** 2, c[5][1].double(), *c[5][2],
                                      c[1].double() ** 2, -c[2].double(), c[4].double()]) for c in calls])
        d = torch.cat([d, numel[:, None]], 1)
        d[:, 5] += numel
        per = torch.zeros(L, 8, dtype=f64, device=self.device).index_add_(0, li, d)
        per[:, 1] = torch.zeros(L, dtype=f64, device=self.device).scatter_reduce_(0, li, d[:, 1], "amax",
                                                                                  include_self=False)
        self.sub_(self.copies, [p.detach() for p in self.params])
        sq = torch.stack(self.norm([p.grad for p in self.params] + [p.detach() for p in self.params]
                                   + self.copies)).double().square().view(3, -1)
        gwu = torch.zeros(3, L, dtype=f64, device=self.device).index_add_(1, self.owner, sq).sqrt()
        counts = torch.zeros(L, 2, dtype=f64, device=self.device)
        if self._counted(sq[0].sum()):
            c = torch.stack([c for p in self.params for c in (torch.isnan(p.grad).sum(), torch.isinf(p.grad).sum())])
            counts.index_add_(0, self.owner, c.view(-1, 2).double())
        n = per[:, 7].clamp(min=1)
        row = torch.stack([per[:, 0].sqrt(), per[:, 1], per[:, 2], per[:, 3], (per[:, 4] / n).sqrt(), per[:, 5] / n,
                           per[:, 6], gwu[0], gwu[1], gwu[2] / gwu[1], counts[:, 0], counts[:, 1]], dim=1)
        self.pending.append(row)
        if len(self.pending) >= 64:
            self.flush()

    def flush(self):
        if self.pending:
            self.rows.append(torch.stack(self.pending).cpu())
            self.pending = []

    def close(self):
        self.flush()
        for h in self.handles:
            h.remove()


class Hooked(Monitor):
    """A variant made of an object with hooks on the model: the floor or a watch (`flush` brings its rows to the
    host: part of the cost)."""

    def __init__(self, model, w):
        super().__init__(model)
        self.w = w

    def flush(self) -> None:
        if isinstance(self.w, Floor):
            self.w.flush()
        else:
            _ = self.w.stats

    def close(self) -> None:
        self.w.close()


def monitor(variant: str, model, x, watch=watch) -> Monitor:
    if variant in PEERS:
        return PEERS[variant](model, x)
    w = {"plain": lambda: None, "floor": lambda: Floor(model),
         "watch": lambda: watch(model, flight_recorder=False), "watch+fr": lambda: watch(model),
         "per_sample": lambda: watch(model, flight_recorder=False, per_sample=True),
         "per_sample_norms": lambda: watch(model, flight_recorder=False, per_sample="norms")}[variant]()
    return Monitor(model) if w is None else Hooked(model, w)


class HooksLeft(AssertionError):
    """A variant left a hook behind on the model (or a global one): it would be timed in the next blocks."""


def hooks_left(model) -> list:
    """Every hook on the model's modules and parameters, and every global module or optimizer hook."""
    from hookwidget._torch.modules import has_module_hooks, module_hooks, optimizer_hooks
    from hookwidget._torch.tensors import backward_hooks, post_accumulate_hooks

    left = [f"module hook on {n or 'the model'}" for n, m in model.named_modules() if has_module_hooks(m)]
    left += [f"tensor hook on {n}" for n, p in model.named_parameters()
             if backward_hooks(p) or post_accumulate_hooks(p)]
    left += [f"global {kind} module hook" for kind, d in module_hooks().items() if d]
    return left + [f"global optimizer hook ({len(d)})" for d in optimizer_hooks() if d]


def children_cpu() -> float:
    """CPU seconds of this process's child processes, alive (psutil) or ended and waited for."""
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = done.ru_utime + done.ru_stime
    try:
        import psutil
    except ImportError:
        return total
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


KEPT: dict = {}  # variant -> the steps whose Trace its watch kept in its latest loop (the flight recorder's)


def time_loop(model, x, y, steps: int, variant: str, watch=watch, warmup: int = 20) -> float:
    """CPU seconds per step of `steps` steps of `variant` after `warmup` untimed ones: this process's from the
    first timed step to the last one's rows on the host, and its child processes' until the teardown ended."""
    mon = monitor(variant, model, x, watch)
    try:
        net = mon.model
        opt = torch.optim.Adam(net.parameters(), 1e-4)
        mon.attach(opt)

        def step(i):
            opt.zero_grad()
            mon.backward(mon.loss(net(x), y), i)
            opt.step()

        for i in range(warmup):
            step(i)
        kids, t0 = children_cpu(), time.process_time()
        for i in range(warmup, warmup + steps):
            step(i)
        mon.flush()
        elapsed = time.process_time() - t0
    finally:
        mon.close()
        KEPT[variant] = list(getattr(getattr(mon, "w", None), "kept", None) or [])
        left = hooks_left(model)
        if left:
            raise HooksLeft(f"{variant} left {len(left)} hooks: {', '.join(left[:4])}")
    return (elapsed + children_cpu() - kids) / steps


def steps_for(name: str, steps: int) -> int:
    return max(2, round(steps * STEP_SHARE.get(name, 1.0)))


def one_line(e: BaseException) -> str:
    lines = [s for s in str(e).splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:160]


def time_models(models: list, variants: list, steps: int, repeats: int) -> dict:
    out = {}
    for name in models:
        model, x, y = build(name)
        n = steps_for(name, steps)
        time_loop(model, x, y, max(5, n // 2), "plain", warmup=0)  # untimed: a first loop pays one-off costs
        times, errors = {v: [] for v in variants}, {}
        for r in range(repeats):
            for v in variants if r % 2 == 0 else variants[::-1]:
                if v in errors:
                    continue
                try:
                    times[v].append(time_loop(model, x, y, n, v, warmup=max(2, n // 5)))
                except HooksLeft:
                    raise
                except Exception as e:  # noqa: BLE001 - a peer that cannot run this model: its reason is the row
                    errors[v] = one_line(e)
        med = {v: statistics.median(t) for v, t in times.items() if t and v not in errors}
        res = {"parameters": sum(p.numel() for p in model.parameters()), "steps": n,
               "ms": {v: t * 1e3 for v, t in med.items()},
               "x_plain": {v: t / med["plain"] for v, t in med.items()},
               "x_floor": {v: t / med["floor"] for v, t in med.items()} if "floor" in med else {},
               "rounds_x_plain": {v: [a / b for a, b in zip(t, times["plain"])] for v, t in times.items() if v in med},
               "errors": errors}
        out[name] = res
        print(f"\n{name} ({res['parameters']:,} parameters, {n} steps a block)")
        print(f"  {'variant':<14}{'ms/step':>10}{'x plain':>10}{'x floor':>10}   rounds (x plain)")
        for v in variants:
            if v in errors:
                print(f"  {v:<14}fails: {errors[v]}")
                continue
            vs = f"{res['x_floor'][v]:>10.3f}" if res["x_floor"] else f"{'':>10}"
            each = " ".join(f"{r:.3f}" for r in res["rounds_x_plain"][v])
            print(f"  {v:<14}{res['ms'][v]:>10.3f}{res['x_plain'][v]:>10.3f}{vs}   {each}", flush=True)
    return out


def cell(x: float | None, floor: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×" + (f" ({floor:.2f}×)" if floor is not None else "")


def markdown(res: dict) -> str:
    t, lines = res.get("timing"), ["# hw.watch beside the hand-written floor and its peers (CPU, 1 thread)", ""]
    if t:
        models = list(t["models"])
        lines += [f"{t['device']}, torch {t['torch']}, 1 thread, Adam, `python -m benchmarks.watch_overhead "
                  f"--steps {t['steps']} --repeats {t['repeats']}`: one process, each monitor set up and torn down "
                  f"per block (no hook left: checked), blocks interleaved over {t['repeats']} rounds, medians of "
                  f"CPU time per step (this process and its children). Load average (1/5/15 min) "
                  f"{'/'.join(f'{v:.2f}' for v in t['load_start'])} at the start, "
                  f"{'/'.join(f'{v:.2f}' for v in t['load_end'])} at the end; {t['seconds'] / 60:.1f} minutes "
                  f"(the whole run, with peak memory and growth: {res.get('seconds_total', 0) / 60:.1f}).", "",
                  "| monitor: × plain (× the floor) | " + " | ".join(
                      f"{MODELS[m]} ({t['models'][m]['steps']} steps)" for m in models) + " |",
                  "|---" * (len(models) + 1) + "|"]
        notes: dict = {}  # (variant, why) -> its number

        def note(v, why):
            return f"({notes.setdefault((v, why), len(notes) + 1)})"

        for v in t["variants"]:
            row = []
            for m in models:
                r = t["models"][m]
                if v in r["errors"]:
                    row.append(f"fails {note(v, r['errors'][v])}")
                elif v == "plain":
                    row.append(f"1.00× ({r['ms']['plain']:.1f} ms)")
                else:
                    row.append(cell(r["x_plain"].get(v), r["x_floor"].get(v)))
            lines.append(f"| {LABELS[v]} | " + " | ".join(row) + " |")
        for v, why in t.get("not_run", {}).items():
            lines.append(f"| {LABELS[v]} | " + " | ".join(f"not run {note(v, why)}" for _ in models) + " |")
        lines += ["", *(f"({i}) {LABELS[v]}: {why}" for (v, why), i in notes.items()), *([""] if notes else [])]
    if res.get("memory"):
        mem, models = res["memory"], list(res["memory"]["models"])
        lines += ["Peak memory: one process per monitor, the resident high-water mark (VmHWM, plus child "
                  "processes') after its steps (" + ", ".join(f"{mem['models'][m]['steps']} for {m}" for m in models)
                  + "); excess over plain (× plain). Where the flight recorder found anomalous "
                  "steps, the Traces it keeps of them (each a whole step's a, δ and .grad) are part of its peak: the "
                  "cell says how many.", "",
                  "| monitor | " + " | ".join(MODELS[m] for m in models) + " |",
                  "|---" * (len(models) + 1) + "|"]
        for v in mem["variants"]:
            row = []
            for m in models:
                p, kept = mem["models"][m]["mib"], mem["models"][m].get("kept", {}).get(v, [])
                row.append(f"{p[v]:.0f} MiB" if v == "plain" else
                           f"{p[v] - p['plain']:+.0f} MiB ({p[v] / p['plain']:.2f}×)" if v in p else "fails")
                if len(kept) > 1:  # the latest step is always kept; more are anomalies (or keep=) it keeps whole
                    row[-1] += f", {len(kept) - 1} anomalous step{'s' * (len(kept) > 2)} kept"
            lines.append(f"| {LABELS[v]} | " + " | ".join(row) + " |")
        lines.append("")
    if res.get("growth"):
        g = res["growth"]
        layers = next(iter(g.values()))["layers"]
        lines += [f"What a watch holds (everything reachable from `w` but the model and the optimizer), MLP "
                  f"16-32-32-4 ({layers} layers), B 8, Adam, documented: layers × 13 + 2 float64 and a step index = "
                  f"{layers * 104 + 24} B per recorded step.", "",
                  "| watch | held after 1/10 of the steps | after all | bytes per step |",
                  "|---|---|---|---|"]
        for v, r in g.items():
            (a, ha), (b, hb) = sorted(r["held"].items(), key=lambda kv: int(kv[0]))
            lines.append(f"| {LABELS[v]} | {ha / 1e6:.2f} MB ({int(a):,} steps) | {hb / 1e6:.2f} MB ({int(b):,} steps) "
                         f"| {r['bytes_per_step']:.0f} B |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="mlp,transformer,nn_encoder,gpt2")
    ap.add_argument("--variants", default="plain,floor,watch,watch+fr,per_sample," + ",".join(PEERS))
    ap.add_argument("--memory", action="store_true", help="peak memory (and --growth) only, no timing")
    ap.add_argument("--growth", type=int, default=100_000, help="steps of the growth measure (0: none)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--default-malloc", action="store_true", help="keep glibc's default trimming (see above)")
    args = ap.parse_args()
    if not args.default_malloc and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        # glibc hands freed memory back to the OS and faults it in again on the next step: in a plain loop that
        # was 650 page faults and ~1 ms of system time per MLP step, varying with the heap's history (so from
        # variant to variant). Run again with trimming and mmap thresholds out of reach, so CPU time measures
        # the work, not the allocator's luck.
        env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="4294967296", MALLOC_MMAP_THRESHOLD_="4294967296",
                   PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        # as a module again (`python -m benchmarks.watch_overhead`): re-run as a script, its folder would come first
        # on sys.path and `benchmarks` could be another package of that name
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.watch_overhead", *sys.argv[1:]], env)
    torch.set_num_threads(1)
    variants, models, not_run = ["plain"], args.models.split(","), {}
    for v in args.variants.split(","):
        why = missing(v) if v in PEERS else None
        if why:
            print(f"{v}: {why}")
            not_run[v] = why
        elif v not in variants:
            variants.append(v)
    out = Path(args.out)
    path = out / "watch_overhead.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    t0, load = time.time(), os.getloadavg()
    if not args.memory:
        print(f"torch {torch.__version__}, 1 thread, {args.steps} steps a block, median of {args.repeats} rounds")
        timing = time_models(models, variants, args.steps, args.repeats)
        res["timing"] = {"device": _device(), "torch": torch.__version__, "steps": args.steps, "repeats": args.repeats,
                         "variants": variants, "not_run": not_run, "models": timing, "load_start": load,
                         "load_end": os.getloadavg(), "seconds": time.time() - t0}
    from benchmarks import watch_memory

    t1 = time.time()
    res["memory"] = {"variants": variants, "models": watch_memory.peaks(models, variants, args.steps)}
    if args.growth:
        res["growth"] = watch_memory.growths(args.growth)
    res["memory"]["seconds"] = time.time() - t1  # with the growth measure's
    if not args.memory:
        res["seconds_total"] = time.time() - t0
    print(f"\n{(time.time() - t0) / 60:.1f} minutes; load average {load} at the start, {os.getloadavg()} at the end")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    (out / "watch_overhead.md").write_text(markdown(res))


def _device() -> str:
    import platform

    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
