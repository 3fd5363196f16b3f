"""The live widget in a real JupyterLab and Notebook 7: %%hooktrace, click a layer, toggle grad_zero, see the
kernel's answer."""


import pytest
from browser_session import notebook, run_cell, toggle_grad_zero
from lab_server import jupyter, write_notebook

pytestmark = pytest.mark.browser

SETUP = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 3, bias=False)
        self.fc2 = nn.Linear(3, 2, bias=False)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))

class Evil(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({'<img src=x onerror="__pwned=1">': nn.Linear(3, 4),
                                     "</script><script>__pwned=2</script>": nn.Linear(4, 2)})

    def forward(self, x):
        for m in self.blocks.values():
            x = m(x)
        return x

torch.manual_seed(0)
x, y = torch.randn(5, 6, 4), torch.randn(5, 6, 2)
model, evil, xe = MLP(), Evil(), torch.randn(5, 3)
%load_ext hookwidget"""

TRACE = """\
%%hooktrace model -o t
model.zero_grad()
loss = 0.5 * ((model(x) - y) ** 2).sum()
loss.backward()"""

EVIL_TRACE = """\
%%hooktrace evil -o te
evil(xe).pow(2).sum().backward()"""


# (command, app class for its options, the notebook's URL path): both expose window.jupyterapp
FRONT_ENDS = {"jupyterlab": ("lab", "LabApp", "lab/tree"), "notebook7": ("notebook", "JupyterNotebookApp", "notebooks")}


@pytest.fixture(scope="module", params=list(FRONT_ENDS))
def lab(request, tmp_path_factory):
    """A JupyterLab or Notebook 7 server on 127.0.0.1 with the notebook; killed in the finalizer."""
    command, app, path = FRONT_ENDS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    write_notebook(root / "explore.ipynb", [SETUP, TRACE, EVIL_TRACE, "t"])
    with jupyter(root, command, app) as (base, token):
        yield {"url": f"{base}/{path}/explore.ipynb?token={token}", "root": root, "name": request.param}


def _anywidget_console(page):
    return f"anywidget console: {[w for w in page.console if 'anywidget' in w.lower()]}"


def test_toggle_grad_zero_live(browser, lab, img_dir):
    with notebook(browser, lab["url"], 1500, 1000, failure=img_dir / f"live_failure_{lab['name']}.png",
                  report=_anywidget_console) as page:
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        live = page.locator(".hw-root").nth(0)

        def shot_before():
            if lab["name"] == "jupyterlab":
                live.screenshot(path=str(img_dir / "toggle_before.png"))

        toggle_grad_zero(page, live, before_toggle=shot_before)
        assert live.locator('[data-module="fc1"]').count() == 1  # one box for fc1 (toggle_grad_zero reads the first)
        live.locator('[data-testid="diff"]').scroll_into_view_if_needed()
        if lab["name"] == "jupyterlab":
            live.screenshot(path=str(img_dir / "toggle_after.png"))
        # A refused hook (grad_clamp with min > max): no rerun, and its error is still beside it 2 s later.
        live.locator('[data-module="fc2"]').first.click()
        live.locator('[data-testid="detail-target"]', has_text="fc2").wait_for()
        row = live.locator('[data-hook-row="grad_clamp"]')
        row.locator('[data-param="min"]').fill("1")
        row.locator('[data-param="max"]').fill("-1")
        diff_before = live.locator('[data-testid="diff"]').inner_text()
        row.locator('[data-hook="grad_clamp"]').click()
        err = live.locator('[data-hook-error="grad_clamp"]')
        err.wait_for(state="visible")
        page.wait_for_timeout(2000)
        assert err.is_visible() and "min" in err.inner_text() and "max" in err.inner_text()
        assert not row.locator('[data-hook="grad_clamp"]').is_checked()
        eb, side = err.bounding_box(), live.locator(".hw-side").bounding_box()  # in view, not scrolled away
        assert side["y"] <= eb["y"] and eb["y"] + eb["height"] <= side["y"] + side["height"] + 1
        assert live.locator('[data-testid="diff"]').inner_text() == diff_before  # no rerun happened
        if lab["name"] == "jupyterlab":
            live.screenshot(path=str(img_dir / "hook_refused.png"))
        # An empty parameter is refused in the page, with the reason beside the control.
        row.locator('[data-param="min"]').fill("")
        row.locator('[data-hook="grad_clamp"]').click()
        page.wait_for_timeout(2000)
        assert "min is empty" in err.inner_text() and err.is_visible()
        warnings = [w for w in page.console if "anywidget" in w.lower()]
        assert not [w for w in warnings if "deprecat" in w.lower()], warnings
        # Python and the explorer agree: the hooks on, and the current trace is the UI's rerun.
        def python(code):
            return page.evaluate("""async (code) => {
                const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
                const future = kernel.requestExecute({code});
                let out = '';
                future.onIOPub = msg => { if (msg.header.msg_type === 'stream') out += msg.content.text; };
                await future.done;
                return out;
            }""", code)

        said = python("print([str(iv) for iv in t.interventions], t.session.latest is not t, t.session.baseline is t)")
        assert said.strip() == "[\"grad_zero() on 'fc1'\"] True True", said

        # ... and after changes made from Python: the explorer shows them without a click.
        def ui_hooks():
            return sorted(f"{x.get_attribute('data-hook-kind')} {x.get_attribute('data-hook-target')}"
                          for x in live.locator("[data-hook-target]").all())

        def python_hooks():
            return sorted(python("print(*(f'{iv.kind.name} {iv.target}' for iv in t.interventions), sep='\\n')")
                          .strip().splitlines())

        python('t.add_hook("fc2", "grad_scale", factor=0.5)')
        live.locator('[data-hook-target="fc2"][data-hook-kind="grad_scale"]').wait_for()
        assert ui_hooks() == python_hooks() == ["grad_scale fc2", "grad_zero fc1"]
        python("t3 = t.rerun()")  # a rerun from a cell: the explorer's diff and current trace follow
        live.locator('[data-testid="diff"] [data-param="fc2.weight"]', has_text="⚓").wait_for()
        assert python("print(t.session.latest is t3)").strip() == "True"
        python('t.remove_hook("fc1", "grad_zero")')
        page.wait_for_function("() => !document.querySelector('[data-hook-target=\"fc1\"]')")
        assert ui_hooks() == python_hooks() == ["grad_scale fc2"]
        assert python("print([str(iv) for iv in t.interventions])").strip() == "[\"grad_scale(factor=0.5) on 'fc2'\"]"
        # The second widget: markup in module names stays text in the live widget too.
        evil = page.locator(".hw-root").nth(1)
        evil.locator(".hw-tree-row").nth(1).wait_for()
        names = evil.locator(".hw-tree-name").all_inner_texts()
        assert 'blocks.<img src=x onerror="__pwned=1">' in names
        assert "blocks.</script><script>__pwned=2</script>" in names
        assert evil.locator("img").count() == 0
        assert page.evaluate("typeof window.__pwned") == "undefined"
        # Issue 41: `t` displayed after t.rerun() shows the rerun (its diff, the changed layers, the rerun's loss in
        # the status line), as the explorer displayed before it does (the session's listeners).
        for when in ("before", "after"):
            if when == "after":
                run_cell(page, 3)
                page.wait_for_timeout(1000)
            shown = page.locator(".hw-root").nth(2)
            shown.locator('[data-testid="diff"] [data-param="fc2.weight"]', has_text="⚓").wait_for()
            status = shown.locator('[data-testid="status"]')
            page.wait_for_function("el => el.textContent.startsWith('rerun: loss')", arg=status.element_handle())
            assert "changed" in shown.locator('.hw-nodes [data-module="fc1"]').first.get_attribute("class").split()
            if lab["name"] == "jupyterlab":
                shown.screenshot(path=str(img_dir / f"shown_{when}_python_rerun.png"))
