"""The README's runnable example prints what the README says it prints."""

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
