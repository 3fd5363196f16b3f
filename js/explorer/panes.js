// The explorer's layout around the graph: the left pane (layers / tree) and the side pane (detail, hooks) open
// and close from two toolbar buttons, and the choice is remembered (localStorage, for every explorer on this
// origin). Where nobody chose, the output's width decides (a class on the root, CSS does the rest):
//   wide (≥ WIDE px): three columns, both panes open;
//   mid: the left pane and the graph, the side pane opens when something is selected;
//   narrow (< NARROW px): one column, the graph first at full width, the panes stacked below it.
import { h } from "../shared/dom.js";

export const WIDE = 1400;
export const NARROW = 900;
const KEY = "hookwidget.explorer.panes";

function load() {
  try { return JSON.parse(globalThis.localStorage?.getItem(KEY) || "{}") || {}; } catch { return {}; }
}
function save(prefs) {
  try { globalThis.localStorage?.setItem(KEY, JSON.stringify(prefs)); } catch { /* storage off: not remembered */ }
}

/** The width class of an output `w` px wide. */
export const widthClass = (w) => (w >= WIDE ? "wide" : w >= NARROW || !w ? "mid" : "narrow");

export function createPanes(root, shell, { onResize } = {}) {
  const prefs = load(); // {left: "open"|"closed", side: "open"|"closed"}: only what the user chose
  let width = "mid";
  let selected = false;
  const button = (pane, parts, title) => h("button", { type: "button", class: "hw-pane-toggle", "data-pane-toggle": pane, title, "aria-label": title,
    onclick: () => { prefs[pane] = isOpen(pane) ? "closed" : "open"; save(prefs); apply(); } },
  ...parts.map((p) => (p.length > 1 ? h("span", { class: "hw-pane-label", text: p }) : p))); // the word goes when the toolbar is short
  const leftButton = button("left", ["◧", " layers"], "show or hide the layers / tree pane (remembered)");
  const sideButton = button("side", ["detail ", "◨"], "show or hide the detail and hooks pane (remembered)");

  function isOpen(pane) {
    if (prefs[pane]) return prefs[pane] === "open";
    return pane === "left" || width !== "mid" || selected;
  }

  function apply() {
    for (const c of ["wide", "mid", "narrow"]) root.classList.toggle(`hw-${c}`, c === width);
    for (const [pane, b] of [["left", leftButton], ["side", sideButton]]) {
      const open = isOpen(pane);
      root.classList.toggle(`hw-${pane}-closed`, !open);
      b.setAttribute("aria-pressed", String(open));
    }
    onResize?.();
  }

  function measure() {
    const next = widthClass(shell.clientWidth);
    if (next !== width) { width = next; apply(); }
  }
  if (globalThis.ResizeObserver) new ResizeObserver(measure).observe(shell);
  apply();

  return {
    leftButton, sideButton, measure,
    /** Something is selected (or not): a side pane nobody closed opens to show it. */
    select(on) { if (selected !== on) { selected = on; apply(); } },
    isOpen,
    get width() { return width; },
  };
}
