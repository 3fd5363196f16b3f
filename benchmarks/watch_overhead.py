"""What hw.watch costs per training step, on CPU with one thread.

    PYTHONPATH=. .venv/bin/python benchmarks/watch_overhead.py [--steps 400] [--repeats 3]

Loops (Adam, zero_grad / forward / backward / step):
  plain        no hooks
  watch        hw.watch(model, flight_recorder=False): statistics only, every step
  watch+fr     hw.watch(model): statistics and the flight recorder (a full recording per step)
  histograms   a hand-written "wandb.watch-style" logger: torch.histc (64 bins) of every parameter's
               .grad every step, with its min and max, moved to the host (as a logger would send it)
Models: the MLP 784-512-512-10 at B=32, and a small pre-norm transformer encoder (d=128, 2 blocks,
4 heads, T=32, B=16). Each variant runs `--steps` timed steps after 20 warm-up steps; the variants
alternate over `--repeats` rounds and the median per-step time is reported, with its ratio to plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from hookwidget.watch import watch


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Encoder(nn.Module):
    def __init__(self, d=128, heads=4, layers=2, classes=10):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, heads, 4 * d) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.ln(self.blocks(x)).mean(1))


def build(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        x = torch.randn(32, 784)
    else:
        model = Encoder()
        x = torch.randn(16, 32, 128)
    return model, x, torch.randint(0, 10, (x.shape[0],))


def histograms(model):
    out = []
    for p in model.parameters():
        g = p.grad.detach()
        out.append(torch.cat([torch.histc(g, bins=64), torch.aminmax(g)[0].view(1), torch.aminmax(g)[1].view(1)]))
    return torch.cat(out).tolist()


def time_loop(model, x, y, steps: int, variant: str) -> float:
    opt = torch.optim.Adam(model.parameters(), 1e-4)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if variant == "histograms":
            histograms(model)
        opt.step()

    w = None
    if variant.startswith("watch"):
        w = watch(model, flight_recorder=variant == "watch+fr")
    try:
        for _ in range(20):
            step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if w is not None:
            _ = w.stats  # what is still on device comes to the host: part of the cost
        elapsed = time.perf_counter() - t0
    finally:
        if w is not None:
            w.close()
    return elapsed / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="mlp,transformer")
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = ("plain", "watch", "watch+fr", "histograms")
    print(f"torch {torch.__version__}, 1 thread, {args.steps} steps, median of {args.repeats} rounds")
    for name in args.models.split(","):
        model, x, y = build(name)
        times: dict = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v in variants:
                times[v].append(time_loop(model, x, y, args.steps, v))
        plain = statistics.median(times["plain"])
        print(f"\n{name} ({sum(p.numel() for p in model.parameters()):,} parameters)")
        print(f"  {'variant':<12}{'ms/step':>10}{'x plain':>10}")
        for v in variants:
            t = statistics.median(times[v])
            print(f"  {v:<12}{t * 1e3:>10.3f}{t / plain:>10.2f}")


if __name__ == "__main__":
    main()
