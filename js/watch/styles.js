// Styles of the watch explorer: the trace explorer's theme variables (JupyterLab / VS Code / fallbacks).
import { DARK_VARS, installStyles as install, THEME_VARS } from "../shared/theme.js";

export const CSS = `
.hw-watch {${THEME_VARS}
  --hw-op: #8b5cf6; --hw-param: #0d9488; --hw-error: #dc2626; --hw-spike: #ea580c; --hw-selected: #2563eb;
  font: 12px/1.4 var(--jp-ui-font-family, system-ui, sans-serif); color: var(--hw-fg); background: var(--hw-bg);
  border: 1px solid var(--hw-border); border-radius: 6px; padding: 6px 8px; box-sizing: border-box;
  display: flex; flex-direction: column; gap: 6px; min-width: 0;
}
@media (prefers-color-scheme: dark) {
  .hw-standalone .hw-watch { ${DARK_VARS} }
}
.hw-watch * { box-sizing: border-box; }
.hw-w-head { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: center; }
.hw-w-title { font-weight: 600; }
.hw-w-dim { color: var(--hw-dim); }
.hw-w-state { padding: 0 6px; border-radius: 8px; background: var(--hw-bg2); }
.hw-w-state.open { color: var(--hw-selected); }
.hw-w-head select { font: inherit; color: var(--hw-fg); background: var(--hw-bg2); border: 1px solid var(--hw-border); border-radius: 3px; }
.hw-w-legend { display: inline-flex; align-items: center; gap: 4px; flex-wrap: wrap; }
.hw-w-ramp { width: 110px; height: 10px; border: 1px solid var(--hw-border); }
.hw-w-sw { display: inline-block; width: 10px; height: 10px; border: 1px solid var(--hw-border); vertical-align: -1px; margin-left: 6px; }
.hw-w-grid { display: grid; grid-template-columns: minmax(70px, max-content) minmax(120px, 1fr) 90px 70px; column-gap: 8px; row-gap: 2px; align-items: start; }
.hw-w-grid.no-spark { grid-template-columns: minmax(70px, max-content) minmax(120px, 1fr) 0 70px; }
.hw-w-grid.no-spark .hw-w-spark { visibility: hidden; width: 0; overflow: hidden; } /* keep the cells: the grid places by order */
.hw-w-colhead { color: var(--hw-dim); font-size: 11px; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.hw-w-labels { display: flex; flex-direction: column; max-width: 170px; min-width: 0; }
.hw-w-label { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; font-size: 11px; text-align: right; padding-right: 2px; }
.hw-w-label.bad { color: var(--hw-error); font-weight: 600; }
.hw-w-label.sparse { overflow: visible; font-size: 10px; }
.hw-w-plot { position: relative; min-width: 0; }
.hw-w-plot canvas { display: block; }
.hw-w-heat { cursor: crosshair; image-rendering: pixelated; }
.hw-w-values { display: flex; flex-direction: column; font-variant-numeric: tabular-nums; }
.hw-w-value { white-space: nowrap; overflow: hidden; font-size: 11px; text-align: right; }
.hw-w-value.bad { color: var(--hw-error); font-weight: 600; }
.hw-w-value.sparse { overflow: visible; font-size: 10px; }
.hw-w-rowlabel { font-size: 11px; text-align: right; color: var(--hw-dim); padding-right: 2px; white-space: nowrap; }
.hw-w-chartlabel { height: 54px; display: flex; flex-direction: column; justify-content: center; }
.hw-w-range { font-size: 10px; font-variant-numeric: tabular-nums; }
.hw-w-axis { position: relative; height: 14px; font-size: 10px; color: var(--hw-dim); }
.hw-w-axis span { position: absolute; top: 0; transform: translateX(-50%); white-space: nowrap; }
.hw-w-kept { display: flex; flex-wrap: wrap; gap: 4px; align-items: center; }
.hw-w-kept button { font: inherit; color: var(--hw-fg); background: var(--hw-bg2); border: 1px solid var(--hw-border); border-radius: 3px; padding: 1px 6px; cursor: pointer; }
.hw-w-kept button.anomalous { border-color: var(--hw-error); }
.hw-w-kept button.on { outline: 2px solid var(--hw-selected); }
.hw-w-readout { min-height: 1.4em; color: var(--hw-fg); white-space: nowrap; overflow: hidden; text-overflow: ellipsis; font-variant-numeric: tabular-nums; }
.hw-w-readout.pinned { white-space: normal; } /* a clicked step: all of its values */
.hw-w-anoms { max-height: 110px; overflow: auto; font-size: 11px; margin: 0; padding-left: 18px; }
.hw-w-anoms summary { cursor: pointer; }
.hw-w-status { padding: 2px 6px; border-radius: 3px; background: var(--hw-bg2); white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.hw-w-status[data-state="error"] { color: var(--hw-error); }
.hw-w-trace { overflow-x: auto; }
.hw-w-zoom { display: inline-flex; gap: 3px; align-items: center; }
.hw-w-zoom button, .hw-w-lead { font: inherit; color: var(--hw-fg); background: var(--hw-bg2); border: 1px solid var(--hw-border); border-radius: 3px; padding: 0 6px; cursor: pointer; }
.hw-w-lead { margin-left: 6px; color: var(--hw-selected); text-align: left; }
.hw-w-axis { cursor: ew-resize; user-select: none; }
.hw-w-facts { font-size: 11px; margin: 4px 0; word-break: break-word; }
.hw-w-facts:empty { display: none; }
.hw-w-trace:empty { display: none; }
.hw-w-trace-title { font-weight: 600; margin: 4px 0; }
`;

/** Put the stylesheet into `root` once (with the page's CSP nonce when there is one). */
export const installWatchStyles = (root, nonce) => install(root, nonce, CSS);
