// Entry of the standalone page written by Watch.to_html: the watch explorer on the inlined rows; a kept
// step opens in the trace explorer on a read-only model of its inlined Trace.
import { render as renderExplorer } from "../explorer/explorer.js";
import { h } from "../shared/dom.js";
import { base64ToBytes } from "../shared/protocol.js";
import { createStaticModel } from "../explorer/static_model.js";
import { createStore } from "./store.js";
import { createWatchView } from "./view.js";

/** A store filled from the page's data (the same "rows" message the kernel sends, with base64 buffers). */
export function storeFromData(data) {
  const store = createStore(data.meta);
  store.apply({ type: "rows", start: 0, count: data.steps.length, steps: data.steps, a_start: 0, anomalies: data.anomalies, nonfinite: data.nonfinite || [],
    kept: data.kept, dropped: data.dropped, total_steps: null, state: data.state }, [base64ToBytes(data.stats), base64ToBytes(data.step_stats)]);
  return store;
}

export function renderPage(data, el, nonce) {
  let cleanup = null;
  return createWatchView({
    store: storeFromData(data), el, nonce, readonly: true,
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
