// Entry of the standalone page written by Watch.to_html: the watch explorer on the inlined level-of-detail data
// (views/watch_export.py: an overview of the whole run, full-resolution rows where they matter); a kept
// step opens in the trace explorer on a read-only model of its inlined Trace.
import { render as renderExplorer } from "../explorer/explorer.js";
import { h } from "../shared/dom.js";
import { base64ToBytes } from "../shared/protocol.js";
import { createStaticModel } from "../explorer/static_model.js";
import { createStore } from "./store.js";
import { fromBfloat16, levelFrom } from "./bins.js";
import { createWatchView } from "./view.js";

const b64 = (text, Ctor) => { const bytes = base64ToBytes(text); return new Ctor(bytes.buffer, bytes.byteOffset, bytes.byteLength / Ctor.BYTES_PER_ELEMENT); };

/** A store filled from the page's data: the overview (bfloat16 min/max/mean of each bin, float32 per-step
 * statistics), the full-resolution segments (float32), the anomalies, kept steps and non-finite stretches. */
export function storeFromData(data) {
  const store = createStore(data.meta);
  const { L, K } = store, o = data.overview;
  if (o && o.rows.length) store.overview = levelFrom({ P: L * K, K, size: o.size, r0: 0, first: o.first, lastStep: o.last_step, rows: o.rows,
    min: fromBfloat16(b64(o.min, Uint16Array)), max: fromBfloat16(b64(o.max, Uint16Array)), mean: fromBfloat16(b64(o.mean, Uint16Array)), step: b64(o.step, Float32Array) });
  for (const seg of data.segments || [])
    store.addSegment({ r0: seg.start, n: seg.steps.length, K, steps: seg.steps, stats: b64(seg.stats, Float32Array), step: b64(seg.step_stats, Float32Array) });
  store.have = store.n = data.n_rows;
  store.apply({ type: "rows", start: data.n_rows, count: 0, steps: [], a_start: 0, anomalies: data.anomalies, nonfinite: data.nonfinite || [],
    kept: data.kept, dropped: data.dropped, total_steps: null, state: data.state });
  return store;
}

export function renderPage(data, el, nonce) {
  let cleanup = null;
  return createWatchView({
    store: storeFromData(data), el, nonce, readonly: true, note: data.held || "",
    async openTrace(step, host) {
      const t = data.traces?.[String(step)];
      if (!t) return { ok: false, text: `step ${step}: its Trace is not in this page` };
      cleanup?.();
      const box = h("div", {});
      host.replaceChildren(h("div", { class: "hw-w-trace-title", text: `step ${step}: the kept Trace (read-only)` }), box);
      cleanup = renderExplorer({ model: createStaticModel(t), el: box, nonce });
      return { ok: true };
    },
  });
}

const nonce = document.currentScript?.nonce || "";
function start() {
  const node = document.getElementById("hw-data");
  if (!node) return;
  renderPage(JSON.parse(node.textContent), document.getElementById("hw-app"), nonce);
  requestAnimationFrame(() => { window.__hwReady = true; document.body.setAttribute("data-ready", "1"); });
}
if (typeof document !== "undefined") {
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
}
