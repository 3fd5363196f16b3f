"""Real torchvision and timm models for hookwidget's coverage and exactness (issue 14).

tests/zoo.py writes torchvision's and timm's blocks out; here are the libraries' own classes, built
small, with random weights (nothing is downloaded: `weights=None` / `pretrained=False`, or the model
class constructed directly with reduced depth and width), on 32×32 images (64×64 for MobileViT). Each
builder returns a `zoo.Case`, as tests/zoo.py's builders do, with family "torchvision" or "timm", so
`measure(key)` is tests/zoo.py's measurement (exactness of every factor layer against `.grad`,
per-sample norms against a per-sample autograd loop, coverage and the note naming each parameter left
out) run on these builders.

torchvision and timm come through tests/vision_shim.py (PyPI's torchvision is a CUDA build that imports
beside the CPU torch only with its detection ops' schemas defined first). `available()` says whether they
import; every builder raises ImportError when they do not.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # zoo, vision_shim, whether or not tests/ is a package
import vision_shim  # noqa: E402
import zoo  # noqa: E402

B = zoo.B
N_CLS = 10


def available() -> str | None:
    """None when torchvision and timm import, else one line why not."""
    try:
        vision_shim.import_timm()
    except ImportError as e:
        return str(e)
    return None


def _tv():
    return vision_shim.import_torchvision()


def _timm():
    return vision_shim.import_timm()


def _img(s=32):
    return torch.randn(B, 3, s, s), torch.randint(0, N_CLS, (B,))


def forward(model, x):
    """model(x), after dropping timm's eval-mode attention-bias caches (LeViT, EfficientFormer): a cached
    bias is one tensor in the graphs of every later forward, so a second backward through it fails and its
    gradient would be shared between runs."""
    for m in model.modules():
        cache = getattr(m, "attention_bias_cache", None)
        if cache:
            cache.clear()
    return model(x)


def _classify(model, batch):
    x, y = batch
    return F.cross_entropy(forward(model, x), y, reduction="sum")


def _case(name, family, model, s=32, batch_norm=False):
    return zoo.Case(name, family, model, _img(s), _classify, batch_norm)


def _tv_case(name, model, **kw):
    return _case(name, "torchvision", model, **kw)


def _timm_case(name, model, **kw):
    return _case(name, "timm", model, **kw)


# ----------------------------------------------------------------------------------------------
# torchvision
# ----------------------------------------------------------------------------------------------
def tv_resnet18():
    """ResNet-18's BasicBlocks, one per stage (torchvision fixes the widths at 64..512)."""
    _tv()
    from torchvision.models.resnet import BasicBlock, ResNet

    return _tv_case("torchvision resnet (BasicBlock ×[1,1,1,1])", ResNet(BasicBlock, [1, 1, 1, 1], num_classes=N_CLS),
                    batch_norm=True)


def tv_mobilenet_v3_small():
    _tv()
    from torchvision.models.mobilenetv3 import MobileNetV3, _mobilenet_v3_conf

    setting, last = _mobilenet_v3_conf("mobilenet_v3_small", width_mult=0.25)
    return _tv_case("torchvision mobilenet_v3_small (×0.25)", MobileNetV3(setting, last, num_classes=N_CLS),
                    batch_norm=True)


def tv_efficientnet_b0():
    _tv()
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    setting, last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
    return _tv_case("torchvision efficientnet_b0 (×0.25 width, depth)",
                    EfficientNet(setting, dropout=0.2, stochastic_depth_prob=0.2, num_classes=N_CLS,
                                 last_channel=last), batch_norm=True)


def tv_regnet_y_400mf():
    """regnet_y_400mf's design (SE, group width 8) at a small width and depth."""
    _tv()
    from torchvision.models.regnet import BlockParams, RegNet

    params = BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return _tv_case("torchvision regnet_y (SE, group width 8)", RegNet(params, stem_width=16, num_classes=N_CLS),
                    batch_norm=True)


def tv_convnext_tiny():
    """convnext_tiny's CNBlock (dwconv 7×7, LayerNorm, layer scale) and LayerNorm2d, two stages."""
    _tv()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    setting = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)]
    return _tv_case("torchvision convnext (LayerNorm2d, layer scale)",
                    ConvNeXt(setting, stochastic_depth_prob=0.1, layer_scale=0.5, num_classes=N_CLS))


def tv_vit():
    """vit_b_16's VisionTransformer: 32×32 images, 8×8 patches, 2 layers of width 32."""
    _tv()
    from torchvision.models.vision_transformer import VisionTransformer

    return _tv_case("torchvision vit (MultiheadAttention)",
                    VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                      mlp_dim=64, dropout=0.1, num_classes=N_CLS))


def tv_swin_t():
    """swin_t's SwinTransformer (shifted windows, relative position bias, patch merging), two stages."""
    _tv()
    from torchvision.models.swin_transformer import SwinTransformer

    return _tv_case("torchvision swin (window attention)",
                    SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                    window_size=[4, 4], stochastic_depth_prob=0.1, num_classes=N_CLS))


# ----------------------------------------------------------------------------------------------
# timm
# ----------------------------------------------------------------------------------------------
def timm_resnetv2_bit():
    """resnetv2_50x1_bit's design: StdConv2d (weight standardisation), GroupNorm, pre-activation bottlenecks."""
    _timm()
    from timm.layers import GroupNormAct, StdConv2d
    from timm.models.resnetv2 import ResNetV2

    model = ResNetV2(layers=[1, 1], channels=(32, 64), stem_chs=16, stem_type="fixed", num_classes=N_CLS,
                     drop_path_rate=0.1, conv_layer=partial(StdConv2d, eps=1e-8),
                     norm_layer=partial(GroupNormAct, num_groups=8))
    return _timm_case("timm resnetv2 bit (StdConv2d, GroupNorm)", model)


def timm_tf_efficientnet_b0():
    """tf_efficientnet_b0 at ×0.25 width and depth: TF 'same' padding, so Conv2dSame on every strided conv."""
    _timm()
    from timm.layers import BatchNormAct2d  # noqa: F401  (the norm tf_efficientnet uses)
    from timm.models.efficientnet import _gen_efficientnet

    model = _gen_efficientnet("tf_efficientnet_b0", channel_multiplier=0.25, depth_multiplier=0.25,
                              pretrained=False, bn_eps=1e-3, pad_type="same", num_classes=N_CLS,
                              drop_rate=0.2, drop_path_rate=0.1)
    return _timm_case("timm tf_efficientnet_b0 (Conv2dSame, ×0.25)", model, batch_norm=True)


def timm_convnext_atto():
    """convnext_atto's design (conv_mlp: LayerNorm2d and 1×1 convs) at widths 8..32."""
    _timm()
    from timm.models.convnext import ConvNeXt

    model = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), conv_mlp=True, ls_init_value=0.5, num_classes=N_CLS,
                     drop_path_rate=0.1)
    return _timm_case("timm convnext_atto (LayerNorm2d, conv_mlp)", model)


def timm_convnext_nano_mlp():
    """convnext with the Linear MLP (channels-last LayerNorm) and GRN (ConvNeXt-V2)."""
    _timm()
    from timm.models.convnext import ConvNeXt

    model = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), use_grn=True, ls_init_value=None, num_classes=N_CLS,
                     drop_rate=0.1)
    return _timm_case("timm convnext v2 (GRN, channels-last LayerNorm)", model)


def timm_vit_tiny():
    timm = _timm()
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=N_CLS, img_size=32,
                              patch_size=8, depth=2, embed_dim=48, num_heads=3, drop_rate=0.1,
                              drop_path_rate=0.1)
    return _timm_case("timm vit_tiny (patch 8, 2 blocks, width 48)", model)


def timm_deit_tiny():
    timm = _timm()
    model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, num_classes=N_CLS,
                              img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3,
                              drop_path_rate=0.1)
    return _timm_case("timm deit_tiny distilled (two tokens, two heads)", model)


def timm_mobilevit_xxs():
    timm = _timm()
    model = timm.create_model("mobilevit_xxs", pretrained=False, num_classes=N_CLS, drop_path_rate=0.1)
    return _timm_case("timm mobilevit_xxs", model, s=64, batch_norm=True)


def timm_efficientformer_l1():
    """efficientformer_l1 at widths 8..32 (its attention biases fix the last stage at 7×7: 224×224 input).

    In float64: its stem and downsampling convs have biases right before BatchNorm, whose gradient in train
    mode is zero analytically; in float32 autograd's .grad there is rounding noise (~1e-7) that the
    exactness tolerance of tests/zoo.py (scaled by the largest gradient) does not absorb."""
    timm = _timm()
    model = timm.create_model("efficientformer_l1", pretrained=False, num_classes=N_CLS, depths=(1, 1, 1, 2),
                              embed_dims=(8, 16, 24, 32), num_vit=1, layer_scale_init_value=0.5,
                              drop_path_rate=0.1).double()
    x, y = _img(224)
    return zoo.Case("timm efficientformer_l1 (widths 8..32, float64)", "timm", model, (x.double(), y), _classify,
                    batch_norm=True)


def timm_levit_128s():
    """LeViT: Linear and Conv2d followed by BatchNorm (LinearNorm, ConvNorm), attention biases."""
    timm = _timm()
    model = timm.create_model("levit_128s", pretrained=False, num_classes=N_CLS, img_size=64, embed_dim=(32, 48, 64),
                              depth=(1, 1, 1), num_heads=(2, 2, 2), key_dim=8, drop_path_rate=0.1)
    return _timm_case("timm levit_128s (LinearNorm, widths 32..64)", model, s=64, batch_norm=True)


def timm_eva02_tiny():
    """EVA-02: rotary position embedding in attention, SwiGLU MLP."""
    timm = _timm()
    model = timm.create_model("eva02_tiny_patch14_224", pretrained=False, num_classes=N_CLS, img_size=28,
                              patch_size=14, depth=2, embed_dim=48, num_heads=3, drop_path_rate=0.1)
    return _timm_case("timm eva02_tiny (rope, SwiGLU)", model, s=28)


TORCHVISION = [tv_resnet18, tv_mobilenet_v3_small, tv_efficientnet_b0, tv_regnet_y_400mf, tv_convnext_tiny, tv_vit,
               tv_swin_t]
TIMM = [timm_resnetv2_bit, timm_tf_efficientnet_b0, timm_convnext_atto, timm_convnext_nano_mlp, timm_vit_tiny,
        timm_deit_tiny, timm_mobilevit_xxs, timm_efficientformer_l1, timm_levit_128s, timm_eva02_tiny]
BUILDERS = {b.__name__: b for b in TORCHVISION + TIMM}


def build(key: str) -> zoo.Case:
    torch.manual_seed(0)
    case = BUILDERS[key]()
    case.model.eval()
    return case


def measure(key: str) -> dict:
    """tests/zoo.py's measurement of one of these models (see zoo.measure)."""
    with mock.patch.dict(zoo.BUILDERS, {key: BUILDERS[key]}):
        return zoo.measure(key)


def measure_all(keys=None, progress=None) -> list:
    res = []
    for key in keys or BUILDERS:
        r = measure(key)
        if progress:
            progress(r)
        res.append(r)
    return res
