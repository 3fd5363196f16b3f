// The learning rates the watch recorded (statistic "lr": per layer, the LR of the param group holding its
// weight at that step's optimizer step; NaN where no optimizer stepped it). Two uses: the direct lead of an
// anomaly ("step 200: learning rate ×300"), found before any inferred one (leads.js), and a step's learning
// rate(s) in the readout and in the box above a kept Trace. Pages from a watch that did not record it say so.
import { fmt } from "../shared/format.js";

/** A rise of a layer's LR by at least this factor over its previous recorded value is a direct lead (a
 * scheduler's usual steps, warmup's small ones and every decay stay below it). */
export const LR_FACTOR = 5;

const fmtRatio = (x) => (x >= 100 ? String(Math.round(x)) : x.toPrecision(2));

/** Layer l's learning rate before row r: the latest recorded value in the `window` rows before it (NaN: none). */
function before(store, r, l, k, window) {
  for (let i = r - 1; i >= Math.max(0, r - window); i--) {
    const v = store.value(i, l, k);
    if (!Number.isNaN(v)) return v;
  }
  return NaN;
}

/** The layers whose learning rate rose ≥ LR_FACTOR at row r: [{layer, base, value, ratio}]. */
export function lrRises(store, r, window = 20) {
  const k = store.meta.stats.indexOf("lr");
  if (k < 0) return [];
  const out = [];
  for (let l = 0; l < store.L; l++) {
    const value = store.value(r, l, k), base = before(store, r, l, k, window);
    if (!(value > 0) || Number.isNaN(base)) continue;
    const ratio = base > 0 ? value / base : Infinity;
    if (ratio >= LR_FACTOR) out.push({ layer: l, base, value, ratio });
  }
  return out;
}

/** The direct lead of the anomaly at row `a`: the earliest row in the lookback where a learning rate rose
 * (lrRises), with the update ratios that moved with it; null where none did. `departure` (leads.js) tells
 * how a series stands against its window. */
export function lrLead(store, a, opt, departure) {
  for (let r = Math.max(0, a - opt.lookback); r <= a; r++) {
    const rises = lrRises(store, r, opt.window);
    if (!rises.length) continue;
    const names = rises.map((x) => store.meta.layers[x.layer]);
    const ratios = rises.map((x) => x.ratio).sort((x, y) => x - y), ratio = ratios[ratios.length >> 1];
    const same = rises.every((x) => x.base === rises[0].base && x.value === rises[0].value);
    const times = Number.isFinite(ratio) ? `×${fmtRatio(ratio)}` : "from 0";
    const values = same ? ` (${fmt(rises[0].base)} → ${fmt(rises[0].value)})` : "";
    const where = rises.length > 1 ? ` in ${rises.length} layers (${names.slice(0, 2).join(", ")}${rises.length > 2 ? ", …" : ""})` : ` of ${names[0]}`;
    let text = `step ${store.steps[r]}: learning rate ${times}${values}${where}`;
    const u = store.meta.stats.indexOf("update_ratio");
    if (u >= 0) {
      const moved = rises.map((x) => departure((i) => store.value(i, x.layer, u), r, opt)).filter((d) => d && Number.isFinite(d.ratio));
      if (moved.length) text += `, update ratio ‖ΔW‖/‖W‖ ×${fmtRatio(moved.map((d) => d.ratio).sort((x, y) => x - y)[moved.length >> 1])}`;
    }
    return { step: store.steps[r], row: r, stat: "lr", layers: names, ratio, base: rises[0].base, value: rises[0].value, lr: true, direct: true, text, window: opt.window };
  }
  return null;
}

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
