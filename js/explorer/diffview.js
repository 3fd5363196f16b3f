// What a rerun changed, against the hook-free run (the session's baseline) unless said otherwise:
// loss, and per parameter ‖grad‖₂ before / after, relative change ‖g₁−g₀‖₂/‖g₀‖₂ ("new" where
// g₀ = 0) and cosine. Click a column header to sort; parameters of hooked modules are marked.
import { h } from "../shared/dom.js";
import { fmt } from "../shared/format.js";
import { createSortable } from "../shared/table.js";

const COLS = [
  { key: "name", label: "parameter", title: "qualified parameter name; ⚓ = a hook sits on its module" },
  { key: "before", label: "‖g₀‖₂", title: "gradient norm in the compared run (hook-free baseline by default)", desc: true },
  { key: "after", label: "‖g₁‖₂", title: "gradient norm in this rerun", desc: true },
  { key: "rel_change", label: "‖g₁−g₀‖₂ / ‖g₀‖₂", title: "relative change of the gradient; “new” where g₀ = 0", desc: true },
  { key: "cosine", label: "cosine", title: "cos(g₀, g₁): 1 = same direction", desc: true },
];

const sortValue = (v) => (v === "new" || v === "inf" ? Infinity : v === "-inf" ? -Infinity : v === "nan" || v === null || v === undefined ? -Infinity : v);

export function createDiffView() {
  const el = h("div", { class: "hw-diff", "data-testid": "diff" });
  let diff = null;
  const table = createSortable({ cols: COLS, initial: { key: "rel_change", desc: true }, onSort: draw,
    valueOf: (p, key) => (key === "name" ? p.name : sortValue(p[key])) });

  function draw() {
    if (!diff) { el.replaceChildren(); return; }
    const rows = table.sorted(diff.params);
    const head = table.head(el);
    const body = rows.map((p) => h("tr", { class: (p.rel_change === 0 ? "" : "changed") + (p.hooked ? " hooked" : ""), "data-param": p.name },
      h("td", { text: (p.hooked ? "⚓ " : "") + p.name, title: p.hooked ? "a hook sits on this parameter's module" : undefined }),
      h("td", { text: fmt(p.before) }), h("td", { "data-testid": "after", text: fmt(p.after) }),
      h("td", { "data-testid": "rel-change", text: fmt(p.rel_change) }), h("td", { "data-testid": "cosine", text: fmt(p.cosine) })));
    const against = diff.against === "previous" ? "the previous run" : "the hook-free run";
    el.replaceChildren(
      h("div", { class: "hw-panel-title", text: `last rerun, compared with ${against}` }),
      h("div", { "data-testid": "diff-loss", text: `loss ${fmt(diff.loss_before)} → ${fmt(diff.loss_after)}` + (diff.hooks?.length ? ` · hooks on: ${diff.hooks.join(", ")}` : "") }),
      h("table", { class: "hw-table hw-diff-table" }, head, ...body));
  }

  return { el, render(d) { diff = d; draw(); } };
}
