// The module tree: qualified name, class, parameter count, call count; click selects the module.
import { fmt, h } from "./dom.js";

export function createTreeView({ onSelect }) {
  const list = h("div", { class: "hw-tree-list", role: "tree" });
  const el = h("div", { class: "hw-tree" }, h("div", { class: "hw-panel-title", text: "modules" }), list);
  let rows = new Map();

  function setSummary(summary, changedModules = new Set()) {
    const depth = new Map();
    const byName = new Map(summary.modules.map((m) => [m.name, m]));
    const depthOf = (m) => {
      if (depth.has(m.name)) return depth.get(m.name);
      const d = m.parent !== null && m.parent !== undefined && byName.has(m.parent) ? depthOf(byName.get(m.parent)) + 1 : 0;
      depth.set(m.name, d);
      return d;
    };
    const children = new Map();
    for (const m of summary.modules) {
      const p = m.parent !== null && m.parent !== undefined && byName.has(m.parent) ? m.parent : null;
      if (!children.has(p)) children.set(p, []);
      children.get(p).push(m);
    }
    const ordered = [];
    const walk = (p) => { for (const m of children.get(p) || []) { ordered.push(m); walk(m.name); } };
    walk(null);
    rows = new Map();
    const frag = [];
    for (const m of ordered.slice(0, 5000)) {
      const flags = m.flags || [];
      const row = h("div", { class: "hw-tree-row" + (changedModules.has(m.name) ? " changed" : ""), role: "treeitem", "data-tree-module": m.name,
        onclick: () => onSelect({ kind: "module", target: m.name }) },
        h("span", { class: "hw-tree-name", text: m.name || "(root)" }),
        h("span", { class: "hw-tree-cls", text: m.cls }),
        h("span", { class: "hw-tree-num", title: "parameters", text: m.params ? `${fmt(m.params)} p` : "" }),
        h("span", { class: "hw-tree-num", title: "calls", text: `×${m.calls}` }),
        flags.length ? h("span", { class: "hw-flag", text: flags.join(" ") }) : null);
      row.style.paddingLeft = `${4 + 12 * depthOf(m)}px`; // CSSOM, not a style attribute (CSP)
      rows.set(m.name, row);
      frag.push(row);
    }
    if (ordered.length > 5000) frag.push(h("div", { class: "hw-dim", text: `… ${ordered.length - 5000} more modules (use search)` }));
    list.replaceChildren(...frag);
  }

  function select(sel) {
    for (const [name, row] of rows) row.classList.toggle("selected", sel?.kind === "module" && sel.target === name);
  }

  return { el, setSummary, select };
}
