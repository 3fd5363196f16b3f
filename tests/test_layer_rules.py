"""Layer specs: every rule against autograd's .grad and torch.func's per-sample gradients and norms;
subclasses that change forward, and other layers no rule is exact for, get no exact rule, a reason, and
the generic torch.func rule (tests/test_generic_rule.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import hookwidget as hw
from hookwidget.layers import factors as fx

B = 3


def capture(module, x, forward=None, loss=None, calls_per_forward=1):
    """(calls, output): the module's (a, δ) by plain hooks, and backward run on `loss(output)`."""
    calls = []

    def hook(m, inputs, out):
        c = SimpleNamespace(a=inputs[0].detach(), delta=None, state=fx.forward_state(m))
        out.register_hook(lambda g: setattr(c, "delta", g.detach()))
        calls.append(c)

    h = module.register_forward_hook(hook)
    module.zero_grad()
    out = (forward or (lambda m, x: m(x)))(module, x)
    loss(out).backward()
    h.remove()
    assert len(calls) == calls_per_forward
    return calls, out


def rel_err(x, ref) -> float:
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check(x, ref, what, tol=1e-4):
    assert x.shape == ref.shape, (what, x.shape, ref.shape)
    e = rel_err(x, ref)
    print(f"{what}: max rel err {e:.2e}")
    assert e < tol, (what, e)


def reference(module, x, R, forward=None):
    """torch.func per-sample gradients of loss_b = Σ out_b ⊙ R_b + ½‖out_b‖² (buffers passed too)."""
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = dict(module.named_buffers())
    fwd = forward or (lambda m, x: m(x))

    class Call(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return fwd(self.m, x)

    wrapped = Call(module)

    def one(p, xi, ri):
        out = functional_call(wrapped, ({f"m.{k}": v for k, v in p.items()},
                                        {f"m.{k}": v for k, v in buffers.items()}), (xi[None],))
        return (out * ri[None]).sum() + 0.5 * out.pow(2).sum()

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, R)


def loss_with(R):
    return lambda out: (out * R).sum() + 0.5 * out.pow(2).sum()


def check_rule(module, x, forward=None, what="", calls_per_forward=1):
    """summed_grad == .grad, per_sample_grad == torch.func's, per_sample_norm_sq == its squared norms."""
    torch.manual_seed(1)
    out = (forward or (lambda m, x: m(x)))(module, x)
    R = torch.randn_like(out)
    calls, _ = capture(module, x, forward, loss_with(R), calls_per_forward)
    ref = reference(module, x, R, forward)
    fs = fx.factors(module, calls)
    assert sorted(f.param for f in fs) == sorted(n for n, p in module.named_parameters())
    for f in fs:
        p = getattr(module, f.param)
        check(fx.summed_grad(f), p.grad, f"{what} {f.param} summed vs .grad ({f.kind})")
        check(fx.per_sample_grad(f), ref[f.param], f"{what} {f.param} per-sample vs torch.func")
        check(fx.per_sample_norm_sq(f), ref[f.param].flatten(1).pow(2).sum(1), f"{what} {f.param} norm²")
    total = sum(g.flatten(1).pow(2).sum(1) for g in ref.values())
    check(fx.layer_norm_sq(module, fs), total, f"{what} layer norm²")
    assert fx.per_sample_meaning(module) == "exact"
    return fs


class Conv1D(nn.Module):
    """A copy of transformers.pytorch_utils.Conv1D (GPT-2): x @ weight + bias, weight (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"

# id, layer factory, input shape (with batch)
CASES = [
    ("linear", lambda: nn.Linear(5, 4), (B, 6, 5)),
    ("hf_conv1d", lambda: Conv1D(4, 5), (B, 6, 5)),
    ("hf_conv1d_2d_input", lambda: Conv1D(7, 5), (B, 5)),
    ("conv1d_stride_dilation", lambda: nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=1), (B, 4, 13)),
    ("conv1d_same_even_kernel", lambda: nn.Conv1d(3, 4, 4, padding="same"), (B, 3, 9)),
    ("conv1d_same_dilated", lambda: nn.Conv1d(3, 4, 3, padding="same", dilation=3), (B, 3, 10)),
    ("conv1d_valid", lambda: nn.Conv1d(3, 4, 3, padding="valid", bias=False), (B, 3, 9)),
    ("conv1d_groups", lambda: nn.Conv1d(4, 6, 3, groups=2, padding=2, stride=2), (B, 4, 11)),
    ("conv1d_depthwise", lambda: nn.Conv1d(5, 10, 3, groups=5, padding=1), (B, 5, 8)),
    ("conv1d_reflect", lambda: nn.Conv1d(3, 4, 3, padding=2, padding_mode="reflect"), (B, 3, 9)),
    ("conv1d_circular_same", lambda: nn.Conv1d(3, 4, 4, padding="same", padding_mode="circular"), (B, 3, 9)),
    ("conv2d_stride_dilation", lambda: nn.Conv2d(3, 5, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(1, 0)),
     (B, 3, 9, 8)),
    ("conv2d_same_even", lambda: nn.Conv2d(2, 3, (4, 3), padding="same", dilation=(1, 2)), (B, 2, 7, 8)),
    ("conv2d_groups", lambda: nn.Conv2d(6, 9, 3, groups=3, stride=2, padding=1), (B, 6, 7, 7)),
    ("conv2d_depthwise", lambda: nn.Conv2d(4, 4, 3, groups=4, padding=1), (B, 4, 6, 6)),
    ("conv2d_replicate", lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="replicate"), (B, 2, 6, 5)),
    ("conv2d_reflect_groups", lambda: nn.Conv2d(4, 4, 3, padding=(1, 2), groups=2, padding_mode="reflect"),
     (B, 4, 6, 6)),
    ("conv3d", lambda: nn.Conv3d(2, 4, (2, 3, 3), stride=(1, 2, 1), padding=1), (B, 2, 4, 6, 5)),
    # 1×1 convolutions: per-sample gradients by one batched product over the positions read
    ("conv1d_pointwise_stride_padding", lambda: nn.Conv1d(3, 5, 1, stride=2, padding=1), (B, 3, 8)),
    ("conv2d_pointwise", lambda: nn.Conv2d(4, 6, 1), (B, 4, 5, 3)),
    ("conv2d_pointwise_stride_padding", lambda: nn.Conv2d(4, 6, 1, stride=(2, 1), padding=(1, 0), dilation=2),
     (B, 4, 5, 4)),
    ("conv2d_pointwise_reflect", lambda: nn.Conv2d(3, 2, 1, padding=1, padding_mode="reflect"), (B, 3, 4, 4)),
    ("conv3d_pointwise_stride", lambda: nn.Conv3d(2, 3, 1, stride=2, bias=False), (B, 2, 3, 5, 4)),
    ("conv3d_groups_circular", lambda: nn.Conv3d(4, 4, 3, groups=2, padding=1, padding_mode="circular"),
     (B, 4, 4, 4, 4)),
    ("convT1d", lambda: nn.ConvTranspose1d(3, 5, 3, stride=2, padding=1, output_padding=1), (B, 3, 7)),
    ("convT1d_groups_dilation", lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2, dilation=2), (B, 4, 6)),
    ("convT2d", lambda: nn.ConvTranspose2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0)), (B, 3, 5, 4)),
    ("convT2d_groups", lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1), (B, 4, 4, 5)),
    ("convT3d", lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (B, 2, 3, 3, 2)),
    ("groupnorm", lambda: nn.GroupNorm(2, 6), (B, 6, 5)),
    ("groupnorm_2d", lambda: nn.GroupNorm(3, 6), (B, 6, 4, 3)),
    ("rmsnorm", lambda: nn.RMSNorm(5), (B, 4, 5)),
    ("rmsnorm_2d_shape", lambda: nn.RMSNorm((4, 5), eps=1e-5), (B, 4, 5)),
    ("layernorm", lambda: nn.LayerNorm(5), (B, 4, 5)),
    ("layernorm_2d_shape", lambda: nn.LayerNorm((4, 5)), (B, 4, 5)),
    ("layernorm_no_bias", lambda: nn.LayerNorm(5, bias=False), (B, 2, 3, 5)),
    ("batchnorm1d_eval", lambda: nn.BatchNorm1d(5).eval(), (B, 5)),
    ("batchnorm1d_eval_seq", lambda: nn.BatchNorm1d(5).eval(), (B, 5, 4)),
    ("batchnorm2d_eval", lambda: nn.BatchNorm2d(3).eval(), (B, 3, 4, 4)),
    ("batchnorm3d_eval", lambda: nn.BatchNorm3d(2).eval(), (B, 2, 3, 2, 2)),
    ("instancenorm1d", lambda: nn.InstanceNorm1d(3, affine=True), (B, 3, 6)),
    ("instancenorm2d_eval_running", lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True).eval(),
     (B, 3, 4, 5)),
]


def _randomise(m):
    """Non-trivial affine parameters and running statistics, so a wrong x̂ or a left-out term shows."""
    with torch.no_grad():
        for p in m.parameters():
            if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)):
                p.copy_(torch.randn_like(p))
        if getattr(m, "running_mean", None) is not None:
            m.running_mean.copy_(torch.randn_like(m.running_mean))
            m.running_var.copy_(torch.rand_like(m.running_var) + 0.5)
    return m


@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel")
@pytest.mark.parametrize("make, shape", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule_matches_autograd_and_torch_func(make, shape):
    torch.manual_seed(0)
    m = _randomise(make())
    x = torch.randn(shape) * 2 + 0.5
    assert fx.unsupported_reason(m) is None
    check_rule(m, x, what=type(m).__name__)


def _timm_std_conv():
    """timm's own StdConv2d (through tests/vision_shim.py), or a skip where timm is not installed."""
    sys.path.insert(0, str(Path(__file__).parent))
    import vision_shim

    try:
        return vision_shim.import_timm().layers.StdConv2d
    except ImportError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("kwargs, shape, twice", [
    ({"kernel_size": 3, "bias": True}, (B, 4, 6, 5), False),
    ({"kernel_size": 3, "stride": 2, "eps": 1e-8}, (B, 4, 7, 7), False),
    ({"kernel_size": 3, "groups": 2}, (B, 4, 5, 5), False),
    ({"kernel_size": 1}, (B, 4, 5, 3), False),  # the pointwise path of the kernel's gradient
    ({"kernel_size": 3}, (B, 4, 5, 5), True),  # two calls: their kernels' gradients add, then map back
], ids=["3x3_bias", "stride_bit_eps", "groups", "1x1", "called_twice"])
def test_timms_weight_standardised_conv_is_exact(kwargs, shape, twice):
    """timm's StdConv2d convolves with its weight standardised per output channel: the kernel's gradient mapped
    by the standardisation's backward, against autograd's .grad and torch.func through the standardisation."""
    StdConv2d = _timm_std_conv()
    torch.manual_seed(0)
    k = kwargs.pop("kernel_size")
    m = StdConv2d(4, 4 if twice else 6, k, **kwargs)
    with torch.no_grad():
        m.weight.mul_(torch.rand_like(m.weight) + 0.5).add_(0.3)  # channels of different means and spreads
    assert fx.rule_for(m) is not None and not fx.is_generic(m)
    fs = check_rule(m, torch.randn(shape), forward=(lambda m, x: m(torch.tanh(m(x)))) if twice else None,
                    what="StdConv2d", calls_per_forward=2 if twice else 1)
    assert next(f for f in fs if f.param == "weight").kind == "mapped"


@pytest.mark.parametrize("kwargs, shape", [
    ({"kernel_size": 3, "stride": 2}, (B, 4, 7, 6)),  # odd and even sizes: the extra pixel right, bottom
    ({"kernel_size": 3, "stride": 2, "groups": 4}, (B, 4, 8, 8)),  # depthwise, as the tf_ EfficientNets
    ({"kernel_size": 4, "bias": False}, (B, 4, 5, 5)),  # an even kernel at stride 1: uneven padding
    ({"kernel_size": 3, "dilation": 2}, (B, 4, 6, 7)),
    ({"kernel_size": 1, "stride": 2}, (B, 4, 5, 5)),  # nothing to pad
], ids=["3x3_s2", "depthwise_s2", "4x4", "dilated", "1x1_s2"])
def test_timms_same_padded_conv_is_exact(kwargs, shape):
    """timm's Conv2dSame pads its input as TensorFlow's SAME at each call (from the input's size): per sample
    against torch.func and the sum against .grad, by the exact rule (not the generic one)."""
    _timm_std_conv()
    from timm.layers.conv2d_same import Conv2dSame

    torch.manual_seed(0)
    k = kwargs.pop("kernel_size")
    m = Conv2dSame(4, 8, k, **kwargs)
    assert fx.rule_for(m) is not None and not fx.is_generic(m)
    check_rule(m, torch.randn(shape), what="Conv2dSame")


@pytest.mark.parametrize("kwargs, shape", [
    ({"kernel_size": 3, "gamma": 1.7, "gain_init": 1.0}, (B, 4, 6, 5)),
    ({"kernel_size": 1, "bias": False, "eps": 1e-5}, (B, 4, 5, 3)),
], ids=["3x3", "1x1_no_bias"])
def test_timms_scaled_weight_standardised_conv_is_exact(kwargs, shape):
    """NFNets' ScaledStdConv2d: the kernel is the standardised weight times gain · scale (gain a parameter):
    weight, gain and bias per sample against torch.func, and their sum against .grad."""
    _timm_std_conv()
    from timm.layers import ScaledStdConv2d

    torch.manual_seed(0)
    k = kwargs.pop("kernel_size")
    m = ScaledStdConv2d(4, 6, k, **kwargs)
    with torch.no_grad():
        m.weight.mul_(torch.rand_like(m.weight) + 0.5).add_(0.3)
        m.gain.copy_(torch.rand_like(m.gain) + 0.5)  # a gain per output channel, not all ones
    assert fx.rule_for(m) is not None
    fs = check_rule(m, torch.randn(shape), what="ScaledStdConv2d")
    assert {f.param for f in fs if f.kind == "mapped"} == {"weight", "gain"}


def test_conv_transpose_with_output_size():
    torch.manual_seed(0)
    m = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)
    x = torch.randn(B, 2, 4, 5)
    check_rule(m, x, forward=lambda m, x: m(x, output_size=(8, 10)), what="ConvTranspose2d output_size")


def test_gram_and_materialised_norms_agree_for_convolutions():
    # T*T < weight size takes the Gram route over unfolded inputs; many tokens materialise: both exact
    torch.manual_seed(0)
    for shape in ((B, 3, 3, 3), (B, 3, 12, 12)):
        m = nn.Conv2d(3, 2, 2, bias=False)
        fs = check_rule(m, torch.randn(shape), what=f"Conv2d {shape}")
        assert fx.gram_applies(fs[0]) == (shape[-1] == 3)


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Conv2d(3, 3, 3, padding=1), (B, 3, 5, 5)),  # outer kind: unfolded X over both calls
    (lambda: nn.Conv1d(4, 4, 3, groups=2), (B, 4, 7)),  # conv kind: kernel per call, summed
    (lambda: nn.GroupNorm(2, 4), (B, 4, 5)),
    (lambda: Conv1D(3, 4), (B, 4, 4)),
], ids=["conv2d", "conv1d_groups", "groupnorm", "hf_conv1d"])
def test_a_layer_called_twice_adds_both_calls(make, shape):
    torch.manual_seed(0)
    m = make()
    x = torch.randn(shape)
    fs = check_rule(m, x, forward=lambda m, x: m(torch.tanh(m(x))) if isinstance(m, (nn.GroupNorm, nn.Conv2d))
                    else m(x) + m(x.flip(-1)), what=f"{type(m).__name__} twice", calls_per_forward=2)
    w = next(f for f in fs if f.param == "weight")
    if w.kind == "outer":  # Gram norms and unfolded X over both calls agree with the conv kernels
        check(torch.einsum("bto,bti->boi", w.D, w.X).reshape(B, *w.shape), fx.per_sample_grad(w), "unfolded X")


@pytest.mark.parametrize("cls, shape, eval_without_stats", [
    (nn.BatchNorm1d, (6, 4), False), (nn.BatchNorm1d, (6, 4, 3), False), (nn.BatchNorm2d, (6, 3, 4, 4), False),
    (nn.BatchNorm2d, (6, 3, 4, 4), True)], ids=["bn1d", "bn1d_seq", "bn2d", "bn2d_eval_no_running_stats"])
def test_batchnorm_on_batch_statistics_gives_contributions_that_sum_to_grad(cls, shape, eval_without_stats):
    torch.manual_seed(0)
    m = _randomise(cls(shape[1], track_running_stats=not eval_without_stats))
    if eval_without_stats:
        m.eval()  # eval, yet batch statistics
    x = torch.randn(shape) * 3 + 1
    R = torch.randn(shape)
    calls, out = capture(m, x, loss=loss_with(R))
    assert fx.per_sample_meaning(m) == "contribution"
    fs = fx.factors(m, calls)
    assert {f.per_sample for f in fs} == {"contribution"}
    # reference: each sample its own copy of weight and bias; x̂ by hand from the batch's statistics
    dims = [0] + list(range(2, x.dim()))
    mean, var = x.mean(dims, keepdim=True), x.var(dims, unbiased=False, keepdim=True)
    xhat = (x - mean) / torch.sqrt(var + m.eps)
    n = shape[0]
    view = (n, shape[1]) + (1,) * (x.dim() - 2)
    wb = m.weight.detach().expand(n, -1).clone().requires_grad_()
    bb = m.bias.detach().expand(n, -1).clone().requires_grad_()
    y = xhat * wb.reshape(view) + bb.reshape(view)
    check(y, out.detach(), "hand-made batch norm vs the layer", tol=1e-5)
    gw, gb = torch.autograd.grad(loss_with(R)(y), (wb, bb))
    for f, ref, p in zip(fs, (gw, gb), (m.weight, m.bias)):
        check(fx.summed_grad(f), p.grad, f"BatchNorm train {f.param} summed vs .grad")
        check(fx.per_sample_grad(f).sum(0), p.grad, f"BatchNorm train {f.param} sum of rows vs .grad")
        check(fx.per_sample_grad(f), ref, f"BatchNorm train {f.param} rows vs per-sample-copy gradients")


def test_batchnorm_keeps_its_forward_mode_when_the_model_changes_mode_later():
    torch.manual_seed(0)
    m = _randomise(nn.BatchNorm2d(3))
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    calls, _ = capture(m, x, loss=loss_with(torch.randn(4, 3, 5, 5)))  # train mode: batch statistics
    m.eval()  # e.g. a validation loop before the factors are asked for
    w = next(f for f in fx.factors(m, calls) if f.param == "weight")
    check(fx.summed_grad(w), m.weight.grad, "BatchNorm state from forward time")
    assert w.per_sample == "contribution"
    for c in calls:
        c.state = None  # without it the rule reads today's mode (running statistics): not .grad
    w = next(f for f in fx.factors(m, calls) if f.param == "weight")
    assert rel_err(fx.summed_grad(w), m.weight.grad) > 1e-2


@pytest.mark.parametrize("make, shape", [(lambda: nn.Conv1d(2, 3, 3, padding=1), (2, 7)),
                                         (lambda: nn.InstanceNorm1d(2, affine=True), (2, 7))], ids=["conv", "instnorm"])
def test_unbatched_input_is_a_batch_of_one(make, shape):
    torch.manual_seed(0)
    m = _randomise(make())
    x = torch.randn(shape)
    calls, _ = capture(m, x, loss=loss_with(torch.randn(shape[0] if isinstance(m, nn.InstanceNorm1d) else 3, 7)))
    for f in fx.factors(m, calls):
        check(fx.summed_grad(f), getattr(m, f.param).grad, f"unbatched {type(m).__name__} {f.param}")
        assert fx.per_sample_grad(f).shape == (1, *f.shape)


def test_embedding_with_padding_idx():
    torch.manual_seed(0)
    m = nn.Embedding(7, 4, padding_idx=2)
    idx = torch.randint(0, 7, (B, 6))
    idx[0, :3] = 2
    idx[1, 4] = idx[1, 1]
    out = m(idx)
    R = torch.randn_like(out)
    calls, _ = capture(m, idx, loss=loss_with(R))
    ref = reference(m, idx, R)["weight"]
    (f,) = fx.factors(m, calls)
    check(fx.summed_grad(f), m.weight.grad, "Embedding summed")
    check(fx.per_sample_grad(f), ref, "Embedding per-sample")
    check(fx.per_sample_norm_sq(f), ref.flatten(1).pow(2).sum(1), "Embedding norm²")


class TextScaled(nn.Embedding):
    """A copy of transformers' GemmaTextScaledWordEmbedding (Gemma 1 to 4): the lookup times a 0-d buffer."""

    def __init__(self, n, d, padding_idx=None, embed_scale=1.0):
        super().__init__(n, d, padding_idx)
        self.register_buffer("embed_scale", torch.tensor(embed_scale), persistent=False)

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class WordScaled(nn.Embedding):
    """A copy of transformers' BartScaledWordEmbedding (BART, M2M100, XGLM, ...): the lookup times a number."""

    def __init__(self, n, d, padding_idx=None, embed_scale=1.0):
        super().__init__(n, d, padding_idx)
        self.embed_scale = embed_scale

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


class KeepsScaledForward(WordScaled):
    pass


class Rescaled(WordScaled):
    def forward(self, input_ids):
        return super().forward(input_ids) * 2.0


class Mixin:
    pass


class MixedScaled(nn.Embedding, Mixin):
    """The same forward's code over other bases."""

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


@pytest.mark.parametrize("cls", [TextScaled, WordScaled, KeepsScaledForward])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_a_scaled_word_embedding_gets_the_exact_rule_by_its_forwards_code(cls, padding_idx):
    """A class whose forward has the code of the lookup times embed_scale (layers/embedding.py's references), wherever
    it is defined, gets the rule: row idx_t of W.grad gets δ_t · embed_scale."""
    torch.manual_seed(0)
    m = cls(7, 4, padding_idx=padding_idx, embed_scale=1.3)
    idx = torch.randint(0, 7, (B, 6))
    idx[0, :3] = 2
    assert not fx.is_generic(m) and fx.exact_reason(m) is None
    check_rule(m, idx, what=cls.__name__)


def test_a_changed_copy_other_bases_or_a_vector_scale_get_no_exact_rule():
    assert fx.is_generic(Rescaled(7, 4))  # its own forward, not the copy's
    mixed = MixedScaled(7, 4)
    mixed.embed_scale = 2.0
    assert fx.is_generic(mixed)  # the copy's code, other bases: its super() may lead elsewhere
    vector = WordScaled(7, 4, embed_scale=torch.ones(4))
    assert "embed_scale is not a number or a 0-d tensor" in fx.exact_reason(vector) and fx.is_generic(vector)
    assert "embed_scale is not a 0-d tensor" in fx.exact_reason(TextScaled(7, 4, embed_scale=[1.0, 2.0, 3.0, 4.0]))


@pytest.mark.parametrize("path", ["bart.modeling_bart.BartScaledWordEmbedding",
                                  "m2m_100.modeling_m2m_100.M2M100ScaledWordEmbedding",
                                  "xglm.modeling_xglm.XGLMScaledWordEmbedding",
                                  "gemma.modeling_gemma.GemmaTextScaledWordEmbedding",
                                  "gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding",
                                  "t5gemma2.modeling_t5gemma2.T5Gemma2TextScaledWordEmbedding"])
def test_transformers_scaled_word_embeddings_are_recognised(path):
    """Each of these is a copy of one of the two references, except T5Gemma2's (it adds tokens of its own)."""
    pytest.importorskip("transformers")
    import importlib

    module, name = path.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{name} is not in this transformers")
    m = cls.__new__(cls)
    nn.Embedding.__init__(m, 7, 4)
    m.embed_scale = torch.tensor(2.0)
    spec = fx.spec_for(m)
    assert spec.name == ("generic (torch.func)" if name.startswith("T5Gemma2") else
                         "CastScaledLookup" if "Gemma" in name else "ScaledLookup")


@pytest.mark.parametrize("key", ["bart", "gemma"])
def test_a_scaled_word_embedding_tied_to_the_lm_head_is_counted_by_capture_norms(key):
    """BART's and Gemma's word embeddings share their table with the LM head: with capture="norms" the table's
    per-sample norm (both contributions and their cross term) is counted, equal to an autograd loop's."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import zoo

    case = zoo.build(key)
    model = case.model
    t = hw.trace(lambda: case.loss(model, case.batch).backward(), model, capture="norms")
    assert t.per_sample_left_out == {}
    params = [p for p in model.parameters() if p.requires_grad]
    ref = []
    for i in range(zoo.B):
        gs = torch.autograd.grad(case.loss(model, zoo._take(case.batch, i)), params, allow_unused=True)
        ref.append(sum(g.double().pow(2).sum() for g in gs if g is not None).sqrt())
    torch.testing.assert_close(t.per_sample_grad_norms().double(), torch.stack(ref), rtol=1e-5, atol=0)


class CopiedRMSNorm(nn.Module):
    """A copy of transformers' LlamaRMSNorm (and of 141 more models' RMSNorm classes)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class CopiedT5LayerNorm(nn.Module):
    """A copy of transformers' T5LayerNorm (over nn.Module, as the reference: other bases would not match)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class CopiedGemmaRMSNorm(nn.Module):
    """A copy of transformers' GemmaRMSNorm: its forward and the _norm it calls."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(d))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class OwnNorm(CopiedGemmaRMSNorm):
    """Gemma's forward with a _norm of its own: the subclass computes something else."""

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


class OnePlusRMSNorm(CopiedRMSNorm):
    """(1 + w) in a forward of its own: no reference has its code, so no exact rule."""

    def forward(self, hidden_states):
        h = hidden_states.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)) * (1.0 + self.weight)


@pytest.mark.parametrize("cls,spec", [(CopiedRMSNorm, "LlamaStyleRMSNorm"), (CopiedT5LayerNorm, "T5StyleRMSNorm"),
                                      (CopiedGemmaRMSNorm, "GemmaStyleRMSNorm")])
@pytest.mark.parametrize("shape", [(B, 5, 6), (B, 6)])
def test_transformers_style_rms_norms_get_their_exact_rule_by_their_code(cls, spec, shape):
    torch.manual_seed(0)
    m = cls(6, eps=0.5)  # an eps that matters: a rule that left it out would be off
    assert fx.spec_for(m).name == spec
    check_rule(m, torch.randn(*shape), what=spec)


def test_a_changed_rms_norm_gets_no_exact_rule():
    assert fx.is_generic(OnePlusRMSNorm(6))
    assert fx.is_generic(OwnNorm(6))  # a method the reference's forward calls, overridden
    m = CopiedGemmaRMSNorm(6)
    m.eps = 1  # an int: not what the rule reads
    assert "float eps" in fx.exact_reason(m)


@pytest.mark.parametrize("path", ["llama.modeling_llama.LlamaRMSNorm", "qwen2.modeling_qwen2.Qwen2RMSNorm",
                                  "mistral.modeling_mistral.MistralRMSNorm", "gemma.modeling_gemma.GemmaRMSNorm",
                                  "t5.modeling_t5.T5LayerNorm"])
def test_transformers_rms_norms_are_recognised(path):
    pytest.importorskip("transformers")
    import importlib

    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    want = ("GemmaStyleRMSNorm" if name.startswith("Gemma") else "T5StyleRMSNorm" if name.startswith("T5") else
            "LlamaStyleRMSNorm")
    assert fx.spec_for(cls(6)).name == want


def test_the_watch_counts_a_llamas_rms_norms_in_its_per_sample_norms():
    """hw.watch(per_sample=True) streams only exact rules: with the RMSNorms' rule a Llama is covered whole, its
    largest per-sample norm that of an autograd loop over every parameter."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import zoo

    case = zoo.build("llama")
    model = case.model
    with hw.watch(model, per_sample=True) as w:
        model.zero_grad()
        case.loss(model, case.batch).backward()
    assert not w.notes, w.notes
    params = [p for p in model.parameters() if p.requires_grad]
    ref = torch.stack([sum(g.double().pow(2).sum() for g in torch.autograd.grad(
        case.loss(model, zoo._take(case.batch, i)), params, allow_unused=True) if g is not None).sqrt()
        for i in range(zoo.B)])
    assert w.per_sample[0, 0].item() == pytest.approx(ref.max().item(), rel=1e-5)
    assert int(w.per_sample[0, 1]) == int(ref.argmax())


class CopiedTimmLayerNorm(nn.LayerNorm):
    """A copy of timm's LayerNorm (its fast-norm branch names a function of timm's: never taken here)."""

    _fast_norm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast_norm:
            x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # noqa: F821
        else:
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x


class CopiedLayerNorm2d(nn.LayerNorm):
    """A copy of torchvision's ConvNeXt LayerNorm2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


@pytest.mark.parametrize("cls,shape", [(CopiedTimmLayerNorm, (B, 5, 6)), (CopiedLayerNorm2d, (B, 6, 3, 4))])
def test_timm_and_torchvision_layer_norms_get_the_exact_rule_by_their_code(cls, shape):
    torch.manual_seed(0)
    m = _randomise(cls(6))
    assert not fx.is_generic(m)
    check_rule(m, torch.randn(*shape), what=cls.__name__)
    m._fast_norm = True  # timm's fast norm: another kernel, refused
    assert "fast norm" in fx.exact_reason(m)


def test_timms_and_torchvisions_own_layer_norms_are_recognised():
    sys.path.insert(0, str(Path(__file__).parent))
    import vision_shim

    try:
        vision_shim.import_timm()
    except ImportError as e:
        pytest.skip(str(e))
    import timm.layers.norm as timm_norm
    import torchvision.models.convnext as tv_convnext

    for m in (timm_norm.LayerNorm(6), timm_norm.LayerNorm2d(6), tv_convnext.LayerNorm2d(6)):
        assert not fx.is_generic(m) and fx.exact_reason(m) is None, type(m)


class CopiedLayerScale(nn.Module):
    """A copy of timm's LayerScale."""

    def __init__(self, dim, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class CopiedLayerScale2d(nn.Module):
    """A copy of timm's LayerScale2d."""

    def __init__(self, dim, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        gamma = self.gamma.view(1, -1, 1, 1)
        return x.mul_(gamma) if self.inplace else x * gamma


@pytest.mark.parametrize("cls,shape", [(CopiedLayerScale, (B, 5, 6)), (CopiedLayerScale2d, (B, 6, 3, 4))])
def test_timms_layer_scale_gets_an_exact_rule_by_its_code(cls, shape):
    torch.manual_seed(0)
    m = cls(6)
    assert fx.spec_for(m).name in ("TimmLayerScale", "TimmLayerScale2d")
    check_rule(m, torch.randn(*shape), what=cls.__name__)


def test_an_in_place_layer_scale_is_exact_on_its_input_before_the_write():
    """inplace=True overwrites x with x ⊙ γ: the rows come from x as the layer read it, not as it left it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), CopiedLayerScale(6, inplace=True), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(B, 5, 4)
    t = hw.trace(lambda: model(x).pow(2).sum().backward(), model)
    gamma = model[1].gamma
    ref = torch.stack([torch.autograd.grad(model(x[i:i + 1]).pow(2).sum(), gamma)[0] for i in range(B)])
    torch.testing.assert_close(t.per_sample_grads("1", "gamma"), ref)
    assert not t.per_sample_left_out


def _transformers_module(kind: str):
    from types import SimpleNamespace

    from transformers.models.afmoe.modeling_afmoe import AfmoeRMSNorm
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
    from transformers.models.dinov2.modeling_dinov2 import Dinov2LayerScale

    torch.manual_seed(0)
    if kind == "afmoe rmsnorm":
        m = AfmoeRMSNorm(6, eps=0.5)
        return m, (B, 5, 6), "CastAfterRMSNorm"
    if kind == "dinov2 layer scale":
        m = Dinov2LayerScale(SimpleNamespace(layerscale_value=0.5, hidden_size=6))
        return m, (B, 5, 6), "Dinov2StyleLayerScale"
    fmt = kind.split()[-1]
    return ConvNextLayerNorm(6, data_format=fmt), ((B, 6, 3, 4) if fmt == "channels_first" else (B, 3, 4, 6)), \
        "HFConvNextLayerNorm"


@pytest.mark.parametrize("kind", ["afmoe rmsnorm", "dinov2 layer scale", "convnext channels_first",
                                  "convnext channels_last"])
def test_more_transformers_copies_get_their_exact_rules(kind):
    """The classes themselves (each with copies in other models): AfmoeRMSNorm casts after w ⊙ x̂, Dinov2's layer
    scale, ConvNeXt's LayerNorm in both data formats."""
    pytest.importorskip("transformers")
    m, shape, spec = _transformers_module(kind)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    assert fx.spec_for(m).name == spec
    check_rule(m, torch.randn(*shape), what=kind)


# -- exact or absent ---------------------------------------------------------------------------
class StdConv2d(nn.Conv2d):
    """A copy of timm.layers.std_conv.StdConv2d: the weight is standardised inside forward."""

    def __init__(self, *args, eps=1e-6, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x):
        weight = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                              training=True, momentum=0.0, eps=self.eps).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv2dSame(nn.Conv2d):
    """A copy of timm.layers.conv2d_same.Conv2dSame: TF-style dynamic 'same' padding in forward."""

    def forward(self, x):
        ih, iw = x.shape[-2:]
        kh, kw = self.weight.shape[-2:]
        ph = max((-(ih // -self.stride[0]) - 1) * self.stride[0] + (kh - 1) * self.dilation[0] + 1 - ih, 0)
        pw = max((-(iw // -self.stride[1]) - 1) * self.stride[1] + (kw - 1) * self.dilation[1] + 1 - iw, 0)
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


class LayerNorm2d(nn.LayerNorm):
    """A copy of torchvision's / timm's LayerNorm2d: a LayerNorm over channels of an NCHW tensor."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


OVERRIDES = [
    ("StdConv2d", "Conv2d", lambda: StdConv2d(3, 4, 3, padding=1), lambda: torch.randn(B, 3, 6, 6)),
    ("Conv2dSame", "Conv2d", lambda: Conv2dSame(3, 4, 4, stride=2), lambda: torch.randn(B, 3, 7, 7)),
    ("LayerNorm2d", "LayerNorm", lambda: LayerNorm2d(3), lambda: torch.randn(B, 3, 4, 4)),
]


@pytest.mark.parametrize("name, base, make, data", OVERRIDES, ids=[o[0] for o in OVERRIDES])
def test_a_subclass_that_overrides_forward_gets_the_generic_rule(name, base, make, data):
    torch.manual_seed(0)
    m, x = make(), data()
    reason = fx.exact_reason(m)
    assert isinstance(reason, str) and reason.startswith(f"{name} overrides {base}.forward: no exact (a, δ) rule")
    assert fx.unsupported_reason(m) is None and fx.is_generic(m) and fx.spec_for(m) is fx.GENERIC
    assert fx.rule_for(m) is None and not fx.needs_input(m) and fx.forward_state(m) is None
    with pytest.raises(ValueError, match="the generic rule reruns the module's forward"):
        fx.factors(m, [SimpleNamespace(a=x, delta=None)])
    model = nn.Sequential(m, nn.Flatten(), nn.LazyLinear(2))
    model(x)  # materialise the lazy layer
    t = hw.trace(lambda: model(x).pow(2).sum().backward())
    assert t.supports("0") and not t.per_sample_left_out
    check(t.weight_grad("0"), m.weight.grad, f"{name} weight_grad")
    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = vmap(grad(lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()), in_dims=(None, 0))(params, x)
    check(t.per_sample_grads("0"), ref["0.weight"], f"{name} per-sample")
    check(t.per_sample_grad_norms(), torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1), f"{name} norms")


def test_a_forward_replaced_on_the_instance_gets_no_exact_rule():
    m = nn.Linear(3, 2)
    plain = m.forward
    m.forward = lambda x: plain(x * 2)
    assert fx.exact_reason(m).startswith("Linear.forward is replaced on this instance: no exact (a, δ) rule")
    assert fx.rule_for(m) is None and not fx.needs_input(m) and fx.is_generic(m)
    del m.forward
    assert fx.unsupported_reason(m) is None and fx.exact_reason(m) is None and not fx.is_generic(m)


def test_the_base_rule_would_be_wrong_for_a_weight_standardising_subclass():
    torch.manual_seed(0)
    m, x = StdConv2d(3, 4, 3, padding=1), torch.randn(B, 3, 6, 6)
    calls, _ = capture(m, x, loss=loss_with(torch.randn(B, 4, 6, 6)))
    wrong = fx.SPECS[nn.Conv2d].rule(m, calls[0].a, calls[0].delta)[0]
    assert rel_err(fx.summed_grad(wrong), m.weight.grad) > 1e-2


def test_a_subclass_that_keeps_forward_keeps_the_rule():
    class Plain(nn.Linear):
        """Only a new name and a helper: forward is nn.Linear's."""

        def extra(self):
            return 1

    torch.manual_seed(0)
    m = Plain(4, 3)
    assert fx.unsupported_reason(m) is None and fx.needs_input(m)
    check_rule(m, torch.randn(B, 5, 4), what="Linear subclass")


def test_a_conv1d_named_class_of_another_package_gets_no_rule():
    class Conv1DElsewhere(Conv1D):
        pass

    Conv1DElsewhere.__name__ = "Conv1D"
    Conv1DElsewhere.__module__ = "mypackage.layers"
    # a subclass of the transformers class that keeps its forward still gets the rule
    assert fx.unsupported_reason(Conv1DElsewhere(3, 4)) is None

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return x @ self.weight.T  # (out, in): not transformers' layout

    Other.__name__, Other.__module__ = "Conv1D", "mypackage.layers"
    assert fx.exact_reason(Other()) == "no factor rule for Conv1D" and fx.is_generic(Other())


@pytest.mark.parametrize("make, message", [
    (lambda: nn.Embedding(5, 3, sparse=True), "Embedding(sparse=True): .grad is a sparse tensor"),
    (lambda: nn.MultiheadAttention(4, 2), "no factor rule for MultiheadAttention"),
    (lambda: nn.PReLU(), "no factor rule for PReLU"),
    (lambda: nn.SyncBatchNorm(3), "no factor rule for SyncBatchNorm: its statistics span every process"),
    (lambda: nn.utils.parametrizations.weight_norm(nn.Linear(3, 2)),
     "ParametrizedLinear.weight is computed (parametrize, weight_norm or spectral_norm), not a parameter"),
], ids=["sparse", "mha", "prelu", "syncbn", "weight_norm"])
def test_layers_without_an_exact_rule_say_why(make, message):
    """No exact (a, δ) rule, and why; all but SyncBatchNorm fall back to the generic rule (checked per trace)."""
    m = make()
    assert fx.exact_reason(m).startswith(message)
    assert fx.rule_for(m) is None and not fx.needs_input(m)
    if isinstance(m, nn.SyncBatchNorm):
        assert fx.unsupported_reason(m).startswith(message) and not fx.is_generic(m)
    else:
        assert fx.unsupported_reason(m) is None and fx.is_generic(m)


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_scaled_by_frequency_gives_each_samples_contribution(padding_idx):
    """scale_grad_by_freq divides by counts over the whole batch: a row is the sample's contribution, the gradient
    of its loss through the batch's own backward (the output's gradient kept for its row alone); rows sum to .grad."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, scale_grad_by_freq=True, padding_idx=padding_idx)
    model = nn.Sequential(emb, nn.Linear(4, 1))
    ids = torch.randint(0, 10, (5, 7))
    ids[0, :3] = 3  # a token repeated within one sample and across samples
    ids[1, 0] = 3
    t = hw.trace(lambda: model(ids).pow(2).sum().backward(), model)
    per = t.per_sample_grads("0")
    out = model(ids).pow(2).sum((1, 2))
    ref = torch.stack([torch.autograd.grad(out[i], emb.weight, retain_graph=True)[0] for i in range(5)])
    torch.testing.assert_close(per, ref)
    torch.testing.assert_close(t.weight_grad("0"), emb.weight.grad)
    assert fx.per_sample_meaning(emb) == "contribution" and "0.weight" not in t.per_sample_left_out


def test_needs_input_and_supported_types_come_from_the_registry():
    frozen = nn.Linear(3, 3)
    frozen.weight.requires_grad_(False)
    frozen.bias.requires_grad_(False)
    keeps = [nn.Linear(3, 3), nn.Conv2d(2, 2, 3), nn.Conv2d(2, 2, 3, padding="same"), nn.Conv3d(2, 2, 3),
             nn.ConvTranspose1d(2, 2, 3), nn.Embedding(4, 2), nn.LayerNorm(3), nn.RMSNorm(3), nn.GroupNorm(1, 2),
             nn.BatchNorm1d(3), Conv1D(3, 2)]
    copies = [frozen, nn.LayerNorm(3, elementwise_affine=False), nn.Conv2d(2, 2, 4, padding="same"),
              nn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect"), nn.PReLU(), nn.ReLU()]
    assert [fx.needs_input(m) for m in keeps] == [True] * len(keeps)
    assert [fx.needs_input(m) for m in copies] == [False] * len(copies)
    names = fx.supported_types()
    for n in ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "Embedding",
              "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "transformers.pytorch_utils.Conv1D"):
        assert n in names, n


class Net(nn.Module):
    """New layer types end to end through hw.trace."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding="same", padding_mode="reflect")
        self.gn = nn.GroupNorm(2, 8)
        self.dw = nn.Conv1d(8, 8, 3, groups=8, stride=2)
        self.up = nn.ConvTranspose1d(8, 4, 2, stride=2)
        self.rms = nn.RMSNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.proj = Conv1D(3, 4)

    def forward(self, x):  # x (B, 4, T)
        h = torch.tanh(self.dw(self.gn(self.conv(x))))
        h = self.bn(self.up(h))
        return self.proj(self.rms(h.transpose(1, 2)))


@pytest.mark.parametrize("capture_mode", ["full", "norms"])
def test_new_layers_through_trace(capture_mode):
    torch.manual_seed(0)
    model = Net()
    _randomise(model.bn).eval()
    x, y = torch.randn(5, 4, 10), torch.randn(5, 8, 3)

    def step():
        model.zero_grad()
        ((model(x) - y) ** 2).sum().backward()

    t = hw.trace(step, capture=capture_mode)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def one(p, xi, yi):
        return ((functional_call(model, (p, buffers), (xi[None],)) - yi[None]) ** 2).sum()

    ref = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    check(t.per_sample_grad_norms(), torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1),
          f"trace {capture_mode} norms")
    if capture_mode == "full":
        for name, m in model.named_children():
            check(t.weight_grad(name), m.weight.grad, f"trace {name} weight_grad")
            check(t.per_sample_grads(name), ref[f"{name}.weight"], f"trace {name} per-sample")
