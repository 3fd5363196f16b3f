"""Every Python block in docs/ runs, and prints what the page says it prints; so does every example the
reference renders from a docstring.

A page is read as a notebook would run it: its ```python blocks in order, in one IPython shell namespace of its
own (so `%load_ext hookwidget` and `%%hooktrace` work), in a temporary working directory (pages save files). A
block followed by the word "prints" and a block has its standard output compared with that block. A block that
cannot run alone (it needs torchrun, a Trainer's dataset, a marimo runtime) is preceded by `<!-- skip: why -->`;
the reason is required, and there are few. A `::: name` entry (mkdocstrings) runs in its place on the page: the
python blocks of the docstrings it renders (the object's, and its members' as the entry's options pick them), in
the namespace the page's blocks above it made: the reference pages set up what their docstrings' examples use.
The offline check of the built site (scripts/build_docs.py) is tested here too, on pages made to fail it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*skip:\s*(.*?)\s*-->\s*$")
MOST_SKIPS = 8  # the blocks that cannot run standalone stay few
ENTRY = re.compile(r"^::: ([\w.]+)[ \t]*\n((?:(?:[ ]{4}.*)?\n)*)", re.M)  # a mkdocstrings entry and its options


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
    """The pages with a python block to run, or a docstring's (a page whose every block is skipped is in the skip
    test only)."""
    return sorted(p for p in DOCS.rglob("*.md") if ENTRY.search(p.read_text())
                  or any(b["lang"] == "python" and b["skip"] is None for b in blocks(p.read_text())))


def _handler_options() -> dict:
    """The python handler's options in mkdocs.yml: what an entry without options of its own renders."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # BaseLoader: no !!python tags
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            return plugin["mkdocstrings"]["handlers"]["python"]["options"]
    return {}


def _flag(value):
    """An option as YAML's BaseLoader reads it (strings): true/false to bools, lists kept."""
    return {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value


def _rendered(path: str, options: dict) -> list[tuple[str, str]]:
    """(qualified name, docstring) of what `::: path` renders: the object, then the members its options pick (a
    class's own public ones in source order, and inherited_members from hookwidget's own bases), as mkdocstrings
    picks them (`members`, `filters`, `inherited_members`; regular expressions on the name)."""
    module, _, attr = path.rpartition(".")
    try:
        obj = importlib.import_module(path)
    except ImportError:
        obj = getattr(importlib.import_module(module), attr)
    out = [(path, inspect.getdoc(obj) or "")]
    if not inspect.isclass(obj):
        return out
    merged = _flag(options.get("merge_init_into_class", _handler_options().get("merge_init_into_class", False)))
    if merged and obj.__init__.__module__.startswith("hookwidget"):  # its docstring follows the class's
        out.append((f"{path}.__init__", inspect.getdoc(obj.__init__) or ""))
    members = _flag(options.get("members", True))
    if members is False:
        return out
    names = list(vars(obj))
    inherited = _flag(options.get("inherited_members", False))
    for base in obj.__mro__[1:]:
        if inherited and base.__module__.startswith("hookwidget"):
            names += [n for n in vars(base) if n not in names and (inherited is True or n in inherited)]
    filters = options.get("filters", _handler_options().get("filters", []))
    for name in names:
        picked = name in members if isinstance(members, list) else all(
            bool(re.search(f.lstrip("!"), name)) != f.startswith("!") for f in filters)
        value = inspect.getattr_static(obj, name)
        value = getattr(value, "__func__", value)  # a classmethod or staticmethod: its function
        if picked and (inspect.isfunction(value) or isinstance(value, property)):
            out.append((f"{path}.{name}", inspect.getdoc(value) or ""))
    return out


def runnable(text: str) -> list[dict]:
    """The page's blocks in order, each `::: name` entry in its place replaced by the python blocks of the
    docstrings it renders (each with `where`: the page line, or the docstring's object)."""
    items, at = [], 0

    def page_blocks(start: int, end: int) -> list[dict]:
        offset = text[:start].count("\n")
        return [{**b, "line": b["line"] + offset, "where": f"line {b['line'] + offset}"}
                for b in blocks(text[start:end])]

    for m in ENTRY.finditer(text):
        items += page_blocks(at, m.start())
        options = (yaml.safe_load(m.group(2)) or {}).get("options", {}) if m.group(2).strip() else {}
        for name, doc in _rendered(m.group(1), options):
            items += [{**b, "where": name} for b in blocks(doc)]
        at = m.end()
    return items + page_blocks(at, len(text))


def test_an_entry_runs_the_examples_of_the_docstrings_it_renders():
    text = ("```python\nx = 1\n```\n::: hookwidget.trace.Trace\n    options:\n      members: [weight_grad]\n\n"
            "```python\ny = 2\n```\n")
    got = runnable(text)
    assert [b["where"] for b in got] == ["line 1", "hookwidget.trace.Trace.weight_grad", "line 8"]
    assert "t.weight_grad(" in got[1]["code"]
    inherited = _rendered("hookwidget.trace.Trace", {"inherited_members": True})
    assert "hookwidget.trace.Trace.position_norms" in dict(inherited)  # a base class's method (trace/shares.py)
    assert "hookwidget.trace.Trace.position_norms" not in dict(_rendered("hookwidget.trace.Trace", {}))
    assert not any(n.rsplit(".", 1)[1].startswith("_") for n, _ in inherited)  # mkdocs.yml's filters: "!^_"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_each_page_runs_in_order_and_prints_what_it_says(page, fresh_shell):
    shell = fresh_shell
    ran = 0
    for b in runnable(page.read_text()):
        if b["lang"] != "python" or b["skip"] is not None:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = shell.run_cell(b["code"], store_history=False)
        where = f"{page.relative_to(ROOT)}: {b['where']}"
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


# a public name whose entry cannot carry an example of its own (a dict; a class whose docstring is another
# floor's) -> what a block of its page that runs does with it
USED_ON_PAGE = {"KINDS": r"hw\.KINDS\["}


def test_every_public_name_has_a_reference_entry_whose_example_runs():
    """Each public name has a `:::` entry in docs/reference whose docstrings (its own or its members') give a python
    example, which the page test above runs; or, where the entry cannot carry one, a block of its page runs it. The
    magics run as cells of their page."""
    import hookwidget
    from hookwidget.integrations import lightning, transformers
    from hookwidget.watch.detect import Anomaly

    public = {name: getattr(hookwidget, name) for name in hookwidget.__all__}
    public.update({"Anomaly": Anomaly, "transformers.HookwidgetCallback": transformers.HookwidgetCallback,
                   "lightning.HookwidgetCallback": lightning.HookwidgetCallback})
    examples, code = {}, {}
    for page in sorted((DOCS / "reference").glob("*.md")):
        text = page.read_text()
        code[page.name] = "\n".join(b["code"] for b in runnable(text) if b["lang"] == "python" and not b["skip"])
        for m in ENTRY.finditer(text):
            options = (yaml.safe_load(m.group(2)) or {}).get("options", {}) if m.group(2).strip() else {}
            module, _, attr = m.group(1).rpartition(".")
            obj = getattr(importlib.import_module(module), attr, None) if module else None
            ran = [b for _, doc in _rendered(m.group(1), options) for b in blocks(doc)
                   if b["lang"] == "python" and b["skip"] is None]
            examples[id(obj)] = examples.get(id(obj), 0) + len(ran)
    lacking = [name for name, obj in public.items() if not examples.get(id(obj))
               and not (name in USED_ON_PAGE and any(re.search(USED_ON_PAGE[name], c) for c in code.values()))]
    assert not lacking, f"no reference entry with an example that runs: {lacking}"
    assert "%%hooktrace" in code["magics.md"] and "%%hookwatch" in code["magics.md"]


def _docs_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_notebook_runs_once_for_the_site_and_its_run_is_kept_until_what_it_depends_on_changes(tmp_path,
                                                                                                monkeypatch):
    """The site renders each example notebook with its outputs (scripts/docs_hooks.py): run in a kernel, kept,
    run again when its key changes (here: HOOKWIDGET_SMOKE), and a cell that raises fails the build."""
    import nbclient
    import nbformat

    hooks = _docs_hooks()
    monkeypatch.setattr(hooks, "EXECUTED", tmp_path / "runs")
    monkeypatch.delenv("HOOKWIDGET_SMOKE", raising=False)
    path = tmp_path / "examples" / "demo.ipynb"
    path.parent.mkdir()
    cell = "import os\nprint(6 * 7, os.environ.get('HOOKWIDGET_SMOKE'))"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)]), path)

    root = hooks._executed(path)
    ran = nbformat.read(root / "examples" / "demo.ipynb", as_version=4)
    assert ran.cells[0].outputs[0]["text"] == "42 None\n" and "widgets" not in ran.metadata
    with monkeypatch.context() as m:  # kept: the same key does not start a kernel
        m.setattr(nbclient.NotebookClient, "execute", lambda self, **kw: pytest.fail("ran again"))
        assert hooks._executed(path) == root
    monkeypatch.setenv("HOOKWIDGET_SMOKE", "1")
    again = hooks._executed(path)
    assert again != root and not root.exists()  # the older run of it is removed
    assert nbformat.read(again / "examples" / "demo.ipynb", as_version=4).cells[0].outputs[0]["text"] == "42 1\n"

    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('boom')")]), path)
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="boom"):
        hooks._executed(path)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [again.name]  # nothing kept of the failed run


def test_the_docs_extra_is_in_dev_and_the_site_has_no_public_url():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^docs = \[.*"mkdocs-material', pyproject, flags=re.M)
    assert re.search(r'^dev = \["hookwidget\[[^\]]*\bdocs\b', pyproject, flags=re.M)
    config = (ROOT / "mkdocs.yml").read_text()
    assert not re.search(r"^site_url:", config, flags=re.M) and re.search(r"^\s+font: false", config, flags=re.M)
    assert "build_docs.py" in (ROOT / "scripts" / "test.sh").read_text()
    assert os.path.isfile(ROOT / "scripts" / "docs_hooks.py")
