"""The watch explorer in a real JupyterLab: %%hookwatch shows it before the loop, the heatmap grows while
the loop runs (the kernel still busy), and clicking a kept step opens its Trace in the trace explorer."""

import pytest
from browser_session import notebook, open_kept_step, run_cell, start_cell
from lab_server import jupyter, write_notebook

pytestmark = pytest.mark.browser


SETUP = """\
import time
import torch
import torch.nn as nn
import torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.blocks = nn.ModuleDict({'<img src=x onerror="__pwned=1">': nn.Linear(16, 16)})
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        for m in self.blocks.values():
            x = m(torch.tanh(self.fc1(x)))
        return self.fc2(torch.tanh(x))

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64, 1)
%load_ext hookwidget"""

LOOP = """\
%%hookwatch model -o w
for step in range(STEPS):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    time.sleep(0.25)  # a slow step: the explorer must grow while this cell runs"""
STEPS = 40


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with the notebook; killed in the finalizer."""
    root = tmp_path_factory.mktemp("watchlab")
    write_notebook(root / "watch.ipynb", [SETUP, LOOP.replace("STEPS", str(STEPS))])
    with jupyter(root) as (base, token):
        yield {"url": f"{base}/lab/tree/watch.ipynb?token={token}", "root": root}


# Records, from before the loop's cell runs, every step count the heatmap shows with the kernel's status then.
OBSERVE = """() => {
    window.__growth = [];
    // The loop's cell is running while its prompt reads [*] (the kernel's status also flips on comm traffic).
    const prompt = () => document.querySelectorAll('.jp-Cell .jp-InputPrompt')[1]?.textContent || '';
    const kernel = () => (prompt().includes('*') ? 'busy' : 'idle');
    let last = null;
    const note = () => {
        const el = document.querySelector('[data-testid=watch-heatmap]');
        const n = el ? Number(el.dataset.steps) : null;
        if (n !== last) { last = n; window.__growth.push([n, kernel(), Math.round(performance.now())]); }
    };
    new MutationObserver(note).observe(document.body, { attributes: true, childList: true, subtree: true });
}"""


@pytest.mark.parametrize("width", [1100, 1500])
def test_watch_grows_live_and_opens_a_kept_step(browser, lab, img_dir, width):
    with notebook(browser, lab["url"], width, 1400, failure=img_dir / f"watch_live_failure_{width}.png",
                  report=lambda page: f"growth: {page.evaluate('window.__growth || null')}") as page:
        if width == 1500:  # the module-scoped server still holds the first run's kernel: start from scratch
            page.evaluate("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
        # JupyterLab's "news?" toast would cover the widget.
        page.add_style_tag(content=".Toastify { display: none !important; }")
        # The setup cell first, then (the kernel idle again) the loop.
        run_cell(page, 0, timeout=90_000)
        page.evaluate(OBSERVE)
        start_cell(page, 1)
        heat = page.locator('[data-testid="watch-heatmap"]')
        heat.wait_for(timeout=90_000)
        watch = page.locator('[data-testid="watch"]')
        # While the loop runs (its cell's prompt reads [*]): some rows, not all.
        page.wait_for_function(f"window.__growth.some(([n, k, _t]) => n > 0 && n < {STEPS} && k === 'busy')",
                               timeout=30_000, polling=100)
        assert watch.locator('[data-testid="watch-state"]').inner_text() == "recording"
        watch.screenshot(path=str(img_dir / f"watch_live_running_{width}.png"), animations="allow", timeout=5_000)
        page.wait_for_function("Number(document.querySelector('[data-testid=watch-heatmap]').dataset.steps) === "
                               f"{STEPS}"
                               " && document.querySelector('[data-testid=watch-state]').textContent === 'closed'",
                               timeout=60_000)
        growth = page.evaluate("window.__growth")
        during = sorted({n for n, k, _t in growth if k == "busy" and 0 < n < STEPS})
        assert len(during) >= 2, growth  # it grew at least twice while the cell ran
        summary = watch.locator('[data-testid="watch-summary"]').inner_text()
        assert summary.startswith(f"3 layers · {STEPS} steps recorded"), summary
        # Names from user code are text.
        labels = watch.locator(".hw-w-label").all_inner_texts()
        assert labels == ["fc1", 'blocks.<img src=x onerror="__pwned=1">', "fc2"], labels
        assert watch.locator("img").count() == 0 and page.evaluate("typeof window.__pwned") == "undefined"
        # Hovering the heatmap reads a value.
        box = heat.bounding_box()
        heat.hover(position={"x": box["width"] * 0.5 * STEPS / max(STEPS, box["width"]), "y": 3})
        assert watch.locator('[data-testid="watch-readout"]').inner_text().startswith("fc1 · step ")
        watch.screenshot(path=str(img_dir / f"watch_live_done_{width}.png"))
        # A kept step opens its Trace in the trace explorer, which talks to its own kernel-side widget.
        assert watch.locator("[data-kept-step]").count() == 1  # nothing anomalous: the latest step only
        opened = open_kept_step(watch, STEPS - 1)
        watch.screenshot(path=str(img_dir / f"watch_live_trace_{width}.png"))
        # every panel of the kept Trace's explorer inside its frame: in a narrow output the detail goes below
        inside = opened.evaluate("""(root) => { const r = root.getBoundingClientRect();
            return [...root.querySelectorAll(':scope > *')]
                .every((c) => c.getBoundingClientRect().right <= r.right + 1); }""")
        assert inside, f"a panel of the kept Trace's explorer sticks out of it at {width} px"
        assert not page.errors, page.errors


def test_standalone_page_of_a_diverging_run(page, img_dir, tmp_path):
    """w.to_html: the same view under the page's strict CSP, NaN/Inf marked, a kept step opens read-only."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import hookwidget as hw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.9, momentum=0.9)
    x, y = torch.randn(256, 16), torch.randn(256, 1) * 10
    with hw.watch(model) as w:
        for step in range(40):
            opt.zero_grad()
            F.mse_loss(model(x[(step * 32) % 256:][:32]), y[(step * 32) % 256:][:32]).backward()
            opt.step()
    first_bad = w.anomalies[0].step
    path = w.to_html(tmp_path / "watch.html")
    for width in (1100, 1500):
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='1']")
        assert page.locator('[data-testid="watch-heatmap"]').get_attribute("data-steps") == "40"
        assert "(log scale)" in page.locator('[data-testid="watch-legend"]').inner_text()
        assert page.locator('[data-testid="watch-loss"]').get_attribute("data-scale") == "log"
        page.locator('[data-testid="watch"]').screenshot(path=str(img_dir / f"watch_page_{width}.png"))
        page.locator(f'[data-kept-step="{first_bad}"]').click()
        page.locator('[data-testid="watch-trace"] .hw-root [data-module="0"]').first.wait_for()
        page.screenshot(path=str(img_dir / f"watch_page_trace_{width}.png"), full_page=True)
    assert not page.errors, page.errors
