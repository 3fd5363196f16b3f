// Small pieces the watch view's parts share: the statistics' labels, an element maker that sets styles through
// the CSSOM (a standalone page's strict CSP refuses style attributes), an anomaly's colour.
import { h as hh } from "../shared/dom.js";

export const STAT_LABELS = {
  grad_norm: "‖W.grad‖₂", delta_norm: "‖δ‖₂ (output gradient)", delta_max: "max |δ|", a_rms: "RMS of the input a",
  a_zero_frac: "fraction of a that is 0", a_nonfinite: "NaN/Inf entries of a", weight_norm: "‖W‖₂",
  update_ratio: "update ratio ‖ΔW‖/‖W‖", delta_nan: "NaN entries of δ", delta_inf: "Inf entries of δ",
  grad_nan: "NaN entries of W.grad", grad_inf: "Inf entries of W.grad", lr: "learning rate of its param group",
};

/** dom.js's h, with `style` set through the CSSOM. */
export function h(tag, attrs = {}, ...children) {
  const { style, ...rest } = attrs || {};
  const node = hh(tag, rest, ...children);
  for (const part of (style || "").split(";")) {
    const i = part.indexOf(":");
    if (i > 0) node.style.setProperty(part.slice(0, i).trim(), part.slice(i + 1).trim());
  }
  return node;
}

export const anomalyColour = (reason) => (/non-finite|nan|inf/i.test(reason) ? "#dc2626" : /spike/i.test(reason) ? "#ea580c" : "#2563eb");
