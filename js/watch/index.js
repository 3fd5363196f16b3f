// Entry of the watch widget's ES module. What the view holds of the run lives in one store per model (store.js:
// bounded, an overview in bins, the latest rows and the zoomed window), filled from the moment the model exists
// (initialize), so no message is lost before a view renders; every view draws that store.
// A kept step opens in the trace explorer: the kernel makes a HookWidget and names its model here.
import { render as renderExplorer } from "../explorer/explorer.js";
import { h } from "../shared/dom.js";
import * as P from "../shared/protocol.js";
import { createStore } from "./store.js";
import { createWatchView } from "./view.js";

// Keyed by the model's `meta` object: anywidget hands initialize and render different proxies of one model.
const live = new WeakMap();

/** The store of `model` and a request helper: created once, listening to the kernel's messages. */
export function liveOf(model) {
  const key = model.get("meta");
  let entry = live.get(key);
  if (entry) return entry;
  const store = createStore(key);
  const requests = P.createRequests(model);
  let syncing = false;
  const sync = () => { syncing = true; model.send(P.sync(store.have)); };
  model.on("msg:custom", (msg, buffers) => {
    if (!msg || typeof msg !== "object") return;
    if (msg.type === "rows") {
      const gap = store.apply(msg, buffers || []);
      if (!gap) syncing = false;
      else if (!syncing) sync();
    } else if (msg.type === "lod") {
      store.applyLod(msg, buffers || []);
    } else if (msg.type === "status") {
      requests.settle(msg, buffers);
    }
  });
  sync(); // everything recorded so far (answered as soon as the kernel is idle)
  // The zoomed steps at the resolution of the pixels (the kernel answers with a "lod" message); one at a time.
  const requestWindow = ({ start, stop, bins, stat }) => model.send({ type: "window", start, stop, bins, stat, request_id: P.newRequestId() });
  entry = { store, request: requests.request, requestWindow };
  live.set(key, entry);
  return entry;
}

function initialize({ model }) {
  liveOf(model);
}

function render({ model, el }) {
  const { store, request, requestWindow } = liveOf(model);
  let cleanup = null;
  async function mount(step, host) {
    const id = model.get("trace_model");
    if (!id || model.get("trace_step") !== step) return { ok: false, text: `the kernel did not open step ${step}` };
    let child;
    try { child = await model.widget_manager.get_model(id.replace(/^IPY_MODEL_/, "")); }
    catch (e) { return { ok: false, text: `the Trace of step ${step} is gone (${e.message}): click it again` }; }
    cleanup?.();
    const box = h("div", {});
    host.replaceChildren(h("div", { class: "hw-w-trace-title", text: `step ${step}: the kept Trace (to try hooks and reruns on this step, trace it with hw.trace)` }), box);
    cleanup = renderExplorer({ model: child, el: box });
    return { ok: true };
  }
  const waitTrace = (step) => new Promise((resolve) => {
    if (model.get("trace_step") === step && model.get("trace_model")) return resolve();
    const done = () => { model.off("change:trace_model", done); clearTimeout(timer); resolve(); };
    const timer = setTimeout(done, 10_000);
    model.on("change:trace_model", done);
  });
  const view = createWatchView({
    store, el, requestWindow,
    async openTrace(step, host) {
      const r = await request(P.open(step));
      if (!r.ok) return r;
      await waitTrace(step);
      return mount(step, host);
    },
  });
  const stateChanged = () => { store.state = model.get("state"); view.redraw(); };
  model.on("change:state", stateChanged);
  if (model.get("trace_model") && model.get("trace_step") >= 0) view.open(model.get("trace_step"));
  return () => { model.off("change:state", stateChanged); view.destroy(); cleanup?.(); };
}

export default { initialize, render };
