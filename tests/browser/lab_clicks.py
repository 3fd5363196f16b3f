"""Issue 41's "a click answers where the eye is", in JupyterLab as a newcomer meets it, written once for the browser
test (test_lab_click_answers.py) and the benchmark (benchmarks/click_lab.py): the file browser open, a notebook whose
cells trace the CNN and GPT-2 124M and display their explorers (then display them again: fresh explorers, nothing
cached in the page), and a real mouse click on a layer timed in the page, from the click event to its detail drawn
(the kernel's answer rendered, not "loading…") with its head inside the window and every pane that clips it."""

from __future__ import annotations

import contextlib

from browser_session import SHOWN, default_layout, dismiss_news, notebook, run_cell
from explorer_models import CNN_SOURCE, GPT2_124M_SOURCE

CELLS = [
    CNN_SOURCE + "\nimport hookwidget as hw\nt = hw.trace(cnn_step)\nt",
    GPT2_124M_SOURCE + "\nimport hookwidget as hw\ng = hw.trace(gpt2_step)\ng",
    "t",  # the same traces displayed again: new explorers, whose first clicks ask the kernel again
    "g",
]
CNN, GPT2, CNN_AGAIN, GPT2_AGAIN = range(4)
# (layer, where it is clicked): a graph box, a row of the module tree, or of the layers table (a deep model opens on
# it; GPT-2's blocks start folded in the graph).
CNN_CLICKS = [("fc", "box"), ("conv2", "tree")]  # fc is in the graph's first view; a small model opens on its tree
GPT2_CLICKS = [("transformer.h.5.mlp.c_fc", "row"), ("lm_head", "row")]

# Arm the timer before the click: the click event's time (the input, before any handler), then every frame whether
# `name`'s detail is drawn and shows; resolves window.__hwClick.ms.
ARM = """([cell, name]) => {
  const root = document.querySelector(`.hw-root[data-hw-cell="${cell}"]`);
  const shown = (SHOWN);
  const state = window.__hwClick = { t0: null, ms: null };
  document.addEventListener('click', (e) => { state.t0 = e.timeStamp; }, { capture: true, once: true });
  const drawn = () => {
    const el = root.querySelector('[data-testid="detail"] [data-testid="detail-target"]');
    return el !== null && el.textContent === name && shown(el);
  };
  const frame = () => {
    if (state.t0 !== null && drawn()) state.ms = performance.now() - state.t0;
    else requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
}""".replace("SHOWN", SHOWN)


@contextlib.contextmanager
def lab_notebook(browser, url: str, width: int, height: int = 900, failure=None):
    """The notebook at `url` with the file browser open, the CNN and GPT-2 124M cells run (each traces once) and both
    explorers painted; closed on exit."""
    with notebook(browser, url, width, height, failure=failure) as page:
        default_layout(page)
        for cell in (CNN, GPT2):
            display(page, cell, timeout=600_000 if cell == GPT2 else 120_000)
        dismiss_news(page)
        yield page


def display(page, cell: int, timeout: int = 120_000) -> None:
    """Run `cell` (it ends displaying an explorer) and wait until that explorer has painted its graph."""
    run_cell(page, cell, timeout)
    page.wait_for_function("""(i) => {
        const root = window.jupyterapp.shell.currentWidget.content.widgets[i].node.querySelector('.hw-root');
        if (!root || !root.querySelector('.hw-nodes > g')) return false;
        root.setAttribute('data-hw-cell', String(i));  // found by cell, however the notebook windows its cells
        return true; }""", arg=cell, timeout=60_000)
    page.wait_for_timeout(300)


def click_in_view(page, cell: int, name: str, via: str, hang_ms: int) -> float:
    """Click layer `name` in the explorer of `cell` (its graph box, tree row or layers-table row) with the mouse;
    milliseconds from the click event until its detail is drawn and in view. A TimeoutError past `hang_ms`."""
    root = page.locator(f'.hw-root[data-hw-cell="{cell}"]')
    target = {"box": root.locator(f'.hw-svg [data-module="{name}"]').first,
              "tree": root.locator(f'[data-tree-module="{name}"]').first,
              "row": root.locator(f'[data-testid="overview"] tr[data-layer-row="{name}"]')}[via]
    target.scroll_into_view_if_needed()
    page.evaluate(ARM, [cell, name])
    target.click()
    page.wait_for_function("window.__hwClick.ms !== null", timeout=hang_ms)
    return page.evaluate("window.__hwClick.ms")
