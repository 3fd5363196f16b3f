"""Time from the end of a cell's own code to a painted, clickable explorer, phase by phase (issue 15).

The GPT-2-small shape of tests/browser/measure_frontend.py (12 blocks, d=768, seq 128, batch 4, vocab 50257),
forward + backward, capture "full", default options.

    .venv/bin/python -m benchmarks.explorer_time            # Python phases (in process) + a real JupyterLab
    .venv/bin/python -m benchmarks.explorer_time --python   # the Python phases only (no browser)
    .venv/bin/python -m benchmarks.explorer_time --profile  # ... and cProfile's top functions of the display

Python side (in process, a fresh trace per repeat, median): the trace's own work after the user's code
(hooks off, records), graph build (`t.graph`, node norms included), payload.summary (health, module tree,
graph summary), widget construction, the display's mimebundle (static snapshot), JSON of the widget state.
Browser side (Debian chromium driving JupyterLab, `%%hooktrace` cell, timed by the kernel's and the page's
clocks, one machine): kernel phases (wrapped functions), the widget state's arrival over the websocket,
anywidget's set-up until the explorer's render() starts, render() (collapse, dagre layout, SVG), the first
frame after it, and one click on a layer until its detail is drawn (kernel payload.detail + transfer + draw).
The figures and where the time goes: docs/frontend_measurements.md (issue 15).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BROWSER = ROOT / "tests" / "browser"

MODEL = '''\
import sys, time, functools, json
sys.path.insert(0, {browser!r})
import torch
import torch.nn.functional as F
from measure_frontend import GPT
torch.manual_seed(0)
model, idx = GPT(), torch.randint(0, 50257, (4, 128))
'''

# Wraps the functions of the display path to time them in the kernel (epoch ms, the page's clock too).
PROBES = '''\
import hookwidget as hw
from hookwidget.record import graph as _g
from hookwidget.views import payload as _p
from hookwidget.views.payload import summaries as _ps
from hookwidget.views import export as _e
from hookwidget.views import widget as _w
_t = sys.modules["hookwidget.trace"]  # the module (hw.trace is the function)
_HW_T = []
def _hw_probe(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def wrap(*a, **k):
        t0 = time.time() * 1000
        try:
            return f(*a, **k)
        finally:
            _HW_T.append((label, t0, time.time() * 1000))
    setattr(owner, name, wrap)
for _o, _n in [(_g, "build"), (_ps, "health"), (_p, "summary"), (_ps, "graph_summary"), (_ps, "module_tree"),
               (_p, "detail"), (_e, "snapshot"), (_w.HookWidget, "__init__"), (_t.Trace, "_repr_mimebundle_")]:
    _hw_probe(_o, _n, _n)
%load_ext hookwidget
'''

CELL = '''\
%%hooktrace model -o t
_HW_T.clear()
model.zero_grad()
logits = model(idx)
F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
_hw_code_end = time.time() * 1000'''

REPORT = 'print("HWREPORT" + json.dumps({"code_end": _hw_code_end, "probes": _HW_T}))'

# Before any page script: stamp every websocket frame's arrival, and the first frame after the explorer's
# element appears (render() is synchronous: the observer runs once it has returned).
INIT = """(() => {
  window.__hw = { ws: [], painted: null, rootSeen: null };
  const Orig = window.WebSocket;
  function Stamped(...args) {
    const ws = new Orig(...args);
    ws.addEventListener("message", (e) => {
      const n = typeof e.data === "string" ? e.data.length : (e.data.byteLength ?? e.data.size ?? 0);
      window.__hw.ws.push([Date.now(), n]);
    });
    return ws;
  }
  Stamped.prototype = Orig.prototype;
  for (const k of ["CONNECTING", "OPEN", "CLOSING", "CLOSED"]) Stamped[k] = Orig[k];
  window.WebSocket = Stamped;
  new MutationObserver(() => {
    if (window.__hw.rootSeen || !document.querySelector(".hw-root .hw-nodes")) return;
    window.__hw.rootSeen = Date.now();
    requestAnimationFrame(() => setTimeout(() => { window.__hw.painted = Date.now(); }, 0));
  }).observe(document, { childList: true, subtree: true });
})();"""

# Click a tree row and resolve when its detail is drawn (the detail panel names the target).
CLICK = """async (name) => {
  const root = document.querySelector(".hw-root");
  const row = root.querySelector(`[data-tree-module="${CSS.escape(name)}"]`);
  const detail = root.querySelector('[data-testid="detail"]');
  const drawn = () => detail.querySelector('[data-testid="detail-target"]')?.textContent === name;
  return await new Promise((resolve) => {
    const t0 = Date.now();
    const obs = new MutationObserver(() => { if (drawn()) { obs.disconnect(); resolve([t0, Date.now()]); } });
    obs.observe(detail, { childList: true, subtree: true, characterData: true });
    row.click();
    if (drawn()) { obs.disconnect(); resolve([t0, Date.now()]); }
  });
}"""

CLICK_LAYERS = ("ln_f", "wte", "head")  # rows shown in the tree at first (the blocks start folded)


# -- Python phases, in process ------------------------------------------------------------------------
def python_phases(repeats: int = 3, profile: bool = False) -> dict:
    import torch
    import torch.nn.functional as F  # noqa: N812

    sys.path.insert(0, str(BROWSER))
    from measure_frontend import GPT

    import hookwidget as hw
    from hookwidget.views import payload

    torch.manual_seed(0)
    model, idx = GPT(), torch.randint(0, 50257, (4, 128))
    end = {}

    def step():
        model.zero_grad()
        logits = model(idx)
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
        end["t"] = time.perf_counter()

    hw.trace(step)  # warm-up: imports, first-call costs
    runs = []
    for _ in range(repeats):
        t = hw.trace(step)
        row = {"trace finish (after the code)": time.perf_counter() - end["t"]}
        row.update(_timed_display(t, payload))
        del t
        t = hw.trace(step)
        t0 = time.perf_counter()
        t._repr_mimebundle_()
        row["display of a fresh trace, all of the above"] = time.perf_counter() - t0
        runs.append(row)
        del t
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    t = hw.trace(step)
    out["nodes"] = t.graph.number_of_nodes()
    out["layers"] = len(t.layers)
    w = t.widget()
    out["summary_bytes"] = len(json.dumps(w.summary, separators=(",", ":")))
    out["esm_bytes"] = len(w._esm) if isinstance(w._esm, str) else pathlib.Path(w._esm).stat().st_size
    for name in CLICK_LAYERS:
        t0 = time.perf_counter()
        meta, bufs = payload.detail(t, name)
        out[f"detail {name}"] = time.perf_counter() - t0
        out[f"detail {name} bytes"] = len(json.dumps(meta)) + sum(len(b) for b in bufs)
    if profile:
        t = hw.trace(step)
        prof = cProfile.Profile()
        prof.enable()
        t._repr_mimebundle_()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
        out["profile"] = s.getvalue()
    return out


def _timed_display(t, payload) -> dict:
    """The display path of a fresh trace, phase by phase, in the order the display runs them: graph, health,
    the rest of payload.summary, the widget (its summary given), the mimebundle (static snapshot), JSON."""
    from unittest import mock

    from ipywidgets.widgets.widget import _remove_buffers

    from hookwidget.views.widget import HookWidget

    row = {}
    t0 = time.perf_counter()
    _ = t.graph
    row["graph build (t.graph)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    payload.health(t)
    row["payload: health"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    s = payload.summary(t)
    row["payload: rest of summary"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with mock.patch.object(payload, "summary", lambda _: s):
        w = HookWidget(t)
    row["widget construction (summary given)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    w._repr_mimebundle_()
    row["mimebundle (snapshot)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, _, buffers = _remove_buffers(w.get_state())
    json.dumps(state)
    row["state to JSON"] = time.perf_counter() - t0
    w.close()
    return row


# -- the browser: JupyterLab ----------------------------------------------------------------------------
def browser_phases(runs: int = 2) -> list[dict]:
    sys.path.insert(0, str(BROWSER))
    from conftest import ARGS, CHROMIUM
    from lab_server import jupyter, write_notebook
    from playwright.sync_api import sync_playwright

    root = pathlib.Path(tempfile.mkdtemp())
    cells = [MODEL.format(browser=str(BROWSER)) + PROBES] + [CELL, REPORT] * runs
    write_notebook(root / "explore.ipynb", cells)
    out = []
    with jupyter(root) as (base, token), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.set_default_timeout(int(os.environ.get("HW_TIMEOUT_MS", 180_000)))
        page.add_init_script(INIT)
        page.goto(f"{base}/lab/tree/explore.ipynb?token={token}")
        page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook .jp-Cell')")
        page.wait_for_function("""() => { const w = window.jupyterapp.shell.currentWidget;
            return w && w.sessionContext?.session?.kernel?.status === 'idle'; }""")
        run_cell = """(i) => { const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = i;
            return window.jupyterapp.commands.execute('notebook:run-cell'); }"""
        page.evaluate(run_cell, 0)
        page.wait_for_function("() => { const w = window.jupyterapp.shell.currentWidget; "
                               "return w.sessionContext.session.kernel.status === 'idle' "
                               "&& w.content.widgets[0].model.executionCount; }")
        if page.locator(".jp-Cell").first.locator(".jp-OutputArea-output[data-mime-type*='error']").count():
            raise RuntimeError("the set-up cell failed: " + page.locator(".jp-Cell").first.inner_text()[-1500:])
        for k in range(runs):
            page.evaluate("() => { window.__hw.painted = null; window.__hw.rootSeen = null; window.__hw.ws = []; "
                          "document.querySelectorAll('.hw-root').forEach((e) => e.classList.remove('hw-root')); "
                          "performance.clearMarks(); }")
            page.evaluate(run_cell, 1 + 2 * k)
            try:
                page.wait_for_function("window.__hw.painted !== null")
            except Exception:
                shot = ROOT / "tests" / "artifacts" / "explorer_time_failed.png"
                shot.parent.mkdir(exist_ok=True)
                page.screenshot(path=str(shot), full_page=True)
                raise RuntimeError(f"the explorer did not paint: see {shot}") from None
            clicks = {name: page.evaluate(CLICK, name) for name in CLICK_LAYERS if _visible_row(page, name)}
            page.evaluate(run_cell, 2 + 2 * k)
            text = page.locator(".jp-OutputArea-output", has_text="HWREPORT").last.inner_text()
            report = json.loads(text.split("HWREPORT", 1)[1].strip())
            marks = page.evaluate("""() => Object.fromEntries(performance.getEntriesByType('mark')
                .filter((m) => m.name.startsWith('hookwidget:'))
                .map((m) => [m.name, performance.timeOrigin + m.startTime]))""")
            info = page.locator(".hw-root .hw-graph-info").last.inner_text()
            out.append(_browser_row(report, page.evaluate("window.__hw"), marks, clicks, info, cold=k == 0))
        browser.close()
    return out


def _visible_row(page, name: str) -> bool:
    return page.locator(f'.hw-root [data-tree-module="{name}"]').count() > 0


def _browser_row(report: dict, hw: dict, marks: dict, clicks: dict, info: str, cold: bool) -> dict:
    code_end = report["code_end"]
    probes: dict = {}
    for label, t0, t1 in report["probes"]:
        probes.setdefault(label, []).append((t0, t1))
    first = lambda label: probes.get(label, [(None, None)])[0]  # noqa: E731
    display = first("_repr_mimebundle_")
    start, end = marks.get("hookwidget:render-start"), marks.get("hookwidget:render-end")
    frames = [(t, n) for t, n in hw["ws"] if display[0] and display[0] <= t <= (start or hw["painted"])]
    last = frames[-1] if frames else (None, 0)
    row = {"run": "cold (first in the kernel)" if cold else "warm", "graph_info": info,
           "frames (ms after display end, bytes)": [(round(t - display[1]), n) for t, n in frames],
           "code end → display starts (trace finish)": display[0] and display[0] - code_end,
           "graph build": _span(first("build")),
           "payload: health (graph build included)": _span(first("health")),
           "payload: module_tree": _span(first("module_tree")),
           "payload: graph_summary": _span(first("graph_summary")),
           "payload: summary (all)": _span(first("summary")),
           "widget construction (summary included)": _span(first("__init__")),
           "display (mimebundle, all of the above)": _span(display),
           "kernel done → last frame before render() received": last[0] and last[0] - display[1],
           "frame bytes (display start → render)": sum(n for _, n in frames),
           "last frame received → render() starts": start and last[0] and start - last[0],
           "render()": end and start and end - start,
           "render() → frame painted": end and hw["painted"] - end,
           "code end → painted": hw["painted"] - code_end}
    for name, (t0, t1) in clicks.items():
        det = [p for p in probes.get("detail", []) if p[0] >= t0 - 5]
        row[f"click {name} → detail drawn"] = t1 - t0
        if det:
            row[f"click {name}: kernel payload.detail"] = det[0][1] - det[0][0]
    return row


def _span(p):
    return None if p[0] is None else p[1] - p[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="store_true", help="the Python phases only")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions of the display")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2, help="traced cells in the browser (the first is cold)")
    ap.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = ap.parse_args()
    py = python_phases(args.repeats, args.profile)
    prof = py.pop("profile", None)
    print("Python, in process (median of", args.repeats, "fresh traces):")
    for k, v in py.items():
        print(f"  {k:40s} " + (f"{v * 1000:8.1f} ms" if isinstance(v, float) else f"{v:>8,}"))
    if prof:
        print(prof)
    result = {"python": py}
    if not args.python:
        result["browser"] = browser_phases(args.runs)
        for row in result["browser"]:
            print(f"JupyterLab, {row['run']}:")
            for k, v in row.items():
                if k != "run":
                    print(f"  {k:42s} " + (f"{v:8.0f} ms" if isinstance(v, (int, float)) and "bytes" not in k
                                           else f"{v}"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
