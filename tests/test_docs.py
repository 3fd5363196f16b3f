"""Every Python block in docs/ runs, and prints what the page says it prints.

A page is read as a notebook would run it: its ```python blocks in order, in one IPython shell namespace of its
own (so `%load_ext hookwidget` and `%%hooktrace` work), in a temporary working directory (pages save files). A
block followed by the word "prints" and a block has its standard output compared with that block. A block that
cannot run alone (it needs torchrun, a Trainer's dataset, a marimo runtime) is preceded by `<!-- skip: why -->`;
the reason is required, and there are few. The offline check of the built site (scripts/build_docs.py) is tested
here too, on pages made to fail it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*skip:\s*(.*?)\s*-->\s*$")
MOST_SKIPS = 8  # the blocks that cannot run standalone stay few


def blocks(text: str) -> list[dict]:
    """Each fenced block: its language, code, the skip reason in the comment just before it (or None), and the
    expected output when the text between it and the next block is "prints"."""
    found = list(FENCE.finditer(text))
    out = []
    for k, m in enumerate(found):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        following = text[m.end():found[k + 1].start()] if k + 1 < len(found) else ""
        prints = found[k + 1].group(2) if k + 1 < len(found) and following.strip() == "prints" else None
        out.append({"lang": m.group(1), "code": m.group(2), "skip": skip.group(1) if skip else None,
                    "prints": prints, "line": text[:m.start()].count("\n") + 1})
    return out


def pages() -> list[Path]:
    """The pages with a python block to run (a page whose every block is skipped is in the skip test only)."""
    return sorted(p for p in DOCS.rglob("*.md")
                  if any(b["lang"] == "python" and b["skip"] is None for b in blocks(p.read_text())))


def test_blocks_finds_fences_skips_and_expected_output():
    text = ("intro ```python inline``` is not a fence\n\n```python\nprint(1)\n```\nprints\n```\n1\n```\n"
            "<!-- skip: needs torchrun -->\n```python\nboom()\n```\n```bash\nls\n```\n")
    got = blocks(text)
    assert [(b["lang"], b["skip"], b["prints"]) for b in got] == [
        ("python", None, "1\n"), ("", None, None), ("python", "needs torchrun", None), ("bash", None, None)]


def test_skipped_blocks_give_a_reason_and_stay_few():
    skipped = [(p.relative_to(ROOT), b["line"], b["skip"]) for p in sorted(DOCS.rglob("*.md"))
               for b in blocks(p.read_text()) if b["skip"] is not None]
    assert all(len(reason) > 15 for _, _, reason in skipped), skipped
    assert len(skipped) <= MOST_SKIPS, skipped
    for p in sorted(DOCS.rglob("*.md")):  # a skip comment must sit right above a python block
        for m in re.finditer(r"^<!--\s*skip:", p.read_text(), flags=re.M):
            rest = p.read_text()[m.end():]
            assert re.match(r"[^\n]*-->\s*\n```python", rest), (p, "a skip comment not right above ```python")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_each_page_runs_in_order_and_prints_what_it_says(page, fresh_shell):
    shell = fresh_shell
    ran = 0
    for b in blocks(page.read_text()):
        if b["lang"] != "python" or b["skip"] is not None:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = shell.run_cell(b["code"], store_history=False)
        where = f"{page.relative_to(ROOT)}:{b['line']}"
        assert result.success, (where, result.error_in_exec or result.error_before_exec)
        if b["prints"] is not None:
            assert out.getvalue().strip() == b["prints"].strip(), where
        ran += 1
    assert ran, f"{page}: every python block is skipped"


def _build_docs():
    spec = importlib.util.spec_from_file_location("build_docs", ROOT / "scripts" / "build_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("html,bad", [
    ('<script src="https://cdn.example.org/x.js"></script>', True),
    ('<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">', True),
    ('<style>@font-face{src:url("https://fonts.gstatic.com/a.woff2")}</style>', True),
    ('<script>await import("https://cdnjs.cloudflare.com/ajax/libs/mermaid/11/mermaid.esm.min.mjs")</script>', True),
    ('<a href="https://pytorch.org/">PyTorch</a><script src="../assets/x.js"></script><img src="img/a.png">', False),
])
def test_the_offline_check_finds_assets_from_other_hosts(tmp_path, html, bad):
    (tmp_path / "index.html").write_text(f"<html><head></head><body>{html}</body></html>")
    assert bool(_build_docs().external_assets(tmp_path)) == bad


def test_the_reference_names_every_public_name():
    import hookwidget

    reference = "\n".join(p.read_text() for p in sorted((DOCS / "reference").glob("*.md")))
    for name in hookwidget.__all__:
        assert re.search(rf"\b{name}\b", reference), f"hw.{name} is not in docs/reference/"
    for name in ("Anomaly", "HookwidgetCallback", "%%hooktrace", "%%hookwatch"):
        assert name in reference, name


def test_the_docs_extra_is_in_dev_and_the_site_has_no_public_url():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^docs = \[.*"mkdocs-material', pyproject, flags=re.M)
    assert re.search(r'^dev = \["hookwidget\[[^\]]*\bdocs\b', pyproject, flags=re.M)
    config = (ROOT / "mkdocs.yml").read_text()
    assert not re.search(r"^site_url:", config, flags=re.M) and re.search(r"^\s+font: false", config, flags=re.M)
    assert "build_docs.py" in (ROOT / "scripts" / "test.sh").read_text()
    assert os.path.isfile(ROOT / "scripts" / "docs_hooks.py")
