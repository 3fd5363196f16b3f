"""The watch points at the cause, in a real JupyterLab (file browser open, 1100 and 1500 px): a 300-step run whose
learning rate is raised ×300 at step 200 diverges after; the first anomaly (the loss spike at step 201) names
step 200's learning-rate change (recorded by the watch, with the update ratio that moved) as its lead, the step
axis zooms (the wheel, the lead's button) until step 200 is a column wide enough to click, the readout and the
box above the kept Trace show the step's learning rate, and the to_html page of the same watch shows the same."""

import pytest
from browser_session import notebook, run_cell
from lab_server import jupyter, write_notebook

pytestmark = pytest.mark.browser

SETUP = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 8), torch.randn(256, 1)
%load_ext hookwidget"""

LOOP = """\
%%hookwatch model -o w
for step in range(300):
    if step == 200:  # the cause: the learning rate raised x300
        for g in opt.param_groups:
            g["lr"] *= 300
    opt.zero_grad()
    F.mse_loss(model(x[(step * 32) % 256:][:32]), y[(step * 32) % 256:][:32]).backward()
    opt.step()"""

EXPORT = "w.to_html('watch.html')"

LEAD = "lead: step 200: learning rate ×300 (0.01 → 3) in 3 layers"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("leadlab")
    write_notebook(root / "leads.ipynb", [SETUP, LOOP, EXPORT])
    with jupyter(root) as (base, token):
        yield {"url": f"{base}/lab/tree/leads.ipynb?token={token}", "root": root}


def layout(watch):
    """The heatmap's zoomed rows [v0, v1) and the width of one step column (px)."""
    z = watch.locator(".hw-w-zoom")
    return (int(z.get_attribute("data-v0")), int(z.get_attribute("data-v1")),
            float(watch.locator('[data-testid="watch-heatmap"]').get_attribute("data-col-w")))


def click_step(watch, page, step):
    """Click the heatmap column of `step` (row = step here); returns that column's width."""
    v0, v1, col_w = layout(watch)
    assert v0 <= step < v1, (v0, v1)
    box = watch.locator('[data-testid="watch-heatmap"]').bounding_box()
    page.mouse.click(box["x"] + (step - v0 + 0.5) * col_w, box["y"] + 4)
    return col_w


def check_lead_and_zoom(page, watch, img_dir, name):
    first = watch.locator('[data-testid="watch-first-lead"]')
    page.wait_for_function("(t) => document.querySelector('[data-testid=watch-first-lead]')?.textContent.includes(t)",
                           arg=LEAD)
    text = first.inner_text()
    assert f"(first at step 201 · {LEAD}" in text and ", update ratio ‖ΔW‖/‖W‖ ×" in text, text
    _, _, col_w = layout(watch)
    assert col_w < 4, col_w  # 300 steps: a step is a few px before zooming
    # The wheel over step 200 zooms around it until a step is a clickable column.
    heat = watch.locator('[data-testid="watch-heatmap"]')
    box = heat.bounding_box()
    for _ in range(12):
        v0, v1, col_w = layout(watch)
        if col_w >= 20:
            break
        page.mouse.move(box["x"] + (200 - v0 + 0.5) * col_w, box["y"] + 4)
        page.mouse.wheel(0, -200)
        page.wait_for_timeout(80)
    v0, v1, col_w = layout(watch)
    assert col_w >= 20 and v0 <= 200 < v1, (v0, v1, col_w)
    click_step(watch, page, 200)
    readout = watch.locator('[data-testid="watch-readout"]').inner_text()
    assert readout.startswith("step 200 · ") and "update ratio" in readout, readout
    assert " · learning rate 3 · " in readout, readout
    watch.screenshot(path=str(img_dir / f"watch_lead_{name}.png"))
    # Back to all steps, then the lead's own button zooms to step 200 and selects it.
    watch.locator('[data-testid="watch-zoom-all"]').click()
    assert layout(watch)[1] - layout(watch)[0] == 300
    watch.locator("li[data-step='201'] .hw-w-lead").click()
    v0, v1, col_w = layout(watch)
    assert col_w >= 20 and v0 <= 200 < v1, (v0, v1, col_w)
    assert watch.locator('[data-testid="watch-readout"]').inner_text().startswith("step 200 · ")
    assert watch.locator('[data-testid="watch-stat"]').input_value() == "lr"  # the heatmap shows the cause
    # The kept step 201 opens with its learning rate, update ratios and its lead above the Trace.
    watch.locator('[data-kept-step="201"]').click()
    facts = watch.locator('[data-testid="watch-step-facts"]')
    page.wait_for_function(
        "() => document.querySelector('[data-testid=watch-step-facts]')?.textContent.startsWith('step 201')")
    assert "update ratio" in facts.inner_text() and LEAD in facts.inner_text()
    assert " · learning rate 3 · " in facts.inner_text(), facts.inner_text()
    watch.locator('[data-testid="watch-trace"] .hw-root').first.wait_for(timeout=60_000)
    watch.screenshot(path=str(img_dir / f"watch_lead_trace_{name}.png"))


@pytest.mark.parametrize("width", [1100, 1500])
def test_first_anomaly_names_the_learning_rate_change(browser, lab, img_dir, width):
    with notebook(browser, lab["url"], width, 1400, failure=img_dir / f"watch_lead_failure_{width}.png") as page:
        page.add_style_tag(content=".Toastify { display: none !important; }")
        if width == 1500:
            page.evaluate("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
        for i in range(3):
            run_cell(page, i)
        watch = page.locator('[data-testid="watch"]')
        page.wait_for_function("document.querySelector('[data-testid=watch-state]')?.textContent === 'closed'"
                               " && document.querySelector('[data-testid=watch-heatmap]').dataset.steps === '300'")
        check_lead_and_zoom(page, watch, img_dir, f"live_{width}")
        # The to_html page of the same watch: the same code, the same lead.
        page.goto((lab["root"] / "watch.html").as_uri())
        page.wait_for_selector("body[data-ready='1']")
        check_lead_and_zoom(page, page.locator('[data-testid="watch"]'), img_dir, f"page_{width}")
        assert not page.errors, page.errors
