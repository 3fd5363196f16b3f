"""Every notebook in examples/ runs top to bottom in a real kernel (HOOKWIDGET_SMOKE=1: tiny sizes),
and the committed notebooks are exactly what examples/_build.py writes: no outputs, no drift."""

import importlib.util
import pathlib
import re
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 120  # seconds per cell; a smoke notebook takes 10-20 s in all on 2 cores


def _execute(nb, monkeypatch):
    monkeypatch.setenv("HOOKWIDGET_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "agg")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT,
        startup_timeout=60,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    client.execute()
    return nb


def test_there_are_six_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_hooks_explained.ipynb",
        "02_per_sample_gradients.ipynb",
        "03_debugging_gradients.ipynb",
        "04_transformer.ipynb",
        "05_watch_training.ipynb",
        "06_which_samples.ipynb",
    ]


def test_the_python3_kernel_is_this_environments_python(monkeypatch):
    # ipykernel installed in .venv provides the python3 spec under sys.prefix; jupyter_client
    # replaces its "python" by sys.executable, so no user-level `ipykernel install` is needed.
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] in ("python", "python3", sys.executable), spec.argv
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys, os; print(sys.prefix)")])
    out = _execute(nb, monkeypatch).cells[0].outputs[0]["text"].strip()
    assert out == sys.prefix


def test_the_notebooks_use_public_names_only():
    """A notebook teaches what a user may call: hookwidget's top level and its integrations, nothing internal."""
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        internal = re.findall(r"(?:from|import) hookwidget\.(?!integrations\b)[\w.]+", code)
        assert not internal, (path.name, internal)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    nb = _execute(nbformat.read(path, as_version=4), monkeypatch)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert shown, "the notebook printed nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_opens_with_one_sentence_and_ends_with_what_to_try_next(path):
    nb = nbformat.read(path, as_version=4)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "This notebook" in first.source
    assert last.cell_type == "markdown" and "What to try next" in last.source
    setup = nb.cells[1].source
    assert 'SMOKE = os.environ.get("HOOKWIDGET_SMOKE") == "1"' in setup


def test_committed_notebooks_are_what_build_writes_without_outputs(tmp_path):
    spec = importlib.util.spec_from_file_location("examples_build", EXAMPLES / "_build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    build.HERE = tmp_path
    build.main()
    for path in NOTEBOOKS:
        assert (tmp_path / path.name).read_text() == path.read_text(), f"{path.name}: rerun examples/_build.py"
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
