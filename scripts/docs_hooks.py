"""MkDocs hooks (mkdocs.yml `hooks:`): the pages the site takes from outside docs/, and their relative links.

The repository's Markdown links are written for a reader of the repository (GitHub, an editor): docs/guide/watch.md
links `../../benchmarks/results/watch_overhead.md`, CHANGELOG.md links `docs/performance.md`. The site keeps those
files where they are instead of copying or symlinking them: `on_files` adds CHANGELOG.md (as changelog.md), the
benchmark write-ups and the example notebooks to the site from their own paths, and `on_page_markdown` rewrites
each relative link from the repository's layout to the site's. A link to a file the site does not carry (a .py
in hookwidget/, pyproject.toml) becomes the repository path as code: there is no public URL to point at.

The example notebooks are committed without outputs (examples/_build.py writes them; tests/test_examples.py runs
them). The site shows them with their outputs: `on_files` runs each one top to bottom in a kernel, once, and keeps
the run in .cache/executed-notebooks/ under a key of everything the outputs depend on (the notebook, hookwidget's
files, the Python and torch versions, HOOKWIDGET_SMOKE); a later build or `mkdocs serve` with the same key renders
the kept run. A cell that raises fails the build. Widget state is not kept: a widget's output then renders as the
static snapshot hookwidget puts beside it (no widget manager from a CDN: the site is read offline).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import posixpath
import re
import shutil
import sys
import time
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.hookwidget")
ROOT = Path(__file__).resolve().parent.parent
EXECUTED = ROOT / ".cache" / "executed-notebooks"  # git-ignored: one folder per key, each holding examples/NAME
CELL_TIMEOUT = 900  # seconds: a full-size cell (the transformer's training loop) on a loaded 2-core machine

# repository path -> the path it has in the site (relative to docs/); globs resolved in _extra()
EXTRA = {"CHANGELOG.md": "changelog.md", "benchmarks/README.md": None, "benchmarks/PROFILE.md": None,
         "benchmarks/results/*.md": None, "examples/README.md": None, "examples/*.ipynb": None,
         "examples/marimo_explorer.py": None}
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def _extra() -> dict[str, str]:
    """Each repository file the site carries from outside docs/, and its path in the site."""
    out = {}
    for pattern, dest in EXTRA.items():
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            out[rel] = dest or rel
    return out


def _site_path(repo_path: str, extra: dict[str, str]) -> str | None:
    """Where a repository file is in the site (relative to docs/), or None when the site does not carry it."""
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/"):] if (ROOT / repo_path).exists() else None
    if repo_path in extra:
        return extra[repo_path]
    if (ROOT / repo_path).is_dir() and f"{repo_path}/README.md" in extra:  # a folder: its README is its page
        return extra[f"{repo_path}/README.md"]
    return None


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the added notebooks into pages
def on_files(files: Files, config) -> Files:
    for repo_path, dest in _extra().items():
        if repo_path.endswith(".ipynb"):  # its run, in a folder laid out as the repository: the same page address
            run_root = _executed(ROOT / repo_path)
            files.append(File(repo_path, str(run_root), config.site_dir, config.use_directory_urls))
        elif dest == repo_path:  # a real source folder: mkdocs-jupyter's NotebookFile reads src_dir, not a path made
            files.append(File(repo_path, str(ROOT), config.site_dir, config.use_directory_urls))
        else:
            files.append(File.generated(config, dest, abs_src_path=str(ROOT / repo_path)))
    return files


def _run_key(notebook: Path) -> str:
    """What a notebook's outputs depend on: its cells, hookwidget's files (not the built front-end: widget state is
    not kept), the interpreter and torch, and the sizes (HOOKWIDGET_SMOKE)."""
    h = hashlib.sha256(notebook.read_bytes())
    package = ROOT / "hookwidget"
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.relative_to(package).parts[0] != "static":
            h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    h.update(f"{sys.version}|{importlib.metadata.version('torch')}|{os.environ.get('HOOKWIDGET_SMOKE')}".encode())
    return h.hexdigest()[:20]


def _executed(notebook: Path) -> Path:
    """The folder whose examples/NAME is `notebook` run top to bottom: kept from an earlier build with the same
    key, else run now (nbclient, the python3 kernel, widget state dropped) and kept, older runs of it removed. A
    cell that raises raises here, and the build fails with the cell's error."""
    import nbformat
    from nbclient import NotebookClient

    key = _run_key(notebook)
    root = EXECUTED / f"{notebook.stem}-{key}"
    out = root / "examples" / notebook.name
    if out.exists():
        return root
    start = time.perf_counter()
    nb = nbformat.read(notebook, as_version=4)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "MPLBACKEND": "agg", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT, startup_timeout=60,
                       store_widget_state=False, resources={"metadata": {"path": str(notebook.parent)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    nb.metadata.pop("widgets", None)
    for old in EXECUTED.glob(f"{notebook.stem}-*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = root.with_name(root.name + f".{os.getpid()}.tmp")
    (tmp / "examples").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, tmp / "examples" / notebook.name)
    tmp.rename(root)  # whole or not at all: a build stopped halfway leaves no half-written run to reuse
    log.info("ran %s in %.0f s (kept in %s)", notebook.name, time.perf_counter() - start, root)
    return root


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Rewrite each relative link from the page's place in the repository to its place in the site."""
    extra = _extra()
    by_site = {v: k for k, v in extra.items()}
    src = page.file.src_uri
    repo_src = by_site.get(src, f"docs/{src}")

    def fix(m: re.Match) -> str:
        target = m.group(2)
        if target.startswith(("http://", "https://", "#", "mailto:")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        repo_target = posixpath.normpath(posixpath.join(posixpath.dirname(repo_src), path))
        site = _site_path(repo_target, extra)
        if site is None:
            if m.group(1).startswith("!"):
                return m.group(0)  # an image the site lacks: leave it, and the strict build says so
            return f"{m.group(1)[:-2].lstrip('[')} (`{repo_target}`)"
        new = posixpath.relpath(site, posixpath.dirname(src) or ".")
        return f"{m.group(1)}{new}{'#' + anchor if anchor else ''}{m.group(3)}"

    markdown = GENERATED.sub(lambda m: _generated(m.group(1)), markdown)
    return _outside_code(markdown, lambda text: LINK.sub(fix, text))


GENERATED = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.M)


def _generated(name: str) -> str:
    """A table made from the code at build time, so that the reference cannot drift from it: the intervention
    kinds (hw.KINDS) and the magics' flags (their argparse parsers in magic.py, whose help texts %%hooktrace? and
    %%hookwatch? show too)."""
    if name == "intervention-kinds":
        from hookwidget import KINDS

        rows = [f"| `{k.name}` | {k.attach} | {', '.join(f'`{p}`' for p in k.params) or '—'} | {k.doc} |"
                for k in KINDS.values()]
        return "\n".join(["| kind | acts on | parameters | what it does |", "|---|---|---|---|", *rows])
    if name in ("hooktrace-options", "hookwatch-options"):
        from hookwidget.magic import HookTraceMagics, _watch_parser

        parser = HookTraceMagics.hooktrace.parser if name == "hooktrace-options" else _watch_parser()
        rows = []
        for action in parser._actions:
            if not action.option_strings and action.dest in ("models", "model"):
                flag = "`MODEL ...`" if action.nargs == "*" else "`MODEL`"
            elif action.option_strings and action.dest != "help":
                meta = f" {action.metavar}" if action.metavar else (
                    f" {{{','.join(action.choices)}}}" if action.choices else
                    "" if action.nargs == 0 else f" {action.dest.upper()}")
                flag = ", ".join(f"`{o}{meta}`" for o in action.option_strings)
            else:
                continue
            if not action.help:  # a new flag without help: say so rather than print an empty cell
                raise ValueError(f"docs: {parser.prog}'s {action.dest} has no help text (give it help= in magic.py)")
            text = action.help.replace("|", "\\|")
            rows.append(f"| {flag} | {text} |")
        return "\n".join(["| flag | meaning |", "|---|---|", *rows])
    raise ValueError(f"docs: no generated table named {name!r}")


def _outside_code(markdown: str, fn) -> str:
    """Apply fn to the text outside fenced code blocks (a link in a code block is code)."""
    parts = re.split(r"(^```.*?^```[^\n]*$)", markdown, flags=re.M | re.S)
    return "".join(p if k % 2 else fn(p) for k, p in enumerate(parts))


# nbconvert's page template (mkdocs-jupyter's notebook pages) loads mermaid from cdnjs when a notebook has a
# diagram (ours have none) and MathJax from an empty URL when none is configured: the site is read offline.
NOTEBOOK_CDN = re.compile(r'<script type="module">(?:(?!</script>).)*?cdnjs\.cloudflare\.com(?:(?!</script>).)*?'
                          r'</script>|<script src=""> </script>', re.S)


def on_post_page(output: str, page, config) -> str:
    if page.file.src_uri.endswith(".ipynb"):
        output = _notebook_toc(NOTEBOOK_CDN.sub("", output))
    return output


def _notebook_toc(output: str) -> str:
    """mkdocs-jupyter slugs a notebook's table of contents through Markdown, which drops inline code, and its
    headings through nbconvert, which keeps it: "`W.grad` is Σ δ aᵀ" is #is-at in the TOC and #wgrad-is-at on
    the page. The TOC lists the headings in order (the first, the page's title, aside), so each of its links is
    pointed at the heading in its place."""
    ids = re.findall(r'<h[1-6] id="([^"]+)">', output)
    toc = list(dict.fromkeys(re.findall(r'<a href="#([^"]*)" class="md-nav__link">', output)))
    if not toc or len(ids) - len(toc) not in (0, 1):
        return output  # not the shape this fix knows: the site's link test reports what is broken
    for link, heading in zip(toc, ids[len(ids) - len(toc):]):
        if link != heading and link not in ids:
            output = output.replace(f'<a href="#{link}" class="md-nav__link">', f'<a href="#{heading}" '
                                    'class="md-nav__link">')
    return output
