// The cause an anomaly points back to: for each anomalous step, the earliest step before it (or at it) where
// a leading statistic left its window: the update ratio ‖ΔW‖/‖W‖ (a learning-rate change shows as the update
// ratio jumping in most layers while their gradients stay normal), the gradient norm, the activation RMS.
// Computed from the store's rows (every row is on the front-end), so the live widget and the to_html page
// show the same leads. A statistic "leaves its window" when its log10 distance from the median of the
// WINDOW rows before it exceeds max(log10(FACTOR), SIGMAS robust standard deviations), or it turns ±Inf.
// Where the watch recorded the learning rate, a rise of it in the lookback is the lead, named directly
// ("step 200: learning rate ×300"), ahead of any inferred one (lr.js).
import { lrLead } from "./lr.js";

export const LEAD_STATS = ["update_ratio", "grad_norm", "a_rms"];
export const LEAD_LABELS = { lr: "learning rate", update_ratio: "update ratio ‖ΔW‖/‖W‖", grad_norm: "‖W.grad‖₂", a_rms: "activation RMS", step_grad_norm: "global ‖grad‖₂" };
export const DEFAULTS = { window: 20, minWindow: 5, lookback: 10, factor: 5, sigmas: 5 };

const log = (v) => (v > 0 ? Math.log10(v) : NaN);

function median(xs) {
  const s = [...xs].sort((a, b) => a - b), m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/** How series `get` at row r stands against the `window` rows before it: {ratio, base} when it left the window, else null. */
export function departure(get, r, opt = DEFAULTS) {
  const v = get(r);
  if (Number.isNaN(v)) return null; // not measured (no optimizer step, a layer not run)
  const hist = [];
  for (let i = Math.max(0, r - opt.window); i < r; i++) { const x = log(get(i)); if (Number.isFinite(x)) hist.push(x); }
  if (hist.length < opt.minWindow) return null;
  const med = median(hist), mad = median(hist.map((x) => Math.abs(x - med))) * 1.4826;
  const base = 10 ** med;
  if (v === Infinity) return { ratio: Infinity, base, value: v };
  const x = log(v);
  if (!Number.isFinite(x)) return null;
  const far = Math.max(Math.log10(opt.factor), opt.sigmas * mad);
  return Math.abs(x - med) > far ? { ratio: 10 ** (x - med), base, value: v } : null;
}

/** Every leading series of the store: {stat, layer (index, or -1 for the global gradient norm), get}. */
function seriesOf(store) {
  const out = [];
  for (const stat of LEAD_STATS) {
    const k = store.meta.stats.indexOf(stat);
    if (k >= 0) for (let l = 0; l < store.L; l++) out.push({ stat, layer: l, get: (r) => store.value(r, l, k) });
  }
  out.push({ stat: "step_grad_norm", layer: -1, get: (r) => store.stepValue(r, 1) });
  return out;
}

/** The lead of the anomaly at row `a`: {step, row, stat, layers, ratio, base, value, lr, text}, or null. */
export function leadOf(store, a, opt = DEFAULTS) {
  const direct = lrLead(store, a, opt, departure);
  if (direct) return direct;
  const series = seriesOf(store);
  for (let r = Math.max(0, a - opt.lookback); r <= a; r++) {
    const hits = [];
    for (const s of series) { const d = departure(s.get, r, opt); if (d) hits.push({ ...s, ...d }); }
    if (hits.length) return describe(store, r, hits, opt);
  }
  return null;
}

const RANK = { update_ratio: 0, grad_norm: 1, step_grad_norm: 2, a_rms: 3 };

function describe(store, r, hits, opt) {
  hits.sort((x, y) => RANK[x.stat] - RANK[y.stat] || Math.abs(Math.log10(y.ratio)) - Math.abs(Math.log10(x.ratio)));
  const top = hits[0], same = hits.filter((x) => x.stat === top.stat).sort((x, y) => x.layer - y.layer);
  const names = same.map((x) => (x.layer < 0 ? "" : store.meta.layers[x.layer]));
  // A learning-rate change: the update ratio jumps in most measured layers while their gradients stay in their window.
  let lr = false;
  if (top.stat === "update_ratio") {
    const k = store.meta.stats.indexOf("update_ratio"), g = store.meta.stats.indexOf("grad_norm");
    let measured = 0;
    for (let l = 0; l < store.L; l++) if (!Number.isNaN(store.value(r, l, k))) measured++;
    const gradsCalm = !hits.some((x) => x.stat === "grad_norm" || x.stat === "step_grad_norm") || g < 0;
    lr = same.length * 2 >= measured && gradsCalm;
  }
  const step = store.steps[r];
  const ratio = median(same.map((x) => x.ratio).filter(Number.isFinite)) || top.ratio;
  const where = top.layer < 0 ? "" : same.length > 1 ? ` in ${same.length} layers (${names.slice(0, 2).join(", ")}${same.length > 2 ? ", …" : ""})` : ` of ${names[0]}`;
  const times = Number.isFinite(ratio) ? `×${ratio >= 1 ? fmtRatio(ratio) : `1/${fmtRatio(1 / ratio)}`}` : "→ Inf";
  let text = `step ${step}: ${LEAD_LABELS[top.stat]} ${times}${where}`;
  if (lr) text += ", gradients in their window: the learning rate (or optimizer) changed";
  return { step, row: r, stat: top.stat, layers: names, ratio, base: top.base, value: top.value, lr, text, window: opt.window };
}

const fmtRatio = (x) => (x >= 100 ? String(Math.round(x)) : x.toPrecision(2));

/** The lead of each anomalous step: step -> lead (or null). Cached on the store's row count and anomaly count. */
export function leadsOf(store, opt = DEFAULTS) {
  const key = `${store.n}/${store.anomalies.length}`;
  if (store._leads?.key === key) return store._leads.map;
  const map = new Map();
  for (const [step] of store.anomalies) {
    if (map.has(step)) continue;
    const a = store.rowOf(step);
    map.set(step, a < 0 ? null : leadOf(store, a, opt));
  }
  store._leads = { key, map };
  return map;
}
