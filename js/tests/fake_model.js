// A fake anywidget model and the fixtures the tests play the kernel with: every message and summary here
// follows hookwidget/views/payload_schema.json (schema.test.js checks them).
import { render } from "../explorer/explorer.js";

/** A fake anywidget model: get/on/off/send like the real one, plus emit() to play the kernel. */
export function fakeModel(state) {
  const listeners = new Map();
  const sent = [];
  return {
    sent,
    get: (k) => state[k],
    set: (k, v) => { state[k] = v; },
    on(ev, cb) { if (!listeners.has(ev)) listeners.set(ev, []); listeners.get(ev).push(cb); },
    off(ev, cb) { listeners.set(ev, (listeners.get(ev) || []).filter((f) => f !== cb)); },
    send(msg) { sent.push(msg); },
    emit(ev, ...args) { for (const cb of listeners.get(ev) || []) cb(...args); },
    change(k, v) { state[k] = v; this.emit(`change:${k}`); },
  };
}

/** What the module tree says of a tensor the capture kept (payload_schema.json, tensor_summary). */
const seen = (shape, norm = 1) => ({ shape, dtype: "float32", kept: true, norm, nonfinite: 0 });

/** A module row with every key the kernel sends (payload_schema.json, module_row). */
const moduleRow = (row) => ({ calls: 1, output_shape: row.delta?.shape ?? null, supports: false, flags: [], user_hooks: [], ...row });

/** Summary of seed 003's MLP as the kernel sends it (fc1 -> relu -> fc2, loss ops outside modules). */
export function seedSummary(extraModules = []) {
  const nodes = [
    ["MulBackward0#0", "root", "", ""], ["SumBackward0#0", "op", "", ""], ["MmBackward0#0", "op", "fc2", ""],
    ["AccumulateGrad#0", "param", "fc2", "fc2.weight"], ["ReluBackward0#0", "op", "MLP", ""],
    ["MmBackward0#1", "op", "fc1", ""], ["AccumulateGrad#1", "param", "fc1", "fc1.weight"], ["input#0", "input", "fc1", ""],
  ];
  const edges = [0, 1, 1, 2, 2, 3, 2, 4, 4, 5, 5, 6, 5, 7];
  return {
    graph: { id: nodes.map((n) => n[0]), name: nodes.map((n) => n[0].split("#")[0]), role: nodes.map((n) => n[1]), module: nodes.map((n) => n[2]),
      param: nodes.map((n) => n[3]), shape: nodes.map(() => [2, 3]), grad_norm: nodes.map((_, i) => i + 0.5), edges },
    modules: [
      moduleRow({ name: "MLP", cls: "MLP", parent: null, params: 18, own_params: [], a: seen([5, 6, 4]), delta: seen([5, 6, 2]), grad_norm: null }),
      moduleRow({ name: "fc1", cls: "Linear", parent: "MLP", params: 12, own_params: ["fc1.weight"], a: seen([5, 6, 4]), delta: seen([5, 6, 3]), grad_norm: 1, supports: true }),
      moduleRow({ name: "fc2", cls: "Linear", parent: "MLP", params: 6, own_params: ["fc2.weight"], a: seen([5, 6, 3]), delta: seen([5, 6, 2]), grad_norm: 2, supports: true }),
      ...extraModules,
    ],
    params: { "fc1.weight": 1, "fc2.weight": 2 }, loss: 1.5, notes: [], note_ids: [], has_grads: true, hooks: [],
    kinds: [
      { name: "grad_scale", doc: "multiply", attach: "grad", python_only: false, params: [{ name: "factor", type: "float", default: null }] },
      { name: "grad_zero", doc: "zeros", attach: "grad", python_only: false, params: [] },
      { name: "out_zero", doc: "zero output", attach: "out", python_only: false, params: [] },
      { name: "callable", doc: "fn", attach: "grad", python_only: true, params: [{ name: "fn", type: "Callable", default: null }] },
    ],
    health: {},
  };
}

/** A picture's description as the kernel sends it (payload_schema.json, picture). */
function picture(shape, true_shape, buffer, min, max) {
  const numel = true_shape.reduce((a, b) => a * b, 1);
  return { dtype: "float32", shape, true_shape, layout: "matrix", min, max, nonfinite: 0, buffer,
    stats: { numel, min, max, mean: 0, std: 1, norm: 1, nan: 0, inf: 0 } };
}

/** The kernel's detail reply for a Linear layer of seed 003: [message, buffers]. */
export function detailReply(target, request_id) {
  const meta = {
    kind: "layer", target, cls: "Linear", calls: 1, flags: [], notes: [], max_abs_diff: 1.5e-7,
    shapes: { a: { shape: [5, 6, 4], dtype: "float32", norm: 1, kept: true, nonfinite: 0 }, delta: { shape: [5, 6, 3], dtype: "float32", norm: 1, kept: true, nonfinite: 0 }, output: [5, 6, 3], weight: [3, 4] },
    storage: { weight_grad_floats: 12, factor_floats_per_token: 7, tokens: 30, factor_floats: 210, per_token_grad_floats: 360 },
    tensors: { a: picture([2, 2], [5, 6, 4], 0, -1, 1), per_sample_norms: picture([3], [3], 1, 1, 3) },
  };
  const big = new Float32Array([0, 1, -1, 0.5, 0.25, 1, 2, 3]);
  // Buffers as anywidget hands them: DataViews, here into one shared ArrayBuffer.
  return [{ type: "detail", request_id, target, meta }, [new DataView(big.buffer, 0, 16), new DataView(big.buffer, 20, 12)]];
}

/** The kernel's reply to a rerun with a grad_zero on fc1: what changed. */
export function traceReply(request_id) {
  return { type: "trace", request_id, seconds: 0.01, diff: {
    against: "baseline", hooks: ["fc1"], loss_before: 1.5, loss_after: 1.2345678901234567,
    params: [{ name: "fc1.weight", before: 8.28, after: 0, rel_change: 1, cosine: null, hooked: true },
      { name: "fc2.weight", before: 0, after: 2, rel_change: "new", cosine: null, hooked: false },
      { name: "fc2.bias", before: 1, after: 1, rel_change: 0, cosine: 1, hooked: false }],
    layers: {}, changed_nodes: ["MmBackward0#1"], changed_modules: ["fc1"] } };
}

/** A watch of three layers (one named with markup) and two statistics. */
export const WATCH_META = { layers: ["fc1", '<img src=x onerror="window.__pwned=1">', "fc2"], stats: ["grad_norm", "delta_norm"], step_stats: ["loss", "grad_norm"], every: 1 };

/** A rows message as the kernel sends it: rows [start, start + count), value = 1000 r + 10 l + k. */
export function rows(start, count, extra = {}) {
  const L = WATCH_META.layers.length, K = WATCH_META.stats.length;
  const s = new Float64Array(count * L * K), t = new Float64Array(count * 2);
  for (let i = 0; i < count; i++) {
    for (let l = 0; l < L; l++) for (let k = 0; k < K; k++) s[(i * L + l) * K + k] = 1000 * (start + i) + 10 * l + k;
    t[i * 2] = 1 / (start + i + 1);
    t[i * 2 + 1] = start + i;
  }
  const msg = { type: "rows", start, count, steps: Array.from({ length: count }, (_, i) => 2 * (start + i)), a_start: 0, anomalies: [], kept: [0], dropped: 0, total_steps: 2 * (start + count), state: "open", ...extra };
  // The kernel's buffers arrive as DataViews, possibly at an offset into a larger buffer.
  const pad = new Uint8Array(8 + s.byteLength);
  pad.set(new Uint8Array(s.buffer), 8);
  return [msg, [new DataView(pad.buffer, 8, s.byteLength), new DataView(t.buffer)]];
}

/** The explorer rendered on a fake model of `summary`, in the page. */
export function mount(summary = seedSummary(), readonly = false) {
  const model = fakeModel({ summary, readonly });
  const el = document.createElement("div");
  document.body.append(el);
  render({ model, el });
  return { model, el };
}

/** One turn of the event loop: replies awaited by the views are handled. */
export const tick = () => new Promise((r) => setTimeout(r, 0));
