"""Real-browser fixtures: Debian's chromium driven by Playwright (never a downloaded browser)."""

import os
import pathlib

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = pathlib.Path(__file__).resolve().parents[2]
# Screenshots go under an ignored path; docs/img is rewritten only by update_docs_img.py (HW_UPDATE_DOCS_IMG=1).
SHOTS = ROOT / "tests" / "artifacts" / "screenshots"
IMG = ROOT / "docs" / "img" if os.environ.get("HW_UPDATE_DOCS_IMG") == "1" else SHOTS
STATIC = pathlib.Path(__file__).resolve().parents[2] / "hookwidget" / "static"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/browser/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} missing: install Debian's chromium (scripts/install.sh)")
    if not (STATIC / "widget.js").exists() or not (STATIC / "standalone.js").exists():
        pytest.fail("front-end not built: run `npm run build`")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh page that records uncaught errors and console errors."""
    ctx = browser.new_context(viewport={"width": 1360, "height": 760})
    pg = ctx.new_page()
    pg.set_default_timeout(15_000)
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(f"pageerror: {e}"))
    pg.on("console", lambda m: pg.errors.append(f"console: {m.text}") if m.type == "error" else None)
    yield pg
    ctx.close()


@pytest.fixture(scope="session")
def img_dir():
    IMG.mkdir(parents=True, exist_ok=True)
    return IMG
