"""The shares panel in a real browser: a tiny GPT-2 (transformers, random weights) traced with a decode function,
its to_html page opened, the panel opened, the top sample clicked, and each of its tokens' text found in the strip,
in the order of the ids the model read; screenshots at 1100 and 1500 px wide (tests/artifacts/screenshots)."""

import pytest
import torch
from browser_session import new_page

import hookwidget as hw

pytestmark = pytest.mark.browser
transformers = pytest.importorskip("transformers")

WORDS = ["<b>bold</b>", *(f"w{i}" for i in range(1, 40))]  # id 0 is markup: it must show as text


def decode(ids):
    return [WORDS[i] for i in ids]


@pytest.fixture(scope="module")
def gpt2_page(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(WORDS), n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(1, len(WORDS), (4, 12))
    ids[2, 3:9] = 0  # sample 2: a run of the token whose text is markup
    labels = ids.clone()
    labels[2, 3:9] = torch.tensor([5, 17, 2, 30, 11, 8])

    def step():
        model.zero_grad()
        model(ids, labels=labels).loss.backward()

    t = hw.trace(step, decode=decode)
    top = int(t.sample_shares().argmax())
    return t.to_html(tmp_path_factory.mktemp("shares") / "gpt2.html"), ids, top


@pytest.mark.parametrize("width", [1100, 1500])
def test_a_clicked_sample_shows_its_tokens_text_in_the_strip(browser, gpt2_page, width, img_dir):
    path, ids, top = gpt2_page
    ctx, page = new_page(browser, width, 900)
    try:
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready]")
        page.locator('[data-testid="shares-title"]').click()
        page.wait_for_selector('[data-testid="share-bar"]')
        bars = page.locator('[data-testid="share-bar"]')
        assert bars.count() == 4
        assert bars.first.get_attribute("data-sample") == str(top)  # sorted: the largest share first
        values = [float(bars.nth(i).get_attribute("data-value")) for i in range(4)]
        assert values == sorted(values, reverse=True) and abs(sum(values) - 1) < 1e-5
        bars.first.click()
        page.wait_for_selector('[data-testid="token-strip"] [data-testid="token"]')
        cells = page.locator('[data-testid="token-strip"] [data-testid="token"]')
        assert cells.all_inner_texts() == decode(ids[top].tolist())
        assert "tokens: the input of transformer.wte" in page.locator('[data-testid="shares"]').inner_text()
        page.locator('[data-testid="share-bar"][data-sample="2"]').click()
        page.wait_for_selector('[data-testid="strip-title"]:has-text("sample 2")')
        assert cells.all_inner_texts() == decode(ids[2].tolist())  # "<b>bold</b>" among them, as text
        assert page.locator('[data-testid="token-strip"] b').count() == 0
        bars.first.click()
        page.wait_for_selector(f'[data-testid="strip-title"]:has-text("sample {top}")')
        assert page.errors == []
        page.locator('[data-testid="shares"]').scroll_into_view_if_needed()
        page.screenshot(path=str(img_dir / f"shares_strip_{width}.png"), full_page=True)
    finally:
        ctx.close()


LAB_SETUP = """\
import torch, transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
WORDS = ["<b>bold</b>", *(f"w{i}" for i in range(1, 40))]
def words(ids):
    return [WORDS[i] for i in ids]
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(WORDS), n_positions=16, n_embd=16,
                                     n_layer=2, n_head=2, attn_implementation="eager"))
ids = torch.randint(1, len(WORDS), (4, 12))
ids[2, 3:9] = 0
%load_ext hookwidget"""

LAB_TRACE = """\
%%hooktrace model -o t --decode words
model.zero_grad()
model(ids, labels=ids).loss.backward()"""


def test_the_live_widget_answers_the_panel_from_the_kernel_in_jupyterlab(browser, tmp_path, img_dir):
    """The kernel's path: the panel's request goes through the comm, payload.shares answers with buffers, and the
    strip shows the text %%hooktrace --decode gave; looked at in JupyterLab at 1100 and 1500 px."""
    from browser_session import notebook, run_cell
    from lab_server import jupyter, write_notebook

    write_notebook(tmp_path / "shares.ipynb", [LAB_SETUP, LAB_TRACE, "t"])
    with jupyter(tmp_path, "lab", "LabApp") as (base, token):
        for width in (1100, 1500):
            with notebook(browser, f"{base}/lab/tree/shares.ipynb?token={token}", width, 1000,
                          failure=img_dir / f"shares_lab_failure_{width}.png") as page:
                for i in range(3):
                    run_cell(page, i)
                shell = page.locator(".hw-shell").first
                shell.locator('[data-testid="shares-title"]').click()
                shell.locator('[data-testid="share-bar"][data-sample="2"]').click(timeout=60_000)
                shell.locator('[data-testid="strip-title"]', has_text="sample 2").wait_for(timeout=60_000)
                cells = shell.locator('[data-testid="token-strip"] [data-testid="token"]')
                assert cells.all_inner_texts()[3:9] == ["<b>bold</b>"] * 6
                assert shell.locator('[data-testid="token-strip"] b').count() == 0
                shell.locator('[data-testid="shares"]').scroll_into_view_if_needed()
                page.screenshot(path=str(img_dir / f"shares_lab_{width}.png"))


LAB_SLOW = """\
import time
from hookwidget.views import widget as _widget
_widget._ShareProgress.AFTER_S = _widget._ShareProgress.EVERY_S = 0.0  # report from the first parameter on
_report = _widget._ShareProgress.__call__
def _slowly(self, fraction):  # as if each parameter took a big model's time
    _report(self, fraction)
    time.sleep(0.15)
_widget._ShareProgress.__call__ = _slowly
t"""


def test_the_panel_shows_the_kernels_progress_while_it_computes_in_jupyterlab(browser, tmp_path, img_dir):
    """While the kernel computes the shares (kept busy by a slowed progress report), its "running" statuses reach the
    panel through the comm before the answer: a progress bar that fills, then the bar of samples."""
    from browser_session import notebook, run_cell
    from lab_server import jupyter, write_notebook

    write_notebook(tmp_path / "progress.ipynb", [LAB_SETUP, LAB_TRACE, LAB_SLOW])
    with jupyter(tmp_path, "lab", "LabApp") as (base, token):
        with notebook(browser, f"{base}/lab/tree/progress.ipynb?token={token}", 1100, 1000,
                      failure=img_dir / "shares_progress_failure.png") as page:
            for i in range(3):
                run_cell(page, i)
            shell = page.locator(".hw-shell").last
            shell.locator('[data-testid="shares-title"]').click()
            progress = shell.locator('[data-testid="shares-progress"]')
            progress.wait_for(timeout=60_000)
            page.wait_for_function("() => { const p = [...document.querySelectorAll('[data-testid=shares-progress]')]"
                                   ".at(-1); return p && p.value > 0.3; }", timeout=60_000)
            assert shell.locator('[data-testid="shares-computing"]').inner_text().startswith("computing the shares: ")
            shell.locator('[data-testid="shares"]').scroll_into_view_if_needed()
            page.screenshot(path=str(img_dir / "shares_progress_1100.png"))
            shell.locator('[data-testid="share-bar"]').first.wait_for(timeout=60_000)
            assert progress.count() == 0 and shell.locator('[data-testid="share-bar"]').count() == 4
