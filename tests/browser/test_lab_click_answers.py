"""Issue 41: in a real JupyterLab with the file browser open, at 1100 and 1500 px, a click on a layer of the CNN and
of GPT-2 124M (lm_head, a block's layer) shows its detail in the viewport. One kernel: each model traced once, its
explorer displayed again at 1500 px (fresh explorers: every click asks the kernel). The click-to-detail-in-view times
are printed and written to tests/artifacts/lab_click_times.json; the test asserts only that each answers within
HANG_MS (a loaded CI machine): the figure is benchmarks/click_lab.py's. Screenshots: lab_click_*.png.
Takes about 2 minutes on the 2-core CPU (GPT-2 124M: building it and one traced step of batch 4 × 128)."""

import json

import pytest
from conftest import ROOT
from lab_clicks import (
    CELLS,
    CNN,
    CNN_AGAIN,
    CNN_CLICKS,
    GPT2,
    GPT2_AGAIN,
    GPT2_CLICKS,
    click_in_view,
    display,
    lab_notebook,
)
from lab_server import jupyter, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow]

HANG_MS = 10_000
ARTIFACTS = ROOT / "tests" / "artifacts"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("click_lab")
    write_notebook(root / "click.ipynb", CELLS)
    with jupyter(root) as (base, token):
        yield f"{base}/lab/tree/click.ipynb?token={token}"


def test_a_click_shows_its_detail_in_view_in_jupyterlab(browser, lab, img_dir):
    times = []
    with lab_notebook(browser, lab, 1100, failure=img_dir / "lab_click_failure.png") as page:
        for width, cells in [(1100, (CNN, GPT2)), (1500, (CNN_AGAIN, GPT2_AGAIN))]:
            if width != 1100:
                page.set_viewport_size({"width": width, "height": 900})
                for cell in cells:
                    display(page, cell)
            for cell, clicks in zip(cells, (CNN_CLICKS, GPT2_CLICKS)):
                for name, via in clicks:
                    ms = click_in_view(page, cell, name, via, HANG_MS)
                    times.append({"width": width, "model": "cnn" if cell in (CNN, CNN_AGAIN) else "gpt2_124m",
                                  "layer": name, "via": via, "ms": round(ms, 1)})
                    print(f"{width} px, {times[-1]['model']}, {name} ({via}): detail in view after {ms:.0f} ms")
                    page.wait_for_timeout(200)
                    page.screenshot(path=str(img_dir / f"lab_click_{name.replace('.', '_')}_{width}.png"))
                if cell in (GPT2, GPT2_AGAIN):  # lm_head's W.grad pictures and notes, to read
                    detail = page.locator(f'.hw-root[data-hw-cell="{cell}"] [data-testid="detail"]')
                    for part in ("heat-grad-rebuilt", "layer-notes"):
                        detail.locator(f'[data-testid="{part}"]').evaluate("e => e.scrollIntoView({block: 'end'})")
                        page.wait_for_timeout(200)
                        page.screenshot(path=str(img_dir / f"lab_click_lm_head_{part}_{width}.png"))
        assert page.errors == []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "lab_click_times.json").write_text(json.dumps(times, indent=1))
    assert len(times) == 8 and all(t["ms"] < HANG_MS for t in times)
