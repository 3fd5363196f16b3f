"""The to_html page at 1100 and 1500 px: notes in view, whole names in the tree, readable graph labels on
GPT-2-, ResNet-50- and ViT-B-shaped models at the default view, a graph that uses the page's height, keyboard
and selection."""

import contextlib
import statistics
import time

import pytest
import torch
from browser_session import opened
from gpt2_shaped import gpt2_step
from vision_shaped import resnet50_step, vit_b_step

import hookwidget as hw

pytestmark = pytest.mark.browser

WIDTHS = [1100, 1500]


@pytest.fixture(scope="module")
def gpt2_page(tmp_path_factory):
    model, step = gpt2_step()
    t = hw.trace(step)
    return t.to_html(tmp_path_factory.mktemp("gpt2") / "gpt2.html"), [n for n in t.layers]


@contextlib.contextmanager
def _open(browser, path, width, height=800):
    """The page `path` once drawn (its load time in `.load_ms`), console warnings counted as errors too."""
    with opened(browser, None, width, height, console=("error", "warning")) as pg:
        start = time.perf_counter()
        pg.goto(path.as_uri())
        pg.wait_for_selector("body[data-ready]")
        pg.load_ms = (time.perf_counter() - start) * 1000
        yield pg


LABELS = """() => {
  const hs = [...document.querySelectorAll('.hw-svg .hw-nodes text, .hw-svg .hw-cluster-tab > text')]
    .map(t => t.getBoundingClientRect().height).filter(h => h > 0).sort((a, b) => a - b);
  return hs;
}"""


@pytest.mark.parametrize("width", WIDTHS)
def test_forward_only_trace_shows_its_note(browser, tmp_path, width, img_dir):
    lin = torch.nn.Linear(3, 2)
    t = hw.trace(lambda: lin(torch.randn(4, 3)))
    with _open(browser, t.to_html(tmp_path / "fwd.html"), width) as pg:
        note = pg.locator('[data-testid="no-grads"]')
        assert note.is_visible() and "no gradients captured" in note.inner_text()
        pg.screenshot(path=str(img_dir / f"forward_only_{width}.png"))
        assert pg.errors == []


@pytest.mark.parametrize("width", WIDTHS)
def test_gpt2_shaped_default_view_is_readable(browser, gpt2_page, width, img_dir):
    path, layers = gpt2_page
    with _open(browser, path, width) as pg:
        boxes = pg.locator(".hw-svg .hw-nodes > g").count()
        assert 0 < boxes <= 40
        # Repeated blocks fold: one box for h.0 … h.11.
        fold = pg.locator(".hw-svg .hw-chunk")
        assert fold.count() == 1 and "h.0 … h.11" in fold.text_content() and "GPT2Block × 12" in fold.text_content()
        heights = pg.evaluate(LABELS)
        assert heights and statistics.median(heights) >= 11, heights
        # The graph uses the page's height.
        svg_h = pg.evaluate("document.querySelector('.hw-svg').getBoundingClientRect().height")
        assert svg_h >= 0.6 * 800, svg_h
        # Tree names are whole: every name fits its row, and the blocks are told apart (the tree is the
        # second tab: a model this deep opens on the layer overview).
        pg.locator('[data-tab="tree"]').click()
        clipped = pg.evaluate("""() => [...document.querySelectorAll('.hw-tree-name')]
            .filter(n => n.scrollWidth > n.clientWidth + 1
                      || n.getBoundingClientRect().right > n.closest('.hw-tree').getBoundingClientRect().right + 1)
            .map(n => n.textContent)""")
        assert clipped == []
        names = pg.locator(".hw-tree-name").all_inner_texts()
        assert [f"h.{i}" for i in range(12)] == [n for n in names if n.startswith("h.")]
        assert pg.locator('[data-tree-module="transformer.h.3"]').get_attribute("title").startswith("transformer.h.3 ·")
        assert "params" in pg.locator('[data-tree-module="transformer.h.3"]').inner_text()
        pg.screenshot(path=str(img_dir / f"gpt2_default_{width}.png"))
        # Repeated blocks start folded in the tree too; unfolding one shows its layers.
        assert pg.locator('[data-tree-module="transformer.h.7.mlp.c_fc"]').count() == 0
        pg.locator('[data-tree-toggle="transformer.h.7"]').click()
        # Selecting a layer in the tree expands the graph to it and pans it into view.
        pg.locator('[data-tree-module="transformer.h.7.mlp.c_fc"]').click()
        box = pg.locator('.hw-nodes [data-module="transformer.h.7.mlp.c_fc"]')
        box.wait_for()
        b, svg = box.bounding_box(), pg.locator(".hw-svg").bounding_box()
        assert svg["x"] <= b["x"] + b["width"] / 2 <= svg["x"] + svg["width"]
        assert svg["y"] <= b["y"] + b["height"] / 2 <= svg["y"] + svg["height"]
        pg.wait_for_selector('[data-testid="detail"] [data-testid="heat-a"]')
        assert "T × d per sample" in pg.locator('[data-testid="detail"]').inner_text()
        pg.screenshot(path=str(img_dir / f"gpt2_selected_{width}.png"))
        assert pg.errors == []


# The graph legend's displayed items: (those partly inside its box, those wholly inside).
LEGEND_ITEMS = """() => {
  const legend = document.querySelector('.hw-graph .hw-legend').getBoundingClientRect();
  const cut = [], shown = [];
  for (const item of document.querySelectorAll('.hw-graph .hw-legend-item')) {
    const r = item.getBoundingClientRect();
    if (r.width === 0) continue;
    const inside = r.left >= legend.left - 1 && r.right <= legend.right + 1 && r.top >= legend.top - 1
      && r.bottom <= legend.bottom + 1;
    const outside = r.left >= legend.right - 1 || r.top >= legend.bottom - 1;
    if (inside) shown.push(item.textContent); else if (!outside) cut.push(item.textContent);
  }
  return [cut, shown];
}"""


@pytest.fixture(scope="module")
def gpt2_param_layers():
    """Names of the GPT-2-shaped model's layers that hold parameters of their own, in module order."""
    model, _ = gpt2_step()
    return [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


@pytest.mark.parametrize("width", WIDTHS)
def test_gpt2_shaped_layer_overview_is_visible_first(browser, gpt2_page, gpt2_param_layers, width, img_dir):
    """Issue 16: a deep model opens on a sortable table of its layers, one row per layer with parameters,
    in view without scrolling; its norm cells share one colour scale; a row click selects the layer."""
    path, _ = gpt2_page
    with _open(browser, path, width) as pg:
        ov = pg.locator('[data-testid="overview"]')
        assert ov.is_visible()
        rows = ov.locator("tr[data-layer-row]")
        assert [r.get_attribute("data-layer-row") for r in rows.all()] == gpt2_param_layers
        assert len(gpt2_param_layers) == 76
        # In view without scrolling: the table's header and first rows, every column inside the page.
        box = ov.bounding_box()
        assert box["y"] < 120 and box["x"] + box["width"] <= width, box
        for col in ("name", "delta", "grad", "a", "flags"):
            b = ov.locator(f'[data-layer-sort="{col}"]').bounding_box()
            assert b and box["x"] <= b["x"] and b["x"] + b["width"] <= box["x"] + box["width"], (col, b)
            assert b["y"] + b["height"] <= 800, (col, b)
        first = rows.first.bounding_box()
        assert first["y"] + first["height"] <= 800
        assert pg.locator(".hw-svg").bounding_box()["width"] >= 250  # the graph keeps its room
        assert ov.locator("td[data-t]").count() >= 3 * 70
        pg.screenshot(path=str(img_dir / f"gpt2_overview_{width}.png"))
        # Sort by ‖W.grad‖₂, largest first; a row click selects the layer (detail, tree, graph).
        ov.locator('[data-layer-sort="grad"]').click()
        assert ov.locator('[data-layer-sort="grad"]').get_attribute("aria-sort") == "descending"
        row = rows.first
        name = row.get_attribute("data-layer-row")
        row.click()
        pg.wait_for_selector('[data-testid="detail-target"]')
        assert pg.locator('[data-testid="detail-target"]').inner_text() == name
        assert "selected" in row.get_attribute("class")
        pg.locator(f'.hw-nodes [data-module="{name}"]').wait_for()
        # The legend below the graph stays whole beside the panes (issue 41: the toolbar's was cut short).
        cut, shown = pg.evaluate(LEGEND_ITEMS)
        whole = ["input (no grad)", "parameter", "other leaf", "op / root", "module"]
        assert cut == [] and shown == whole, (cut, shown)
        pg.screenshot(path=str(img_dir / f"gpt2_overview_selected_{width}.png"))
        assert pg.errors == []


def test_keyboard_moves_selects_and_clears(browser, gpt2_page):
    path, _ = gpt2_page
    with _open(browser, path, 1500) as pg:
        pg.locator('[data-tab="tree"]').click()
        pg.locator(".hw-tree-row").first.focus()
        pg.keyboard.press("ArrowDown")
        pg.keyboard.press("ArrowDown")
        pg.keyboard.press("Enter")
        pg.wait_for_selector('[data-testid="detail-target"]')
        assert pg.locator('[data-testid="detail-target"]').inner_text() == "transformer.wte"
        assert pg.locator('[data-tree-module="transformer.wte"]').get_attribute("aria-selected") == "true"
        pg.keyboard.press("Escape")
        assert pg.locator('[data-testid="detail-target"]').count() == 0
        assert pg.locator(".hw-tree-row.selected").count() == 0


def test_first_paint_and_layout_times(browser, gpt2_page):
    """Measured, reported (docs/frontend_measurements.md), and bounded loosely."""
    path, _ = gpt2_page
    with _open(browser, path, 1500) as pg:
        first = pg.evaluate("window.__hwFirstPaintMs")
        layout = float(pg.locator(".hw-graph-info").inner_text().split("layout ")[1].split(" ms")[0])
        print(f"gpt2-shaped: first paint {first:.0f} ms, layout {layout:.0f} ms, page load {pg.load_ms:.0f} ms")
        assert first < 2000 and layout < 1000


VISION = {"resnet50": resnet50_step, "vit_b": vit_b_step}


@pytest.fixture(scope="module", params=list(VISION))
def vision_page(request, tmp_path_factory):
    _, step = VISION[request.param]()
    t = hw.trace(step)
    return request.param, t.to_html(tmp_path_factory.mktemp(request.param) / f"{request.param}.html")


@pytest.mark.parametrize("width", WIDTHS)
def test_vision_shaped_default_view_is_readable(browser, vision_page, width, img_dir):
    """Issue 16 on a ResNet-50 and a ViT-B shape: repeated blocks fold, ≤ 40 boxes, labels ≥ 11 px, the graph
    ≥ 60% of the page's height; layout and first paint measured (printed, kept in tests/artifacts) and bounded."""
    name, path = vision_page
    with _open(browser, path, width) as pg:
        boxes = pg.locator(".hw-svg .hw-nodes > g").count()
        assert 0 < boxes <= 40, boxes
        assert pg.locator(".hw-svg .hw-chunk").count() >= 1  # a run of repeated blocks is one box
        heights = pg.evaluate(LABELS)
        assert heights and statistics.median(heights) >= 11, heights
        svg_h = pg.evaluate("document.querySelector('.hw-svg').getBoundingClientRect().height")
        assert svg_h >= 0.6 * 800, svg_h
        first = pg.evaluate("window.__hwFirstPaintMs")
        layout = float(pg.locator(".hw-graph-info").inner_text().split("layout ")[1].split(" ms")[0])
        line = (f"{name} at {width} px: {boxes} boxes, median label {statistics.median(heights):.1f} px, graph "
                f"{svg_h / 800:.0%} of the height, first paint {first:.0f} ms, layout {layout:.0f} ms, "
                f"page load {pg.load_ms:.0f} ms")
        print(line)
        with open(img_dir.parent / "readability_times.txt", "a", encoding="utf-8") as f:
            f.write(line + "\n")
        assert first < 2000 and layout < 1000
        pg.screenshot(path=str(img_dir / f"{name}_default_{width}.png"))
        assert pg.errors == []
