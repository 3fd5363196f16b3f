// The widget protocol (hookwidget/views/payload_schema.json): messages the front-end sends, the one request
// helper that awaits their replies, and decoding of the kernel's replies. Tensors arrive as binary buffers described by {buffer, dtype, shape, true_shape}; a buffer may be
// a DataView into a larger ArrayBuffer, so byteOffset is always respected.

let counter = 0;
export const newRequestId = () => `r${Date.now().toString(36)}-${++counter}`;

export const detail = (target) => ({ type: "detail", target, request_id: newRequestId() });
export const addHook = (target, kind, params) => ({ type: "add_hook", target, kind, params, request_id: newRequestId() });
export const removeHook = (target, kind) => ({ type: "remove_hook", target, kind, request_id: newRequestId() });
export const shares = (layer, sample) => ({ type: "shares", layer, sample, request_id: newRequestId() }); // "" / -1: whole model / no sample
export const rerun = () => ({ type: "rerun", request_id: newRequestId() });
export const sync = (have) => ({ type: "sync", have, request_id: newRequestId() }); // the watch: rows from `have` on
export const open = (step) => ({ type: "open", step, request_id: newRequestId() }); // the watch: a kept step's Trace

/** One request, one awaited reply (anywidget's invoke pattern, keyed by the protocol's request_id).
 * `request(msg, {timeout, ...tags})` sends msg and resolves with {ok: true, msg, buffers} on its reply, or
 * {ok: false, text} on an error status, a send that throws, or `timeout` ms without a reply (0: wait).
 * The owner hands every kernel message to `settle(msg, buffers)`: it returns the request that message answered
 * (its tags, and `late` when it had timed out: its promise was already resolved), or null when the message
 * answers none (no such request_id, or a "running" status: progress, the reply is still to come).
 * `cancel(text)` answers every pending request with {ok: false, text} (the kernel is gone). */
export function createRequests(model, { noReply = "no reply from the kernel" } = {}) {
  const waiting = new Map(); // request_id -> {resolve, timer, late, ...tags}
  function request(msg, { timeout = 0, ...tags } = {}) {
    return new Promise((resolve) => {
      const req = { ...tags, resolve, timer: null, late: false };
      if (timeout) req.timer = setTimeout(() => { req.late = true; resolve({ ok: false, text: noReply }); }, timeout);
      waiting.set(msg.request_id, req);
      try { model.send(msg); }
      catch (e) { waiting.delete(msg.request_id); clearTimeout(req.timer); resolve({ ok: false, text: `could not reach the kernel: ${e.message}` }); }
    });
  }
  function settle(msg, buffers = []) {
    const req = waiting.get(msg.request_id);
    if (!req) return null;
    clearTimeout(req.timer); // the kernel is on it: a slow reply is still awaited
    if (msg.type === "status" && msg.state === "running") return null;
    waiting.delete(msg.request_id);
    if (!req.late) req.resolve(msg.type === "status" && msg.state === "error" ? { ok: false, text: msg.text } : { ok: true, msg, buffers });
    return req;
  }
  function cancel(text) {
    for (const [id, req] of waiting) { waiting.delete(id); clearTimeout(req.timer); if (!req.late) req.resolve({ ok: false, text }); }
  }
  return { request, settle, cancel };
}

const INCOMING = new Set(["detail", "status", "trace", "shares"]);

/** The kernel's message if it is one we know, else null (ignored, never evaluated). */
export function parseIncoming(msg) {
  if (!msg || typeof msg !== "object" || !INCOMING.has(msg.type)) return null;
  if (msg.type === "status" && !["running", "done", "error"].includes(msg.state)) return null;
  return msg;
}

const ARRAYS = { float32: Float32Array, float64: Float64Array, int32: Int32Array, int64: BigInt64Array, uint8: Uint8Array };

/** A typed array over `buf` (DataView, ArrayBuffer or typed array) for `info` = {dtype, shape}. */
export function decodeTensor(info, buf) {
  const Ctor = ARRAYS[info.dtype];
  if (!Ctor) throw new Error(`unsupported dtype ${info.dtype}`);
  let buffer, offset, length;
  if (buf instanceof ArrayBuffer) [buffer, offset, length] = [buf, 0, buf.byteLength];
  else [buffer, offset, length] = [buf.buffer, buf.byteOffset, buf.byteLength];
  const n = info.shape.reduce((a, b) => a * b, 1);
  if (n * Ctor.BYTES_PER_ELEMENT > length) throw new Error(`buffer of ${length} bytes too short for ${info.dtype} ${info.shape}`);
  if (offset % Ctor.BYTES_PER_ELEMENT !== 0) {
    // Unaligned view: copy the bytes so the typed array can be built.
    return new Ctor(buffer.slice(offset, offset + n * Ctor.BYTES_PER_ELEMENT));
  }
  return new Ctor(buffer, offset, n);
}

/** {key: {data, shape, true_shape, min, max, nonfinite}} from a detail reply's meta.tensors and buffers. */
export function decodeTensors(meta, buffers) {
  const out = {};
  for (const [key, info] of Object.entries(meta.tensors || {})) {
    const buf = buffers[info.buffer];
    if (!buf) continue;
    out[key] = { ...info, data: decodeTensor(info, buf) };
  }
  return out;
}

/** Bytes of a base64 string (the standalone page inlines buffers this way). */
export function base64ToBytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
