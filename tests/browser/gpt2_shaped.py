"""A GPT-2-shaped model built from torch.nn (12 blocks of LayerNorm, attention Linear layers and an MLP,
small widths) for the browser tests of readability at that size."""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape  # noqa: N806
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(B, T, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, vocab=64, ctx=16, d=32, layers=12, heads=4):
        super().__init__()
        self.transformer = GPT2Model(vocab, ctx, d, layers, heads)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        return self.lm_head(self.transformer(idx))


def gpt2_step(seed=0):
    """(model, step): one training step's forward + backward on a batch of 2 × 8 tokens."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel()
    idx = torch.randint(0, 64, (2, 8))
    target = torch.randint(0, 64, (2, 8))

    def step():
        model.zero_grad()
        logits = model(idx)
        F.cross_entropy(logits.reshape(-1, 64), target.reshape(-1)).backward()

    return model, step
