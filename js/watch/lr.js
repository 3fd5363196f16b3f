// The learning rates the watch recorded (statistic "lr": per layer, the LR of the param group holding its
// weight at that step's optimizer step; NaN where no optimizer stepped it), as a step's readout and the box above
// a kept Trace show them. Pages from a watch that did not record it say so. (A rise of one as an anomaly's lead is
// the kernel's: hookwidget/watch/leads.py.)
import { fmt } from "../shared/format.js";

/** Row r's learning rate(s) for reading: "learning rate 0.3", or grouped by value where param groups differ
 * ("learning rates 0.01 (fc1, fc2) · 0.1 (fc)"). */
export function lrText(store, r) {
  const k = store.meta.stats.indexOf("lr");
  if (k < 0) return "(learning rate: not recorded by the watch)";
  const groups = new Map();
  for (let l = 0; l < store.L; l++) {
    const v = store.value(r, l, k);
    if (Number.isNaN(v)) continue;
    if (!groups.has(v)) groups.set(v, []);
    groups.get(v).push(store.meta.layers[l]);
  }
  if (!groups.size) return "learning rate: no optimizer step";
  if (groups.size === 1) return `learning rate ${fmt([...groups.keys()][0])}`;
  return "learning rates " + [...groups].map(([v, names]) => `${fmt(v)} (${names.slice(0, 3).join(", ")}${names.length > 3 ? ", …" : ""})`).join(" · ");
}
