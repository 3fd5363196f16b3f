"""The explorer and the watch view in a real marimo notebook: examples/marimo_explorer.py served by `marimo edit`
(the notebook) and by `marimo run` (the app), driven in Debian's chromium. The watch view grows while the
training cell runs; in the explorer a click on a layer shows its detail and a ticked hook reruns the step and
shows the diff; a kept step of the watch opens in the explorer."""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import sys

import pytest
from browser_session import open_kept_step, opened, shot_on_failure, toggle_grad_zero
from lab_server import free_port, serving

pytestmark = pytest.mark.browser
pytest.importorskip("marimo")

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "marimo_explorer.py"
STEPS = 40  # the notebook's loop with HOOKWIDGET_SMOKE=1


@contextlib.contextmanager
def marimo_server(root: pathlib.Path, notebook: pathlib.Path, mode: str = "edit"):
    """`marimo edit` or `marimo run` on a copy of `notebook` in `root` (127.0.0.1, a random port and token, its
    own config and state directories: every cell runs when the page opens); yields the page's URL; killed on
    exit."""
    shutil.copy(notebook, root / notebook.name)
    xdg = {name: root / name.lower() for name in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME",
                                                  "XDG_DATA_HOME")}
    (xdg["XDG_CONFIG_HOME"] / "marimo").mkdir(parents=True)
    (xdg["XDG_CONFIG_HOME"] / "marimo" / "marimo.toml").write_text("[runtime]\nauto_instantiate = true\n")
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, **{k: str(v) for k, v in xdg.items()}, "PYTHONPATH": str(REPO), "HOOKWIDGET_SMOKE": "1",
           "MARIMO_SKIP_UPDATE_CHECK": "1"}
    exe = pathlib.Path(sys.executable).parent / "marimo"
    argv = [str(exe), mode, notebook.name, "--headless", "--host", "127.0.0.1", f"--port={port}",
            f"--token-password={token}", "--no-sandbox"]
    base = f"http://127.0.0.1:{port}"
    with serving(argv, root, env, f"{base}/health", f"marimo {mode}"):
        yield f"{base}/?access_token={token}"


# Installed before marimo's page loads: every 50 ms, the step count of the watch's heatmap (inside the shadow
# root of marimo's anywidget element) each time it changes, with whether the training cell is running then
# ("running" / "idle"; the app view never marks it) and the time in ms.
OBSERVE = """
window.__growth = [];
let last = null;
setInterval(() => {
  let heat = null;
  for (const host of document.querySelectorAll('marimo-anywidget')) {
    heat = host.shadowRoot && host.shadowRoot.querySelector('[data-testid=watch-heatmap]');
    if (heat) break;
  }
  const n = heat ? Number(heat.dataset.steps) : null;
  if (n === last) return;
  last = n;
  const cell = document.querySelector('[data-cell-name=train]');
  const running = !!(cell && cell.querySelector('.cell-status-icon.running'));
  window.__growth.push([n, running ? 'running' : 'idle', Math.round(performance.now())]);
}, 50);
"""


@pytest.fixture(scope="module", params=["edit", "run"])
def notebook(browser, tmp_path_factory, request):
    """The example notebook open in marimo, every cell run from the page's load; the page's errors in `.errors`,
    the server's mode in `.mode`."""
    root = tmp_path_factory.mktemp(f"marimo_{request.param}")
    with marimo_server(root, NOTEBOOK, request.param) as url, opened(browser, None, 1500, 1600, timeout=30_000) as page:
        page.mode = request.param
        page.add_init_script(OBSERVE)
        page.goto(url)
        yield page


def _on_failure(page, img_dir, name, report=None):
    """A failing test leaves its screenshot (and prints the page's errors)."""
    return shot_on_failure(page, img_dir / f"marimo_{page.mode}_failure_{name}.png", report)


def _growth(page):
    return f"growth: {page.evaluate('window.__growth || null')}"


def test_watch_view_grows_while_the_training_cell_runs(notebook, img_dir):
    page = notebook
    with _on_failure(page, img_dir, "watch", _growth):
        watch = page.locator('[data-testid="watch"]')
        watch.wait_for(timeout=90_000)
        # While the training cell runs (in the notebook view, marimo's running mark on it; the app view shows
        # no such mark): some rows, not all.
        running = "r === 'running'" if page.mode == "edit" else "true"
        page.wait_for_function(f"window.__growth.some(([n, r, _t]) => n > 0 && n < {STEPS} && {running})",
                               timeout=60_000, polling=100)
        assert watch.locator('[data-testid="watch-state"]').inner_text() == "recording"
        watch.screenshot(path=str(img_dir / f"marimo_{page.mode}_watch_running.png"), animations="allow",
                         timeout=5_000)
        page.wait_for_function(f"window.__growth.some(([n, _r, _t]) => n === {STEPS})", timeout=60_000, polling=100)
        watch.locator('[data-testid="watch-state"]', has_text="closed").wait_for(timeout=30_000)
        growth = page.evaluate("window.__growth")
        during = [(n, t) for n, r, t in growth if 0 < n < STEPS and (r == "running" or page.mode == "run")]
        assert len({n for n, _t in during}) >= 2, growth  # it grew at least twice while the cell ran
        # ... spread over the loop, not delivered at its end: the 40 steps take 4 s or more.
        end = next(t for n, _r, t in growth if n == STEPS)
        assert end - during[0][1] >= 1000, growth
        summary = watch.locator('[data-testid="watch-summary"]').inner_text()
        assert summary.startswith(f"2 layers · {STEPS} steps recorded"), summary
        assert watch.locator(".hw-w-label").all_inner_texts() == ["fc1", "fc2"]
        watch.screenshot(path=str(img_dir / f"marimo_{page.mode}_watch_done.png"))
        assert not page.errors, page.errors


def test_explorer_click_a_layer_toggle_a_hook_and_see_the_rerun(notebook, img_dir):
    page = notebook
    with _on_failure(page, img_dir, "explorer"):
        # The explorer is the notebook's first widget (the watch view holds its own, once a step is opened).
        live = page.locator("marimo-anywidget").first.locator(".hw-root")
        toggle_grad_zero(page, live)
        live.screenshot(path=str(img_dir / f"marimo_{page.mode}_explorer_rerun.png"))
        assert not page.errors, page.errors


def test_a_kept_step_of_the_watch_opens_in_the_explorer(notebook, img_dir):
    page = notebook
    with _on_failure(page, img_dir, "kept_step"):
        watch = page.locator('[data-testid="watch"]')
        watch.locator('[data-testid="watch-state"]', has_text="closed").wait_for(timeout=120_000)
        opened_trace = open_kept_step(watch)  # the latest step's
        assert opened_trace.locator('[data-testid="shape-a"]').inner_text().startswith("(6, 4)")
        watch.screenshot(path=str(img_dir / f"marimo_{page.mode}_watch_trace.png"))
        assert not page.errors, page.errors


class FakeContext:
    """marimo's runtime context as hookwidget reads it: the running cell, and with_cell_id."""

    def __init__(self, cell_id):
        self.cell_id, self.entered = cell_id, []

    @contextlib.contextmanager
    def with_cell_id(self, cell_id):
        old, self.cell_id = self.cell_id, cell_id
        self.entered.append(cell_id)
        try:
            yield
        finally:
            self.cell_id = old


def _watched():
    import torch

    import hookwidget as hw

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with hw.watch(model) as w:
        model(torch.randn(4, 3)).sum().backward()
    return w


def test_a_kept_step_opened_by_a_click_is_made_in_the_watch_widgets_cell(monkeypatch):
    """In marimo a front-end message runs in no cell: the kept step's explorer is made as part of the cell that
    made the watch's widget (the browser test above opens one for real)."""
    import types

    from hookwidget.views import watch_widget as ww

    ctx = FakeContext("cell-a")
    monkeypatch.setitem(sys.modules, "marimo._runtime.context",
                        types.SimpleNamespace(safe_get_context=lambda: ctx))
    w = _watched()
    wid = w.widget()  # made while cell-a runs
    ctx.cell_id = None  # a click, handled between cells
    made_in, init = [], ww.KeptTraceWidget.__init__

    def spy(self, t):
        made_in.append(ctx.cell_id)
        init(self, t)

    monkeypatch.setattr(ww.KeptTraceWidget, "__init__", spy)
    wid._on_msg(wid, {"type": "open", "step": 0, "request_id": "r1"}, [])
    assert made_in == ["cell-a"] and ctx.entered == ["cell-a"] and ctx.cell_id is None
    assert wid.trace_step == 0 and wid.trace_model == wid._trace_widget.model_id


def test_in_a_marimo_notebook_the_watch_shows_as_its_widget(monkeypatch):
    import types

    w = _watched()
    assert w._repr_mimebundle_() == {"text/plain": repr(w)}  # no kernel, no marimo notebook: text
    monkeypatch.setitem(sys.modules, "marimo", types.SimpleNamespace(running_in_notebook=lambda: True))
    data, _metadata = w._repr_mimebundle_()
    assert data["text/plain"] == repr(w)
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == w.widget().model_id
