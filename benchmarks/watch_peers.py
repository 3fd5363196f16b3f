"""The monitors hw.watch is timed against in benchmarks/watch_overhead.py, and the protocol every variant of that
benchmark's training loop follows (`Monitor`), so that a peer's own loss or backward (Cockpit's) fits the same loop.

Each peer is set up at the start of a block and torn down at its end, as a user would around one run, and leaves
nothing behind (watch_overhead.py checks that the model has no hook left after every block):
  wandb1, wandb100  wandb.watch(model, log="all", log_freq=1 or 100) in an offline run in a temporary folder (no
                    network; system metrics, console capture, code and git saving off: not part of the watch);
                    run.unwatch(model) and run.finish() at the end. Nothing else is logged in the loop: the watch's
                    histograms go to wandb-core (a child process; its CPU time is counted) with commit=False.
  torchlens         TorchLens's observability.HistoryCollector(model, streams=("activation", "param_grad")):
                    discover(x) (one forward), attach(optimizer=opt), detach() at the end; an in-RAM ring of 256
                    steps that drops the oldest (what a long run needs: the default refuses once full)
  torchlens_all     the same with all four streams (activation, param, param_grad, param_delta)
  cockpit           Cockpit (cockpit-for-pytorch) with configuration("economy"), every step, on a BackPACK-extended
                    copy of the model (extend() leaves hooks it has no removal for; the copy is dropped at the end)
A peer that cannot run on a model (no BackPACK rule for a layer, say) raises, and the benchmark prints its reason.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
import warnings

import torch
import torch.nn.functional as F


def loss_of(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class Monitor:
    """One variant of the training loop (zero_grad, forward, loss, backward, optimizer step). This class is the
    plain loop; a variant overrides what it changes. `model`: what the loop trains; `attach(opt)`: once the
    optimizer exists; `flush()`: what must reach the host before the clock stops; `close()`: teardown, untimed."""

    def __init__(self, model):
        self.model = model

    def attach(self, opt) -> None:
        pass

    def loss(self, out, y):
        return loss_of(out, y)

    def backward(self, loss, step: int) -> None:
        loss.backward()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class WandbWatch(Monitor):
    def __init__(self, model, log_freq: int):
        os.environ["WANDB_MODE"] = "offline"  # never the network, whatever the user's settings say
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        super().__init__(model)
        self.dir = tempfile.mkdtemp(prefix="hw-bench-wandb-")
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False,
                                  disable_git=True)
        self.run = wandb.init(project="hookwidget-bench", dir=self.dir, mode="offline", settings=settings)
        try:
            self.run.watch(model, log="all", log_freq=log_freq)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            self.run.unwatch(self.model)
            self.run.finish()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class TorchLens(Monitor):
    def __init__(self, model, x, streams: tuple):
        from torchlens.observability import HistoryCollector, WatchSettings

        super().__init__(model)
        settings = WatchSettings(ram_policy="drop_oldest")
        self.collector = HistoryCollector(model, streams=streams, settings=settings)
        self.collector.discover(x)

    def attach(self, opt) -> None:
        self.collector.attach(optimizer=opt)

    def close(self) -> None:
        self.collector.detach()


class Cockpit(Monitor):
    def __init__(self, model):
        from backpack import extend
        from cockpit import Cockpit as _Cockpit
        from cockpit.utils.configuration import configuration

        super().__init__(extend(copy.deepcopy(model)))
        self.lossfunc = extend(torch.nn.CrossEntropyLoss())
        self.cockpit = _Cockpit(self.model.parameters(), quantities=configuration("economy"))

    def attach(self, opt) -> None:
        self.opt = opt

    def loss(self, out, y):
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        self.losses = F.cross_entropy(out, y, reduction="none")
        return self.lossfunc(out, y)

    def backward(self, loss, step: int) -> None:
        info = {"batch_size": len(self.losses), "individual_losses": self.losses, "loss": loss,
                "optimizer": self.opt}
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                with self.cockpit(step, info=info):
                    loss.backward(create_graph=self.cockpit.create_graph(step))
            except Exception as e:
                # BackPACK warns of each module it has no rule for and stops there; a quantity then fails on a
                # missing .grad without naming them
                found = (re.search(r"extension for Module <class '[\w.]*?(\w+)'>", str(w.message)) for w in said)
                layers = sorted({m[1] for m in found if m} - {type(self.model).__name__})
                if layers:
                    raise RuntimeError(f"no BackPACK extension for {', '.join(layers)}") from e
                raise

    def close(self) -> None:
        self.model = self.cockpit = None  # the extended copy, and what Cockpit computed, go with it


PEERS = {
    "wandb1": lambda model, x: WandbWatch(model, 1),
    "wandb100": lambda model, x: WandbWatch(model, 100),
    "torchlens": lambda model, x: TorchLens(model, x, ("activation", "param_grad")),
    "torchlens_all": lambda model, x: TorchLens(model, x, ("activation", "param", "param_grad", "param_delta")),
    "cockpit": lambda model, x: Cockpit(model),
}
LABELS = {
    "wandb1": '`wandb.watch(model, log="all", log_freq=1)` (offline)',
    "wandb100": '`wandb.watch(model, log="all", log_freq=100)` (offline)',
    "torchlens": "TorchLens `observability.HistoryCollector` (activation + param_grad)",
    "torchlens_all": "TorchLens `HistoryCollector`, all four streams",
    "cockpit": 'Cockpit, `configuration("economy")`',
}
PACKAGES = {"wandb1": "wandb", "wandb100": "wandb", "torchlens": "torchlens.observability",
            "torchlens_all": "torchlens.observability", "cockpit": "cockpit"}


def missing(name: str) -> str | None:
    """Why peer `name` cannot run in this environment (its package does not import), or None."""
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cockpit imports pkg_resources, deprecated
            importlib.import_module(PACKAGES[name])
            if name == "cockpit":
                importlib.import_module("backpack")
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to print
        hint = (" (pip install cockpit-for-pytorch; it imports pkg_resources: setuptools<81, and json-tricks, "
                "pandas, seaborn)" if name == "cockpit" else "")
        return f"does not import: {type(e).__name__}: {e}{hint}"
    return None
