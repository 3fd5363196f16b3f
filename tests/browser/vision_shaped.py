"""A ResNet-50-shaped and a ViT-B-shaped model written out with torch.nn (torchvision and timm do not import
beside the CPU build of torch here): the same module tree and autograd graph as the real ones (torchvision's
ResNet-50 names and blocks [3, 4, 6, 3]; timm's ViT-B/16 names, 12 blocks), at a width and input size the
browser tests can trace in about a second. `full=True` gives the real widths and 224 × 224 inputs."""

import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride=1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


class ResNet50(nn.Module):
    def __init__(self, base=64, classes=1000, blocks=(3, 4, 6, 3)):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        cin = base
        for i, n in enumerate(blocks):
            width = base * 2 ** i
            layer = []
            for j in range(n):
                layer.append(Bottleneck(cin, width, stride=2 if i and not j else 1))
                cin = width * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape  # noqa: N806
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, d))


class Mlp(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.norm2, self.mlp = nn.LayerNorm(d), Mlp(d, 4 * d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch, d):
        super().__init__()
        self.proj = nn.Conv2d(3, d, patch, patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    def __init__(self, image=224, patch=16, d=768, depth=12, heads=12, classes=1000):
        super().__init__()
        self.patch_embed = PatchEmbed(patch, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def resnet50_step(full=False, seed=0):
    """(model, step): a ResNet-50-shaped training step on 2 images (full: 224², base width 64, else 32², 8)."""
    torch.manual_seed(seed)
    model = ResNet50(base=64 if full else 8, classes=1000 if full else 10)
    x = torch.randn(2, 3, 224 if full else 32, 224 if full else 32)
    y = torch.randint(0, 1000 if full else 10, (2,))

    def step():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()

    return model, step


def vit_b_step(full=False, seed=0):
    """(model, step): a ViT-B/16-shaped training step on 2 images (full: 224², d 768, else 32² in 8-px patches,
    d 48)."""
    torch.manual_seed(seed)
    image, patch = (224, 16) if full else (32, 8)
    model = VisionTransformer(image, patch, d=768 if full else 48, heads=12, classes=1000 if full else 10)
    x = torch.randn(2, 3, image, image)
    y = torch.randint(0, 1000 if full else 10, (2,))

    def step():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()

    return model, step
