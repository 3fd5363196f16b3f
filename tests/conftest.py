import pytest
import torch
import torch.nn.functional as F
from torch import nn


@pytest.fixture(autouse=True)
def close_open_watches():
    """Every watch a test opened is closed when the test ends, passed or failed: an open one keeps its hooks and
    the GradScaler stand-in installed, and the tests after it would fail for that alone."""
    yield
    from hookwidget.watch import amp, core

    left = {id(w): w for w in (*core._OPEN.values(), *amp._PATCH.listeners)}
    for w in left.values():
        w.close()


@pytest.fixture
def float64_default():
    """References and traces in float64 (restored after the test: other files share the process). A file uses it
    as `pytestmark = pytest.mark.usefixtures("float64_default")`."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.fixture
def fresh_shell(tmp_path, monkeypatch):
    """IPython's test shell with an empty namespace, in a temporary working directory: a README quick start or a
    docs page runs in it as pasted into a new notebook (magics included)."""
    from IPython.testing import globalipapp

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    globalipapp.start_ipython()
    ip = globalipapp.get_ipython()
    saved = dict(ip.user_ns)
    ip.user_ns.clear()
    ip.user_ns.update({k: v for k, v in saved.items() if k.startswith("_") or k in ("In", "Out", "exit", "quit",
                                                                                      "get_ipython")})
    yield ip
    ip.user_ns.clear()
    ip.user_ns.update(saved)


class SeedMLP(nn.Module):
    """Seed 003's two-layer MLP (no bias, ReLU between)."""

    def __init__(self, d_in=4, d_hidden=3, d_out=2):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden, bias=False)
        self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


@pytest.fixture
def seed_mlp():
    """Seed 003's model and data: x (5, 6, 4), y (5, 6, 2), torch.manual_seed(0)."""
    torch.manual_seed(0)
    x = torch.randn(5, 6, 4).requires_grad_(True)
    y = torch.randn(5, 6, 2)
    model = SeedMLP()

    def step():
        model.zero_grad()
        loss = 0.5 * ((model(x) - y) ** 2).sum()
        loss.backward()
        return loss

    return model, x, y, step
