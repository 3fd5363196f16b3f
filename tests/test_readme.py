"""The README's runnable example prints what the README says it prints; its install section comes first and names
every extra; its images resolve."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_intervention_example_prints_the_documented_diff():
    text = README.read_text()
    section = text.split("## Change a gradient, rerun, read the diff", 1)[1]
    code, printed = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.S)[:2]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().strip() == printed.strip()


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each `## ` section, in order."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def test_the_user_install_comes_first_then_the_developer_set_up():
    (first, install), (second, setup) = sections(README.read_text())[:2]
    assert first == "Install"
    assert "```bash\npip install hookwidget\n```" in install
    assert "Install your torch first" in install  # hookwidget never picks the torch build
    pyproject = (README.parent / "pyproject.toml").read_text()
    table = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([\w-]+) = ", table, flags=re.M)
    assert "tensorboard" in extras
    for extra in extras:
        assert f"[{extra}]" in install, f"the extra [{extra}] is not in the README's install section"
    assert "JupyterLab 4, Notebook 7 and marimo" in install  # the front-ends the browser tests drive
    assert second.startswith("Developer set-up")
    assert re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S) == ["bash scripts/install.sh", "bash scripts/test.sh"]
    assert "The main example: `.venv/bin/jupyter lab examples/01_hooks_explained.ipynb`" in setup


def test_every_readme_image_is_a_file_in_the_repository_or_an_absolute_url():
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", README.read_text())
    assert images
    for src in images:
        assert src.startswith("https://") or (README.parent / src).is_file(), src
