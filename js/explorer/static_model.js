// A read-only stand-in for the anywidget model, built from the payload inlined in a standalone page.
// Detail requests are answered from the precomputed details; hook messages are refused.
import { base64ToBytes } from "../shared/protocol.js";

export function createStaticModel(data) {
  const listeners = new Map();
  const emit = (event, ...args) => queueMicrotask(() => (listeners.get(event) || []).forEach((cb) => cb(...args)));
  const state = { summary: data.summary, diff: data.diff ?? null, readonly: true };
  return {
    get: (key) => state[key],
    set() {}, save_changes() {},
    on(event, cb) { if (!listeners.has(event)) listeners.set(event, []); listeners.get(event).push(cb); },
    off(event, cb) { listeners.set(event, (listeners.get(event) || []).filter((f) => f !== cb)); },
    send(msg) {
      if (msg.type === "detail") {
        const d = data.details?.[msg.target];
        if (d) return emit("msg:custom", { type: "detail", request_id: msg.request_id, target: msg.target, meta: d.meta }, d.buffers.map(base64ToBytes));
        const meta = nodeMeta(data.summary.graph, msg.target);
        if (meta) return emit("msg:custom", { type: "detail", request_id: msg.request_id, target: msg.target, meta }, []);
        return emit("msg:custom", { type: "status", request_id: msg.request_id, state: "error", text: `no detail for ${msg.target} in this page (${data.details_note || "not exported"})` });
      }
      if (msg.type === "shares") return emit("msg:custom", ...sharesReply(data.shares, msg));
      emit("msg:custom", { type: "status", request_id: msg.request_id, state: "error", text: "read-only page: this needs a running kernel" });
    },
  };
}

/** A graph node's detail from the summary alone (what the kernel's payload.detail sends, minus tensors). */
export function nodeMeta(graph, target) {
  const i = graph.id.indexOf(target);
  if (i < 0) return null;
  const next = [], prev = [];
  for (let j = 0; j < graph.edges.length; j += 2) {
    if (graph.edges[j] === i && next.length < 50) next.push(graph.id[graph.edges[j + 1]]);
    if (graph.edges[j + 1] === i && prev.length < 50) prev.push(graph.id[graph.edges[j]]);
  }
  return { kind: "node", target, name: graph.name[i], role: graph.role[i], module: graph.module[i], param: graph.param[i],
    shape: graph.shape[i], grad_norm: graph.grad_norm[i], next, prev, notes: [], tensors: {} };
}

/** The page's answer to a shares request, from what to_html inlined (views/payload/shares.py static_shares): the
 * whole model's bar and, where the page was small enough, each sample's strip; a layer's shares need the kernel. */
export function sharesReply(inlined, msg) {
  const error = (text) => [{ type: "status", request_id: msg.request_id, state: "error", text }];
  if (!inlined) return error("this page carries no shares (written by an older hookwidget)");
  if (inlined.error) return error(inlined.error);
  if (msg.layer) return error(`read-only page: the shares of one layer (${msg.layer}) need a running kernel; this page carries the whole model's`);
  const hit = msg.sample >= 0 ? inlined.strips?.[String(msg.sample)] : inlined.bar;
  if (!hit) {
    const meta = { ...inlined.bar.meta, sample: msg.sample, positions: null, positions_note: inlined.note || "not on this page", tokens: null, ids: null, tokens_note: null, token_layer: null };
    return [{ type: "shares", request_id: msg.request_id, layer: "", meta }, inlined.bar.buffers.map(base64ToBytes)];
  }
  return [{ type: "shares", request_id: msg.request_id, layer: "", meta: hit.meta }, hit.buffers.map(base64ToBytes)];
}
