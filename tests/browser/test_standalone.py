"""The to_html page in a real browser: click a layer, see the right shapes and W.grad's max abs diff;
user strings stay text under a strict CSP."""

import pytest
import torch
from test_export import EVIL, Evil

import hookwidget as hw

pytestmark = pytest.mark.browser


def test_click_layer_shows_shapes_and_max_diff(page, tmp_path, seed_mlp, img_dir):
    model, x, y, step = seed_mlp
    t = hw.trace(step)
    path = t.to_html(tmp_path / "seed.html")
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready]")
    page.locator('[data-module="fc1"]').click()
    detail = page.locator('[data-testid="detail"]')
    page.wait_for_selector('[data-testid="detail"] [data-testid="maxdiff"]')
    assert detail.locator('[data-testid="detail-target"]').inner_text() == "fc1"
    assert detail.locator('[data-testid="shape-a"]').inner_text().startswith("(5, 6, 4)")
    assert detail.locator('[data-testid="shape-delta"]').inner_text().startswith("(5, 6, 3)")
    assert detail.locator('[data-testid="shape-weight"]').inner_text() == "(3, 4)"
    # Reference: autograd's .grad against Σ δ ⊗ a from the captured factors, in float64.
    a, d = t.layers["fc1"].a.double(), t.layers["fc1"].delta.double()
    ref = float((model.fc1.weight.grad.double() - torch.einsum("bto,bti->oi", d, a)).abs().max())
    shown = float(detail.locator('[data-testid="maxdiff"]').get_attribute("data-value"))
    assert shown <= 1e-5 and abs(shown - ref) <= 1e-5
    assert detail.locator('[data-testid="heat-a"]').is_visible()
    assert detail.locator('[data-testid="per-sample-norms"]').is_visible()
    # Read-only: hook toggles visible but disabled, with the note.
    toggle = page.locator('[data-hook="grad_zero"]')
    assert toggle.is_visible() and toggle.is_disabled()
    assert "kernel" in page.locator('[data-testid="readonly-note"]').inner_text()
    # The stylesheet applied under the CSP (nonce), and nothing failed.
    assert page.evaluate("getComputedStyle(document.querySelector('.hw-root')).display") == "grid"
    assert page.errors == []
    page.screenshot(path=str(img_dir / "explorer_detail.png"))
    page.locator('[data-testid="graph"]').screenshot(path=str(img_dir / "explorer_graph.png"))


def test_node_click_and_graph_controls(page, tmp_path, seed_mlp):
    t = hw.trace(seed_mlp[3])
    page.goto(t.to_html(tmp_path / "seed.html").as_uri())
    page.wait_for_selector("body[data-ready]")
    page.locator('[data-node-id="MulBackward0#0"]').click()
    page.wait_for_selector('[data-testid="detail"] [data-testid="grad-norm"]')
    assert page.locator('[data-testid="detail-target"]').inner_text() == "MulBackward0#0"
    page.locator('[data-expand="fc2"]').click()
    page.wait_for_selector('[data-node-id="AccumulateGrad#0"]')
    page.locator('[data-node-id="AccumulateGrad#0"]').click()
    page.wait_for_selector('[data-testid="detail"] [data-testid="param"]')
    assert page.locator('[data-testid="param"]').inner_text() == "fc2.weight"
    page.locator('[data-testid="direction"]').click()
    assert "forward" in page.locator('[data-testid="direction"]').inner_text()
    assert page.errors == []


def test_markup_in_module_names_stays_text(page, tmp_path):
    torch.manual_seed(0)
    model, x = Evil(), torch.randn(5, 3)
    t = hw.trace(lambda: model(x).pow(2).sum().backward())
    page.goto(t.to_html(tmp_path / "evil.html").as_uri())
    page.wait_for_selector("body[data-ready]")
    assert page.locator('meta[http-equiv="Content-Security-Policy"]').count() == 1
    for name in EVIL:
        row = page.locator(".hw-tree-row").filter(has_text=f"blocks.{name}")
        assert row.locator(".hw-tree-name").inner_text() == f"blocks.{name}"
        row.click()
        page.wait_for_selector('[data-testid="detail"] [data-testid="maxdiff"]')
        assert page.locator('[data-testid="detail-target"]').inner_text() == f"blocks.{name}"
    assert page.locator('[data-module^="blocks."]').count() == 2
    assert page.locator("#hw-app img").count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.errors == []
