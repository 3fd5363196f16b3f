"""The docs site as a reader gets it: built (scripts/build_docs.py, strict), served on localhost, opened in chromium.

Every internal link and image of every built page resolves to a built file (a crawl of the HTML, anchors
included for links into pages); the home page, a guide, the reference and the performance page load with every
image decoded, no console error, no response ≥ 400, and no request to any host but the local server: the
site is read offline.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import importlib.util
import threading
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse

import pytest
from browser_session import opened

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]
PAGES = ["", "guide/tracing/", "reference/tracing/", "performance/"]


class Links(html.parser.HTMLParser):
    """The href and src of a page's a, link, script, img, source and iframe tags, and the ids it defines."""

    def __init__(self):
        super().__init__()
        self.targets, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for key in ("href", "src"):
            if tag in ("a", "link", "script", "img", "source", "iframe") and attrs.get(key):
                self.targets.append((tag, attrs[key]))


def parse(path: Path) -> Links:
    links = Links()
    links.feed(path.read_text(errors="replace"))
    return links


def built_file(site: Path, url_path: str) -> Path | None:
    """The file a local URL path serves (a folder: its index.html), or None."""
    path = site / unquote(url_path).lstrip("/")
    if path.is_dir():
        path = path / "index.html"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("build_docs", ROOT / "scripts" / "build_docs.py")
    build_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_docs)
    out = tmp_path_factory.mktemp("docs") / "site"
    build_docs.build(out)
    assert build_docs.external_assets(out) == []
    return out


@pytest.fixture(scope="module")
def served(site):
    """The built site on http://127.0.0.1:<free port>/, quietly."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_every_internal_link_and_image_of_every_page_resolves(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    ids = {}
    broken = []
    for page in pages:
        base = "http://site/" + page.relative_to(site).as_posix()
        for tag, target in parse(page).targets:
            url, anchor = urldefrag(urljoin(base, target))
            parsed = urlparse(url)
            if parsed.scheme in ("data", "mailto", "blob") or parsed.netloc != "site":
                continue
            found = built_file(site, parsed.path)
            if found is None:
                broken.append(f"{page.relative_to(site)}: <{tag}> {target}")
            elif anchor and tag == "a" and found.suffix == ".html":
                if found not in ids:
                    ids[found] = parse(found).ids
                if anchor not in ids[found]:
                    broken.append(f"{page.relative_to(site)}: <a> {target} (no #{anchor} there)")
    assert not broken, "\n".join(broken[:40])


def test_the_crawl_finds_a_broken_link(tmp_path):
    """The crawl above can fail: a page linking a missing page and a missing image is reported twice."""
    (tmp_path / "index.html").write_text('<a href="guide/">g</a><img src="img/none.png"><a href="#top">t</a>')
    targets = parse(tmp_path / "index.html").targets
    missing = [t for _, t in targets if not t.startswith("#") and built_file(tmp_path, urlparse(t).path) is None]
    assert missing == ["guide/", "img/none.png"]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p or "home")
def test_a_page_loads_whole_from_localhost_only(browser, served, path):
    requests, failed = [], []
    with opened(browser, None, 1280, 900) as page:
        page.on("request", lambda r: requests.append(r.url))
        page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        page.goto(served + path, wait_until="networkidle")
        page.evaluate("window.scrollTo(0, document.body.scrollHeight)")  # any image that loads when seen
        page.wait_for_load_state("networkidle")
        broken_images = page.evaluate(
            "[...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)")
        title = page.title()
        text = page.inner_text("article")
        errors = list(page.errors)
    outside = [u for u in requests if not u.startswith(served) and not u.startswith(("data:", "blob:", "about:"))]
    assert not outside, outside
    assert not failed, failed
    assert not broken_images, broken_images
    assert not errors, errors
    assert "hookwidget" in title
    expected = {"": "Where to start", "guide/tracing/": "gradient accumulation",
                "reference/tracing/": "weight_grad", "performance/": "At a glance"}[path]
    assert expected in text
    if path == "performance/":
        with opened(browser, served + path, 1280, 900) as page:
            page.wait_for_load_state("networkidle")
            charts = page.evaluate("[...document.images].filter(i => i.src.includes('/img/charts/')"
                                   " && i.naturalWidth > 0).length")
        assert charts == 6
