// What a rerun changed: loss and per-parameter gradient norms before/after.
import { fmt, h } from "./dom.js";

export function createDiffView() {
  const el = h("div", { class: "hw-diff", "data-testid": "diff" });
  return {
    el,
    render(diff) {
      if (!diff) { el.replaceChildren(); return; }
      const rows = diff.params.map((p) => h("tr", { class: p.rel_change === 0 ? "" : "changed", "data-param": p.name },
        h("td", { text: p.name }), h("td", { text: fmt(p.before) }), h("td", { "data-testid": "after", text: fmt(p.after) }),
        h("td", { text: fmt(p.rel_change) })));
      el.replaceChildren(
        h("div", { class: "hw-panel-title", text: "last rerun" }),
        h("div", { "data-testid": "diff-loss", text: `loss ${fmt(diff.loss_before, 6)} → ${fmt(diff.loss_after, 6)}` }),
        h("table", { class: "hw-table" }, h("tr", {}, ...["parameter", "‖grad‖ before", "after", "rel. change"].map((t) => h("th", { text: t }))), ...rows));
    },
  };
}
