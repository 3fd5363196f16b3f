"""What hw.watch costs per training step, on CPU with one thread.

    PYTHONPATH=. .venv/bin/python benchmarks/watch_overhead.py [--steps 500] [--repeats 3]
        [--models mlp,transformer,gpt2] [--variants plain,floor,watch,watch+fr,per_sample,histograms] [--memory]

Loops (Adam, zero_grad / forward / backward / step):
  plain        no hooks
  floor        hand-written hooks that compute the watch's 12 statistics per layer every step (`Floor`): what
               hw.watch's statistics cost at the least, measured in the same run
  watch        hw.watch(model, flight_recorder=False): statistics only, every step
  watch+fr     hw.watch(model): statistics and the flight recorder
  per_sample   hw.watch(model, flight_recorder=False, per_sample=True): also the largest per-sample
               gradient norm of each step and its sample (ghost norms)
  histograms   a hand-written "wandb.watch-style" logger: torch.histc (64 bins) of every parameter's
               .grad every step, with its min and max, moved to the host (as a logger would send it)
Models: the MLP 784-512-512-10 at B=32; a small pre-norm transformer encoder (d=128, 2 blocks,
4 heads, T=32, B=16); a GPT-2-shaped decoder (vocabulary 2048, tied embedding and head, learned
positions, d=128, 2 causal blocks, 4 heads, T=64, B=8).
Timing: time.process_time (CPU time of this process: the machine may be shared, wall time is not
reliable there), torch.set_num_threads(1), glibc's heap trimming off (MALLOC_TRIM_THRESHOLD_ and
MALLOC_MMAP_THRESHOLD_ set, the script re-executes itself; --default-malloc keeps glibc's defaults, under
which page faults add ~1 ms of system time to some MLP steps and not others). An untimed plain loop
of 50 steps comes first (a process's first loop pays one-off costs that would be charged to plain).
Each variant runs `--steps` timed steps after 20 warm-up steps; the variants alternate within each of
`--repeats` rounds (so load changes hit them alike) and the median per-step time is reported with its
ratio to plain's median.
--memory: instead, peak memory per variant, each in a process of its own (the resident set's high-water mark,
ru_maxrss, after `--steps` steps), reported with its excess over plain's: what a watch holds at its peak (the
flight recorder: the latest step's and the running step's detail, and the kept Traces).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hookwidget.watch import watch


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

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))


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
    if name == "gpt2":
        model = GPT2()
        idx = torch.randint(0, 2048, (8, 65))
        return model, idx[:, :-1], idx[:, 1:]
    raise ValueError(name)


class Floor:
    """The floor: hand-written hooks for the watch's 12 statistics per layer, at its cadence. In the forward hook
    of each layer with parameters ‖a‖ and its nonzero entries, and a tensor hook on its output for ‖δ‖ and
    min/max δ (NaN/Inf counted only where a norm is not finite: on CPU reading it is free, as the watch does);
    at the optimizer step one multi-tensor norm for ‖W.grad‖ and ‖W‖, a copy of W before it and ‖ΔW‖ after;
    the step's (layers, 12) row put together on device; rows to the host every 64 steps."""

    def __init__(self, model):
        from hookwidget._torch.norms import foreach_copy_, foreach_norm, foreach_sub_

        self.norm, self.copy_, self.sub_ = foreach_norm, foreach_copy_, foreach_sub_
        self.layers = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
        self.params = [p for m in self.layers for p in m.parameters(recurse=False)]
        owner = [i for i, m in enumerate(self.layers) for _ in m.parameters(recurse=False)]
        self.owner, self.L = torch.tensor(owner), len(self.layers)
        self.copies = [torch.empty_like(p) for p in self.params]
        self.calls, self.pending, self.rows = [], [], []
        self.handles = [m.register_forward_hook(self._forward(i)) for i, m in enumerate(self.layers)]
        self.handles += [register_optimizer_step_pre_hook(self._pre),
                         register_optimizer_step_post_hook(self._post)]

    def _forward(self, i):
        def hook(module, inputs, out):
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                return
            a = inputs[0].detach()
            a = a if a.is_floating_point() else a.float()
            n = torch.linalg.vector_norm(a)
            bad = a.numel() - torch.isfinite(a).sum() if not torch.isfinite(n) else n.new_zeros(())
            entry = [i, n, a.bool().sum(), a.numel(), bad]
            self.calls.append(entry)

            def delta(g):
                lo, hi = torch.aminmax(g)
                gn = torch.linalg.vector_norm(g)
                counts = (torch.stack([torch.isnan(g).sum(), torch.isinf(g).sum()]).double()
                          if not torch.isfinite(gn) else torch.zeros(2, dtype=torch.float64))
                entry.append((gn, torch.maximum(lo.abs(), hi.abs()), counts))

            out.register_hook(delta)

        return hook

    def _pre(self, opt, args, kwargs):
        self.copy_(self.copies, [p.detach() for p in self.params])

    def _post(self, opt, args, kwargs):
        calls, self.calls = [c for c in self.calls if len(c) == 6], []
        f64, L = torch.float64, self.L
        li = torch.tensor([c[0] for c in calls])
        d = torch.stack([torch.stack([c[5][0].double() ** 2, c[5][1].double(), *c[5][2],
                                      c[1].double() ** 2, float(c[3]) - c[2].double(), c[4].double(),
                                      torch.tensor(float(c[3]), dtype=f64)]) for c in calls])
        per = torch.zeros(L, 8, dtype=f64).index_add_(0, li, d)
        per[:, 1] = torch.zeros(L, dtype=f64).scatter_reduce_(0, li, d[:, 1], "amax", include_self=False)
        self.sub_(self.copies, [p.detach() for p in self.params])
        sq = torch.stack(self.norm([p.grad for p in self.params] + [p.detach() for p in self.params]
                                   + self.copies)).double().square().view(3, -1)
        gwu = torch.zeros(3, L, dtype=f64).index_add_(1, self.owner, sq).sqrt()
        n = per[:, 7].clamp(min=1)
        row = torch.stack([per[:, 0].sqrt(), per[:, 1], per[:, 2], per[:, 3], (per[:, 4] / n).sqrt(), per[:, 5] / n,
                           per[:, 6], gwu[0], gwu[1], gwu[2] / gwu[1], per[:, 2] * 0, per[:, 3] * 0], dim=1)
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


def histograms(model):
    out = []
    for p in model.parameters():
        g = p.grad.detach()
        out.append(torch.cat([torch.histc(g, bins=64), torch.aminmax(g)[0].view(1), torch.aminmax(g)[1].view(1)]))
    return torch.cat(out).tolist()


def loss_of(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def time_loop(model, x, y, steps: int, variant: str, watch=watch) -> float:
    opt = torch.optim.Adam(model.parameters(), 1e-4)

    def step():
        opt.zero_grad()
        loss_of(model(x), y).backward()
        if variant == "histograms":
            histograms(model)
        opt.step()

    w = None
    if variant == "floor":
        w = Floor(model)
    elif variant in ("watch", "watch+fr"):
        w = watch(model, flight_recorder=variant == "watch+fr")
    elif variant == "per_sample":
        w = watch(model, flight_recorder=False, per_sample=True)
    try:
        for _ in range(20):
            step()
        t0 = time.process_time()
        for _ in range(steps):
            step()
        if isinstance(w, Floor):
            w.flush()
        elif w is not None:
            _ = w.stats  # what is still on device comes to the host: part of the cost
        elapsed = time.process_time() - t0
    finally:
        if w is not None:
            w.close()
    return elapsed / steps


def peak_mb(name: str, variant: str, steps: int) -> float:
    """ru_maxrss (MiB) of this process after `steps` steps of `variant` on model `name`: run it in a fresh one."""
    import resource

    model, x, y = build(name)
    time_loop(model, x, y, steps, variant)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory(models: list, variants: list, steps: int) -> None:
    import subprocess

    print(f"peak resident memory (MiB, ru_maxrss, one process per variant), {steps} steps")
    for name in models:
        peaks = {}
        for v in variants:
            code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                    f"import torch; torch.set_num_threads(1); import watch_overhead as b; "
                    f"print(b.peak_mb({name!r}, {v!r}, {steps}))")
            peaks[v] = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                            text=True).stdout.split()[-1])
        print(f"\n{name}")
        for v in variants:
            print(f"  {v:<12}{peaks[v]:>10.1f} MiB{peaks[v] - peaks['plain']:>+10.1f} over plain", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="mlp,transformer,gpt2")
    ap.add_argument("--variants", default="plain,floor,watch,watch+fr,per_sample,histograms")
    ap.add_argument("--memory", action="store_true", help="peak memory per variant instead of time (see above)")
    ap.add_argument("--default-malloc", action="store_true", help="keep glibc's default trimming (see above)")
    args = ap.parse_args()
    if not args.default_malloc and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        # glibc hands freed memory back to the OS and faults it in again on the next step: in a plain loop that
        # was 650 page faults and ~1 ms of system time per MLP step, varying with the heap's history (so from
        # variant to variant). Run again with trimming and mmap thresholds out of reach, so CPU time measures
        # the work, not the allocator's luck.
        env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="4294967296", MALLOC_MMAP_THRESHOLD_="4294967296")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    torch.set_num_threads(1)
    variants = [v for v in args.variants.split(",")
                if v != "per_sample" or "per_sample" in inspect.signature(watch).parameters]
    if "plain" not in variants:
        variants.insert(0, "plain")
    if args.memory:
        return memory(args.models.split(","), variants, args.steps)
    print(f"torch {torch.__version__}, 1 thread, {args.steps} steps, median of {args.repeats} rounds, "
          f"process_time")
    for name in args.models.split(","):
        model, x, y = build(name)
        time_loop(model, x, y, 50, "plain")  # untimed: the process's first loop pays one-off costs (allocator)
        times: dict = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v in variants:
                times[v].append(time_loop(model, x, y, args.steps, v))
        plain = statistics.median(times["plain"])
        print(f"\n{name} ({sum(p.numel() for p in model.parameters()):,} parameters)")
        print(f"  {'variant':<12}{'ms/step':>10}{'x plain':>10}{'x floor':>10}   rounds (x plain)")
        for v in variants:
            t = statistics.median(times[v])
            floor = statistics.median(times["floor"]) if "floor" in times else None
            each = " ".join(f"{s / p:.3f}" for s, p in zip(times[v], times["plain"]))
            vs = f"{t / floor:>10.3f}" if floor else f"{'':>10}"
            print(f"  {v:<12}{t * 1e3:>10.3f}{t / plain:>10.3f}{vs}   {each}", flush=True)


if __name__ == "__main__":
    main()
