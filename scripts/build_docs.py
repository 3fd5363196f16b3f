"""Build the docs site as CI does: `mkdocs build --strict` (any warning fails: a broken link, a page missing
from the nav's files, a docstring mkdocstrings cannot render), then check that the built HTML loads nothing
from another host: the site is read offline, from a folder or localhost (no CDN font, script or style).

    python scripts/build_docs.py [--full] [SITE_DIR]   # default: a temporary folder, removed afterwards

The example notebooks are rendered with their outputs: scripts/docs_hooks.py runs each one once and keeps the run
(.cache/executed-notebooks/) until the notebook, hookwidget or the environment changes. This script runs them at
the notebooks' smoke sizes (HOOKWIDGET_SMOKE=1, as tests/test_examples.py does): the five took 89 s on two loaded
cores (load average about 10), their full sizes 521 s (377 s of it the transformer's 300 steps), measured one
after the other with nbclient. `--full` (or `mkdocs serve` / `mkdocs build` run directly) renders the full sizes.

tests/browser/test_docs_site.py builds with build() and then opens the pages in chromium.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# an asset the browser fetches by itself: script/img/iframe/source src, a stylesheet or icon link, CSS url(),
# an ES module import; a plain <a href="https://..."> is a link the reader may follow, not an asset
ASSET = re.compile(r"""<(?:script|img|iframe|source|audio|video|embed)\b[^>]*\bsrc=["']https?://[^"']+"""
                   r"""|<link\b[^>]*\bhref=["']https?://[^"']+"""
                   r"""|url\(\s*["']?https?://[^)"']+|import\(\s*["']https?://[^"']+|@import\s+["']https?://""", re.I)


def build(site_dir: Path, full: bool = False) -> float:
    """mkdocs build --strict into site_dir, the notebooks at their smoke sizes unless `full`; returns the seconds
    it took. Raises CalledProcessError with the build's output on a warning or an error (a notebook cell that
    raises included)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if full:
        env.pop("HOOKWIDGET_SMOKE", None)
    else:
        env["HOOKWIDGET_SMOKE"] = "1"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site_dir)],
                   cwd=ROOT, env=env, check=True)
    return time.perf_counter() - start


def external_assets(site_dir: Path) -> list[str]:
    """'page: reference' for each asset a built page (HTML or CSS) would fetch from another host."""
    found = []
    for path in sorted([*site_dir.rglob("*.html"), *site_dir.rglob("*.css")]):
        for m in ASSET.finditer(path.read_text(errors="replace")):
            found.append(f"{path.relative_to(site_dir)}: {m.group(0)[:160]}")
    return found


def main(argv: list[str]) -> int:
    full = "--full" in argv
    argv = [a for a in argv if a != "--full"]
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(argv[0]) if argv else Path(tmp) / "site"
        seconds = build(site, full)
        bad = external_assets(site)
        for line in bad:
            print(f"docs: loads from another host: {line}", file=sys.stderr)
        print(f"docs: built {site if argv else 'the site'} in {seconds:.1f} s"
              f"{'' if not bad else f', {len(bad)} external asset(s)'}")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
