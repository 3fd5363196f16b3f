// What a rerun changed, against the hook-free run (the session's baseline) unless said otherwise:
// loss, and per parameter ‖grad‖₂ before / after, its impact (‖g₁−g₀‖₂ over the model's gradient scale:
// how much the change matters), relative change ‖g₁−g₀‖₂/‖g₀‖₂ ("new" where g₀ = 0) and cosine.
// Rows are ranked by impact (a gradient that appeared first); a change below the gradient's float precision
// is marked "noise", ranked last, not coloured as changed, and its cosine is not shown (its direction is
// rounding). Click a column header to sort; parameters of hooked modules are marked.
import { h } from "../shared/dom.js";
import { fmt } from "../shared/format.js";
import { createSortable } from "../shared/table.js";

const COLS = [
  { key: "name", label: "parameter", title: "qualified parameter name; ⚓ = a hook sits on its module" },
  { key: "impact", label: "impact", title: "‖g₁−g₀‖₂ / the model's gradient scale (‖all grads‖₂): how much the change matters; “noise”: below the gradient's float precision", desc: true },
  { key: "before", label: "‖g₀‖₂", title: "gradient norm in the compared run (hook-free baseline by default)", desc: true },
  { key: "after", label: "‖g₁‖₂", title: "gradient norm in this rerun", desc: true },
  { key: "rel_change", label: "‖g₁−g₀‖₂ / ‖g₀‖₂", title: "relative change of the gradient; “new” where g₀ = 0", desc: true },
  { key: "cosine", label: "cosine", title: "cos(g₀, g₁): 1 = same direction; – where a gradient is zero or at rounding level", desc: true },
];

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
const sortValue = (v) => (v === "new" || v === "inf" ? Infinity : v === "-inf" ? -Infinity : v === "nan" || v === null || v === undefined ? -Infinity : v);

/** The model's gradient scale: the diff's own, else the larger of ‖all grads‖₂ before and after. */
export function gradScale(diff) {
  if (num(diff?.grad_scale)) return diff.grad_scale;
  const total = (key) => Math.sqrt((diff?.params || []).reduce((s, p) => s + (num(p[key]) ?? 0) ** 2, 0));
  return Math.max(total("before"), total("after")) || null;
}

/** A row's impact (‖g₁−g₀‖₂ over the scale); from its relative change where an older kernel sent no `change`. */
export function impactOf(p, scale) {
  if (num(p.impact) !== null) return p.impact;
  const change = num(p.change) ?? (p.rel_change === "new" ? num(p.after) : num(p.rel_change) !== null && num(p.before) !== null ? p.rel_change * p.before : null);
  return change !== null && scale ? change / scale : null;
}

/** What the ranking sorts by, largest first: a gradient that appeared (∞), impact, exact zero; noise (−1) and unknown (null) last. */
export function rankValue(p, scale) {
  if (p.noise) return -1;
  if (p.rel_change === "new") return Infinity;
  return impactOf(p, scale);
}

/** The rows in rank order (what the table shows first). */
export function rankRows(diff) {
  const scale = gradScale(diff);
  const at = new Map((diff?.params || []).map((p, i) => [p, i]));
  return [...(diff?.params || [])].sort((p, q) => {
    const x = rankValue(p, scale), y = rankValue(q, scale);
    if (x === null || y === null) return x === y ? at.get(p) - at.get(q) : x === null ? 1 : -1;
    return y - x || at.get(p) - at.get(q);
  });
}

/** The line that says the two runs had different weights (analysis/diff.py's weights_line says the same). */
export function weightsLine(names) {
  const few = names.slice(0, 3).join(", ") + (names.length > 3 ? ` and ${names.length - 3} more` : "");
  return `weights differ: ${few} held other values in the two runs (two model instances, or the model changed between them), so their gradients differ for that reason too, not only by a hook`;
}

export function createDiffView() {
  const el = h("div", { class: "hw-diff", "data-testid": "diff" });
  let diff = null;
  let scale = null;
  const table = createSortable({ cols: COLS, initial: { key: "impact", desc: true }, onSort: draw,
    valueOf: (p, key) => (key === "name" ? p.name : key === "impact" ? rankValue(p, scale) : sortValue(p[key])) });

  function draw() {
    if (!diff) { el.replaceChildren(); return; }
    scale = gradScale(diff);
    const rows = table.sorted(diff.params); // by impact: rankRows's order
    const head = table.head(el);
    const body = rows.map((p) => {
      const moved = p.rel_change !== 0 && !p.noise;
      const impact = impactOf(p, scale);
      return h("tr", { class: (moved ? "changed" : "") + (p.noise ? "hw-noise" : "") + (p.hooked ? " hooked" : ""), "data-param": p.name },
        h("td", { text: (p.hooked ? "⚓ " : "") + p.name, title: p.hooked ? "a hook sits on this parameter's module" : undefined }),
        p.noise
          ? h("td", { "data-testid": "impact", class: "hw-dim", text: "noise", title: `‖g₁−g₀‖₂ = ${fmt(p.change)}: below this gradient's float precision (rounding, not a change)` })
          : h("td", { "data-testid": "impact", text: impact === null ? "–" : fmt(impact, 3) }),
        h("td", { text: fmt(p.before) }), h("td", { "data-testid": "after", text: fmt(p.after) }),
        h("td", { "data-testid": "rel-change", text: fmt(p.rel_change) }),
        h("td", { "data-testid": "cosine", text: p.noise ? "–" : fmt(p.cosine), title: p.noise ? "not shown: the gradient is at rounding level, its direction means nothing" : undefined }));
    });
    const against = diff.against === "previous" ? "the previous run" : "the hook-free run";
    el.replaceChildren(
      h("div", { class: "hw-panel-title", text: `last rerun, compared with ${against}` }),
      ...(diff.weights_differ?.length ? [h("div", { class: "hw-banner-main", "data-testid": "weights-differ", text: weightsLine(diff.weights_differ) })] : []),
      h("div", { "data-testid": "diff-loss", text: `loss ${fmt(diff.loss_before)} → ${fmt(diff.loss_after)}` + (diff.hooks?.length ? ` · hooks on: ${diff.hooks.join(", ")}` : "")
        + (scale ? ` · ranked by impact: ‖g₁−g₀‖₂ / ${fmt(scale)} (the model's ‖grad‖₂)` : "") }),
      h("table", { class: "hw-table hw-diff-table" }, head, ...body));
  }

  return { el, render(d) { diff = d; draw(); } };
}
