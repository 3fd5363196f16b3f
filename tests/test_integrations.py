"""hookwidget.integrations: the callbacks inside a real Hugging Face Trainer (tiny GPT-2, random weights, CPU) and a
real Lightning Trainer (small MLP, CPU), with gradient accumulation. The reference is taken in the same fit by
hand-written hooks: the torch optimizer's own step hooks (register_step_pre_hook / register_step_post_hook) read
‖p.grad‖₂ as the step uses it (after the Trainer's clipping) and copy the parameters before and after it (‖ΔW‖/‖W‖),
and the trainer's own events (Trainer: on_substep_end / on_step_end; Lightning: on_train_batch_end and
trainer.global_step) say which micro-batches each optimizer step held. Nothing in the reference comes from
hookwidget."""

import csv
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from hookwidget._torch.modules import module_hooks, optimizer_hooks


def hook_count(model) -> int:
    """Every module and optimizer hook registered now (the model's modules' own and the global ones)."""
    return (sum(len(d) for m in model.modules() for d in module_hooks(m).values())
            + sum(len(d) for d in module_hooks().values()) + sum(len(d) for d in optimizer_hooks()))


class StepNorms:
    """Hand-written hooks on a torch optimizer: per optimizer step and layer (a module with parameters of its own,
    named as in named_modules), ‖W.grad‖₂ as the step used it and ‖ΔW‖₂/‖W‖₂ of the step (root sums of squares
    over the layer's own parameters)."""

    def __init__(self, model):
        self.model, self.rows, self.globals, self.before, self.handles = model, [], [], None, []

    def attach(self, opt):
        opt = getattr(opt, "optimizer", opt)  # accelerate's wrapper: the torch optimizer inside
        self.handles = [opt.register_step_pre_hook(self.pre), opt.register_step_post_hook(self.post)]

    def layers(self):
        return [(name or type(m).__name__, list(m.parameters(recurse=False))) for name, m in self.model.named_modules()
                if list(m.parameters(recurse=False))]

    def pre(self, opt, args, kwargs):
        self.before = {id(p): p.detach().clone() for p in self.model.parameters()}

    def post(self, opt, args, kwargs):  # .grad as the step used it: Lightning's backward runs inside step(closure)
        self.globals.append(math.sqrt(sum(p.grad.double().square().sum().item() for p in self.model.parameters()
                                          if p.grad is not None)))

        def root(f, ps):
            return math.sqrt(sum(f(p) ** 2 for p in ps))

        self.rows.append({name: {"grad_norm": root(lambda p: p.grad.double().norm().item(), ps),
                                 "update_ratio": root(lambda p: (p.detach() - self.before[id(p)]).double().norm()
                                                      .item(), ps) / root(lambda p: self.before[id(p)].double()
                                                                          .norm().item(), ps)}
                          for name, ps in self.layers()})

    def remove(self):
        for h in self.handles:
            h.remove()


def close(a, b):
    return a == pytest.approx(b, rel=2e-5, abs=1e-12)


def check_against(cb, norms, ref_micro, losses):
    """One row per optimizer step: its grad_norm and update_ratio are the hand-written ones, its loss the trainer's,
    the micro-batches the trainer's."""
    w = cb.watch
    assert not w.active
    assert cb.micro_batches == ref_micro
    assert cb.optimizer_steps() == sorted(ref_micro) and len(w.steps) == len(norms.rows) == len(ref_micro)
    for r, layers in enumerate(norms.rows):
        assert set(layers) == set(w.layer_names)
        for layer in w.layer_names:
            for stat in ("grad_norm", "update_ratio"):
                assert close(w.series(layer, stat)[r].item(), layers[layer][stat]), (r, layer, stat)
    assert w.series("loss").tolist() == pytest.approx(losses, rel=1e-4)


# -- imports ------------------------------------------------------------------------------------------------
def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_hookwidget_imports_neither_transformers_nor_lightning():
    r = run_python("import sys, hookwidget, hookwidget.integrations, hookwidget.integrations.fit\n"
                   "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'lightning', "
                   "'pytorch_lightning', 'wandb')]\nassert not bad, bad")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name, extra", [("lightning", "lightning"), ("transformers", "transformers")])
def test_without_the_package_one_clear_line(name, extra):
    r = run_python(f"import sys; sys.modules[{name!r}] = None\nimport hookwidget.integrations.{name}")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"ImportError: hookwidget.integrations.{name} needs "
                    f"{'Lightning' if name == 'lightning' else 'transformers'}: pip install hookwidget[{extra}]")


# -- Hugging Face Trainer ---------------------------------------------------------------------------------------
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, length=12, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_parts():
    """transformers (skipped without it or accelerate, which its Trainer needs) and the reference callback."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class TrainerReference(tf.TrainerCallback):
        """The Trainer's own micro-batch and optimizer-step events, the hand-written norms at each optimizer
        step, and the logs as a callback before hookwidget's (where report_to integrations sit) receives them."""

        def __init__(self, norms):
            self.norms, self.n, self.first = norms, 0, 0
            self.micro, self.logs = {}, {}

        def on_train_begin(self, args, state, control, optimizer=None, **kw):
            self.norms.attach(optimizer)

        def on_substep_end(self, args, state, control, **kw):
            self.n += 1

        def on_step_end(self, args, state, control, **kw):
            self.n += 1
            self.micro[state.global_step], self.first = list(range(self.first, self.n)), self.n

        def on_log(self, args, state, control, logs=None, **kw):
            if "loss" in logs:
                self.logs[state.global_step] = dict(logs)

    return tf, TrainerReference


def gpt2(tf):
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                           eos_token_id=0)
    return tf.GPT2LMHeadModel(config)


def hf_trainer(tf, tmp_path, model, callbacks):
    args = tf.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, gradient_accumulation_steps=2, per_device_train_batch_size=2,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
        seed=0, dataloader_num_workers=0)
    return tf.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def test_trainer_callback_against_hand_written_hooks(tmp_path):
    tf, TrainerReference = trainer_parts()
    from hookwidget.integrations.transformers import HookwidgetCallback

    model = gpt2(tf)
    before = hook_count(model)
    norms = StepNorms(model)
    ref, cb = TrainerReference(norms), HookwidgetCallback()
    trainer = hf_trainer(tf, tmp_path, model, [ref, cb])  # ref first: where the report_to integrations are
    trainer.train()
    norms.remove()
    assert hook_count(model) == before
    assert sorted(ref.micro) == [1, 2, 3, 4] and all(len(b) == 2 for b in ref.micro.values())
    # the Trainer clips (max_grad_norm=1.0): the optimizer's .grad is not the one backward left
    assert any(abs(g - ref.logs[s]["grad_norm"]) > 1e-3 for s, g in zip(sorted(ref.logs), norms.globals))
    check_against(cb, norms, ref.micro, [ref.logs[s]["loss"] for s in sorted(ref.logs)])
    # a handful of keys reached the logs at the Trainer's cadence (logging_steps=1), as a callback before ours sees
    # them, and the Trainer's log_history
    assert sorted(ref.logs) == [1, 2, 3, 4]
    w = cb.watch
    ui = w.stat_names.index("update_ratio")
    for r, (_, logs) in enumerate(sorted(ref.logs.items())):
        keys = sorted(k for k in logs if k.startswith("hookwidget/"))
        assert keys == ["hookwidget/anomalies", "hookwidget/grad_norm", "hookwidget/update_ratio_max",
                        "hookwidget/update_ratio_max_layer"]
        assert close(logs["hookwidget/grad_norm"], norms.globals[r])
        top = max(norms.rows[r].items(), key=lambda kv: kv[1]["update_ratio"])
        assert w.layer_names[logs["hookwidget/update_ratio_max_layer"]] == top[0]
        assert close(logs["hookwidget/update_ratio_max"], top[1]["update_ratio"])
        assert logs["hookwidget/anomalies"] == len(w.anomalies) == 0
        assert w.stats[r, :, ui].isfinite().all()
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert all(h["hookwidget/grad_norm"] == ref.logs[h["step"]]["hookwidget/grad_norm"] for h in history)


def test_trainer_callback_per_layer_series_opt_in(tmp_path):
    tf, _ = trainer_parts()
    from hookwidget.integrations.transformers import HookwidgetCallback

    cb = HookwidgetCallback(log_stats=("grad_norm",), flight_recorder=False)
    trainer = hf_trainer(tf, tmp_path, gpt2(tf), [cb])
    trainer.train()
    w = cb.watch
    history = [h for h in trainer.state.log_history if "loss" in h]
    for r, h in enumerate(history):
        keys = [k for k in h if k.startswith("hookwidget/")]
        assert len(keys) == 4 + len(w.layer_names)
        assert all(h[f"hookwidget/grad_norm/{layer}"] == w.series(layer, "grad_norm")[r].item()
                   for layer in w.layer_names)


def test_trainer_fit_is_unchanged_by_the_callback(tmp_path):
    tf, _ = trainer_parts()
    from hookwidget.integrations.transformers import HookwidgetCallback

    finals = []
    for callbacks in ([], [HookwidgetCallback()]):
        model = gpt2(tf)
        hf_trainer(tf, tmp_path, model, callbacks).train()
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("added_later", [False, True])
@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_trainer_fit_that_raises_leaves_no_hook(tmp_path, added_later, error):
    tf, _ = trainer_parts()
    from hookwidget.integrations.transformers import HookwidgetCallback

    model = gpt2(tf)
    before = hook_count(model)
    calls = []

    def raise_at_third(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise error("boom")

    cb = HookwidgetCallback()
    trainer = hf_trainer(tf, tmp_path, model, [] if added_later else [cb])
    if added_later:
        trainer.add_callback(cb)
    handle = model.transformer.h[1].register_forward_pre_hook(raise_at_third)
    with pytest.raises(error):
        trainer.train()
    handle.remove()
    assert not cb.watch.active and hook_count(model) == before
    # one optimizer step, then a micro-batch no step followed: its row belongs to no trainer step
    assert cb.watch.steps == [0] and cb.micro_batches == {1: [0, 1]} and cb.optimizer_steps() == [1]


def test_arguments_checked_when_the_callback_is_made():
    for name in ("transformers", "lightning"):
        pytest.importorskip(name)
        module = __import__(f"hookwidget.integrations.{name}", fromlist=["HookwidgetCallback"])
        with pytest.raises(ValueError, match="log_stats: no statistic grad_nrom; choose from delta_norm, "):
            module.HookwidgetCallback(log_stats=("grad_nrom",))
        with pytest.raises(TypeError, match="evrey"):
            module.HookwidgetCallback(evrey=2)


# -- Lightning ----------------------------------------------------------------------------------------------
def lightning_parts():
    L = pytest.importorskip("lightning.pytorch")

    class MLP(L.LightningModule):
        def __init__(self, fail_at=None):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            self.fail_at, self.calls, self.losses = fail_at, 0, []

        def training_step(self, batch, batch_idx):
            self.calls += 1
            if self.calls == self.fail_at:
                raise Boom("boom")
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Reference(L.Callback):
        def __init__(self, norms):
            self.norms, self.n, self.first, self.last = norms, 0, 0, 0
            self.micro = {}

        def on_train_start(self, trainer, pl_module):
            self.norms.attach(trainer.optimizers[0])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.n += 1
            if trainer.global_step != self.last:
                self.last = trainer.global_step
                self.micro[self.last], self.first = list(range(self.first, self.n)), self.n

    return L, MLP, Reference


def lightning_fit(tmp_path, L, module, callbacks, logger=None):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2,
                        logger=logger if logger is not None else False, log_every_n_steps=1, callbacks=callbacks,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


def test_lightning_callback_against_hand_written_hooks(tmp_path):
    L, MLP, Reference = lightning_parts()
    from lightning.pytorch.loggers import CSVLogger

    from hookwidget.integrations.lightning import HookwidgetCallback

    torch.manual_seed(0)
    module = MLP()
    before = hook_count(module)
    norms = StepNorms(module)
    ref, cb = Reference(norms), HookwidgetCallback(log_stats=("grad_norm",))
    logger = CSVLogger(str(tmp_path), name="csv")
    lightning_fit(tmp_path, L, module, [cb, ref], logger)
    norms.remove()
    assert hook_count(module) == before
    assert sorted(ref.micro) == [1, 2, 3] and all(len(b) == 2 for b in ref.micro.values())
    # Lightning divides each micro-batch's loss by accumulate_grad_batches for backward: the step's loss is their mean
    check_against(cb, norms, ref.micro, [sum(module.losses[2 * s:2 * s + 2]) / 2 for s in range(3)])
    # the keys reached the Trainer's logger (log_every_n_steps=1), at x = global_step
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("hookwidget/grad_norm")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for r in rows:
        assert close(float(r["hookwidget/grad_norm"]), norms.globals[int(r["step"]) - 1])
        for layer in cb.watch.layer_names:
            assert close(float(r[f"hookwidget/grad_norm/{layer}"]), norms.rows[int(r["step"]) - 1][layer]["grad_norm"])


def test_lightning_fit_that_raises_leaves_no_hook(tmp_path):
    L, MLP, _ = lightning_parts()
    from hookwidget.integrations.lightning import HookwidgetCallback

    torch.manual_seed(0)
    module = MLP(fail_at=4)
    before = hook_count(module)
    cb = HookwidgetCallback()
    with pytest.raises(Boom):
        lightning_fit(tmp_path, L, module, [cb])
    assert not cb.watch.active and hook_count(module) == before
    # one optimizer step, then a micro-batch no step followed: its row belongs to no trainer step
    assert cb.watch.steps == [0, 1] and cb.micro_batches == {1: [0, 1]} and cb.optimizer_steps() == [1, None]
