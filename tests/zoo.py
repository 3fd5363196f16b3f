"""A zoo of small architectures for hookwidget's coverage and exactness (issue 14).

Each builder returns a Case: a tiny model with random weights (nothing is downloaded), a batch whose
tensors all have the batch dimension first, and a sum-reduced loss, so per-sample gradients are
defined. `measure(name)` traces one training step with `hw.trace` and checks, against autograd only:

1. exactness: `t.weight_grad` / `t.bias_grad` of every layer in `t.factor_layers` against the
   parameter's `.grad` (a parameter shared by several layers: the sum over them);
2. per-sample norms: `t.per_sample_grad_norms()` against a loop of autograd over the samples, each run
   alone, over the same parameters (those of the factor layers whose input has the batch dimension);
3. coverage: the share of gradient elements those parameters hold, and, for every parameter left
   out, the note of `t.notes` that names its layer (by qualified name or class name).

Models run in eval mode (no dropout; BatchNorm on running statistics, so samples do not mix); models
with BatchNorm are traced once more in train mode for exactness alone (a sample's row is then only its
contribution, so per-sample norms are not compared there). transformers is imported only by the
builders of the transformers models; timm and torchvision are not used (their blocks are written out).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

B = 3  # batch size of every case


@dataclass
class Case:
    name: str
    family: str  # "transformers" or "torch"
    model: nn.Module
    batch: tuple  # tensors, batch dimension first
    loss: Callable  # (model, batch) -> sum-reduced scalar
    batch_norm: bool = False
    notes: list = field(default_factory=list)


def _ce(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum")


# ----------------------------------------------------------------------------------------------
# torch.nn models, torchvision-style blocks written out
# ----------------------------------------------------------------------------------------------
def _conv_bn(cin, cout, k=3, stride=1, groups=1, act=True):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU(inplace=True)) if act else nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + idt)


class ResNetTiny(nn.Module):
    def __init__(self, n_cls=5):
        super().__init__()
        self.stem = _conv_bn(3, 8)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, n_cls)

    def forward(self, x):
        return self.fc(self.pool(self.layer2(self.layer1(self.stem(x)))).flatten(1))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project (linear bottleneck)."""

    def __init__(self, c, expand=4):
        super().__init__()
        h = c * expand
        self.block = nn.Sequential(
            nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6(inplace=True),
            nn.Conv2d(h, h, 3, 1, 1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6(inplace=True),
            nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.block(x)


class MobileNetTiny(nn.Module):
    def __init__(self, n_cls=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True))
        self.blocks = nn.Sequential(InvertedResidual(8), InvertedResidual(8))
        self.head = nn.Linear(8, n_cls)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's LayerNorm over channels of an NCHW tensor, as torchvision writes it (overrides forward)."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock: 7x7 depthwise conv, LayerNorm channels-last, MLP, layer scale (a Parameter)."""

    def __init__(self, c):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.pwconv1 = nn.Linear(c, 4 * c)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * c, c)
        self.layer_scale = nn.Parameter(torch.full((c, 1, 1), 0.5))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y)))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class ConvNeXtTiny(nn.Module):
    def __init__(self, n_cls=5, c=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 4, 4), LayerNorm2d(c, eps=1e-6))
        self.stages = nn.Sequential(ConvNeXtBlock(c), ConvNeXtBlock(c))
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.head = nn.Linear(c, n_cls)

    def forward(self, x):
        return self.head(self.norm(self.stages(self.stem(x)).mean((2, 3))))


class SqueezeExcite(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.fc1 = nn.Conv2d(c, c // r, 1)
        self.fc2 = nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True)))))


class RegNetYBlock(nn.Module):
    """RegNetY's bottleneck: 1x1, 3x3 grouped (group width 4), squeeze-excite, 1x1; projection shortcut."""

    def __init__(self, cin, cout, stride=1, group_width=4):
        super().__init__()
        self.a = _conv_bn(cin, cout, 1)
        self.b = _conv_bn(cout, cout, 3, stride, groups=cout // group_width)
        self.se = SqueezeExcite(cout)
        self.c = _conv_bn(cout, cout, 1, act=False)
        self.proj = _conv_bn(cin, cout, 1, stride, act=False) if stride != 1 or cin != cout else None

    def forward(self, x):
        idt = x if self.proj is None else self.proj(x)
        return F.relu(self.c(self.se(self.b(self.a(x)))) + idt)


class RegNetTiny(nn.Module):
    def __init__(self, n_cls=5):
        super().__init__()
        self.stem = _conv_bn(3, 8, 3, 2)
        self.s1 = RegNetYBlock(8, 16, stride=2)
        self.s2 = RegNetYBlock(16, 16)
        self.fc = nn.Linear(16, n_cls)

    def forward(self, x):
        return self.fc(self.s2(self.s1(self.stem(x))).mean((2, 3)))


class UNetTiny(nn.Module):
    """Two levels: conv + GroupNorm down, max-pool, ConvTranspose2d up, skip concat, 1x1 out."""

    def __init__(self, c=8):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.GroupNorm(2, c), nn.SiLU())
        self.enc2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.GroupNorm(4, 2 * c), nn.SiLU())
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.InstanceNorm2d(c, affine=True), nn.SiLU())
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        return self.out(self.dec(torch.cat([self.up(e2), e1], 1)))


class LSTMTagger(nn.Module):
    def __init__(self, vocab=50, d=16, n_tags=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * d, n_tags)

    def forward(self, ids):
        return self.out(self.lstm(self.emb(ids))[0])


class GRUClassifier(nn.Module):
    def __init__(self, d_in=8, d=16, n_cls=4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, n_cls)

    def forward(self, x):
        h = self.gru(torch.tanh(self.inp(x)))[0]
        return self.out(self.norm(h[:, -1]))


class TorchTransformer(nn.Module):
    """nn.TransformerEncoder (nn.MultiheadAttention inside), pre-norm, learned positions by nn.Embedding."""

    def __init__(self, vocab=50, d=32, T=8, n_cls=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_cls)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.norm(self.encoder(h)).mean(1))


class MixerBlock(nn.Module):
    def __init__(self, tokens, d):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.norm2 = nn.LayerNorm(d)
        self.channel_mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):  # (B, T, d)
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MLPMixer(nn.Module):
    def __init__(self, n_cls=5, d=16, patch=4, size=16):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.blocks = nn.Sequential(MixerBlock((size // patch) ** 2, d), MixerBlock((size // patch) ** 2, d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_cls)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))


def _rope(x, base=10000.0):
    T, dh = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, dh, 2, dtype=torch.float32, device=x.device) / dh)
    ang = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * inv[None]
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class LlamaLikeBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(d, eps=1e-6)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(d, eps=1e-6)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        Bn, T, d = x.shape
        h = self.attn_norm(x)

        def split(t):
            return t.view(Bn, T, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = _rope(split(self.q(h))), _rope(split(self.k(h))), split(self.v(h))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(Bn, T, d)
        x = x + self.o(att)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaLike(nn.Module):
    """Embedding, RMSNorm, RoPE attention, gated MLP, lm_head tied to the embedding."""

    def __init__(self, vocab=64, d=32, heads=4, n_layer=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaLikeBlock(d, heads) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(self.norm(h))


class TCN(nn.Module):
    """Dilated causal Conv1d stack with BatchNorm1d, one weight-normed conv (parametrizations), Conv3d-free."""

    def __init__(self, cin=4, c=8, n_cls=3):
        super().__init__()
        self.c1 = nn.Conv1d(cin, c, 3, padding=2, dilation=1)
        self.bn1 = nn.BatchNorm1d(c)
        self.c2 = nn.utils.parametrizations.weight_norm(nn.Conv1d(c, c, 3, padding="same", dilation=2))
        self.c3 = nn.Conv1d(c, c, 5, padding="same", padding_mode="reflect")
        self.head = nn.Linear(c, n_cls)

    def forward(self, x):
        h = F.relu(self.bn1(self.c1(x)[..., :-2]))
        h = F.relu(self.c3(F.relu(self.c2(h))))
        return self.head(h.mean(-1))


class Video3D(nn.Module):
    def __init__(self, n_cls=3):
        super().__init__()
        self.conv = nn.Conv3d(2, 6, 3, padding=1)
        self.bn = nn.BatchNorm3d(6)
        self.convt = nn.ConvTranspose3d(6, 4, 2, stride=2, groups=2)
        self.head = nn.Linear(4, n_cls)

    def forward(self, x):
        return self.head(self.convt(F.relu(self.bn(self.conv(x)))).mean((2, 3, 4)))


class FastText(nn.Module):
    """EmbeddingBag bag-of-words (no factor rule) plus a scaled-gradient Embedding and a Linear head."""

    def __init__(self, vocab=40, d=12, n_cls=4):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, d, mode="mean")
        self.emb = nn.Embedding(vocab, d, scale_grad_by_freq=True)
        self.head = nn.Linear(2 * d, n_cls)

    def forward(self, ids):
        return self.head(torch.cat([self.bag(ids), self.emb(ids).mean(1)], -1))


class Siamese(nn.Module):
    """One encoder called on both inputs of a pair (a layer with two calls per forward), a head on |e1 - e2|."""

    def __init__(self, d_in=10, d=16):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d_in, d), nn.LayerNorm(d), nn.Tanh(), nn.Linear(d, d))
        self.head = nn.Linear(d, 1)

    def forward(self, x1, x2):
        return self.head((self.enc(x1) - self.enc(x2)).abs()).squeeze(-1)


def _classify(model, batch):
    x, y = batch
    return _ce(model(x), y)


def _img(n_cls=5, c=3, s=16):
    return torch.randn(B, c, s, s), torch.randint(0, n_cls, (B,))


def _torch_case(name, model, batch, loss=_classify, batch_norm=False):
    return Case(name, "torch", model, batch, loss, batch_norm)


def siamese():
    return _torch_case("siamese (one encoder, two calls)", Siamese(),
                       (torch.randn(B, 10), torch.randn(B, 10), torch.rand(B)),
                       loss=lambda m, b: F.binary_cross_entropy_with_logits(m(b[0], b[1]), b[2], reduction="sum"))


def resnet():
    return _torch_case("resnet (BasicBlock, BatchNorm)", ResNetTiny(), _img(), batch_norm=True)


def mobilenet():
    return _torch_case("mobilenet_v2 (depthwise)", MobileNetTiny(), _img(), batch_norm=True)


def convnext():
    return _torch_case("convnext (dwconv, LayerNorm2d)", ConvNeXtTiny(), _img())


def regnet():
    return _torch_case("regnet_y (grouped conv, SE)", RegNetTiny(), _img(), batch_norm=True)


def unet():
    x = torch.randn(B, 1, 8, 8)
    return _torch_case("unet (ConvTranspose2d, GroupNorm)", UNetTiny(), (x, torch.randn(B, 1, 8, 8)),
                       loss=lambda m, b: F.mse_loss(m(b[0]), b[1], reduction="sum"))


def lstm():
    ids = torch.randint(1, 50, (B, 7))
    ids[0, -2:] = 0  # padding
    return _torch_case("lstm tagger", LSTMTagger(), (ids, torch.randint(0, 6, (B, 7))))


def gru():
    return _torch_case("gru classifier", GRUClassifier(), (torch.randn(B, 6, 8), torch.randint(0, 4, (B,))))


def torch_transformer():
    return _torch_case("nn.TransformerEncoder", TorchTransformer(),
                       (torch.randint(0, 50, (B, 8)), torch.randint(0, 4, (B,))))


def mixer():
    return _torch_case("mlp-mixer", MLPMixer(), _img())


def llama_like():
    ids = torch.randint(0, 64, (B, 8))
    return _torch_case("llama-like (hand-written, tied)", LlamaLike(), (ids,),
                       loss=lambda m, b: _ce(m(b[0])[:, :-1], b[0][:, 1:]))


def tcn():
    return _torch_case("tcn (Conv1d, weight_norm)", TCN(), (torch.randn(B, 4, 12), torch.randint(0, 3, (B,))),
                       batch_norm=True)


def video3d():
    return _torch_case("conv3d / convtranspose3d", Video3D(), (torch.randn(B, 2, 4, 6, 6), torch.randint(0, 3, (B,))),
                       batch_norm=True)


def fasttext():
    return _torch_case("fasttext (EmbeddingBag)", FastText(), (torch.randint(0, 40, (B, 6)), torch.randint(0, 4, (B,))))


# ----------------------------------------------------------------------------------------------
# transformers models, tiny configs, random weights
# ----------------------------------------------------------------------------------------------
_V = 64  # vocabulary


def _tokens(T=8):
    return torch.randint(3, _V, (B, T))


def _hf_case(name, model, batch, loss):
    return Case(name, "transformers", model, batch, loss)


def _causal(model, batch):
    (ids,) = batch
    return _ce(model(ids).logits[:, :-1], ids[:, 1:])


def _small(**kw):
    return dict(vocab_size=_V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=_V, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return _hf_case("gpt2 (tied wte/lm_head)", GPT2LMHeadModel(cfg), (_tokens(),), _causal)


def gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(vocab_size=_V, max_position_embeddings=32, hidden_size=32, num_layers=2, num_heads=4,
                       attention_types=[[["global", "local"], 1]], window_size=4, embed_dropout=0.0,
                       attention_dropout=0.0, resid_dropout=0.0, bos_token_id=1, eos_token_id=2)
    return _hf_case("gpt-neo", GPTNeoForCausalLM(cfg), (_tokens(),), _causal)


def opt():
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=_V, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                    max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _hf_case("opt", OPTForCausalLM(cfg), (_tokens(),), _causal)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return _hf_case("llama", LlamaForCausalLM(LlamaConfig(**_small(num_key_value_heads=2))), (_tokens(),), _causal)


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _hf_case("qwen2", Qwen2ForCausalLM(Qwen2Config(**_small(num_key_value_heads=2))), (_tokens(),), _causal)


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(**_small(num_key_value_heads=1, head_dim=8))
    return _hf_case("gemma (RMSNorm 1+w, tied)", GemmaForCausalLM(cfg), (_tokens(),), _causal)


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**_small(num_key_value_heads=2, sliding_window=4))
    return _hf_case("mistral", MistralForCausalLM(cfg), (_tokens(),), _causal)


def _mlm(model, batch):
    ids, labels = batch
    return _ce(model(ids).logits, labels)


def _bert_kw():
    return _small(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, type_vocab_size=2)


def bert():
    from transformers import BertConfig, BertForMaskedLM

    ids, labels, mask = _tokens(), torch.randint(0, _V, (B, 8)), torch.ones(B, 8, dtype=torch.long)
    ids[0, -3:], labels[0, -3:], mask[0, -3:] = 0, -100, 0  # a padded sample, masked out of attention and loss

    def loss(model, batch):
        ids, labels, mask = batch
        return _ce(model(ids, mask).logits, labels)

    return _hf_case("bert (masked LM, padding mask)", BertForMaskedLM(BertConfig(**_bert_kw())), (ids, labels, mask),
                    loss)


def roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM

    cfg = RobertaConfig(**{**_bert_kw(), "pad_token_id": 1, "bos_token_id": 0, "max_position_embeddings": 40})
    return _hf_case("roberta (masked LM)", RobertaForMaskedLM(cfg), (_tokens(), torch.randint(0, _V, (B, 8))), _mlm)


def distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = DistilBertConfig(vocab_size=_V, max_position_embeddings=32, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                           dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3, pad_token_id=0)
    return _hf_case("distilbert (classifier)", DistilBertForSequenceClassification(cfg),
                    (_tokens(), torch.randint(0, 3, (B,))), _classify_logits)


def _classify_logits(model, batch):
    x, y = batch
    return _ce(model(x).logits, y)


def _seq2seq(model, batch):
    ids, dec, labels = batch
    return _ce(model(input_ids=ids, decoder_input_ids=dec).logits, labels)


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=_V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)
    return _hf_case("t5 (gated-gelu)", T5ForConditionalGeneration(cfg),
                    (_tokens(), _tokens(6), torch.randint(0, _V, (B, 6))), _seq2seq)


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=_V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                     eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return _hf_case("bart", BartForConditionalGeneration(cfg),
                    (_tokens(), _tokens(6), torch.randint(0, _V, (B, 6))), _seq2seq)


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, num_labels=5)
    x, y = _img()
    return _hf_case("vit (classifier)", ViTForImageClassification(cfg), (x, y), _classify_logits)


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=_V, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32,
                        max_source_positions=8, max_target_positions=16, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)

    def loss(model, batch):
        feats, dec, labels = batch
        return _ce(model(feats, decoder_input_ids=dec).logits, labels)

    return _hf_case("whisper", WhisperForConditionalGeneration(cfg),
                    (torch.randn(B, 8, 16), _tokens(6), torch.randint(0, _V, (B, 6))), loss)


def wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    cfg = Wav2Vec2Config(vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                         num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
                         activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                         layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0)

    def loss(model, batch):
        wave, labels = batch
        logits = model(wave).logits
        return _ce(logits, labels[:, : logits.shape[1]])

    return _hf_case("wav2vec2 (CTC head, frame CE)", Wav2Vec2ForCTC(cfg),
                    (torch.randn(B, 200), torch.randint(0, 12, (B, 40))), loss)


TORCH = [siamese, resnet, mobilenet, convnext, regnet, unet, lstm, gru, torch_transformer, mixer, llama_like, tcn,
         video3d, fasttext]
TRANSFORMERS = [gpt2, gpt_neo, opt, llama, qwen2, mistral, gemma, bert, roberta, distilbert, t5, bart, vit, whisper,
                wav2vec2]
BUILDERS = {b.__name__: b for b in TORCH + TRANSFORMERS}


def build(key: str) -> Case:
    torch.manual_seed(0)
    case = BUILDERS[key]()
    case.model.eval()
    return case


# ----------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------
def _mixing_in_backward(model) -> list:
    """Parameters whose .grad mixes samples in backward alone (the forward treats them apart): an Embedding with
    scale_grad_by_freq divides by counts over the whole batch."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Embedding) and m.scale_grad_by_freq]


def _contribution(case: Case, params: list, i: int) -> list:
    """Sample i's contribution to these parameters' .grad: the batch's own backward with the gradient at the
    model's output kept for sample i's row only (batch dimension first)."""
    def keep_row(module, args, out):
        mask = torch.zeros(out.shape[0], *[1] * (out.dim() - 1), dtype=out.dtype, device=out.device)
        mask[i] = 1
        out.register_hook(lambda g: g * mask)

    handle = case.model.register_forward_hook(keep_row)
    try:
        return list(torch.autograd.grad(case.loss(case.model, case.batch), params, allow_unused=True))
    finally:
        handle.remove()


def _take(batch, i):
    return tuple(t[i:i + 1] for t in batch)


def _traced(case: Case):
    import hookwidget as hw

    model = case.model

    def step():
        model.zero_grad(set_to_none=True)
        loss = case.loss(model, case.batch)
        loss.backward()
        return loss

    t = hw.trace(step, model)
    return t, {id(p): p.grad.detach().clone() for p in model.parameters() if p.grad is not None}


def _layer_params(module, name=None):
    """The parameters a factor rule covers: weight and bias where they are trainable parameters."""
    return [(pn, module._parameters[pn]) for pn in ("weight", "bias")
            if module._parameters.get(pn) is not None and module._parameters[pn].requires_grad]


def _exactness(t, grads: dict) -> tuple[list, int]:
    """Mismatches (layer names, parameter, max abs diff) and the number of parameters compared. A parameter
    shared with a layer that has no rule (a tied embedding that scales its rows) is each module's share:
    its sum can differ from .grad, and then the trace must name it in per_sample_left_out."""
    by_param: dict = {}
    failures = []
    scale = max((float(g.abs().max()) for g in grads.values()), default=0.0)
    for n in t.factor_layers:
        module = t.layers[n].module
        for pn, p in _layer_params(module):
            try:
                g = t.weight_grad(n) if pn == "weight" else t.bias_grad(n)
            except Exception as e:  # noqa: BLE001  (a failure to report, with the layer named)
                failures.append((n, pn, f"{type(e).__name__}: {e}"))
                continue
            entry = by_param.setdefault(id(p), [p, [], 0])
            entry[1].append(f"{n}.{pn}")
            entry[2] = entry[2] + g.reshape(p.shape)
    for p, names, rebuilt in by_param.values():
        ref = grads.get(id(p))
        if ref is None:
            ref = torch.zeros_like(p)
        # a gradient that is analytically zero (a bias before a norm) is rounding noise: scale by the model's too
        atol = 1e-5 * float(ref.abs().max()) + 1e-6 * scale + 1e-12
        named = any(t.params.get(n) is p for n in t.per_sample_left_out)
        if not torch.allclose(rebuilt.to(ref.dtype), ref, rtol=1e-4, atol=atol) and not named:
            failures.append(("+".join(names), "", f"max abs diff {float((rebuilt - ref).abs().max()):.3g} "
                             f"(max |grad| {float(ref.abs().max()):.3g})"))
    return failures, len(by_param)


def _owners(model) -> dict:
    """id(parameter) -> [(qualified module name, module)] of the modules that hold it directly."""
    out: dict = {}
    for qn, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                out.setdefault(id(p), [])
                if all(m is not o for _, o in out[id(p)]):
                    out[id(p)].append((qn, m))
    return out


def _names(text: str, word: str) -> bool:
    return re.search(r"(?<![\w.])" + re.escape(word) + r"(?![\w.])", text) is not None


def _why(note: str) -> str:
    if note.startswith("no (a, δ) factor rule"):
        return "no factor rule"
    if note.startswith("per-sample gradients leave out"):
        return "input has no batch dimension"
    if "keyword arguments only" in note:
        return "tensors passed as keywords only"
    return note[:60]


def _short(why: str) -> str:
    """A left-out parameter's reason without the layer names before it, cut to fit a table cell."""
    why = re.sub(r"^[\w.]+: ", "", why.split("; ")[0])
    return why if len(why) <= 110 else why[:107] + "..."


def _reason_for(module, name: str, notes: list) -> tuple[str | None, str]:
    """The note that names the module (by qualified name, else by class name): (short reason, how named)."""
    for note in notes:
        if name and _names(note, name):
            if note.startswith("no (a, δ) factor rule"):  # the reason follows the name in brackets
                m = re.search(r"(?<![\w.])" + re.escape(name) + r" \((.*?)(?::|\)(?:, [\w.]+ \(|$))", note)
                return (m.group(1) if m else "no factor rule"), "name"
            return _why(note), "name"
    for note in notes:
        if _names(note, type(module).__name__):
            return _why(note), "type"
    return None, ""


def measure(key: str) -> dict:
    """Trace one training step of the zoo model `key` and compare with autograd (see the module doc)."""
    case = build(key)
    model = case.model
    out = {"key": key, "name": case.name, "family": case.family}
    t0 = time.perf_counter()
    failures = []
    if case.batch_norm:  # BatchNorm on batch statistics: exactness only (rows are contributions)
        model.train()
        t_train, g_train = _traced(case)
        fails, _ = _exactness(t_train, g_train)
        failures += [(f"[train] {n}", pn, why) for n, pn, why in fails]
        model.eval()
    t, grads = _traced(case)
    fails, compared = _exactness(t, grads)
    failures += fails
    out["exact_failures"] = failures
    out["compared_params"] = compared
    out["notes"] = list(t.notes)

    # the parameters per-sample norms cover: every parameter with a .grad but those the trace says it leaves
    # out (t.per_sample_left_out); the autograd loop below checks that claim numerically
    left_ids = {id(t.params[n]) for n in t.per_sample_left_out}
    covered = [p for p in {id(p): p for p in model.parameters()}.values() if id(p) in grads and id(p) not in left_ids]
    unique = {id(p): p for p in model.parameters()}  # parameters() is de-duplicated already
    with_grad = [p for pid, p in unique.items() if pid in grads]
    out["params"] = sum(p.numel() for p in unique.values())
    out["grad_numel"] = sum(p.numel() for p in with_grad)
    out["covered_numel"] = sum(p.numel() for p in covered)
    out["coverage"] = out["covered_numel"] / max(out["grad_numel"], 1)

    # per-sample norms: hookwidget against a loop of autograd over the samples
    try:
        hw_norms = t.per_sample_grad_norms().detach().double()
    except Exception as e:  # noqa: BLE001
        hw_norms, out["norms_error"] = None, f"{type(e).__name__}: {e}"
    # (parameters of layers whose backward mixes samples: each sample's contribution through the batch's graph)
    mixing = {id(p) for p in _mixing_in_backward(model)}
    alone, shared = [p for p in covered if id(p) not in mixing], [p for p in covered if id(p) in mixing]
    ref, losses = [], []
    for i in range(B):
        loss_i = case.loss(model, _take(case.batch, i))
        losses.append(float(loss_i.detach()))
        gs = list(torch.autograd.grad(loss_i, alone, allow_unused=True)) if alone else []
        gs += _contribution(case, shared, i) if shared else []
        ref.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in gs if g is not None)))
    ref = torch.tensor(ref, dtype=torch.float64)
    full = float(case.loss(model, case.batch).detach())
    out["loss_split_ok"] = abs(sum(losses) - full) <= 1e-4 * max(1.0, abs(full))
    out["ref_norms"], out["hw_norms"] = ref, hw_norms
    if hw_norms is not None and hw_norms.shape == ref.shape:
        out["norms_rel_err"] = float(((hw_norms - ref).abs() / ref.clamp_min(1e-12)).max())
    else:
        out["norms_rel_err"] = float("inf")

    # every parameter left out, with the note that names its layer
    left = []
    owners = _owners(model)
    cov_ids = {id(p) for p in covered}
    for p in with_grad:
        if id(p) in cov_ids:
            continue
        for qn, m in owners.get(id(p), [("?", None)]):
            pname = next(k for k, v in m._parameters.items() if v is p) if m is not None else "?"
            stated = next((why for n, why in t.per_sample_left_out.items() if t.params[n] is p), None)
            if stated is not None and any(stated in note for note in t.notes):  # the note names the parameter
                reason, how = _short(stated), "parameter"
            else:
                reason, how = _reason_for(m, qn, t.notes) if m is not None else (None, "")
            left.append({"param": f"{qn}.{pname}" if qn else pname, "type": type(m).__name__, "numel": p.numel(),
                         "reason": reason, "named_by": how, "module": qn})
    out["left_out"] = left
    out["seconds"] = time.perf_counter() - t0
    return out


def measure_all(keys=None, progress=None) -> list:
    res = []
    for key in keys or BUILDERS:
        if BUILDERS[key] in TRANSFORMERS:
            try:
                import transformers  # noqa: F401
            except ImportError:
                continue
        r = measure(key)
        if progress:
            progress(r)
        res.append(r)
    return res
