"""w.to_wandb: a watch's series and anomalies in an offline W&B run, read back from the run's own file (the
records W&B would sync) and compared with the loop's losses and .grad norms, taken by hand (plain PyTorch)."""

import glob
import json
import math
import os
import struct
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                       "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(key, value)
    return tmp_path


def records(run, timeout=30.0):
    """The records of an offline run's .wandb file, once W&B's own process has written all of them (up to its exit
    record: run.finish() can return before the file is complete)."""
    deadline = time.monotonic() + timeout
    while True:
        found = list(_records(run))
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _records(run):
    """The records of an offline run's .wandb file as it is now: a 7-byte header, then 32 KiB blocks of chunks
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) holding protobuf Records."""
    (path,) = glob.glob(f"{os.path.dirname(run.dir)}/run-*.wandb")
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and n == 0):
            pos += left
            continue
        if pos + 7 + n > len(data):  # a chunk W&B's process is still writing: read again later (records())
            return
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            buf = b""
            yield r


def logged(run):
    """Each history row as {key: value}; a dict's fields under "key/field"."""
    for r in records(run):
        if r.WhichOneof("record_type") == "history":
            yield {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}


def history(run):
    """The rows of the watch's series, keyed by hookwidget_step."""
    return {row["hookwidget_step"]: row for row in logged(run) if "step/loss" in row}


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


def train(w_of, steps=6, nan_at=3):
    """The loop, with the reference taken by hand after each backward: loss, global and per-layer ‖.grad‖."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(16, 5), torch.randn(16, 2)
    w = w_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = []
    for k in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * (math.nan if k == nan_at else 1.0)
        loss.backward()
        layers = {name: torch.cat([p.grad.flatten() for p in m.parameters()]).double().norm().item()
                  for name, m in model.named_children() if isinstance(m, nn.Linear)}
        glob_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).double().norm().item()
        ref.append((loss.item(), glob_norm, layers))
        if k != nan_at:
            opt.step()
    return w, ref


def check(rows, ref, w):
    assert sorted(rows) == list(range(len(ref)))
    for k, (loss, norm, layers) in enumerate(ref):
        assert same(rows[k]["step/loss"], loss) and same(rows[k]["step/grad_norm"], norm)
        for name, value in layers.items():
            assert same(rows[k][f"grad_norm/{name}"], value)
        for li, layer in enumerate(w.layer_names):  # every statistic of every layer is there
            for si, stat in enumerate(w.stat_names):
                assert same(rows[k][f"{stat}/{layer}"], w.stats[k, li, si].item())


@pytest.mark.parametrize("live", [False, True])
def test_series_and_anomalies_reach_an_offline_run(offline, live):
    run = wandb.init(project="hookwidget-test", dir=offline, mode="offline")  # WANDB_DIR is read once a process

    def watched(model):
        w = hw.watch(model, flight_recorder=False, batch=2)
        if live:  # streamed from here on, while the loop runs (rows reach the host 2 steps at a time)
            assert w.to_wandb(run) is run
        return w

    w, ref = train(watched)
    w.close()
    if not live:
        assert w.to_wandb(run) is run
    assert run.summary["hookwidget/anomaly_count"] == len(w.anomalies) > 0
    run.finish()
    check(history(run), ref, w)
    (table,) = [row for row in logged(run) if "hookwidget/anomalies/path" in row]
    assert table["hookwidget_step"] == w.anomalies[-1].step and table["hookwidget/anomalies/_type"] == "table-file"
    (path,) = glob.glob(f"{run.dir}/{table['hookwidget/anomalies/path']}")
    data = json.load(open(path))
    assert data["columns"] == ["step", "where", "reason", "samples"]
    assert [tuple(r) for r in data["data"]] == [(a.step, a.where, a.reason, "") for a in w.anomalies]  # per_sample off



def test_without_a_run_it_starts_one_and_finishes_it(offline):
    w, ref = train(lambda m: hw.watch(m, flight_recorder=False), nan_at=None)
    w.close()
    assert wandb.run is None
    run = w.to_wandb()
    assert wandb.run is None  # finished: it was not the user's
    summary = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
               for r in records(run) if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert summary["hookwidget/anomaly_count"] == 0
    check(history(run), ref, w)
    assert not [row for row in logged(run) if "hookwidget/anomalies/path" in row]


def test_an_active_run_is_used_and_left_open(offline):
    w, _ = train(lambda m: hw.watch(m, flight_recorder=False), steps=2, nan_at=None)
    w.close()
    run = wandb.init(project="hookwidget-test", dir=offline, mode="offline")
    assert w.to_wandb() is run and wandb.run is run
    run.log({"after": 1.0})  # still the user's to log into and finish
    run.finish()
    assert [row["after"] for row in logged(run) if "after" in row] == [1.0]


def test_trainer_report_to_wandb_gets_the_callbacks_series(offline, tmp_path):
    """report_to=["wandb"]: the Trainer's WandbCallback logs the series the hookwidget callback adds to the logs
    (under its "train/" prefix), at the Trainer's logging cadence."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from hookwidget.integrations.transformers import HookwidgetCallback

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                             bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = tf.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, gradient_accumulation_steps=2,
                                per_device_train_batch_size=2, logging_steps=2, report_to=["wandb"], use_cpu=True,
                                save_strategy="no", disable_tqdm=True, seed=0)
    cb = HookwidgetCallback(log_stats=("grad_norm", "update_ratio"))  # per-layer series: opt-in
    trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    run = wandb.run
    run.finish()
    kept = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(kept) == [2, 4]
    rows = {row["train/global_step"]: row for row in logged(run) if "train/loss" in row}
    assert sorted(rows) == [2, 4]
    for step, row in rows.items():
        for key in ("grad_norm", "update_ratio_max", "update_ratio_max_layer", "anomalies"):
            assert row[f"train/hookwidget/{key}"] == kept[step][f"hookwidget/{key}"]
        for layer in cb.watch.layer_names:
            for stat in ("grad_norm", "update_ratio"):
                key = f"hookwidget/{stat}/{layer}"
                assert row[f"train/{key}"] == kept[step][key]
