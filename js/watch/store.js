// The rows of a watch on the front-end: steps × layers × statistics (float64), the per-step loss and
// gradient norm, anomalies and kept steps. Filled from the kernel's "rows" messages (or a standalone
// page's inlined data), by row index, so a message that arrives out of order or after a gap is kept;
// a gap is reported so the caller can ask the kernel for the rows it missed (a "sync" message).
import { decodeTensor } from "../shared/protocol.js";

export function createStore(meta) {
  const L = meta.layers.length, K = meta.stats.length, P = L * K;
  let cap = 0, data = new Float64Array(0), perStep = new Float64Array(0), present = new Uint8Array(0);
  const steps = [];
  const listeners = new Set();
  const store = {
    meta, L, K, n: 0, have: 0, steps, anomalies: [], kept: [], dropped: 0, totalSteps: null, state: "open",
    /** Onset step of each non-finite stretch -> the non-finite steps counted after it (Python's w.nonfinite). */
    nonfinite: new Map(),
    /** Statistic k of layer l at row r (NaN where not received). */
    value: (r, l, k) => (present[r] ? data[(r * L + l) * K + k] : NaN),
    /** Per-step statistic j (0 loss, 1 global gradient norm) at row r. */
    stepValue: (r, j) => (present[r] ? perStep[r * 2 + j] : NaN),
    received: (r) => present[r] === 1,
    subscribe(fn) { listeners.add(fn); return () => listeners.delete(fn); },
    /** Apply a rows message; returns true when rows or anomalies before it are missing (ask for a sync). */
    apply(msg, buffers = []) {
      const start = msg.start | 0, count = msg.count | 0;
      let gap = start > store.have;
      if (count > 0) {
        const s = decodeTensor({ dtype: "float64", shape: [count * P] }, buffers[0]);
        const t = decodeTensor({ dtype: "float64", shape: [count * 2] }, buffers[1]);
        grow(start + count);
        data.set(s, start * P);
        perStep.set(t, start * 2);
        for (let i = 0; i < count; i++) { present[start + i] = 1; steps[start + i] = msg.steps[i]; }
        store.n = Math.max(store.n, start + count);
        while (store.have < store.n && present[store.have]) store.have++;
      }
      const a0 = msg.a_start | 0, list = Array.isArray(msg.anomalies) ? msg.anomalies : [];
      if (a0 <= store.anomalies.length) store.anomalies.splice(a0, store.anomalies.length - a0, ...list);
      else gap = true;
      if (Array.isArray(msg.nonfinite)) store.nonfinite = new Map(msg.nonfinite.map(([k, v]) => [k, v]));
      if (Array.isArray(msg.kept)) store.kept = msg.kept;
      if (typeof msg.dropped === "number") store.dropped = msg.dropped;
      if (msg.total_steps !== undefined) store.totalSteps = msg.total_steps;
      if (msg.state) store.state = msg.state;
      for (const fn of listeners) fn(store);
      return gap;
    },
    /** Row index of step `step` (or -1). */
    rowOf(step) { return steps.indexOf(step); },
    /** Anomalies by step: step -> [[where, reason], ...]. */
    anomalyMap() {
      const m = new Map();
      for (const [step, where, reason] of store.anomalies) {
        if (!m.has(step)) m.set(step, []);
        m.get(step).push([where, reason]);
      }
      return m;
    },
  };
  function grow(rows) {
    if (rows <= cap) return;
    const next = Math.max(rows, cap * 2, 64);
    const d = new Float64Array(next * P); d.fill(NaN); d.set(data);
    const p = new Float64Array(next * 2); p.fill(NaN); p.set(perStep);
    const q = new Uint8Array(next); q.set(present);
    [data, perStep, present, cap] = [d, p, q, next];
  }
  return store;
}
