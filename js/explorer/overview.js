// The layer overview: one row per layer that holds parameters of its own — name, class, ‖δ‖₂ of its
// output gradient, ‖W.grad‖₂ of its own parameters, ‖a‖₂ of its input (first call), health flags.
// Every norm cell is coloured on ONE log scale shared by the three columns (blue small, pale typical,
// red large), so a vanishing or exploding layer stands out. Click a header to sort; click a row (or
// Enter on it) to select the layer, the same selection the tree makes. It sits in a tab beside the
// tree ("layers" / "tree"), open at first when the model has more than OPEN_ABOVE such layers.
import { cssOf, stopsMap } from "../shared/colour.js";
import { h } from "../shared/dom.js";
import { fmt } from "../shared/format.js";
import { createSortable } from "../shared/table.js";

export const OPEN_ABOVE = 8;

const COLS = [
  { key: "index", label: "#", title: "call order" },
  { key: "name", label: "layer", title: "module name (whole name in the row's tooltip)" },
  { key: "cls", label: "class", title: "module class" },
  { key: "delta", label: "‖δ‖₂", title: "norm of the gradient of the layer's output (first call)", norm: true, desc: true, cls: "hw-ov-num" },
  { key: "grad", label: "‖W.grad‖₂", title: "norm of the gradients of the layer's own parameters", norm: true, desc: true, cls: "hw-ov-num" },
  { key: "a", label: "‖a‖₂", title: "norm of the layer's input (first call)", norm: true, desc: true, cls: "hw-ov-num" },
  { key: "flags", label: "health", title: "vanishing / exploding / non-finite gradient (trace.health())" },
];

/** Layers with parameters of their own, in call order, with the numbers the table shows. */
export function layerRows(summary) {
  const mods = summary?.modules || [];
  const hasChild = new Set(mods.map((m) => m.parent));
  const own = (m) => (Array.isArray(m.own_params) ? m.own_params.length > 0 : m.params > 0 && !hasChild.has(m.name));
  return mods.filter(own).map((m, index) => ({
    index, name: m.name, cls: m.cls, flags: m.flags || [],
    delta: m.delta ? m.delta.norm : null, grad: m.grad_norm ?? null,
    a: !m.a ? null : isIndex(m.a.dtype) ? INDEX : m.a.norm,
  }));
}

// An integer input (an Embedding's token ids) has a norm, but not one to compare with activations.
const INDEX = { index: true };
const isIndex = (dtype) => typeof dtype === "string" && /^u?int|^bool/.test(dtype);
const isNum = (v) => typeof v === "number" && Number.isFinite(v);

/** The shared log scale: log10 range of every finite positive norm, at least 4 decades around the median. */
export function logScale(rows) {
  const logs = rows.flatMap((r) => [r.delta, r.grad, r.a]).filter((v) => isNum(v) && v > 0).map(Math.log10).sort((x, y) => x - y);
  if (!logs.length) return null;
  const med = logs[Math.floor(logs.length / 2)];
  return { lo: Math.min(logs[0], med - 2), hi: Math.max(logs.at(-1), med + 2) };
}

/** Position of a norm on the scale in [0, 1] (0 for an exact zero); null when not a finite number. */
export function scalePos(v, scale) {
  if (!isNum(v) || !scale) return null;
  if (v <= 0) return 0;
  return Math.min(1, Math.max(0, (Math.log10(v) - scale.lo) / (scale.hi - scale.lo)));
}

/** Blue → pale → red, linear in RGB on each half: the red − blue difference grows with t. */
const BLUE_RED = stopsMap([[49, 99, 206], [240, 240, 240], [214, 39, 40]]);
export const scaleColour = (t) => cssOf(BLUE_RED(t));

const sortValue = (v) => (v === INDEX ? null : v === "inf" || v === "nan" ? Infinity : v === "-inf" ? -Infinity : v ?? null);
/** What a column sorts by: names and classes as text, health flags as one string, norms as numbers (null last). */
function valueOf(r, key) {
  if (key === "flags") return r.flags.length ? r.flags.join(" ") : "";
  return key === "name" || key === "cls" || key === "index" ? r[key] : sortValue(r[key]);
}

export function createOverview({ onSelect, onClear }) {
  const body = h("div", { class: "hw-ov-body" });
  const el = h("div", { class: "hw-overview", "data-testid": "overview" }, body);
  let rows = [];
  let scale = null;
  const table = createSortable({
    cols: COLS.map((c) => ({ ...c, title: `${c.title} — click to sort` })), initial: { key: "index", desc: false },
    attr: "data-layer-sort", valueOf, tie: (p, q) => p.index - q.index, onSort: draw,
  });
  let selected = null;
  let trs = new Map();

  function cell(r, key) {
    const v = r[key];
    if (v === INDEX) return h("td", { class: "hw-ov-norm hw-dim", "data-col": key, title: "the input is integer indices: its norm is not on this scale", text: "ids" });
    const td = h("td", { class: "hw-ov-norm", "data-col": key, text: fmt(v) });
    const t = scalePos(v, scale);
    if (typeof v === "string") { td.classList.add("nonfinite"); td.title = `${v}: not finite`; }
    else if (t !== null) {
      td.setAttribute("data-t", t.toFixed(4));
      td.style.background = scaleColour(t); // CSSOM, not a style attribute (CSP)
      td.style.color = Math.abs(t - 0.5) > 0.32 ? "#fff" : "#111827";
    }
    return td;
  }

  function draw() {
    if (!rows.length) { body.replaceChildren(h("div", { class: "hw-dim", text: "no layer holds parameters of its own" })); trs = new Map(); return; }
    const head = table.head(body);
    trs = new Map();
    const bodyRows = table.sorted(rows).map((r) => {
      const tr = h("tr", { class: "hw-ov-row", "data-layer-row": r.name, tabindex: "-1", title: `${r.name || "(root)"} · ${r.cls}`,
        onclick: () => onSelect({ kind: "module", target: r.name }) },
      h("td", { class: "hw-dim", "data-col": "index", text: String(r.index + 1) }),
      h("td", { class: "hw-ov-name", "data-col": "name" }, h("span", { class: "hw-ov-clip", dir: "rtl" }, h("bdi", { dir: "ltr", text: r.name || "(root)" }))),
      h("td", { class: "hw-ov-cls", "data-col": "cls", text: r.cls }),
      cell(r, "delta"), cell(r, "grad"), cell(r, "a"),
      h("td", { class: r.flags.length ? "hw-flag" : "hw-dim", "data-col": "flags", text: r.flags.length ? r.flags.join(" ") : "ok" }));
      trs.set(r.name, tr);
      return tr;
    });
    const first = bodyRows[0];
    if (first) first.setAttribute("tabindex", "0");
    body.replaceChildren(
      legend(),
      h("table", { class: "hw-table hw-ov-table", role: "grid", "aria-label": "layers" }, h("thead", {}, head), h("tbody", {}, ...bodyRows)));
    mark();
  }

  function legend() {
    if (!scale) return h("div", { class: "hw-dim", text: "no finite norms captured" });
    const bar = h("span", { class: "hw-ov-bar" });
    for (let i = 0; i <= 8; i++) { const s = h("span", { class: "hw-ov-step" }); s.style.background = scaleColour(i / 8); bar.append(s); }
    return h("div", { class: "hw-ov-legend hw-dim", "data-testid": "overview-legend", title: "one log scale for the three norm columns" },
      `${rows.length} layers with parameters · log scale `, h("span", { text: fmt(10 ** scale.lo, 2) }), bar, h("span", { text: fmt(10 ** scale.hi, 2) }));
  }

  function mark() {
    for (const [name, tr] of trs) {
      const on = selected?.kind === "module" && selected.target === name;
      tr.classList.toggle("selected", on);
      tr.setAttribute("aria-selected", on ? "true" : "false");
      if (on && !el.closest("[hidden]")) tr.scrollIntoView?.({ block: "nearest" });
    }
  }

  body.addEventListener("keydown", (e) => {
    const tr = e.target.closest?.("tr[data-layer-row]");
    if (!tr) return;
    const list = [...trs.values()];
    const i = list.indexOf(tr);
    const move = (j) => { const r = list[Math.max(0, Math.min(list.length - 1, j))]; r?.focus(); r?.scrollIntoView?.({ block: "nearest" }); e.preventDefault(); };
    if (e.key === "ArrowDown") move(i + 1);
    else if (e.key === "ArrowUp") move(i - 1);
    else if (e.key === "Home") move(0);
    else if (e.key === "End") move(list.length - 1);
    else if (e.key === "Enter") { onSelect({ kind: "module", target: tr.getAttribute("data-layer-row") }); e.preventDefault(); }
    else if (e.key === "Escape") { onClear?.(); e.preventDefault(); }
  });

  return {
    el,
    get count() { return rows.length; },
    setSummary(summary) { rows = layerRows(summary); scale = logScale(rows); draw(); },
    select(sel) { selected = sel; mark(); },
  };
}

/** The left column: tabs "layers" / "tree" over the overview and the module tree. */
export function createLeftPane(treeEl, overview) {
  let tab = null; // null until the first summary decides; then the user's choice
  const btn = (key, label) => h("button", { type: "button", class: "hw-tab", role: "tab", "data-tab": key, text: label, onclick: () => show(key) });
  const bLayers = btn("layers", "layers"), bTree = btn("tree", "tree");
  const el = h("div", { class: "hw-left" }, h("div", { class: "hw-tabs", role: "tablist" }, bLayers, bTree), overview.el, treeEl);

  function show(key) {
    tab = key;
    overview.el.hidden = key !== "layers";
    treeEl.hidden = key !== "tree";
    el.classList.toggle("layers", key === "layers");
    for (const [b, k] of [[bLayers, "layers"], [bTree, "tree"]]) { b.setAttribute("aria-selected", String(k === key)); b.classList.toggle("on", k === key); }
    bLayers.textContent = `layers (${overview.count})`;
  }

  return {
    el,
    show,
    get tab() { return tab; },
    /** After overview.setSummary: open the overview at first for a deep model, keep the user's tab after. */
    update() { show(tab ?? (overview.count > OPEN_ABOVE ? "layers" : "tree")); },
  };
}
