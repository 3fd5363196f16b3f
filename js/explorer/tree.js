// The module tree: each module's name (relative to its parent, whole; the full name in its title),
// class (cut first when space is short), parameter count and call count; click or Enter selects.
// Rows with children fold (▸/▾); blocks of a repeated run (h.0 … h.11 of one class) start folded.
// Keyboard: ↑/↓ move, →/← unfold/fold, Home/End jump, Enter selects, Esc clears the selection.
import { h } from "../shared/dom.js";
import { fmtParams } from "../shared/format.js";

export function createTreeView({ onSelect, onClear }) {
  const list = h("div", { class: "hw-tree-list", role: "tree", "aria-label": "modules" });
  const el = h("div", { class: "hw-tree" },
    h("div", { class: "hw-panel-title", text: "modules" },
      h("span", { class: "hw-dim hw-tree-legend", title: "params: parameters the module holds (its children included); ×N: times it was called in the traced code",
        text: " · params · ×calls" })),
    list);
  let rows = new Map();
  let order = [];
  let collapsed = null; // names of folded rows (kept across summaries)
  let last = null; // {summary, changed, selected}
  let kids = new Map();
  const redraw = () => last && setSummary(last.summary, last.changed);

  function toggleRow(name, open) {
    if (!kids.get(name)?.length) return;
    const isOpen = !collapsed.has(name);
    if (open === isOpen) return;
    if (isOpen) collapsed.add(name); else collapsed.delete(name);
    redraw();
    rows.get(name)?.focus();
  }

  list.addEventListener("keydown", (e) => {
    const i = order.indexOf(document.activeElement?.getAttribute?.("data-tree-module"));
    const move = (j) => { const r = rows.get(order[Math.max(0, Math.min(order.length - 1, j))]); if (r) { r.focus(); r.scrollIntoView?.({ block: "nearest" }); } e.preventDefault(); };
    if (e.key === "ArrowDown") move(i + 1);
    else if (e.key === "ArrowUp") move(i < 0 ? 0 : i - 1);
    else if (e.key === "Home") move(0);
    else if (e.key === "End") move(order.length - 1);
    else if (e.key === "ArrowRight" && i >= 0) { toggleRow(order[i], true); e.preventDefault(); }
    else if (e.key === "ArrowLeft" && i >= 0) { toggleRow(order[i], false); e.preventDefault(); }
    else if (e.key === "Enter" && i >= 0) { onSelect({ kind: "module", target: order[i] }); e.preventDefault(); }
    else if (e.key === "Escape") { onClear?.(); e.preventDefault(); }
  });

  function setSummary(summary, changedModules = new Set()) {
    last = { ...last, summary, changed: changedModules };
    const depth = new Map();
    const byName = new Map(summary.modules.map((m) => [m.name, m]));
    const parentOf = (m) => (m.parent !== null && m.parent !== undefined && byName.has(m.parent) ? m.parent : null);
    const depthOf = (m) => {
      if (depth.has(m.name)) return depth.get(m.name);
      const p = parentOf(m);
      const d = p !== null ? depthOf(byName.get(p)) + 1 : 0;
      depth.set(m.name, d);
      return d;
    };
    const children = new Map();
    for (const m of summary.modules) {
      const p = parentOf(m);
      if (!children.has(p)) children.set(p, []);
      children.get(p).push(m);
    }
    kids = new Map([...children].map(([p, list]) => [p, list.map((m) => m.name)]));
    if (collapsed === null) collapsed = repeatedBlocks(children);
    const sel = last.selected;
    if (sel?.kind === "module" && byName.has(sel.target)) {
      for (let p = parentOf(byName.get(sel.target)); p !== null; p = parentOf(byName.get(p))) collapsed.delete(p);
    }
    const ordered = [];
    const walk = (p) => { for (const m of children.get(p) || []) { ordered.push(m); if (!collapsed.has(m.name)) walk(m.name); } };
    walk(null);
    rows = new Map();
    order = [];
    const frag = [];
    for (const m of ordered.slice(0, 5000)) {
      const flags = m.flags || [];
      const p = parentOf(m);
      const local = p && m.name.startsWith(p + ".") ? m.name.slice(p.length + 1) : m.name || "(root)";
      const row = h("div", { class: "hw-tree-row" + (changedModules.has(m.name) ? " changed" : ""), role: "treeitem", tabindex: "-1",
        "data-tree-module": m.name, title: `${m.name || "(root)"} · ${m.cls}${m.params ? ` · ${m.params.toLocaleString("en-US")} parameters` : ""} · called ${m.calls}×`,
        "aria-expanded": children.get(m.name)?.length ? String(!collapsed.has(m.name)) : undefined,
        onclick: () => onSelect({ kind: "module", target: m.name }) },
        children.get(m.name)?.length
          ? h("span", { class: "hw-tree-toggle", "data-tree-toggle": m.name, title: collapsed.has(m.name) ? `unfold (${children.get(m.name).length} children)` : "fold",
            text: collapsed.has(m.name) ? "▸" : "▾", onclick: (e) => { e.stopPropagation(); toggleRow(m.name, collapsed.has(m.name)); } })
          : h("span", { class: "hw-tree-toggle" }),
        h("span", { class: "hw-tree-name", text: local }),
        h("span", { class: "hw-tree-cls", text: m.cls }),
        h("span", { class: "hw-tree-num", title: "parameters (children included)", text: fmtParams(m.params) }),
        m.calls !== 1 ? h("span", { class: "hw-tree-num", title: `called ${m.calls} times`, text: `×${m.calls}` }) : null,
        flags.length ? h("span", { class: "hw-flag", text: flags.join(" ") }) : null);
      row.style.paddingLeft = `${4 + 12 * depthOf(m)}px`; // CSSOM, not a style attribute (CSP)
      rows.set(m.name, row);
      order.push(m.name);
      frag.push(row);
    }
    if (order.length) rows.get(order[0]).setAttribute("tabindex", "0");
    if (ordered.length > 5000) frag.push(h("div", { class: "hw-dim", text: `… ${ordered.length - 5000} more modules (use search)` }));
    list.replaceChildren(...frag);
  }

  function select(sel) {
    last = { ...last, selected: sel };
    if (sel?.kind === "module" && last.summary && !rows.has(sel.target)) redraw(); // unfold to show it
    for (const [name, row] of rows) {
      const on = sel?.kind === "module" && sel.target === name;
      row.classList.toggle("selected", on);
      row.setAttribute("aria-selected", on ? "true" : "false");
      if (on) row.scrollIntoView?.({ block: "nearest" });
    }
  }

  return { el, setSummary, select };
}

const NUMBERED = /^(.*?)(\d+)$/;

/** Rows to fold at first: blocks with children in a run of ≥ 3 alike siblings (one class, the same children by
 * name and class) named prefix0, prefix1, … — the rule the graph folds by (collapse.js). */
function repeatedBlocks(children) {
  const out = new Set();
  const shape = (m) => (children.get(m.name) || []).map((c) => `${c.name.slice(m.name.length + 1)}:${c.cls}`).join(",");
  for (const list of children.values()) {
    let i = 0;
    while (i < list.length) {
      const m = NUMBERED.exec(list[i].name);
      let j = i + 1;
      if (m) {
        while (j < list.length) {
          const mj = NUMBERED.exec(list[j].name);
          if (!mj || mj[1] !== m[1] || list[j].cls !== list[i].cls || shape(list[j]) !== shape(list[i])
            || Number(mj[2]) !== Number(m[2]) + (j - i)) break;
          j++;
        }
      }
      if (m && j - i >= 3) for (let k = i; k < j; k++) if (children.get(list[k].name)?.length) out.add(list[k].name);
      i = j;
    }
  }
  return out;
}
