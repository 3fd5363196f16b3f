"""Real-browser fixtures: Debian's chromium driven by Playwright (never a downloaded browser)."""

import os
import pathlib

import pytest
from browser_session import new_page

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = pathlib.Path(__file__).resolve().parents[2]
# Screenshots go under an ignored path; docs/img is rewritten only by update_docs_img.py (HW_UPDATE_DOCS_IMG=1).
SHOTS = ROOT / "tests" / "artifacts" / "screenshots"
IMG = ROOT / "docs" / "img" if os.environ.get("HW_UPDATE_DOCS_IMG") == "1" else SHOTS
STATIC = ROOT / "hookwidget" / "static"
BUILT = ("widget.js", "standalone.js", "watch.js", "watch_standalone.js")  # npm run build makes all four


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/browser/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} missing: install Debian's chromium (scripts/install.sh)")
    missing = [n for n in BUILT if not (STATIC / n).exists()]
    if missing:
        pytest.fail(f"front-end not built ({', '.join(missing)} missing): run `npm run build`")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh page that records uncaught errors and console errors (browser_session.new_page)."""
    ctx, pg = new_page(browser, 1360, 760)
    yield pg
    ctx.close()


@pytest.fixture(scope="session")
def img_dir():
    IMG.mkdir(parents=True, exist_ok=True)
    return IMG
