"""The benchmark models, each with a sum-reduced loss so per-sample gradients are well defined."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block from plain Linear/LayerNorm layers (as nanoGPT), so every
    parameter has a per-sample rule (nn.MultiheadAttention hides its projections from hooks)."""

    def __init__(self, d: int, heads: int, ffn: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        B, T, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Encoder(nn.Module):
    def __init__(self, d=256, heads=4, ffn=1024, layers=2):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, heads, ffn, causal=False) for _ in range(layers)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


class GPT2(nn.Module):
    def __init__(self, vocab=50257, d=768, heads=12, layers=12, seq=128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads, 4 * d, causal=True) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)  # batched: per-sample rules apply
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


class MHABlock(nn.Module):
    """Pre-norm block as real models write it: nn.MultiheadAttention(batch_first=True) (fused in_proj_weight,
    out_proj called functionally inside it), LayerNorm, GELU MLP."""

    def __init__(self, d: int, heads: int, ffn: int, causal: bool):
        super().__init__()
        self.causal = causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        h = self.ln1(x)
        mask = None
        if self.causal:
            T = x.shape[1]
            mask = torch.triu(torch.full((T, T), float("-inf"), device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """ViT-shaped as torchvision/timm write it: patch embedding conv, class token and position embedding as
    Parameters of the model itself (concatenated with / added to the batch), MultiheadAttention blocks."""

    def __init__(self, d=192, heads=3, layers=6, patch=4, image=32, classes=10):
        super().__init__()
        n = (image // patch) ** 2
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embedding = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        self.blocks = nn.Sequential(*[MHABlock(d, heads, 4 * d, causal=False) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embedding
        return self.head(self.ln(self.blocks(x))[:, 0])


class GPT2MHA(nn.Module):
    """GPT-2-shaped the way real models are written: fused q/k/v (nn.MultiheadAttention, causal mask), position
    embedding called on arange(T) (one (T, d) table added to the batch)."""

    def __init__(self, vocab=8192, d=256, heads=4, layers=4, seq=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[MHABlock(d, heads, 4 * d, causal=True) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


MODELS = ("mlp", "cnn", "transformer", "gpt2", "hooks", "vit", "gpt2mha")


def build(name: str, device: str, small: bool = False):
    """(model, inputs, targets, loss(out, target) summed over the batch)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        x, y = torch.randn(32, 784, generator=g), torch.randint(0, 10, (32,), generator=g)
        loss = _ce
    elif name == "cnn":
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 10))
        x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        loss = _ce
    elif name == "transformer":
        model = Encoder()
        x, y = torch.randn(16, 64, 256, generator=g), torch.randn(16, 64, 1, generator=g)
        loss = _mse
    elif name == "gpt2":
        B, layers, vocab = (4, 12, 50257) if not small else (2, 2, 1000)
        model = GPT2(vocab=vocab, layers=layers)
        x = torch.randint(0, vocab, (B, 128), generator=g)
        y = torch.randint(0, vocab, (B, 128), generator=g)
        loss = _ce_seq
    elif name == "vit":  # 32x32 images, 4x4 patches: 64 patches + class token, d=192, 3 heads, 6 blocks
        model = ViT() if not small else ViT(layers=2)
        x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = _ce
    elif name == "gpt2mha":  # d=256, 4 heads, 4 blocks, vocabulary 8192, seq 64, B=8
        model = GPT2MHA() if not small else GPT2MHA(vocab=1000, layers=2)
        x = torch.randint(0, model.tok.num_embeddings, (8, 64), generator=g)
        y = torch.randint(0, model.tok.num_embeddings, (8, 64), generator=g)
        loss = _ce_seq
    elif name == "hooks":  # many tiny layers: the per-module cost of hooks, not arithmetic
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(100)])
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        loss = _mse
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return model.to(device), x.to(device), y.to(device), loss


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def _ce_seq(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


def _mse(out, y):
    return ((out - y) ** 2).sum()


def count_modules(model: nn.Module) -> int:
    """Modules whose hooks fire in a step (every module is called once in these models)."""
    return sum(1 for _ in model.modules())


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


