"""Issue 41: a click always answers where the eye is. In a narrow output (JupyterLab beside its file browser: an
output ~850 px wide in a 1100 px window) the panes stack below the graph; selecting a layer brings its detail into
view, also for the last layer of a GPT-2-sized list (lm_head)."""

import pytest
from gpt2_shaped import gpt2_step
from test_readability import _open

import hookwidget as hw

pytestmark = pytest.mark.browser

IN_VIEW = """(sel) => { const r = document.querySelector(sel).getBoundingClientRect();
  return r.height > 0 && r.top >= 0 && r.top < innerHeight - 40; }"""


@pytest.fixture(scope="module")
def gpt2_html(tmp_path_factory):
    _, step = gpt2_step()
    return hw.trace(step).to_html(tmp_path_factory.mktemp("gpt2") / "gpt2.html")


@pytest.mark.parametrize("output", [850, None], ids=["narrow_output", "full_width"])
def test_clicking_lm_head_brings_its_detail_into_view(browser, gpt2_html, output, img_dir):
    with _open(browser, gpt2_html, 1100) as pg:
        if output:  # the explorer in an output narrower than the window, as in JupyterLab with the file browser open
            # set through the CSSOM, which the page's CSP allows (a style element it refuses)
            pg.evaluate(f"document.getElementById('hw-app').style.width = '{output}px'")
            pg.wait_for_selector(".hw-root.hw-narrow")
        row = pg.locator('[data-testid="overview"] tr[data-layer-row="lm_head"]')
        row.scroll_into_view_if_needed()
        row.click()
        pg.wait_for_selector('[data-testid="detail-target"]')
        assert pg.locator('[data-testid="detail-target"]').inner_text() == "lm_head"
        pg.wait_for_timeout(300)
        assert pg.evaluate(IN_VIEW, '[data-testid="detail-target"]'), "the detail of lm_head is out of view"
        pg.screenshot(path=str(img_dir / f"click_lm_head_{output or 'full'}.png"))
        # A click in the graph, the page at its top (the graph in view, the stacked panes below it), answers in view.
        pg.evaluate("window.scrollTo(0, 0)")
        box = pg.locator('.hw-svg [data-module="transformer.ln_f"]').first
        box.click()
        pg.wait_for_function("document.querySelector('[data-testid=detail-target]')?.textContent"
                             " === 'transformer.ln_f'")
        pg.wait_for_timeout(300)
        assert pg.evaluate(IN_VIEW, '[data-testid="detail-target"]'), "the detail of transformer.ln_f is out of view"
        pg.screenshot(path=str(img_dir / f"click_graph_ln_f_{output or 'full'}.png"))
        assert pg.errors == []
