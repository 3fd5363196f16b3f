"""The fence (hookwidget/_torch/): each function over a name torch keeps private, checked against what torch does.

A failure here means torch changed one of its internals: the message names it. Fix the function in _torch/ (every
other module reaches the internal only through it) and say in its module's docstring which torch it was checked on.
"""

from __future__ import annotations

import contextlib
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hookwidget._torch import amp, autograd, compile, layers, modules, norms, pytree, tensors


@contextlib.contextmanager
def internal(name: str):
    """Any failure inside becomes one loud line naming the torch internal it is about."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  (an AttributeError, TypeError, ... of a changed internal: all alike)
        pytest.fail(f"torch {torch.__version__} changed {name} (hookwidget/_torch/, checked on torch 2.13): "
                    f"{type(e).__name__}: {e}", pytrace=False)


# -- modules.py -------------------------------------------------------------------------------------------
def test_own_parameters_buffers_children_are_the_live_dicts():
    m = nn.BatchNorm1d(3)
    seq = nn.Sequential(m, nn.Linear(3, 2, bias=False))
    with internal("nn.Module._parameters / _buffers / _modules"):
        assert list(modules.own_parameters(m)) == ["weight", "bias"]
        assert modules.own_parameters(m)["weight"] is m.weight
        assert modules.own_parameters(seq[1])["bias"] is None  # a None entry is kept
        assert set(modules.own_buffers(m)) == {"running_mean", "running_var", "num_batches_tracked"}
        assert modules.own_buffers(m)["running_mean"] is m.running_mean
        m.running_mean = torch.ones(3)
        assert modules.own_buffers(m)["running_mean"] is m.running_mean  # the live dict
        assert list(modules.children(seq)) == ["0", "1"] and modules.children(seq)["0"] is m
        assert modules.own_parameters(seq) == {}


def test_module_hooks_hold_what_register_adds():
    m = nn.Linear(2, 2)

    def hook(*args):
        return None

    with internal("nn.Module._forward_pre_hooks / _forward_hooks / _backward_hooks / _backward_pre_hooks"):
        handles = [m.register_forward_pre_hook(hook), m.register_forward_hook(hook),
                   m.register_full_backward_hook(hook), m.register_full_backward_pre_hook(hook)]
        found = modules.module_hooks(m)
        assert list(found) == ["forward_pre", "forward", "backward", "backward_pre"]
        for h, (kind, d) in zip(handles, found.items()):
            assert modules.has_module_hooks(m), kind
            assert d[h.id] is hook, kind
            h.remove()
            assert h.id not in d, kind
        assert not modules.has_module_hooks(m)


def test_global_module_hooks_and_their_flags():
    def hook(*args, **kwargs):
        return None

    with internal("torch.nn.modules.module._global_*_hooks / _global_forward_hooks_with_kwargs"):
        h = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True, always_call=True)
        try:
            assert modules.module_hooks()["forward"][h.id] is hook
            assert [d for d in modules.hook_flags() if h.id in d], "no flag dict holds the hook's flags"
        finally:
            h.remove()
        assert h.id not in modules.module_hooks()["forward"]
        modules.drop_global_kwargs_flag(h.id)
        assert not [d for d in modules.hook_flags() if h.id in d]
        pre = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        back = torch.nn.modules.module.register_module_full_backward_hook(hook)
        try:
            assert modules.module_hooks()["forward_pre"][pre.id] is hook
            assert modules.module_hooks()["backward"][back.id] is hook
        finally:
            pre.remove()
            back.remove()
    m = nn.Linear(2, 2)
    with internal("nn.Module._forward_hooks_with_kwargs / _forward_pre_hooks_with_kwargs"):
        h = m.register_forward_pre_hook(hook, with_kwargs=True)
        assert [d for d in modules.hook_flags(m) if h.id in d]
        h.remove()


def test_full_backward_flag_is_put_back():
    name = "torch.nn.modules.module._global_is_full_backward_hook"
    with internal(name):
        before = torch.nn.modules.module._global_is_full_backward_hook
        with modules.full_backward_flag_kept():
            h = torch.nn.modules.module.register_module_full_backward_hook(lambda *a: None)
            h.remove()
            assert torch.nn.modules.module._global_is_full_backward_hook is True  # outlives the hook
        assert torch.nn.modules.module._global_is_full_backward_hook is before


def test_optimizer_hooks_hold_the_global_step_hooks():
    def hook(*args):
        return None

    with internal("torch.optim.optimizer._global_optimizer_pre_hooks / _global_optimizer_post_hooks"):
        pre = register_optimizer_step_pre_hook(hook)
        post = register_optimizer_step_post_hook(hook)
        try:
            found = modules.optimizer_hooks()
            assert found[0][pre.id] is hook and found[1][post.id] is hook
        finally:
            pre.remove()
            post.remove()
        assert pre.id not in found[0] and post.id not in found[1]


def test_parameters_swapped_for_one_forward():
    m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    w = torch.randn(2, 3)
    x = torch.randn(4, 3)
    with internal("torch.nn.utils.stateless._reparametrize_module"):
        with modules.parameters_swapped(m, {"0.weight": w, "1.running_mean": torch.ones(2), "nope": w}):
            assert m[0].weight is w and torch.equal(m[1].running_mean, torch.ones(2))
            out = m[0].forward(x)
        assert torch.allclose(out, F.linear(x, w, m[0].bias))
        assert isinstance(m[0].weight, nn.Parameter) and m[0].weight is not w


# -- autograd.py ------------------------------------------------------------------------------------------
def test_current_node_is_the_running_backward_node():
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(autograd.current_node()))
    with internal("torch._C._current_autograd_node"):
        assert autograd.current_node() is None
        y.sum().backward()
        assert seen and seen[0] is not None


def test_checkpoint_frame_names_a_checkpointed_forward_and_its_rerun():
    from torch.utils.checkpoint import checkpoint

    seen = []
    lin = nn.Linear(3, 3)
    lin.register_forward_pre_hook(lambda m, i: seen.append(autograd.checkpoint_frame()))
    x = torch.randn(2, 3, requires_grad=True)
    with internal("torch.utils.checkpoint's _checkpoint_hook / _recomputation_hook closures"):
        y = checkpoint(lin, x, use_reentrant=False) + checkpoint(lin, x, use_reentrant=False)
        lin(x)
        y.sum().backward()
        (phase1, first), (phase2, second), plain = seen[:3]
        assert (phase1, phase2, plain) == ("forward", "forward", None) and first is not second
        reruns = seen[3:]
        assert sorted(p for p, _ in reruns) == ["rerun", "rerun"]
        assert {id(f) for _, f in reruns} == {id(first), id(second)}
        seen.clear()
        checkpoint(lin, x, use_reentrant=True).sum().backward()  # reentrant: no saved-tensor hooks
        assert seen == [None, None]


def test_sequence_numbers_order_the_nodes_a_forward_makes():
    x = torch.randn(3, requires_grad=True)
    with internal("torch._C._autograd._get_sequence_nr / Node._sequence_nr"):
        start = autograd.next_sequence_nr()
        a = x * 2
        b = a + 1
        end = autograd.next_sequence_nr()
        assert start <= autograd.sequence_nr(a.grad_fn) < autograd.sequence_nr(b.grad_fn) < end
        assert autograd.sequence_nrs([a.grad_fn, b.grad_fn]) == [autograd.sequence_nr(a.grad_fn),
                                                                 autograd.sequence_nr(b.grad_fn)]


def test_in_transform_inside_vmap_only():
    seen = []

    def f(x):
        seen.append((autograd.in_transform(), autograd.peek_transform() is not None))
        return x * 2

    with internal("torch._C._functorch.peek_interpreter_stack"):
        assert not autograd.in_transform()
        torch.func.vmap(f)(torch.randn(2, 3))
        assert seen == [(True, True)]


def test_output_shape_of_a_node():
    x = torch.randn(3, 4, requires_grad=True)
    with internal("Node._input_metadata"):
        assert autograd.output_shape(x.transpose(0, 1).grad_fn) == (4, 3)
        outs = x.split([1, 3], 1)
        assert autograd.output_shape(outs[0].grad_fn, 1) == (3, 3)
        assert autograd.output_shape(object()) is None


def test_saved_values_of_the_nodes_capture_reads():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    cases = [  # (forward op, saved name, value): every name capture and the layer rules read
        (lambda: x.transpose(0, 1), "dim0", 0), (lambda: x.transpose(0, 1), "dim1", 1),
        (lambda: x.permute(1, 0), "dims", (1, 0)), (lambda: x.unsqueeze(1), "dim", 1),
        (lambda: x.unsqueeze(1).squeeze(1), "dim", 1), (lambda: x.select(0, 1), "dim", 0),
        (lambda: x.unbind(1)[0], "dim", 1), (lambda: x.softmax(1), "dim", 1), (lambda: x.log_softmax(0), "dim", 0),
        (lambda: torch.cat([x, x], 1), "dim", 1), (lambda: x[:, 1:], "dim", 1), (lambda: x.split(2, 1)[0], "dim", 1),
        (lambda: x.split([1, 3], 1)[0], "dim", 1), (lambda: F.layer_norm(x, (4,)), "normalized_shape", (4,)),
    ]
    for op, name, value in cases:
        node = op().grad_fn
        with internal(f"{type(node).__name__}._saved_{name}"):
            assert autograd.saved(node, name) == value
    mm, addmm = (x @ w).grad_fn, torch.addmm(torch.zeros(2), x, w).grad_fn
    with internal("MmBackward0._saved_self / AddmmBackward0._saved_mat1"):
        assert type(mm).__name__ == "MmBackward0" and torch.equal(autograd.saved(mm, "self"), x)
        assert type(addmm).__name__ == "AddmmBackward0" and torch.equal(autograd.saved(addmm, "mat1"), x)
    with pytest.raises(AttributeError):
        autograd.saved(mm, "no_such_value")


# -- tensors.py -------------------------------------------------------------------------------------------
def test_version_counts_in_place_writes():
    t = torch.zeros(3)
    with internal("Tensor._version"):
        v = tensors.version(t)
        t.add_(1)
        assert tensors.version(t) == v + 1
        assert tensors.versions([t, None, torch.zeros(1)]) == [v + 1, None, 0]
        with torch.inference_mode():
            inf = torch.zeros(2)
        with pytest.raises(RuntimeError):
            tensors.version(inf)
        assert tensors.versions([t, inf, None]) == [v + 1, None, None]  # no counter: None, not an error


def test_view_base():
    t = torch.zeros(2, 3)
    with internal("Tensor._base"):
        assert tensors.view_base(t.view(6)) is t
        assert tensors.view_base(t) is None


def test_hook_dict_is_the_one_register_hook_fills():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    got = []
    with internal("Tensor._backward_hooks / Node._register_hook_dict"):
        assert tensors.backward_hooks(y) is None
        d = tensors.hook_dict(y)
        d[-1] = lambda g: got.append(g) or g * 3
        assert tensors.backward_hooks(y) is d
        h = y.register_hook(lambda g: None)
        assert h.id in d
        y.sum().backward()
        assert len(got) == 1 and torch.equal(x.grad, torch.full((3,), 6.0))


def test_post_accumulate_hooks():
    p = torch.randn(2, requires_grad=True)
    with internal("Tensor._post_accumulate_grad_hooks"):
        assert not tensors.post_accumulate_hooks(p)
        h = p.register_post_accumulate_grad_hook(lambda t: None)
        assert h.id in tensors.post_accumulate_hooks(p)


def test_lazy_clone_copies_on_write():
    g = torch.arange(4.0)
    with internal("torch._lazy_clone"):
        assert tensors.lazy_clone is not None
        c = tensors.lazy_clone(g)
        assert torch.equal(c, g)
        g.add_(1)
        assert torch.equal(c, torch.arange(4.0))


def test_sparse_values():
    e = nn.Embedding(10, 3, sparse=True)
    e(torch.tensor([1, 1, 2])).sum().backward()
    g = e.weight.grad.coalesce()
    with internal("Tensor._values"):
        values = tensors.sparse_values(g)
        assert values.shape == (2, 3) and torch.equal(values, g.values()) and values.grad_fn is None
        assert torch.allclose(values.norm(), g.to_dense().norm())


def test_storage_key_and_users():
    t = torch.zeros(4)
    with internal("UntypedStorage._cdata / torch._C._storage_Use_Count"):
        assert tensors.storage_key(t.view(2, 2)) == tensors.storage_key(t) != tensors.storage_key(torch.zeros(4))
        assert tensors.storage_users(t) == 1
        v = t[1:]
        assert tensors.storage_users(t) == 2
        del v
        assert tensors.storage_users(t) == 1


# -- pytree.py, norms.py, compile.py, layers.py, amp.py ---------------------------------------------------
def test_tree_flatten_and_back():
    Pair = namedtuple("Pair", "a b")
    tree = (torch.ones(1), [torch.zeros(2), {"k": torch.ones(3)}], Pair(torch.ones(1), None), 5)
    with internal("torch.utils._pytree.tree_flatten / tree_unflatten"):
        leaves, spec = pytree.tree_flatten(tree)
        assert len(leaves) == 6 and leaves[-1] == 5
        back = pytree.tree_unflatten(leaves, spec)
        assert type(back[2]) is Pair and back[1][1]["k"] is tree[1][1]["k"]


def test_foreach_kernels():
    ts = [torch.randn(3), torch.randn(2, 5), torch.tensor([-7.0])]
    with internal("torch._foreach_norm / _foreach_copy_ / _foreach_sub_"):
        assert all(torch.allclose(n, t.norm()) for n, t in zip(norms.foreach_norm(ts), ts))
        assert [float(n) for n in norms.foreach_norm(ts, float("inf"))] == [float(t.abs().max()) for t in ts]
        copies = [torch.empty_like(t) for t in ts]
        norms.foreach_copy_(copies, ts)
        assert all(torch.equal(c, t) for c, t in zip(copies, ts))
        norms.foreach_sub_(copies, ts)
        assert all(not c.any() for c in copies)


def test_compiled_wrapper():
    m = nn.Linear(2, 2)
    with internal("torch.compile's OptimizedModule._orig_mod"):
        c = torch.compile(m)
        assert compile.is_compiled(c) and not compile.is_compiled(m)
        assert compile.uncompiled(c) is m and compile.uncompiled(m) is m


def test_compiled_code_runs_eagerly_in_the_block_only():
    """torch.compiler.set_stance("force_eager") (public since torch 2.6): no backend is called in the block."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    f = torch.compile(lambda t: t.sin() + 1, backend=backend)
    assert compile.can_run_eagerly()
    with compile.eagerly():
        assert torch.equal(f(torch.ones(3)), torch.ones(3).sin() + 1) and graphs == []
    f(torch.ones(3))
    assert len(graphs) == 1
    torch.compiler.reset()


@pytest.mark.filterwarnings("ignore:Using padding='same'")
def test_conv_bases_and_padding():
    convs = [nn.Conv1d(2, 2, 3), nn.Conv2d(2, 2, 3), nn.Conv3d(2, 2, 3)]
    transposed = [nn.ConvTranspose1d(2, 2, 3), nn.ConvTranspose2d(2, 2, 3), nn.ConvTranspose3d(2, 2, 3)]
    with internal("torch.nn.modules.conv._ConvNd / _ConvTransposeNd / _reversed_padding_repeated_twice"):
        assert all(layers.is_conv(m) for m in convs + transposed) and not layers.is_conv(nn.Linear(2, 2))
        assert all(layers.is_transposed_conv(m) for m in transposed)
        assert not any(layers.is_transposed_conv(m) for m in convs)
        same = nn.Conv1d(1, 1, 4, padding="same")  # uneven: the extra element on the right
        x = torch.randn(1, 1, 7)
        assert layers.conv_self_padding(same) == (1, 2)
        assert torch.allclose(same(x), F.conv1d(F.pad(x, layers.conv_self_padding(same)), same.weight, same.bias))
        assert not any(layers.conv_self_padding(nn.Conv2d(1, 1, 3)))
    with internal("_ConvNd._conv_forward"):
        for m in convs:
            assert all(callable(getattr(m, name)) for name in layers.CONV_FORWARD_METHODS)


def test_norm_and_attention_fields():
    with internal("InstanceNorm._get_no_batch_dim"):
        assert [layers.unbatched_rank(m(2)) for m in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)] \
            == [2, 3, 4]
    with internal("MultiheadAttention._qkv_same_embed_dim"):
        assert layers.packed_qkv(nn.MultiheadAttention(4, 2))
        assert not layers.packed_qkv(nn.MultiheadAttention(4, 2, kdim=3, vdim=3))


def test_bag_max_rows():
    """The rows EmbeddingBag(mode="max")'s backward sends each bag's gradient to, per feature: the bag's argmax."""
    w = torch.randn(6, 3)
    w[4] = w[2]  # a tie between two rows: the kernel's choice, whatever it is, is what backward uses
    ids, offsets = torch.tensor([1, 2, 4, 3, 0, 0, 5]), torch.tensor([0, 3, 3, 4])
    with internal("torch.embedding_bag's fourth output (max_indices)"):
        rows = layers.bag_max_rows(w, ids, offsets, False, 0)
        assert rows.shape == (4, 3)
        bag = nn.EmbeddingBag(6, 3, mode="max", padding_idx=0, _weight=w.clone())
        g = torch.randn(4, 3)
        bag(ids, offsets).backward(g)
        want = torch.zeros(6, 3)
        for b in (0, 2, 3):  # bag 1 is empty and bag 3 all padding but one entry: rows only where a bag has entries
            want[rows[b], torch.arange(3)] += g[b]
        assert torch.equal(bag.weight.grad, want)
        assert set(rows[0].tolist()) <= {1, 2, 4}


def test_grad_scaler_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with internal("GradScaler._scale"):
        assert amp.is_grad_scaler(scaler) and not amp.is_grad_scaler(object())
        assert amp.current_scale(scaler) is None
        scaler.scale(torch.ones(()))
        assert float(amp.current_scale(scaler)) == 8.0


def test_every_fence_module_says_which_torch_it_was_checked_on():
    import hookwidget._torch as fence

    for name in fence.__doc__.split():
        if name.endswith(".py"):
            mod = __import__(f"hookwidget._torch.{name[:-3]}", fromlist=["_"])
            assert "torch 2.13" in mod.__doc__, f"{name}: its docstring says which torch it was checked on"
