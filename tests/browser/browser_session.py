"""The set-up the real-browser tests share, written once: a page in a context of its own that records its errors,
a screenshot and the errors printed when a test fails inside it, and in JupyterLab / Notebook 7 the wait for the
kernel and the running of cells. Also the two checks that the explorer and the watch make in every front-end
(JupyterLab, Notebook 7, marimo): ticking grad_zero reruns the step, and a kept step opens in the explorer."""

from __future__ import annotations

import contextlib
from typing import Callable

# The notebook is open, its cells drawn, and its kernel started and idle.
KERNEL_IDLE = """() => {
    const w = window.jupyterapp && document.querySelector('.jp-Notebook .jp-Cell')
        && window.jupyterapp.shell.currentWidget;
    return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
        && w.sessionContext.session.kernel.status === 'idle';
}"""

# The i-th cell has run (an execution count) and the kernel is idle.
IDLE_AFTER = """(i) => {
    const nb = window.jupyterapp.shell.currentWidget;
    const c = nb.content.widgets[i].model;
    return c.executionCount !== null && nb.sessionContext.session.kernel.status === 'idle';
}"""


def new_page(browser, width: int, height: int, timeout: int = 15_000, console: tuple = ("error",)):
    """(context, page): a page of a new context. `page.errors` collects its uncaught errors and the console messages
    of the types in `console`; `page.console` every console message's text."""
    ctx = browser.new_context(viewport={"width": width, "height": height})
    page = ctx.new_page()
    page.set_default_timeout(timeout)
    page.errors, page.console = [], []

    def on_console(m):
        page.console.append(m.text)
        if m.type in console:
            page.errors.append(f"console: {m.text}")

    page.on("pageerror", lambda e: page.errors.append(f"pageerror: {e}"))
    page.on("console", on_console)
    return ctx, page


@contextlib.contextmanager
def shot_on_failure(page, path, report: Callable | None = None):
    """On an exception inside: a screenshot of the whole window to `path` (as far as the page still allows one) and
    the page's errors printed (with `report(page)` where given), then the exception goes on."""
    try:
        yield
    except Exception:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(path))
        print("page errors:", page.errors, *(() if report is None else (report(page),)))
        raise


@contextlib.contextmanager
def opened(browser, url: str | None, width: int, height: int, *, failure=None, report: Callable | None = None,
           timeout: int = 15_000, console: tuple = ("error",)):
    """A new page (see new_page) at `url` (None: the caller goes where it wants), its context closed on exit; with
    `failure` a path, the screenshot of shot_on_failure."""
    ctx, page = new_page(browser, width, height, timeout, console)
    try:
        with shot_on_failure(page, failure, report) if failure is not None else contextlib.nullcontext():
            if url is not None:
                page.goto(url)
            yield page
    finally:
        ctx.close()


@contextlib.contextmanager
def notebook(browser, url: str, width: int, height: int, *, failure=None, report: Callable | None = None):
    """`opened` on a JupyterLab / Notebook 7 notebook, once its kernel is idle. Only uncaught errors count as the
    page's errors (JupyterLab's own console is not the explorer's)."""
    with opened(browser, url, width, height, failure=failure, report=report, timeout=60_000, console=()) as page:
        page.wait_for_function(KERNEL_IDLE)
        yield page


def default_layout(page) -> None:
    """JupyterLab as a newcomer sees it: the file browser open beside the notebook (as JupyterLab opens it by
    default; the output is ~850 px wide in a 1100 px window), and no "notified about news?" toast over the page."""
    if not page.locator(".jp-FileBrowser").is_visible():
        page.evaluate("window.jupyterapp.commands.execute('filebrowser:activate')")
    page.locator(".jp-FileBrowser").wait_for(state="visible")


def dismiss_news(page) -> None:
    """Close JupyterLab's "would you like to be notified about news?" toast where it shows."""
    news = page.get_by_role("button", name="No", exact=True)
    if news.count():
        news.first.click()


# Whether an element's top shows: inside the window and inside every ancestor that clips it (the notebook panel).
SHOWN = """el => {
  const r = el.getBoundingClientRect();
  let top = 0, bottom = innerHeight;
  for (let p = el.parentElement; p; p = p.parentElement) {
    if (getComputedStyle(p).overflowY !== 'visible' && p.scrollHeight > p.clientHeight) {
      const b = p.getBoundingClientRect(); top = Math.max(top, b.top); bottom = Math.min(bottom, b.bottom);
    }
  }
  return r.height > 0 && r.top >= top && r.bottom <= bottom;
}"""


def start_cell(page, i: int) -> None:
    """Run the notebook's i-th cell without waiting for it (the command's promise resolves when the cell ends)."""
    page.evaluate(f"window.jupyterapp.shell.currentWidget.content.activeCellIndex = {i}")
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-cell'); }")


def run_cell(page, i: int, timeout: int = 120_000) -> None:
    """Run the notebook's i-th cell and wait until it has run and the kernel is idle again."""
    start_cell(page, i)
    page.wait_for_function(IDLE_AFTER, arg=i, timeout=timeout)


def toggle_grad_zero(page, live, before_toggle: Callable | None = None):
    """In the explorer `live` of the MLP (fc1, fc2) on x of shape (5, 6, 4): a click on fc1 shows its detail (the
    kernel answers once it is idle); ticking grad_zero on it reruns the step, and the diff shows fc1.weight's
    gradient zeroed, fc2.weight unchanged, fc1 marked changed once. `before_toggle()` runs just before the tick.
    Returns the status line's locator."""
    fc1 = live.locator('[data-module="fc1"]').first
    fc1.wait_for(timeout=90_000)
    fc1.click()
    maxdiff = live.locator('[data-testid="detail"] [data-testid="maxdiff"]')
    maxdiff.wait_for(timeout=90_000)
    assert live.locator('[data-testid="shape-a"]').inner_text().startswith("(5, 6, 4)")
    assert float(live.locator('[data-testid="detail"] [data-testid="grad-norm"]').inner_text()) > 0
    if before_toggle is not None:
        before_toggle()
    live.locator('[data-hook="grad_zero"]').click()
    status = live.locator('[data-testid="status"]')
    done = "el => el.getAttribute('data-state') === 'done' && el.textContent.includes('rerun done')"
    page.wait_for_function(done, arg=status.element_handle(), timeout=60_000)
    assert "loss" in status.inner_text()
    after = live.locator('[data-testid="diff"] [data-param="fc1.weight"] [data-testid="after"]')
    assert after.inner_text() == "0"
    assert live.locator('[data-testid="diff"] [data-param="fc2.weight"]').get_attribute("class") == ""
    maxdiff.wait_for()
    assert fc1.get_attribute("class").split().count("changed") == 1
    assert live.locator('[data-hook="grad_zero"]').is_checked()
    return status


def open_kept_step(watch, step: int | None = None):
    """Click the watch view's first kept step (it must be `step`, where given): its Trace opens in the explorer
    inside the watch view, which talks to its own kernel-side widget (a click on fc1 shows its detail). Returns
    that explorer."""
    kept = watch.locator("[data-kept-step]")
    if step is None:
        step = int(kept.first.get_attribute("data-kept-step"))
    assert kept.first.get_attribute("data-kept-step") == str(step)
    kept.first.click()
    opened_trace = watch.locator('[data-testid="watch-trace"] .hw-root')
    opened_trace.locator('[data-module="fc1"]').first.wait_for(timeout=60_000)
    assert f"step {step}" in watch.locator('[data-testid="watch-status"]').inner_text()
    opened_trace.locator('[data-module="fc1"]').first.click()
    opened_trace.locator('[data-testid="detail"] [data-testid="maxdiff"]').wait_for(timeout=60_000)
    return opened_trace
