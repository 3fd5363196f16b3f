"""hookwidget in marimo: the trace explorer and the live watch view, each wrapped in `mo.ui.anywidget`.

Open it with `marimo edit examples/marimo_explorer.py` (or `marimo run` for the app view). HOOKWIDGET_SMOKE=1
shrinks the loop; tests/browser/test_marimo.py runs this notebook that way in a real marimo server.
"""

# ruff: noqa: B018  (a cell's last expression is what marimo shows)

import marimo

__generated_with = "0.25.2"
app = marimo.App(width="full")


@app.cell
def _():
    import os
    import time

    import marimo as mo
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import hookwidget as hw

    SMOKE = os.environ.get("HOOKWIDGET_SMOKE") == "1"  # the test sets it: a shorter loop, same code
    return F, SMOKE, hw, mo, nn, time, torch


@app.cell
def _(mo):
    mo.md("""
    # hookwidget in marimo

    This notebook traces one training step of a small MLP and shows it in the explorer: click a layer to
    read what its hooks saw (its input `a`, the gradient `δ` at its output, `W.grad` rebuilt from them),
    tick a hook (`grad_zero` on `fc1`) and the step reruns with it, and the diff against the first run
    appears. Below, `hw.watch` records every step of a training loop; its view grows while the loop runs.
    """)
    return


@app.cell
def _(nn, torch):
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 3, bias=False)
            self.fc2 = nn.Linear(3, 2, bias=False)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(5, 6, 4), torch.randn(5, 6, 2)
    return MLP, model, x, y


@app.cell
def _(hw, model, x, y):
    def step():
        model.zero_grad()
        (0.5 * ((model(x) - y) ** 2).sum()).backward()

    t = hw.trace(step)  # one run of step() with hooks on every module; t.rerun() runs it again
    return (t,)


@app.cell
def _(mo, t):
    # The explorer is an anywidget: mo.ui.anywidget makes it a marimo UI element. Its clicks, hooks and
    # reruns are answered by this kernel; t.add_hook / t.rerun() in a cell show up in it too.
    explorer = mo.ui.anywidget(t.widget())
    explorer
    return


@app.cell
def _(mo):
    mo.md("""
    ## A training loop, watched

    `hw.watch(net)` puts its hooks on now; the next cell trains inside `with w:`, which closes the watch
    when the loop ends (whatever happens). The view is shown here, before the loop, so it grows while the
    loop runs. Click a kept step (below the charts) to open its full Trace in the explorer.
    """)
    return


@app.cell
def _(MLP, hw, mo, torch):
    torch.manual_seed(1)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    w = hw.watch(net)  # rerun this cell (not only the next) for a new watch: a closed watch stays closed
    watch_view = mo.ui.anywidget(w.widget())
    watch_view
    return net, opt, w


@app.cell
def train(F, SMOKE, net, opt, time, torch, w):
    n_steps = 40 if SMOKE else 200
    xs, ys = torch.randn(64, 6, 4), torch.randn(64, 6, 2)
    with w:
        for i in range(n_steps):
            opt.zero_grad()
            F.mse_loss(net(xs[i % 64]), ys[i % 64]).backward()
            opt.step()
            time.sleep(0.1)  # a slow step, so that the view is seen growing
    return (n_steps,)


@app.cell
def _(n_steps, t, w):
    # The same data, read from Python once the loop has ended.
    {
        "steps trained": n_steps,
        "t.layers['fc1'].delta.shape (the gradient at fc1's output)": tuple(t.layers["fc1"].delta.shape),
        "w.series('fc1', 'grad_norm')[-3:] (‖W.grad‖₂ at the last steps)": w.series("fc1", "grad_norm")[-3:].tolist(),
        "w.series('loss')[-1]": float(w.series("loss")[-1]),
        "w.anomalies": w.anomalies,
        "w.kept (steps whose full Trace w.trace(k) returns)": w.kept,
    }
    return


@app.cell
def _(mo):
    mo.md("""
    ## What to try next

    - In a new cell, `t.add_hook("fc2", "grad_scale", factor=0.5)` then `t.rerun()`: the explorer above
      shows the new hook and the new diff without a click.
    - `w.trace()`: the kept Trace of the latest step, the same object `hw.trace` returns.
    - `hw.watch(net, keep=lambda step, stats: stats["global_grad_norm"] > 1)` keeps the steps you choose.
    """)
    return


if __name__ == "__main__":
    app.run()
