"""`to_html`: one self-contained page with the explorer, read-only, for sharing a trace without a kernel;
`snapshot`: the plain-HTML summary a displayed explorer carries for wherever its model is gone.

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

from hookwidget.views import payload

STATIC = pathlib.Path(__file__).resolve().parents[1] / "static"
DETAIL_BUDGET = 8 * 2**20  # bytes of detail written (base64 buffers and their JSON); layers past it are listed
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
    from hookwidget.views.payload.shares import static_shares

    data = {"summary": payload.summary(trace), "diff": diff, **details(trace), "shares": static_shares(trace)}
    return standalone_page("standalone.js", data, title)


def standalone_page(bundle: str, data: dict, title: str) -> str:
    """One self-contained page: `data` as JSON, the built front-end `bundle` (in hookwidget/static) inline, a
    strict CSP that lets only these two run."""
    bundle_path = STATIC / bundle
    if not bundle_path.exists():
        raise FileNotFoundError(f"{bundle_path} is missing: build the front-end with `npm run build` "
                                "(or `pip install -e .`, which runs it)")
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
    """Detail of every layer and parameter node, base64 buffers, within DETAIL_BUDGET bytes as written to the page
    (the base64 text, a third larger than the buffers, and the JSON of its meta)."""
    out, used, skipped, memo = {}, 0, [], {}
    params = [n for n, d in trace.graph.nodes(data=True) if d.get("param")]
    for target in [*trace.layers, *params]:
        if len(out) >= DETAIL_LIMIT:
            skipped.append(target)
            continue
        meta, buffers = payload.detail(trace, target, max_side=DETAIL_SIDE, memo=memo)
        size = sum(4 * -(-len(b) // 3) for b in buffers) + len(json_for_script(meta))  # base64: 4 per 3 bytes
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


SNAPSHOT_ROWS = 200  # layers listed in a snapshot (a notebook output should stay small)


def snapshot(summary: dict, diff: dict | None = None) -> str:
    """A static HTML summary of what the explorer shows (payload.summary's dict): loss, hooks, notes and every
    layer's norms and health flags, as a plain table. It rides in the widget's mimebundle beside the widget
    view, so a front-end that cannot render the view (an untrusted notebook, nbconvert, GitHub) shows
    it; no script, no style element, every user string escaped."""
    e = html.escape
    mods = summary.get("modules", [])
    own = [m for m in mods if m.get("own_params")]
    hooks = summary.get("hooks", [])
    graph = summary.get("graph", {})
    head = [f"loss {_fmt(summary.get('loss'))}", f"{len(mods):,} modules", f"{len(graph.get('id', [])):,} graph nodes"]
    if hooks:
        head.append("hooks: " + ", ".join(f"{h['kind']} on {h['target']}" for h in hooks))
    if diff:
        head.append(f"last rerun: loss {_fmt(diff.get('loss_before'))} → {_fmt(diff.get('loss_after'))}")
        if diff.get("weights_differ"):
            head.append(f"weights differ in {len(diff['weights_differ'])} parameters (not only a hook's effect)")
    rows = "".join(
        "<tr>" + "".join(f"<td>{e(str(v))}</td>" for v in (
            m["name"], m.get("cls", ""), _fmt((m.get("delta") or {}).get("norm")), _fmt(m.get("grad_norm")),
            _fmt((m.get("a") or {}).get("norm")), " ".join(m.get("flags") or []))) + "</tr>"
        for m in own[:SNAPSHOT_ROWS])
    more = f"<p>… {len(own) - SNAPSHOT_ROWS:,} more layers</p>" if len(own) > SNAPSHOT_ROWS else ""
    notes = "".join(f"<li>{e(str(n))}</li>" for n in summary.get("notes", []))
    return ('<div class="hw-snapshot" data-hw-snapshot="1">'
            "<p><b>hookwidget trace</b>: a static snapshot. The explorer needs the kernel that ran this cell: "
            "run the cell again to explore (or save <code>t.to_html(path)</code> to share it).</p>"
            f"<p>{e(' · '.join(head))}</p>" + (f"<ul>{notes}</ul>" if notes else "")
            + "<table><thead><tr><th>layer</th><th>class</th><th>‖δ‖₂</th><th>‖W.grad‖₂</th><th>‖a‖₂</th>"
            f"<th>health</th></tr></thead><tbody>{rows}</tbody></table>{more}</div>")


def _fmt(v) -> str:
    """4 significant digits, like the explorer; "–" for none; "nan"/"inf" as they are."""
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e9):
        return f"{int(v):,}"
    return f"{v:.4g}"
