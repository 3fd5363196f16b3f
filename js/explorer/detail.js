// The detail panel: what one layer or graph node saw — shapes, a and δ heatmaps, W.grad from autograd
// beside the one rebuilt from (a, δ) with their max abs difference, per-sample norms, storage, health.
import { bars, heatmap, tensorView } from "./charts.js";
import { h } from "../shared/dom.js";
import { fmt, fmtCount, fmtShape } from "../shared/format.js";

export function createDetailPanel() {
  const body = h("div", { class: "hw-detail-body" }, h("div", { class: "hw-dim", text: "click a module or node to see its detail" }));
  const el = h("div", { class: "hw-detail", "data-testid": "detail" }, body);

  function show(nodes) { body.replaceChildren(...nodes.flat().filter(Boolean)); }

  return {
    el,
    clear() { show([h("div", { class: "hw-dim", text: "click a module or node to see its detail" })]); },
    loading(target) { show([h("div", { class: "hw-panel-title", text: target }), h("div", { class: "hw-dim", text: "loading…" })]); },
    error(target, text) { show([h("div", { class: "hw-panel-title", text: target }), h("div", { class: "hw-error", text })]); },
    render(meta, tensors, summary) { show(meta.kind === "layer" ? layerDetail(meta, tensors, summary) : nodeDetail(meta, tensors)); },
  };
}

function layerDetail(meta, t, summary) {
  const row = summary.modules.find((m) => m.name === meta.target);
  const sh = meta.shapes || {};
  const out = [
    h("div", { class: "hw-panel-title" }, h("span", { "data-testid": "detail-target", text: meta.target || "(root)" }), " ", h("span", { class: "hw-dim", text: meta.cls })),
    table([
      ["a (input)", shapeCell(sh.a), "shape-a"],
      ["δ (grad of output)", shapeCell(sh.delta), "shape-delta"],
      ["output", fmtShape(sh.output), "shape-output"],
      sh.weight ? ["weight", fmtShape(sh.weight), "shape-weight"] : null,
      ["calls", String(meta.calls), null],
      row ? ["parameters", row.params >= 1000 ? `${fmtCount(row.params)} (${fmt(row.params)})` : fmt(row.params), null] : null,
      row && row.grad_norm !== null ? ["‖grad‖₂ (own params)", fmt(row.grad_norm), "grad-norm"] : null,
      row && row.user_hooks && row.user_hooks.length ? ["your hooks (they act in every trace)", row.user_hooks.join("; "), "user-hooks"] : null,
    ]),
    flags(meta.flags),
    meta.unsupported ? h("div", { class: "hw-note hw-unsupported", "data-testid": "unsupported", text: meta.unsupported }) : null,
  ];
  if (t.a || t.delta) {
    out.push(h("div", { class: "hw-figs" }, t.a ? tensorView("a", t.a, { testid: "heat-a" }) : null, t.delta ? tensorView("δ", t.delta, { testid: "heat-delta" }) : null));
  }
  if (t.grad_autograd || t.grad_rebuilt) {
    const absmax = Math.max(...[t.grad_autograd, t.grad_rebuilt].filter(Boolean).map((x) => Math.max(Math.abs(+x.min || 0), Math.abs(+x.max || 0))));
    out.push(h("div", { class: "hw-section", text: "W.grad: autograd vs rebuilt from Σ δ ⊗ a" }));
    out.push(h("div", { class: "hw-figs" },
      t.grad_autograd ? heatmap("W.grad (autograd)", t.grad_autograd, { absmax, testid: "heat-grad-autograd" }) : null,
      t.grad_rebuilt ? heatmap(t.grad_rebuilt.stats ? "Σ δ⊗a (rebuilt)" : "Σ δ⊗a (block means from the factors)", t.grad_rebuilt, { absmax, testid: "heat-grad-rebuilt" }) : null,
      t.per_sample_grad0 ? heatmap("δ⊗a, sample 0", t.per_sample_grad0, { testid: "heat-per-sample" }) : null));
  }
  if (meta.max_abs_diff !== undefined) {
    out.push(h("div", { class: "hw-maxdiff" }, "max |W.grad − rebuilt| = ", h("b", { "data-testid": "maxdiff", "data-value": String(meta.max_abs_diff), text: fmt(meta.max_abs_diff) })));
  }
  if (meta.grad_check) out.push(gradCheck(meta.grad_check));
  if (t.per_sample_norms) out.push(bars("per-sample ‖grad‖₂", t.per_sample_norms, { testid: "per-sample-norms" }));
  if (meta.storage) {
    const st = meta.storage;
    out.push(h("div", { class: "hw-section", text: "storage (floats)" }), table([
      ["W.grad", fmt(st.weight_grad_floats), "storage-grad"],
      ["factors per token (d_in + d_out)", fmt(st.factor_floats_per_token), null],
      ["tokens", fmt(st.tokens), null],
      ["factors (all tokens)", fmt(st.factor_floats), "storage-factors"],
      ["per-token gradients", fmt(st.per_token_grad_floats), null],
    ]));
  }
  out.push(notes(meta.notes));
  return out;
}

/** A large weight's W.grad against Σ δ⊗a along random directions (not rebuilt whole): each direction's uᵀ W.grad v,
 * the difference and the tolerance it is held to, so the figure says what it was measured along. */
function gradCheck(c) {
  const of = c.layers.length > 1 ? ` (${c.layers.join(" + ")})` : "";
  return h("div", { class: "hw-maxdiff", "data-testid": "grad-check", "data-agree": String(c.agree) },
    `W.grad vs Σ δ⊗a${of} along ${c.directions} random directions u, v (a weight this large is not rebuilt whole): `,
    h("b", { text: c.agree ? "agree" : "differ" }),
    h("ul", { class: "hw-notes" }, ...c.values.map((v, k) => h("li", {
      text: `uᵀ W.grad v = ${fmt(v)}, |uᵀ(W.grad − Σ δ⊗a)v| = ${fmt(c.differences[k])} (tolerance ${fmt(c.tolerances[k])})`,
    }))));
}

function nodeDetail(meta, t) {
  return [
    h("div", { class: "hw-panel-title" }, h("span", { "data-testid": "detail-target", text: meta.target }), " ", h("span", { class: `hw-role role-${meta.role}`, text: meta.role })),
    table([
      ["op", meta.name, null],
      ["module", meta.module || "–", null],
      meta.param ? ["parameter", meta.param, "param"] : null,
      ["shape", fmtShape(meta.shape), "shape-node"],
      ["‖grad‖₂", fmt(meta.grad_norm), "grad-norm"],
      ["gradient goes to", meta.next.join(", ") || "– (leaf)", null],
      ["gradient comes from", meta.prev.join(", ") || "– (root)", null],
    ]),
    t.grad_autograd ? heatmap(".grad", t.grad_autograd, { testid: "heat-grad-autograd" }) : null,
    notes(meta.notes),
  ];
}

function shapeCell(info) {
  if (!info) return "not captured";
  const extra = `${info.kept ? "" : " (summary only)"}${info.nonfinite ? `, ${info.nonfinite} NaN/Inf` : ""}`;
  return `${fmtShape(info.shape)} ‖·‖₂ = ${fmt(info.norm)}${extra}`;
}

function table(rows) {
  return h("table", { class: "hw-table" }, ...rows.filter(Boolean).map(([k, v, id]) =>
    h("tr", {}, h("th", { text: k }), h("td", { "data-testid": id || undefined, text: v }))));
}

function flags(list) {
  if (!list || !list.length) return h("div", { class: "hw-health ok", "data-testid": "health", text: "health: ok" });
  return h("div", { class: "hw-health bad", "data-testid": "health", text: `health: ${list.join(", ")}` });
}

function notes(list) {
  if (!list || !list.length) return null;
  return h("ul", { class: "hw-notes", "data-testid": "layer-notes" }, ...list.map((n) => h("li", { text: n })));
}
