// Theme-aware styles: JupyterLab / VS Code CSS variables when present, light/dark fallbacks otherwise.
import { DARK_VARS, installStyles as install, THEME_VARS } from "../shared/theme.js";

export const CSS = `
.hw-root {${THEME_VARS}
  --hw-input: #9ca3af; --hw-param: #0d9488; --hw-leaf: #5eead4; --hw-op: #8b5cf6; --hw-root-c: #6d28d9;
  --hw-box: color-mix(in srgb, var(--hw-op) 12%, var(--hw-bg));
  --hw-changed: #f97316; --hw-selected: #2563eb; --hw-match: #eab308; --hw-error: #dc2626;
  font: 12px/1.4 var(--jp-ui-font-family, system-ui, sans-serif);
  color: var(--hw-fg); background: var(--hw-bg);
  display: grid; grid-template-columns: var(--hw-left-w) minmax(0, 1fr) var(--hw-side-w);
  --hw-left-w: clamp(300px, 40%, 480px); --hw-side-w: minmax(280px, 360px);
  grid-template-rows: auto 600px auto auto; /* the diff adds its own height below: it never takes the graph's */
  grid-template-areas: "banner banner banner" "tree graph side" "diff diff diff" "status status status";
  height: auto; column-gap: 6px; row-gap: 6px; border: 1px solid var(--hw-border); border-radius: 6px; padding: 6px; box-sizing: border-box;
}
/* Panes (panes.js): a closed one takes no room; a narrow output stacks them below the full-width graph. */
.hw-root:has(> .hw-left:not(.layers)) { --hw-left-w: fit-content(clamp(220px, 30%, 420px)); } /* the tree: as wide as its names */
/* A mid-width output with the detail open: both side panes narrower, the graph keeps ~40% (the layer table drops
   its less important columns). */
.hw-root.hw-mid:not(.hw-side-closed):has(> .hw-left.layers) { --hw-left-w: clamp(260px, 30%, 360px); --hw-side-w: minmax(260px, 300px); }
.hw-root.hw-left-closed { --hw-left-w: 0px; } .hw-root.hw-side-closed { --hw-side-w: 0px; }
.hw-root.hw-left-closed > .hw-left, .hw-root.hw-side-closed > .hw-side { display: none; }
.hw-root.hw-narrow { grid-template-columns: minmax(0, 1fr); height: auto;
  grid-template-rows: auto 560px auto auto auto auto;
  grid-template-areas: "banner" "graph" "tree" "side" "diff" "status"; }
.hw-root.hw-narrow > .hw-left { max-height: 420px; max-width: none; }
.hw-root.hw-narrow > .hw-side { max-height: 560px; }
.hw-root.hw-narrow .hw-pane-toggle[data-pane-toggle="left"] { order: 0; }
@media (prefers-color-scheme: dark) {
  .hw-standalone { ${DARK_VARS} }
  body.hw-page { background: #111827; }
}
.hw-root * { box-sizing: border-box; }
.hw-standalone .hw-root:not(.hw-narrow), .hw-root.hw-fill:not(.hw-narrow) { height: calc(100vh - 16px); grid-template-rows: auto minmax(0, 1fr) auto auto; }
body.hw-page { margin: 8px; }
.hw-banner { grid-area: banner; display: flex; flex-direction: column; gap: 2px; }
.hw-banner[hidden] { display: none; }
.hw-banner-main { padding: 4px 8px; border-radius: 4px; border: 1px solid var(--hw-changed); background: color-mix(in srgb, var(--hw-changed) 12%, var(--hw-bg)); font-weight: 600; }
.hw-banner-notes summary { cursor: pointer; color: var(--hw-dim); }
.hw-banner-notes ul { margin: 2px 0; padding-left: 18px; max-height: 96px; overflow: auto; }
.hw-tree { grid-area: tree; } .hw-graph { grid-area: graph; } .hw-side { grid-area: side; }
.hw-tree-row:focus { outline: 2px dotted var(--hw-selected); }
.hw-tree-legend { font-weight: normal; }
.hw-tree-toggle { flex: 0 0 1em; color: var(--hw-dim); text-align: center; }
.hw-chan-grid { display: flex; flex-wrap: wrap; gap: 3px; max-width: 340px; }
.hw-chan { display: flex; flex-direction: column; align-items: center; }
.hw-chan-label { font-size: 10px; }
.hw-sample { font: inherit; margin-left: 4px; }
.hw-stats { max-width: 340px; font-size: 11px; }
.hw-hook-error { flex-basis: 100%; font-weight: 600; }
.hw-hook-error[hidden] { display: none; }
.hw-unsupported { font-style: normal; color: var(--hw-fg); }
.hw-sortable { cursor: pointer; user-select: none; white-space: nowrap; }
.hw-table tr.hooked td:first-child { font-weight: 600; }
.hw-tree, .hw-side { overflow: auto; min-height: 0; }
.hw-side { display: flex; flex-direction: column; gap: 8px; }
.hw-panel-title { font-weight: 600; margin: 2px 0 4px; overflow-wrap: anywhere; }
.hw-dim { color: var(--hw-dim); }
.hw-tree-row { display: flex; gap: 6px; align-items: baseline; cursor: pointer; padding: 1px 4px; border-radius: 3px; white-space: nowrap; min-width: 0; }
.hw-tree-row:hover { background: var(--hw-bg2); }
.hw-tree-row.selected { outline: 2px solid var(--hw-selected); }
.hw-tree-row.changed .hw-tree-name { color: var(--hw-changed); font-weight: 600; }
.hw-tree-name { flex: 0 0 auto; }
.hw-tree-cls { color: var(--hw-dim); flex: 0 1 auto; min-width: 2ch; overflow: hidden; text-overflow: ellipsis; }
.hw-tree-num { color: var(--hw-dim); flex: 0 0 auto; }
.hw-flag { color: var(--hw-error); }
.hw-graph { display: flex; flex-direction: column; min-width: 0; min-height: 0; border: 1px solid var(--hw-border); border-radius: 4px; }
/* One line whatever the width: the search box and the panes' words give way (the legend sits below the graph). */
.hw-toolbar { display: flex; flex-wrap: nowrap; gap: 4px; align-items: center; padding: 4px; border-bottom: 1px solid var(--hw-border); white-space: nowrap; min-width: 0; overflow: hidden; }
.hw-toolbar > * { flex: 0 0 auto; }
.hw-toolbar .hw-search { width: 14ch; min-width: 7ch; flex: 0 1 auto; }
.hw-graph { container-type: inline-size; } /* a short toolbar drops the panes' words */
@container (max-width: 460px) { .hw-toolbar .hw-pane-label { display: none; } .hw-toolbar .hw-search { width: 9ch; } }
.hw-pane-toggle[aria-pressed="true"] { border-color: var(--hw-selected) !important; }
.hw-pane-toggle[data-pane-toggle="side"] { margin-left: auto; }
.hw-toolbar button, .hw-toolbar input { font: inherit; color: var(--hw-fg); background: var(--hw-bg2); border: 1px solid var(--hw-border); border-radius: 3px; padding: 1px 6px; }
.hw-svg { flex: 1; width: 100%; min-height: 0; cursor: grab; user-select: none; }
/* Below the graph: the legend, whole at any width (its items wrap), then the graph's counts. */
.hw-graph-foot { display: flex; flex-wrap: wrap; align-items: center; gap: 2px 14px; padding: 2px 4px; border-top: 1px solid var(--hw-border); }
.hw-legend { display: inline-flex; gap: 2px 8px; flex-wrap: wrap; }
.hw-legend-item { display: inline-flex; gap: 3px; align-items: center; }
.hw-swatch { width: 11px; height: 11px; border-radius: 2px; display: inline-block; }
.hw-swatch.role-input { background: var(--hw-input); } .hw-swatch.role-param { background: var(--hw-param); }
.hw-swatch.role-leaf { background: var(--hw-leaf); } .hw-swatch.role-op { background: var(--hw-op); }
.hw-swatch-box { background: var(--hw-box); border: 1px solid var(--hw-op); }
.hw-edge { fill: none; stroke: var(--hw-dim); stroke-width: 1.2; }
.hw-arrowhead { fill: var(--hw-dim); }
.hw-node { cursor: pointer; }
.hw-node-rect { stroke: none; }
.hw-node.role-op .hw-node-rect { fill: var(--hw-op); } .hw-node.role-root .hw-node-rect { fill: var(--hw-root-c); }
.hw-node.role-param .hw-node-rect { fill: var(--hw-param); } .hw-node.role-leaf .hw-node-rect { fill: var(--hw-leaf); }
.hw-node.role-input .hw-node-rect { fill: var(--hw-input); }
.hw-loose-input rect { fill: var(--hw-input); cursor: pointer; }
.hw-node-label { fill: #fff; font-size: 12px; text-anchor: middle; pointer-events: none; }
.hw-node.role-leaf .hw-node-label { fill: #134e4a; }
.hw-box { cursor: pointer; }
.hw-box-rect { fill: var(--hw-box); stroke: var(--hw-op); stroke-width: 1.2; }
.hw-chunk .hw-box-rect { stroke-dasharray: 4 3; }
.hw-box-param { fill: var(--hw-param); }
.hw-box-label { fill: var(--hw-fg); font-weight: 600; font-size: 12px; pointer-events: none; }
.hw-box-sub { fill: var(--hw-dim); font-size: 12px; pointer-events: none; }
.hw-expand rect { fill: var(--hw-bg2); stroke: var(--hw-border); } .hw-expand text { fill: var(--hw-fg); text-anchor: middle; font-size: 12px; pointer-events: none; }
.hw-expand { cursor: pointer; }
.hw-cluster { fill: color-mix(in srgb, var(--hw-op) 4%, transparent); stroke: var(--hw-border); stroke-dasharray: 3 3; }
.hw-cluster-tab { cursor: pointer; } .hw-cluster-tab > rect { fill: var(--hw-bg2); stroke: var(--hw-border); } .hw-cluster-tab > text { fill: var(--hw-fg); font-size: 12px; }
.selected > rect:first-of-type, .hw-node.selected .hw-node-rect { stroke: var(--hw-selected); stroke-width: 3; }
.changed > rect:first-of-type, .hw-node.changed .hw-node-rect { stroke: var(--hw-changed); stroke-width: 3; }
.match > rect:first-of-type { stroke: var(--hw-match); stroke-width: 3; }
.hw-detail, .hw-controls, .hw-diff:not(:empty) { border: 1px solid var(--hw-border); border-radius: 4px; padding: 6px; }
.hw-diff { grid-area: diff; max-height: 200px; overflow: auto; }
.hw-table { border-collapse: collapse; margin: 4px 0; }
.hw-table th { text-align: left; font-weight: normal; color: var(--hw-dim); padding: 1px 8px 1px 0; }
.hw-table td { padding: 1px 8px 1px 0; overflow-wrap: anywhere; }
.hw-table tr.changed td { color: var(--hw-changed); }
.hw-figs { display: flex; flex-wrap: wrap; gap: 8px; }
.hw-fig { margin: 4px 0; } .hw-fig figcaption { margin-bottom: 2px; }
.hw-heat { image-rendering: pixelated; border: 1px solid var(--hw-border); display: block; }
.hw-section { font-weight: 600; margin-top: 6px; }
.hw-maxdiff { margin: 4px 0; }
.hw-health.ok { color: var(--hw-param); } .hw-health.bad, .hw-error { color: var(--hw-error); font-weight: 600; }
.hw-notes { color: var(--hw-dim); padding-left: 16px; margin: 4px 0; }
.hw-hook { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; padding: 2px 0; border-bottom: 1px dotted var(--hw-border); }
.hw-hooks-on { padding: 2px 0 4px; } .hw-hook-on { font-weight: 600; }
.hw-hook.on .hw-hook-name { color: var(--hw-changed); font-weight: 600; }
.hw-hook-name { min-width: 110px; }
.hw-param input { width: 64px; font: inherit; color: var(--hw-fg); background: var(--hw-bg2); border: 1px solid var(--hw-border); }
.hw-param input.invalid { border-color: var(--hw-error); }
.hw-note { color: var(--hw-dim); font-style: italic; margin: 2px 0 4px; }
.hw-left { grid-area: tree; display: flex; flex-direction: column; min-height: 0; min-width: 0; gap: 4px; }
.hw-left.layers { container-type: inline-size; } /* the layer table's columns follow the pane's width */
.hw-left > .hw-tree { max-width: none; flex: 1 1 auto; }
.hw-left > [hidden] { display: none; }
.hw-tabs { display: flex; gap: 2px; border-bottom: 1px solid var(--hw-border); }
.hw-tab { font: inherit; color: var(--hw-dim); background: none; border: 1px solid transparent; border-bottom: none; border-radius: 3px 3px 0 0; padding: 1px 8px; cursor: pointer; }
.hw-tab.on { color: var(--hw-fg); font-weight: 600; border-color: var(--hw-border); background: var(--hw-bg2); }
.hw-overview { flex: 1 1 auto; overflow: auto; min-height: 0; }
.hw-ov-legend { display: flex; align-items: center; gap: 4px; flex-wrap: wrap; margin: 2px 0; }
.hw-ov-bar { display: inline-flex; border: 1px solid var(--hw-border); }
.hw-ov-step { width: 9px; height: 10px; display: inline-block; }
.hw-ov-table { font-size: 11px; margin: 0; }
.hw-ov-table thead th { position: sticky; top: 0; background: var(--hw-bg); z-index: 1; }
.hw-ov-table th.hw-ov-num, .hw-ov-norm { text-align: right; }
.hw-ov-table td { padding: 1px 4px; overflow-wrap: normal; white-space: nowrap; }
.hw-ov-row { cursor: pointer; }
.hw-ov-row:hover td:not([data-t]) { background: var(--hw-bg2); }
.hw-ov-row.selected td { box-shadow: inset 0 2px 0 var(--hw-selected), inset 0 -2px 0 var(--hw-selected); }
.hw-ov-row:focus { outline: 2px dotted var(--hw-selected); }
.hw-ov-name { max-width: 150px; }
@container (min-width: 460px) { .hw-ov-name { max-width: 210px; } }
.hw-ov-clip { display: block; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; text-align: left; }
.hw-ov-cls { max-width: 66px; overflow: hidden; text-overflow: ellipsis; color: var(--hw-dim); }
/* Columns by importance: name, ‖δ‖₂, ‖W.grad‖₂ and health stay; class (also in the row's title), call order and
   ‖a‖₂ go first, in that order, as the pane narrows. */
@container (max-width: 519px) { .hw-ov-table [data-col="cls"], .hw-ov-table [data-layer-sort="cls"] { display: none; } }
@container (max-width: 399px) { .hw-ov-table [data-col="index"], .hw-ov-table [data-layer-sort="index"] { display: none; } }
@container (max-width: 339px) { .hw-ov-table [data-col="a"], .hw-ov-table [data-layer-sort="a"] { display: none; }
  .hw-ov-name { max-width: 112px; } /* names clip from the left: their ends (attn.c_proj) stay */ }
.hw-ov-norm.nonfinite { background: var(--hw-error); color: #fff; font-weight: 600; }
.hw-status { grid-area: status; padding: 3px 6px; border-radius: 3px; background: var(--hw-bg2); white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.hw-status[data-state="error"] { color: var(--hw-error); }
.hw-status[data-state="running"] { color: var(--hw-selected); }
`;

/** Put the stylesheet into `root` once (with the page's CSP nonce when there is one). */
export const installStyles = (root, nonce) => install(root, nonce, CSS);
