// A fake anywidget model: get/on/off/send like the real one, plus emit() to play the kernel.
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
      { name: "MLP", cls: "MLP", parent: null, params: 18, calls: 1, flags: [] },
      { name: "fc1", cls: "Linear", parent: "MLP", params: 12, calls: 1, flags: [] },
      { name: "fc2", cls: "Linear", parent: "MLP", params: 6, calls: 1, flags: [] },
      ...extraModules,
    ],
    params: { "fc1.weight": 1, "fc2.weight": 2 }, loss: 1.5, notes: [], hooks: [],
    kinds: [
      { name: "grad_scale", doc: "multiply", attach: "grad", python_only: false, params: [{ name: "factor", type: "float", default: null }] },
      { name: "grad_zero", doc: "zeros", attach: "grad", python_only: false, params: [] },
      { name: "out_zero", doc: "zero output", attach: "out", python_only: false, params: [] },
      { name: "callable", doc: "fn", attach: "grad", python_only: true, params: [{ name: "fn", type: "Callable", default: null }] },
    ],
    health: {},
  };
}
