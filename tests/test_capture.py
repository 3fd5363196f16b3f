"""Capture: observation changes nothing, hooks never outlive a trace, detail within budget."""

import time

import pytest
import torch
import torch.nn.modules.module as module_mod
from torch import nn

import hookwidget as hw


def conv_net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Dropout(0.3),
        nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10),
    )


def run_conv(model, x, y):
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def hook_state(model):
    dicts = [module_mod._global_forward_hooks, module_mod._global_forward_pre_hooks,
             module_mod._global_backward_hooks, module_mod._global_backward_pre_hooks]
    per_module = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                   len(m._backward_pre_hooks)) for m in model.modules()]
    return [len(d) for d in dicts], per_module, torch.autograd.backward, torch.autograd.grad


def test_observation_is_bitwise_neutral_with_batchnorm_and_dropout():
    torch.manual_seed(1)
    model = conv_net()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    state = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(7)
    ref_loss = run_conv(model, x, y)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    ref_rng = torch.get_rng_state()
    ref_stats = {k: v.clone() for k, v in model.state_dict().items()}

    model.load_state_dict(state)
    torch.manual_seed(7)
    for capture in ("full", "summary"):
        model.load_state_dict(state)
        torch.manual_seed(7)
        t = hw.trace(lambda: run_conv(model, x, y), capture=capture)
        assert torch.equal(torch.tensor(t.loss), ref_loss.detach())
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref_grads))
        assert torch.equal(torch.get_rng_state(), ref_rng)
        assert all(torch.equal(v, ref_stats[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("where", ["forward", "backward", "keyboard"])
def test_no_hook_outlives_a_failing_trace(where):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 1))
    before = hook_state(model)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom in backward")

    def cell():
        h = model(torch.randn(2, 3))
        if where == "forward":
            raise ValueError("boom in forward")
        if where == "keyboard":
            raise KeyboardInterrupt
        Boom.apply(h).sum().backward()

    with pytest.raises(KeyboardInterrupt if where == "keyboard" else ValueError):
        hw.trace(cell)
    assert hook_state(model) == before


def test_with_block_fills_the_trace_and_removes_hooks(seed_mlp):
    model, x, y, step = seed_mlp
    before = hook_state(model)
    with hw.tracing() as t:
        step()
    assert hook_state(model) == before
    assert list(t.layers) == ["SeedMLP", "fc1", "fc2"]
    assert torch.allclose(t.weight_grad("fc2"), model.fc2.weight.grad, atol=1e-6)


def test_hooks_only_on_given_modules(seed_mlp):
    model, x, y, step = seed_mlp
    other = nn.Linear(2, 2)
    t = hw.trace(lambda: (step(), other(torch.randn(1, 2))), modules=model.fc2)
    assert list(t.layers) == ["Linear"]
    assert tuple(t.layers["Linear"].delta.shape) == (5, 6, 2)


def test_module_called_twice_keeps_a_call_each_and_sums_its_gradient():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def step():
        shared.zero_grad()
        shared(torch.tanh(shared(x))).pow(2).sum().backward()

    t = hw.trace(step)
    layer = t.layers["Linear"]
    assert len(layer.calls) == 2
    assert torch.equal(layer.a, x)
    assert torch.allclose(t.weight_grad("Linear"), shared.weight.grad, atol=1e-6)
    assert torch.allclose(t.bias_grad("Linear"), shared.bias.grad, atol=1e-6)


def test_in_place_relu_after_layer_keeps_exact_factors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 1))
    x = torch.randn(6, 4)

    def step():
        model.zero_grad()
        model(x).sum().backward()

    t = hw.trace(step)
    for name in ("0", "2"):
        assert torch.allclose(t.weight_grad(name), model.get_submodule(name).weight.grad, atol=1e-6)
    # ReLU's input a was cloned before the in-place op rewrote it: it still has negatives
    assert (t.layers["1"].a < 0).any()


def test_forward_only_and_no_grad_give_activations_and_say_so(seed_mlp):
    model, x, y, step = seed_mlp
    with torch.no_grad():
        t = hw.trace(lambda: model(x))
    assert tuple(t.layers["fc2"].a.shape) == (5, 6, 3)
    assert t.layers["fc2"].delta is None
    assert any("no gradients captured" in n for n in t.notes)
    t2 = hw.trace(lambda: model(x))
    assert t2.graph.number_of_nodes() > 0  # the graph backward would walk


def test_budget_keeps_summaries_and_says_what_was_dropped(seed_mlp):
    model, x, y, step = seed_mlp
    t = hw.trace(step, budget_mb=0.0002)  # ~200 bytes: room for one small tensor
    dropped = [c for layer in t.layers.values() for c in layer.calls if c.a is None]
    assert dropped
    c = dropped[0]
    assert c.a_summary is not None and c.a_summary.shape and c.a_summary.nan == 0
    assert any("memory budget" in n for n in t.notes)


def test_summary_statistics_equal_torch(seed_mlp):
    model, x, y, step = seed_mlp
    full = hw.trace(step)
    t = hw.trace(step, capture="summary")
    s, a = t.layers["fc2"].calls[0].a_summary, full.layers["fc2"].a
    assert s.shape == tuple(a.shape)
    assert s.norm == pytest.approx(float(a.norm()), rel=1e-6)
    assert (s.min, s.max) == pytest.approx((float(a.min()), float(a.max())))
    assert s.mean == pytest.approx(float(a.mean()), abs=1e-7)


def test_nan_and_inf_are_counted(seed_mlp):
    model, x, y, step = seed_mlp
    xb = x.detach().clone()
    xb[0, 0, 0] = float("nan")
    xb[1, 0, 0] = float("inf")
    t = hw.trace(lambda: model(xb), capture="summary")
    s = t.layers["fc1"].calls[0].a_summary
    assert (s.nan, s.inf) == (1, 1)


def test_graph_ids_are_stable_and_attributed(seed_mlp):
    model, x, y, step = seed_mlp
    g1, g2 = hw.trace(step).graph, hw.trace(step).graph
    assert list(g1.nodes) == list(g2.nodes) and list(g1.edges) == list(g2.edges)
    modules = {d["module"] for _, d in g1.nodes(data=True) if d["role"] == "op"}
    assert {"fc1", "fc2"} <= modules
    assert all(d["grad_norm"] is not None for _, d in g1.nodes(data=True) if d["role"] in ("op", "param"))


def test_node_grad_norms_equal_autograd(seed_mlp):
    model, x, y, step = seed_mlp
    t = hw.trace(step)
    pnode = next(d for _, d in t.graph.nodes(data=True) if d["param"] == "fc1.weight")
    assert pnode["grad_norm"] == pytest.approx(float(model.fc1.weight.grad.norm()), rel=1e-6)


class _ReuseNet(nn.Module):
    """In-place ReLU after a layer, a residual, a layer called twice: every way a node's gradient
    can differ from a layer's δ."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act = nn.Linear(4, 8), nn.ReLU(inplace=True)
        self.shared, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.act(self.fc1(x))
        h = h + self.shared(h)
        return self.head(self.shared(torch.tanh(h)))


@pytest.mark.parametrize("capture", ["summary", "full"])
@pytest.mark.parametrize("passes", [1, 2])
def test_every_node_norm_equals_a_hand_written_node_hook(capture, passes):
    from hookwidget.record.graph import GraphWalk

    torch.manual_seed(0)
    model, x = _ReuseNet(), torch.randn(5, 4)

    def step():
        loss = model(x).pow(2).sum()
        for k in range(passes):
            loss.backward(retain_graph=k < passes - 1)

    # the reference: a pre-hook on every grad_fn node records what arrives there (last pass)
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).sum()
    walk, seen, handles = GraphWalk(), {}, []
    walk.extend([loss.grad_fn])
    for node_id, node in zip(walk.ids, walk.nodes):
        def record(grads, node_id=node_id):
            seen[node_id] = (float(grads[0].norm()), float(grads[0].abs().max()), tuple(grads[0].shape))
        handles.append(node.register_prehook(record))
    for k in range(passes):
        loss.backward(retain_graph=k < passes - 1)
    for h in handles:
        h.remove()

    model.zero_grad(set_to_none=True)
    g = hw.trace(step, capture=capture, node_grads=True).graph
    shown = {n: d for n, d in g.nodes(data=True) if d["grad_norm"] is not None}
    assert set(shown) == set(seen)
    for n, (norm, mx, shape) in seen.items():
        assert shown[n]["grad_norm"] == pytest.approx(norm, rel=1e-6), n
        assert shown[n]["grad_max"] == pytest.approx(mx, rel=1e-6), n
        assert shown[n]["shape"] == shape, n


def test_40k_node_chain_builds_iteratively_and_fast():
    x = torch.randn(2, requires_grad=True)
    h = x
    for _ in range(40_000):
        h = h * 1.0
    start = time.perf_counter()
    t = hw.trace(lambda: h.sum().backward(), node_grads=False)
    elapsed = time.perf_counter() - start
    assert t.graph.number_of_nodes() >= 40_002
    assert elapsed < 5.0  # generous: CI machines vary; benchmarks/ measures the real figure


def test_user_hooks_are_listed(seed_mlp):
    model, x, y, step = seed_mlp

    def my_probe(m, i, o):
        return None

    h = model.fc1.register_forward_hook(my_probe)
    try:
        t = hw.trace(step)
    finally:
        h.remove()
    assert any("my_probe" in s for s in t.user_hooks["fc1"])


def test_user_tensor_hooks_on_parameters_and_inputs_are_listed(seed_mlp):
    model, x, y, step = seed_mlp
    xr = x.detach().clone().requires_grad_()

    def double(g):
        return 2 * g

    handles = [model.fc2.weight.register_hook(double), xr.register_hook(double),
               model.fc1.weight.register_post_accumulate_grad_hook(lambda p: None)]
    try:
        t = hw.trace(lambda: model(xr).sum().backward())
    finally:
        for h in handles:
            h.remove()
    here = "test_user_tensor_hooks_on_parameters_and_inputs_are_listed.<locals>"
    assert t.user_hooks["fc2.weight"] == [f"tensor: {here}.double"]
    assert t.user_hooks["fc1.weight"] == [f"post_accumulate_grad: {here}.<lambda>"]
    assert sum("double" in h for hooks in t.user_hooks.values() for h in hooks) == 2  # xr, under its node id
    assert "fc1" not in t.user_hooks  # no module hook there
    assert f"your hooks on fc2.weight: tensor: {here}.double" in repr(t)


def test_bad_options_get_one_clear_line(seed_mlp):
    model, x, y, step = seed_mlp
    with pytest.raises(ValueError, match="capture='everything' must be one of 'full', 'summary', 'norms'"):
        hw.trace(step, capture="everything")
    with pytest.raises(TypeError, match="unknown trace option"):
        hw.trace(step, budget=3)
    with pytest.raises(TypeError, match="hw.trace takes a function"):
        hw.trace(model)
    with pytest.raises(KeyError, match="no layer 'fc9'"):
        hw.trace(step).weight_grad("fc9")


def test_opt_in_backward_hooks_show_grad_input_and_leave_nothing_behind(seed_mlp):
    model, x, y, step = seed_mlp
    before = hook_state(model), module_mod._global_is_full_backward_hook
    t = hw.trace(step, backward_hooks=True)
    assert (hook_state(model), module_mod._global_is_full_backward_hook) == before
    # seed 003: fc2's backward hook sees grad_input[0] = δ₂ W₂ (the gradient that continues leftward)
    fc2 = t.layers["fc2"]
    assert torch.allclose(fc2.calls[0].grad_input, fc2.delta @ model.fc2.weight, atol=1e-6)
    assert not any(d["name"].startswith("BackwardHookFunction") for _, d in t.graph.nodes(data=True))
    assert torch.allclose(t.weight_grad("fc1"), model.fc1.weight.grad, atol=1e-6)


def test_without_node_hooks_layer_outputs_and_params_still_get_norms(seed_mlp):
    model, x, y, step = seed_mlp
    t = hw.trace(step, node_grads=False)
    d2 = torch.autograd.grad(0.5 * ((model(x) - y) ** 2).sum(), [model.fc1.weight])[0]
    pnode = next(d for _, d in t.graph.nodes(data=True) if d["param"] == "fc1.weight")
    assert pnode["grad_norm"] == pytest.approx(float(d2.norm()), rel=1e-6)
    out_nodes = [d for _, d in t.graph.nodes(data=True) if d["module"] == "fc2" and d["grad_norm"] is not None]
    assert any(d["grad_norm"] == pytest.approx(float(t.layers["fc2"].delta.norm()), rel=1e-6) for d in out_nodes)
    assert all(d["grad_norm"] is None for _, d in t.graph.nodes(data=True) if d["name"] == "TBackward0")


def test_without_node_hooks_a_parameter_node_shows_the_grad_backward_made_not_the_clipped_one(seed_mlp):
    model, x, y, step = seed_mlp

    def clipped_step():
        step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # rewrites .grad in place

    step()
    made = {n: float(p.grad.norm()) for n, p in model.named_parameters()}  # the reference: plain backward
    t = hw.trace(clipped_step, node_grads=False)
    params = {d["param"]: d["grad_norm"] for _, d in t.graph.nodes(data=True) if d["role"] == "param"}
    assert params.keys() == made.keys()
    assert all(params[n] == pytest.approx(made[n], rel=1e-6) for n in made)
    assert float(model.fc1.weight.grad.norm()) < 2e-3  # the user's .grad is clipped, as the cell left it
    assert all(torch.equal(t.param_grads[n], t.steps[0].grads[n]) for n in made)
    assert any("changed .grad after its last backward" in n and "clip_grad_norm_" in n for n in t.notes)


def test_large_graphs_skip_per_node_hooks_and_say_so():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(80)])
    t = hw.trace(lambda: model(torch.randn(2, 4)).sum().backward())
    assert any("node_grads=True" in n for n in t.notes)
    t2 = hw.trace(lambda: model(torch.randn(2, 4)).sum().backward(), node_grads=True)
    assert all(d["grad_norm"] is not None for _, d in t2.graph.nodes(data=True) if d["role"] == "op")


def test_a_submodule_called_before_its_model_keeps_its_qualified_name():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 3)

    def step():
        model[0](x)  # called alone first: recorded before the Sequential that contains it
        model(x).sum().backward()

    t = hw.trace(step)
    assert set(t.layers) == {"Sequential", "0", "1", "2"}
    assert [c.a.shape for c in t.layers["0"].calls] == [(2, 3), (2, 3)]


@pytest.mark.parametrize("capture", ["summary", "full"])
def test_node_norms_without_hooks_equal_hand_written_node_hooks_on_a_transformer(capture):
    """Norms derived rather than hooked (layer outputs, new .grads, view chains: 3-D Linear, attention
    reshapes, weight transposes) equal what a pre-hook on every node sees, shapes included."""
    from benchmarks import models
    from hookwidget.record.graph import GraphWalk

    torch.manual_seed(0)
    model, x, y, loss_fn = models.build("transformer", "cpu", small=True)
    loss = loss_fn(model(x), y)
    walk, seen, handles = GraphWalk(), {}, []
    walk.extend([loss.grad_fn])
    for node_id, node in zip(walk.ids, walk.nodes):
        def record(grads, node_id=node_id):
            if grads[0] is not None:
                seen[node_id] = (float(grads[0].norm()), float(grads[0].abs().max()), tuple(grads[0].shape))
        handles.append(node.register_prehook(record))
    loss.backward()
    for h in handles:
        h.remove()

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    g = hw.trace(step, capture=capture, node_grads=True).graph
    shown = {n: d for n, d in g.nodes(data=True) if d["grad_norm"] is not None}
    assert set(shown) == set(seen)
    for n, (norm, mx, shape) in seen.items():
        assert shown[n]["grad_norm"] == pytest.approx(norm, rel=1e-5), n
        assert shown[n]["grad_max"] == pytest.approx(mx, rel=1e-5), n
        assert tuple(shown[n]["shape"]) == shape, n


def test_summary_of_an_input_rewritten_in_place_is_taken_before_the_call():
    """Statistics of small tensors are reduced in batches later: a module's input that an in-place
    module rewrites must still be summarised as it went in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    t = hw.trace(lambda: model(x).sum().backward(), capture="summary")
    before_relu = model[0](x).detach()
    s = t.layers["1"].calls[0].a_summary
    assert s.min == pytest.approx(float(before_relu.min())) and s.min < 0
    assert s.norm == pytest.approx(float(before_relu.norm()), rel=1e-6)
    assert s.mean == pytest.approx(float(before_relu.mean()), rel=1e-5, abs=1e-7)


def test_a_long_training_loop_holds_no_graph_of_earlier_steps():
    """Each step lets its graph go: the tensor hooks left alive stay few however many steps run."""
    from hookwidget.capture.recording import Recording

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    alive = []
    end_step = Recording.end_step

    def spy(self):
        end_step(self)
        alive.append(len(self.hooks.tensor))

    def loop():
        for _ in range(30):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()

    Recording.end_step = spy
    try:
        t = hw.trace(loop)
    finally:
        Recording.end_step = end_step
    assert len(t.steps) == 30 and max(alive) == alive[0]


def test_grad_copies_stay_as_backward_left_them():
    """.grad copies share memory until either side is written (copy on write): the record keeps
    its values when the code or the next cell rewrites .grad in place."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    t = hw.trace(lambda: model(x).sum().backward())
    ref = model.weight.grad.clone()
    model.weight.grad.mul_(3)  # in place, after the trace
    model(x).sum().backward()  # accumulates in place
    assert torch.equal(t.param_grads["weight"], ref)
    assert torch.equal(t.steps[0].grads["weight"], ref)


class _TokensAndSide(nn.Module):
    """side runs on 7 rows that are no samples, summed into every sample's output: per-sample norms leave it out."""

    def __init__(self):
        super().__init__()
        self.tok, self.side, self.head = nn.Embedding(10, 4), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.tok(ids)) + self.side(torch.ones(7, 4)).sum(0)


@pytest.mark.parametrize("capture", ["full", "norms"])
def test_notes_decided_after_the_trace_ignore_later_changes_to_the_model(capture):
    """The notes and per_sample_left_out are decided when first read, from what the modules were when the
    trace ended: freezing a layer, replacing a forward or changing a rule's flag afterwards changes nothing."""
    torch.manual_seed(0)
    m, ids = _TokensAndSide(), torch.randint(0, 10, (3, 5))

    def step():
        m.zero_grad(set_to_none=True)
        m(ids).pow(2).sum().backward()

    now = hw.trace(step, capture=capture)
    want_notes, want_left = list(now.notes), dict(now.per_sample_left_out)
    assert "side.weight" in want_left and "tok.weight" not in want_left, (want_left, want_notes)
    later = hw.trace(step, capture=capture)
    m.side.weight.requires_grad_(False)
    m.head.bias.requires_grad_(False)
    m.head.forward = lambda x: x  # no exact rule for a forward replaced on the instance
    m.tok.sparse = True  # Embedding(sparse=True) is refused by its rule
    try:
        assert later.per_sample_left_out == want_left
        assert later.notes == want_notes
    finally:
        del m.head.forward
        m.tok.sparse = False
        m.side.weight.requires_grad_(True)
        m.head.bias.requires_grad_(True)


def test_memory_the_trace_alone_holds_is_kept_once_and_what_the_cell_holds_is_copied():
    """q, k and v keep one input; a model and its last layer keep one δ: no copy of either (the GPT-2-small
    explorer spent 0.3 s copying them). An input the cell still holds is the cell's: the trace keeps a copy,
    which a later in-place change of the cell's tensor does not reach."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.out = (nn.Linear(4, 4) for _ in range(4))

        def forward(self, h):
            return self.out(torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1) @ self.v(h))

    torch.manual_seed(0)
    m, x = Attn(), torch.randn(2, 3, 4)
    held = {}

    def cell():
        h = held["h"] = x * 2  # the cell keeps q's input alive after the trace
        m.out(m(h)).sum().backward()

    t = hw.trace(cell, m)
    q, k, v = (t.layers[n].calls[0].a for n in ("q", "k", "v"))
    assert q.data_ptr() == k.data_ptr() == v.data_ptr()  # one copy for the three, the cell's own elsewhere
    assert q.data_ptr() != held["h"].data_ptr()
    held["h"].zero_()
    torch.testing.assert_close(q, x * 2)

    t = hw.trace(lambda: m(x).sum().backward(), m)
    q, k, v = (t.layers[n].calls[0].a for n in ("q", "k", "v"))
    assert q.data_ptr() == k.data_ptr() == v.data_ptr()  # x is the cell's: one copy for the three
    whole, last = t.layers["Attn"].calls[0].delta, t.layers["out"].calls[0].delta
    assert whole.data_ptr() == last.data_ptr()  # one δ, kept once


@pytest.mark.parametrize("capture", ["full", "summary", "norms"])
def test_forward_only_under_inference_mode(capture):
    """Inference tensors have no version counter: what a trace holds of them by reference is kept, not guarded
    (and the trace does not fail settling its record)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with torch.inference_mode():
        x = torch.randn(2, 4)
        t = hw.trace(lambda: model(x), capture=capture)
        hidden = model[0](x)  # the reference, by hand
    assert [n.id for n in t.note_records] == ["no_grads"]
    if capture != "summary":  # norms keeps the input of the layers whose norms it streams only
        assert torch.equal(t.layers["0"].a, x)
        assert torch.equal(t.layers["1"].a, hidden) if capture == "full" else t.layers["1"].a is None
