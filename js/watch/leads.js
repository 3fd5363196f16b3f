// The cause each anomaly points back to comes from the kernel: hookwidget/watch/leads.py works it out from the
// watch's rows (the earliest leading statistic out of its window; a recorded learning rate's rise named directly)
// and sends it as the fourth element of each anomaly, so Python, the logs, the saved watch and this view read the
// same lead. The view computes none: it maps each lead to its row, to zoom the step axis to it.

const num = (v) => (v === "inf" ? Infinity : v === "-inf" ? -Infinity : v === "nan" ? NaN : v);

/** The lead of each anomalous step: step -> {step, row, stat, layers, ratio, base, value, lr, text} (or null). */
export function leadsOf(store) {
  const key = `${store.n}/${store.anomalies.length}`;
  if (store._leads?.key === key) return store._leads.map;
  const map = new Map();
  for (const [step, , , lead] of store.anomalies) {
    if (map.has(step)) continue;
    map.set(step, lead ? { ...lead, ratio: num(lead.ratio), base: num(lead.base), value: num(lead.value), row: store.rowOf(lead.step) } : null);
  }
  store._leads = { key, map };
  return map;
}
