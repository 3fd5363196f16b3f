// A read-only stand-in for the anywidget model, built from the payload inlined in a standalone page.
// Detail requests are answered from the precomputed details; hook messages are refused.
import { base64ToBytes } from "./protocol.js";

export function createStaticModel(data) {
  const listeners = new Map();
  const emit = (event, ...args) => queueMicrotask(() => (listeners.get(event) || []).forEach((cb) => cb(...args)));
  const state = { summary: data.summary, readonly: true };
  return {
    get: (key) => state[key],
    set() {}, save_changes() {},
    on(event, cb) { if (!listeners.has(event)) listeners.set(event, []); listeners.get(event).push(cb); },
    off(event, cb) { listeners.set(event, (listeners.get(event) || []).filter((f) => f !== cb)); },
    send(msg) {
      if (msg.type === "detail") {
        const d = data.details?.[msg.target];
        if (d) return emit("msg:custom", { type: "detail", request_id: msg.request_id, target: msg.target, meta: d.meta }, d.buffers.map(base64ToBytes));
        return emit("msg:custom", { type: "status", request_id: msg.request_id, state: "error", text: `no detail for ${msg.target} in this page (${data.details_note || "not exported"})` });
      }
      emit("msg:custom", { type: "status", request_id: msg.request_id, state: "error", text: "read-only page: this needs a running kernel" });
    },
  };
}
