"""`to_html`: one self-contained page with the explorer, read-only, for sharing a trace without a kernel.

The built front-end and the payload are inlined (no CDN, nothing fetched), a strict
Content-Security-Policy allows only the page's own nonce-tagged script and style, and every
inlined text is escaped so that no `</script>` or `<!--` in user data or the bundle can end
the script element early.
"""

from __future__ import annotations

import base64
import html
import json
import pathlib
import secrets

from . import payload

STATIC = pathlib.Path(__file__).parent / "static"
DETAIL_BUDGET = 8 * 2**20  # bytes of tensor detail inlined; layers past it are listed as not exported
DETAIL_SIDE = 64  # heatmap cells per side on the page (the live widget sends up to payload.MAX_SIDE)
DETAIL_LIMIT = 200  # layers and parameter nodes with inlined detail (a 10,000-layer chain stays quick to export)


def to_html(trace, path, diff: dict | None = None) -> pathlib.Path:
    """Write the explorer for `trace` to `path` (one HTML file); returns the path.

    `diff` (payload.diff's dict, as the widget shows it after a rerun) is shown below the explorer."""
    path = pathlib.Path(path)
    path.write_text(page(trace, diff=diff), encoding="utf-8")
    return path


def page(trace, title: str = "hookwidget trace", diff: dict | None = None) -> str:
    """The HTML text of the standalone page."""
    bundle_path = STATIC / "standalone.js"
    if not bundle_path.exists():
        raise FileNotFoundError(f"{bundle_path} is missing: build the front-end with `npm run build` "
                                "(or `pip install -e .`, which runs it)")
    data = {"summary": payload.summary(trace), "diff": diff, **details(trace)}
    nonce = secrets.token_urlsafe(18)
    csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; img-src data: blob:; "
           "connect-src 'none'; base-uri 'none'; form-action 'none'; object-src 'none'")
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{html.escape(csp, quote=False)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
</head>
<body class="hw-page">
<div id="hw-app" class="hw-standalone"></div>
<script type="application/json" id="hw-data">{json_for_script(data)}</script>
<script nonce="{nonce}">{js_for_script(bundle_path.read_text(encoding="utf-8"))}</script>
</body>
</html>
"""


def details(trace) -> dict:
    """Detail of every layer and parameter node, base64 buffers, within DETAIL_BUDGET bytes."""
    out, used, skipped = {}, 0, []
    params = [n for n, d in trace.graph.nodes(data=True) if d.get("param")]
    for target in [*trace.layers, *params]:
        if len(out) >= DETAIL_LIMIT:
            skipped.append(target)
            continue
        meta, buffers = payload.detail(trace, target, max_side=DETAIL_SIDE)
        size = sum(len(b) for b in buffers)
        if used + size > DETAIL_BUDGET:
            skipped.append(target)
            continue
        used += size
        out[target] = {"meta": meta, "buffers": [base64.b64encode(b).decode("ascii") for b in buffers]}
    note = (f"{len(skipped)} targets past the detail limits ({DETAIL_LIMIT} targets, {DETAIL_BUDGET >> 20} MiB); "
            "open the trace in a notebook for them") if skipped else ""
    return {"details": out, "details_note": note}


def json_for_script(data) -> str:
    """JSON that is safe inside <script>: '<', '>', '&' and U+2028/9 as \\u escapes (still valid JSON)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def js_for_script(code: str) -> str:
    """Bundle text that cannot close its <script> early: `</script` -> `<\\/script`, `<!--` -> `<\\!--`.

    Both rewrites keep string literals equal; the bundle is checked to hold no other occurrence."""
    import re

    code = re.sub(r"</(script)", r"<\\/\1", code, flags=re.IGNORECASE)
    return code.replace("<!--", "<\\!--")
