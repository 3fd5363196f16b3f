"""Where the live watch view's long frames come from (issue 42): the run of tests/browser/test_watch_live_scale.py
(1,000 layers streamed at 20 steps a second into the widget in JupyterLab) under a chromium performance trace,
then every frame longer than `--long` ms taken apart from the trace: the renderer main thread's tasks inside the
gap (wall time and the thread's own CPU time: a task whose CPU time is far below its wall time was waiting for a
core, not working), what those tasks ran (the functions called, the V8 CPU profile's samples), garbage collection,
style and layout, and the load average of the machine.

    npx esbuild js/watch/index.js --bundle --format=esm --outfile=hookwidget/static/watch.js  # unminified: named
    PYTHONPATH=. .venv/bin/python tests/browser/trace_watch_live.py [--long 100] [--keep trace.json]
    npm run build  # the minified bundle again

Prints a JSON summary (the figures in benchmarks/results/watch_live_frames.md come from it)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from browser_session import notebook, run_cell, start_cell  # noqa: E402
from conftest import ARGS, CHROMIUM  # noqa: E402
from lab_server import jupyter, write_notebook  # noqa: E402
from test_watch_live_scale import FRAMES, N0, SETUP, STEPS, STREAM, N  # noqa: E402

CATEGORIES = ["devtools.timeline", "disabled-by-default-devtools.timeline",
              "disabled-by-default-devtools.timeline.frame", "v8", "disabled-by-default-v8.gc",
              "disabled-by-default-v8.cpu_profiler"]
TASKS = ("RunTask", "ThreadControllerImpl::RunTask", "ThreadPool_RunTask")  # a thread's top-level work
# Events worth naming inside a long frame (the rest are their parents or too fine).
NAMED = {"FunctionCall", "EventDispatch", "TimerFire", "FireAnimationFrame", "MajorGC", "MinorGC", "V8.GCScavenger",
         "V8.GC_MARK_COMPACTOR", "V8.GCFinalizeMC", "BlinkGC.AtomicPhase", "Layout", "UpdateLayoutTree", "Paint",
         "RecalculateStyles", "PrePaint", "Layerize", "UpdateLayerTree", "ParseHTML", "EvaluateScript", "HitTest",
         "v8.compile", "v8.compileModule", "CompileScript", "ScheduleStyleRecalculation", "CppGC.AtomicMark"}


def record(long_ms: float, keep: str | None) -> dict:
    from playwright.sync_api import sync_playwright

    root = pathlib.Path(tempfile.mkdtemp(prefix="hw_trace_"))
    write_notebook(root / "scale.ipynb", [SETUP, STREAM])
    with jupyter(root) as (base, token), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        with notebook(browser, f"{base}/lab/tree/scale.ipynb?token={token}", 1500, 1400) as page:
            page.add_style_tag(content=".Toastify { display: none !important; }")
            run_cell(page, 0, timeout=180_000)
            page.wait_for_function(f"{STEPS} === {N0}", timeout=120_000)
            page.evaluate(FRAMES)
            load0 = os.getloadavg()
            cpu = CpuSampler(root)
            browser.start_tracing(page=page, categories=CATEGORIES)
            start_cell(page, 1)
            page.wait_for_function(f"document.querySelector('[data-testid=watch-state]').textContent === 'closed'"
                                   f" && {STEPS} === {N}", timeout=120_000, polling=200)
            trace = json.loads(browser.stop_tracing())
            cpu.stop()
            load1 = os.getloadavg()
            frames = page.evaluate("() => { window.__stopFrames = true; return window.__frames; }")[1:]
        browser.close()
    if keep:
        pathlib.Path(keep).write_text(json.dumps(trace))
    return analyse(trace, frames, long_ms, {"before": load0, "after": load1}, cpu.samples)


class CpuSampler:
    """Every 50 ms, the CPU time (utime + stime, in clock ticks) of every process on the machine, by role: chromium's
    renderers and its other processes, this notebook's kernel and server, the playwright driver, this script, and
    everyone else's processes by command (other engineers' test runs on the shared cores); and
    CLOCK_MONOTONIC, the clock of chromium's trace events (µs), to line the two up."""

    def __init__(self, root: pathlib.Path):
        import threading

        self.root, self.samples, self._stop = str(root), [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic() * 1e6
            by = collections.Counter()
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
                    raw = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
                    cmd = raw.replace(b"\0", b" ").decode("utf-8", "replace")
                except OSError:
                    continue
                fields = stat.rsplit(")", 1)[1].split()
                by["this script" if int(pid) == os.getpid() else self._role(cmd)] += int(fields[11]) + int(fields[12])
            self.samples.append((t, dict(by)))
            self._stop.wait(0.05)

    def _role(self, cmd: str) -> str:
        if "chromium" in cmd or "chrome" in cmd:
            return "chromium renderer" if "--type=renderer" in cmd else "chromium other"
        if "ipykernel" in cmd and self.root in cmd or "ipykernel_launcher" in cmd and ".runtime" in cmd:
            return "notebook kernel"
        if "jupyter" in cmd and self.root in cmd:
            return "jupyter server"
        if "playwright" in cmd:
            return "playwright driver"
        words = cmd.split()  # anyone else's: named by program and first argument (pytest, a build, ...)
        named = " ".join(pathlib.Path(w).name for w in words[:3])[:60]
        return f"others: {named}" if words else "others: kernel threads"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def cpu_in(samples: list, a: float, b: float) -> dict:
    """CPU ms each role used over [a, b) (the samples around it), and the cores' capacity over the same span."""
    before = [s for s in samples if s[0] <= a]
    after = [s for s in samples if s[0] >= b]
    if not before or not after:
        return {}
    (t0, c0), (t1, c1) = before[-1], after[0]
    tick = 1000 / os.sysconf("SC_CLK_TCK")
    used = {k: round((c1.get(k, 0) - c0.get(k, 0)) * tick) for k in c1}
    return {"span_ms": round((t1 - t0) / 1e3), "capacity_ms": round((t1 - t0) / 1e3 * os.cpu_count()),
            **{k: v for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0}}


def analyse(trace: dict, frames: list, long_ms: float, load: dict, cpu: list = ()) -> dict:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    # The renderer of the notebook: the main thread with the most animation frames fired.
    fired = collections.Counter((e["pid"], e["tid"]) for e in events if e.get("name") == "FireAnimationFrame")
    main = fired.most_common(1)[0][0]
    on_main = [e for e in events if (e["pid"], e["tid"]) == main and e.get("ph") == "X" and "dur" in e]
    raf = sorted(e["ts"] for e in on_main if e["name"] == "FireAnimationFrame")
    gaps = [(a, b) for a, b in zip(raf, raf[1:], strict=False) if (b - a) / 1e3 >= long_ms]
    tasks = [e for e in on_main if e["name"] in TASKS]
    samples = _samples(events, main[0])
    out = {"load_average": load, "main_thread": threads.get(main), "frames": _spread(frames),
           "frames_in_trace": _spread([(y - x) / 1e3 for x, y in zip(raf, raf[1:], strict=False)]),
           "raf_in_trace": len(raf), "long_gaps": []}
    for a, b in gaps:
        inside = [t for t in tasks if t["ts"] < b and t["ts"] + t["dur"] > a]
        named = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for e in on_main:
            if e["name"] in NAMED and e["ts"] < b and e["ts"] + e["dur"] > a:
                key = e["name"]
                data = e.get("args", {}).get("data", {})
                if e["name"] == "FunctionCall":
                    url = str(data.get("url", ""))[-60:]
                    key += f" {data.get('functionName', '')} {url}:{data.get('lineNumber', '')}"
                elif e["name"] == "EventDispatch":
                    key += " " + str(data.get("type", ""))
                named[key][0] += e["dur"] / 1e3
                named[key][1] += e.get("tdur", e["dur"]) / 1e3
                named[key][2] += 1
        top = sorted(named.items(), key=lambda kv: -kv[1][0])[:12]
        gap = {"from_ms": round((a - raf[0]) / 1e3), "gap_ms": round((b - a) / 1e3, 1),
               "main_tasks": len(inside), "tasks_wall_ms": round(sum(t["dur"] for t in inside) / 1e3, 1),
               "tasks_cpu_ms": round(sum(t.get("tdur", t["dur"]) for t in inside) / 1e3, 1),
               "longest_task": _task(max(inside, key=lambda t: t["dur"])) if inside else None,
               "named": [[k, round(v[0], 1), round(v[1], 1), v[2]] for k, v in top],
               "js_samples": _top_samples(samples, a, b)}
        gap["other_threads"] = _busy(events, threads, main, a, b)
        gap["cpu_by_process"] = cpu_in(cpu, a, b)
        out["long_gaps"].append(gap)
    return out


def _busy(events: list, threads: dict, main: tuple, a: float, b: float) -> list:
    """The threads (other than the renderer's main) busiest during [a, b): wall and CPU ms of their tasks in it."""
    busy = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if key == main or e.get("ph") != "X" or "dur" not in e or e["name"] not in TASKS:
            continue
        lo, hi = max(a, e["ts"]), min(b, e["ts"] + e["dur"])
        if hi > lo:
            share = (hi - lo) / max(e["dur"], 1)
            busy[threads.get(key, str(key))][0] += (hi - lo) / 1e3
            busy[threads.get(key, str(key))][1] += share * e.get("tdur", e["dur"]) / 1e3
    return [[k, round(w, 1), round(c, 1)] for k, (w, c) in sorted(busy.items(), key=lambda kv: -kv[1][0])[:6]]


def _task(t: dict) -> dict:
    return {"wall_ms": round(t["dur"] / 1e3, 1), "cpu_ms": round(t.get("tdur", t["dur"]) / 1e3, 1),
            "src": t.get("args", {}).get("src_func", "") or t.get("args", {}).get("src_file", "")}


def _samples(events: list, pid: int) -> list:
    """(ts, leaf function, url) of each V8 CPU-profile sample of renderer `pid`."""
    nodes, out, t = {}, [], None
    for e in events:
        if e.get("pid") != pid or e.get("name") not in ("Profile", "ProfileChunk"):
            continue
        data = e.get("args", {}).get("data", {})
        if e["name"] == "Profile":
            t = data.get("startTime", t)
            continue
        cpu = data.get("cpuProfile", {})
        for n in cpu.get("nodes", []):
            f = n.get("callFrame", {})
            nodes[n["id"]] = (f.get("functionName") or "(anonymous)", f.get("url", "")[-40:], f.get("lineNumber", -1))
        for s, dt in zip(cpu.get("samples", []), data.get("timeDeltas", []), strict=False):
            t = (t or 0) + dt
            out.append((t, nodes.get(s, ("?", "", -1))))
    return out


def _top_samples(samples: list, a: float, b: float) -> list:
    c = collections.Counter(f for t, f in samples if a <= t < b)
    return [[f"{name} {url}:{line}", n] for (name, url, line), n in c.most_common(8)]


def _spread(ms: list) -> dict:
    import numpy as np

    if not ms:
        return {}
    x = np.asarray(ms, dtype=float)
    return {"count": int(x.size), "p50": round(float(np.median(x)), 1), "p95": round(float(np.percentile(x, 95)), 1),
            "max": round(float(x.max()), 1), "over_50": int((x > 50).sum()), "over_100": int((x > 100).sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=float, default=100.0, help="frames at least this long (ms) are taken apart")
    ap.add_argument("--keep", help="write the raw trace here too")
    ap.add_argument("--from-trace", help="analyse a kept trace (no frames list)")
    args = ap.parse_args()
    t0 = time.time()
    if args.from_trace:
        out = analyse(json.loads(pathlib.Path(args.from_trace).read_text()), [], args.long, {})
    else:
        out = record(args.long, args.keep)
    out["seconds"] = round(time.time() - t0)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
