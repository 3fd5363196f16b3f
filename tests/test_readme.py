"""The README is a front door: its install section comes first and names every extra, its quick starts run as
pasted (in one IPython shell each, magics included) and print what it says they print, its images resolve, and
the package description that pyproject.toml ships to a package index links nothing relative."""

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each `## ` section, in order."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def extras() -> list[str]:
    pyproject = (ROOT / "pyproject.toml").read_text()
    table = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    return re.findall(r"^([\w-]+) = ", table, flags=re.M)


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    headings = [h for h, _ in sections(text)]
    assert headings[0] == "Install" and headings[-1].startswith("Developer set-up")
    assert [h for h in headings if h.startswith("Quick start")] == [
        "Quick start 1: trace a cell, open the explorer", "Quick start 2: change a gradient, rerun, read the diff",
        "Quick start 3: watch a training run"]
    for history in ("this round", "issue 1", "issue 2", " was "):  # the history lives in CHANGELOG.md
        assert history not in text, history
    assert not re.search(r"\d× → \d", text)  # no "1.62× → 1.00×" figures of before and after


def test_the_user_install_works_from_a_clone_and_names_every_extra():
    install = dict(sections(README.read_text()))["Install"]
    assert "```bash\npip install .\n```" in install  # from a clone: the package is not published yet
    assert "not on the package index yet" in install
    assert "install your torch" in install  # hookwidget never picks the torch build
    for extra in extras():
        assert f"[{extra}]" in install, f"the extra [{extra}] is not in the README's install section"
    assert "JupyterLab 4, Notebook 7 and marimo" in install  # the front-ends the browser tests drive


def test_the_developer_set_up_keeps_its_two_commands():
    setup = dict(sections(README.read_text()))["Developer set-up (fresh Debian machine)"]
    assert re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S) == ["bash scripts/install.sh", "bash scripts/test.sh"]
    assert "The main example: `.venv/bin/jupyter lab examples/01_hooks_explained.ipynb`" in setup


def quick_starts() -> list[tuple[str, str]]:
    return [(h, b) for h, b in sections(README.read_text()) if h.startswith("Quick start")]


@pytest.mark.parametrize("heading", [h for h, _ in quick_starts()])
def test_each_quick_start_runs_as_pasted_and_prints_what_it_says(heading, fresh_shell):
    shell = fresh_shell
    body = dict(quick_starts())[heading]
    blocks = list(re.finditer(r"```(\w*)\n(.*?)```", body, flags=re.S))
    assert blocks
    for k, m in enumerate(blocks):
        lang, code = m.group(1), m.group(2)
        if lang != "python":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = shell.run_cell(code, store_history=False)
        assert result.success, (heading, code, result.error_in_exec or result.error_before_exec)
        following = body[m.end():blocks[k + 1].start()] if k + 1 < len(blocks) else ""
        if following.strip() == "prints":  # the next block is this one's output, character for character
            assert out.getvalue().strip() == blocks[k + 1].group(2).strip(), heading


def test_every_readme_image_is_a_file_in_the_repository():
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", README.read_text())
    assert images
    for src in images:
        assert (README.parent / src).is_file(), src


def test_every_relative_link_in_the_readme_and_docs_resolves():
    for page in [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "examples/README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("https://", "http://", "#")):
                continue
            assert (page.parent / target.split("#")[0]).exists(), (page.relative_to(ROOT), target)


def test_the_package_description_has_nothing_relative():
    """A package index shows pyproject's readme without the repository around it: a relative image or link there
    breaks, and there is no public URL to point at instead."""
    name = re.search(r'^readme = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    text = (ROOT / name).read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'(?:src|href)="([^"]+)"', text)
    assert not links, links
    assert "pip install ." in text and "not on the package index yet" in text
