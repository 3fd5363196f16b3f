import { beforeEach, describe, expect, it } from "vitest";
import { render } from "../index.js";
import { fakeModel, seedSummary } from "./fake_model.js";

const tick = () => new Promise((r) => setTimeout(r, 0));

function mount(summary = seedSummary(), readonly = false) {
  const model = fakeModel({ summary, readonly });
  const el = document.createElement("div");
  document.body.append(el);
  render({ model, el });
  return { model, el };
}

function detailReply(target, request_id) {
  const meta = {
    kind: "layer", target, cls: "Linear", calls: 1, flags: [], notes: [], max_abs_diff: 1.5e-7,
    shapes: { a: { shape: [5, 6, 4], norm: 1, kept: true, nonfinite: 0 }, delta: { shape: [5, 6, 3], norm: 1, kept: true, nonfinite: 0 }, output: [5, 6, 3], weight: [3, 4] },
    storage: { weight_grad_floats: 12, factor_floats_per_token: 7, tokens: 30, factor_floats: 210, per_token_grad_floats: 360 },
    tensors: {
      a: { dtype: "float32", shape: [2, 2], true_shape: [5, 6, 4], min: -1, max: 1, nonfinite: 0, buffer: 0 },
      per_sample_norms: { dtype: "float32", shape: [3], true_shape: [3], min: 1, max: 3, nonfinite: 0, buffer: 1 },
    },
  };
  const big = new Float32Array([0, 1, -1, 0.5, 0.25, 1, 2, 3]);
  // Buffers as anywidget hands them: DataViews, here into one shared ArrayBuffer.
  return [{ type: "detail", request_id, target, meta }, [new DataView(big.buffer, 0, 16), new DataView(big.buffer, 20, 12)]];
}

beforeEach(() => { document.body.replaceChildren(); });

describe("explorer", () => {
  it("draws module boxes, op nodes, the DOM hooks and a legend", () => {
    const { el } = mount();
    expect(el.querySelector('[data-module="fc1"]')).not.toBeNull();
    expect(el.querySelector('[data-node-id="MulBackward0#0"]')).not.toBeNull();
    expect(el.querySelector('[data-testid="detail"]')).not.toBeNull();
    expect(el.querySelector('[data-testid="status"]')).not.toBeNull();
    expect(el.querySelector('[data-testid="legend"]').textContent).toMatch(/parameter/);
    expect(el.querySelectorAll('[data-module="fc1"]').length).toBe(1);
  });

  it("asks the kernel for detail on click and renders the binary reply", () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    const req = model.sent.at(-1);
    expect(req).toMatchObject({ type: "detail", target: "fc1" });
    model.emit("msg:custom", ...detailReply("fc1", req.request_id));
    const text = el.querySelector('[data-testid="detail"]').textContent;
    expect(text).toContain("(5, 6, 4)");
    expect(el.querySelector('[data-testid="maxdiff"]').textContent).toBe("1.50e-7");
    expect(el.querySelector('[data-testid="per-sample-norms-values"]').textContent).toBe("1, 2, 3");
    expect(el.querySelector('[data-testid="storage-factors"]').textContent).toBe("210");
  });

  it("lists the user's own hooks on a layer as text", () => {
    const summary = seedSummary();
    summary.modules[1].user_hooks = ["forward: <img src=x onerror=alert(1)>", "tensor: double"];
    const { model, el } = mount(summary);
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    model.emit("msg:custom", ...detailReply("fc1", model.sent.at(-1).request_id));
    const cell = el.querySelector('[data-testid="user-hooks"]');
    expect(cell.textContent).toBe("forward: <img src=x onerror=alert(1)>; tensor: double");
    expect(cell.querySelector("img")).toBeNull();
    el.querySelector('[data-module="fc2"]').dispatchEvent(new Event("click"));
    model.emit("msg:custom", ...detailReply("fc2", model.sent.at(-1).request_id));
    expect(el.querySelector('[data-testid="user-hooks"]')).toBeNull();
  });

  it("a hook toggle sends add_hook then rerun, and shows the kernel's status and diff", () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    const box = el.querySelector('[data-hook="grad_zero"]');
    expect(box.disabled).toBe(false);
    box.checked = true;
    box.dispatchEvent(new Event("change"));
    const [add, rerun] = model.sent.slice(-2);
    expect(add).toMatchObject({ type: "add_hook", target: "fc1", kind: "grad_zero", params: {} });
    expect(rerun.type).toBe("rerun");
    expect(el.querySelector('[data-testid="status"]').getAttribute("data-state")).toBe("running");
    model.change("summary", { ...seedSummary(), hooks: [{ target: "fc1", kind: "grad_zero", params: {} }] });
    model.emit("msg:custom", { type: "trace", request_id: rerun.request_id, diff: {
      loss_before: 1.5, loss_after: 1.5, params: [{ name: "fc1.weight", before: 8.28, after: 0, rel_change: 1, cosine: null }],
      layers: {}, changed_nodes: ["MmBackward0#1"], changed_modules: ["fc1"] } });
    model.emit("msg:custom", { type: "status", request_id: rerun.request_id, state: "done", text: "rerun done" });
    expect(el.querySelector('[data-testid="status"]').textContent).toBe("done: rerun done");
    expect(el.querySelector('[data-module="fc1"]').classList.contains("changed")).toBe(true);
    expect(el.querySelector('[data-param="fc1.weight"] [data-testid="after"]').textContent).toBe("0");
    expect(el.querySelector('[data-hook="grad_zero"]').checked).toBe(true);
  });

  it("a parameterised kind sends its number; an empty parameter is refused in the page", () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc2"]').dispatchEvent(new Event("click"));
    const row = el.querySelector('[data-hook="grad_scale"]').closest(".hw-hook");
    row.querySelector('[data-param="factor"]').value = "";
    const n = model.sent.length;
    row.querySelector('[data-hook="grad_scale"]').checked = true;
    row.querySelector('[data-hook="grad_scale"]').dispatchEvent(new Event("change"));
    expect(model.sent.length).toBe(n);
    row.querySelector('[data-param="factor"]').value = "2.5";
    row.querySelector('[data-hook="grad_scale"]').checked = true;
    row.querySelector('[data-hook="grad_scale"]').dispatchEvent(new Event("change"));
    expect(model.sent.at(-2)).toMatchObject({ type: "add_hook", kind: "grad_scale", params: { factor: 2.5 } });
  });

  it("shows kernel errors on the status line, never swallowed", () => {
    const { model, el } = mount();
    model.emit("msg:custom", { type: "status", request_id: "x", state: "error", text: "rerun failed: RuntimeError: boom\nsecond line" });
    const st = el.querySelector('[data-testid="status"]');
    expect(st.getAttribute("data-state")).toBe("error");
    expect(st.textContent).toBe("error: rerun failed: RuntimeError: boom");
  });

  it("callable kinds and out_* on nodes are not settable; read-only disables every toggle", () => {
    let { el } = mount();
    el.querySelector('[data-node-id="MulBackward0#0"]').dispatchEvent(new Event("click"));
    expect(el.querySelector('[data-hook="callable"]').disabled).toBe(true);
    expect(el.querySelector('[data-hook="out_zero"]').disabled).toBe(true);
    expect(el.querySelector('[data-hook="grad_zero"]').disabled).toBe(false);
    ({ el } = mount(seedSummary(), true));
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    expect([...el.querySelectorAll("[data-hook]")].every((b) => b.disabled)).toBe(true);
    expect(el.querySelector('[data-testid="readonly-note"]').textContent).toMatch(/kernel/);
  });

  it("renders names from user code as text, never markup", () => {
    const evil = '<img src=x onerror="window.__pwned=1">';
    const summary = seedSummary([{ name: evil, cls: "</script><b>x</b>", parent: "MLP", params: 0, calls: 1, flags: [] }]);
    summary.graph.module[1] = evil;
    const { el } = mount(summary);
    expect(el.querySelector("img")).toBeNull();
    expect(el.querySelector("b:not([data-testid])")?.textContent ?? "").not.toBe("x");
    expect(el.textContent).toContain(evil);
    const row = [...el.querySelectorAll("[data-tree-module]")].find((r) => r.getAttribute("data-tree-module") === evil);
    expect(row.textContent).toContain("</script><b>x</b>");
  });

  it("flips edge direction and searches by name", () => {
    const { el } = mount();
    const btn = el.querySelector('[data-testid="direction"]');
    expect(btn.textContent).toMatch(/gradient/);
    expect(el.querySelector(".hw-edge").getAttribute("marker-end")).toMatch(/arrow/);
    btn.dispatchEvent(new Event("click"));
    expect(btn.textContent).toMatch(/forward/);
    expect(el.querySelector(".hw-edge").getAttribute("marker-start")).toMatch(/arrow/);
    const input = el.querySelector('[data-testid="search"]');
    input.value = "fc2";
    input.dispatchEvent(new Event("input"));
    expect(el.querySelector('[data-module="fc2"]').classList.contains("match")).toBe(true);
    expect(el.querySelector('[data-module="fc1"]').classList.contains("match")).toBe(false);
  });

  it("expands a module box into its ops and collapses it back", () => {
    const { el } = mount();
    el.querySelector('[data-expand="fc1"]').dispatchEvent(new Event("click"));
    expect(el.querySelector('[data-node-id="MmBackward0#1"]')).not.toBeNull();
    expect(el.querySelector('g.hw-box[data-module="fc1"]')).toBeNull();
    el.querySelector('[data-collapse="fc1"]').dispatchEvent(new Event("click"));
    expect(el.querySelector('[data-node-id="MmBackward0#1"]')).toBeNull();
  });
});

describe("search", () => {
  it("Enter reveals an op hidden inside a collapsed module", () => {
    const { el } = mount();
    expect(el.querySelector('[data-node-id="MmBackward0#1"]')).toBeNull();
    const input = el.querySelector('[data-testid="search"]');
    input.value = "MmBackward0#1";
    input.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter" }));
    expect(el.querySelector('[data-node-id="MmBackward0#1"]').classList.contains("match")).toBe(true);
  });
});
