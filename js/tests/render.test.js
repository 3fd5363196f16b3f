import { beforeEach, describe, expect, it, vi } from "vitest";
import { buildHierarchy } from "../explorer/collapse.js";
import { REPLY_TIMEOUT_MS, render } from "../explorer/explorer.js";
import { detailReply, fakeModel, mount, seedSummary, tick, traceReply } from "./fake_model.js";



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

  it("asks the kernel for detail on click and renders the binary reply", async () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    const req = model.sent.at(-1);
    expect(req).toMatchObject({ type: "detail", target: "fc1" });
    model.emit("msg:custom", ...detailReply("fc1", req.request_id));
    await tick();
    const text = el.querySelector('[data-testid="detail"]').textContent;
    expect(text).toContain("(5, 6, 4)");
    expect(el.querySelector('[data-testid="maxdiff"]').textContent).toBe("1.5e-7");
    expect(el.querySelector('[data-testid="per-sample-norms-values"]').textContent).toBe("1, 2, 3");
    expect(el.querySelector('[data-testid="storage-factors"]').textContent).toBe("210");
  });

  it("lists the user's own hooks on a layer as text", async () => {
    const summary = seedSummary();
    summary.modules[1].user_hooks = ["forward: <img src=x onerror=alert(1)>", "tensor: double"];
    const { model, el } = mount(summary);
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    model.emit("msg:custom", ...detailReply("fc1", model.sent.at(-1).request_id));
    await tick();
    const cell = el.querySelector('[data-testid="user-hooks"]');
    expect(cell.textContent).toBe("forward: <img src=x onerror=alert(1)>; tensor: double");
    expect(cell.querySelector("img")).toBeNull();
    el.querySelector('[data-module="fc2"]').dispatchEvent(new Event("click"));
    model.emit("msg:custom", ...detailReply("fc2", model.sent.at(-1).request_id));
    await tick();
    expect(el.querySelector('[data-testid="user-hooks"]')).toBeNull();
  });

  it("a hook toggle awaits add_hook's reply, then reruns, and shows the kernel's status and a sortable diff", async () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    const box = el.querySelector('[data-hook="grad_zero"]');
    expect(box.disabled).toBe(false);
    box.checked = true;
    box.dispatchEvent(new Event("change"));
    const add = model.sent.at(-1);
    expect(add).toMatchObject({ type: "add_hook", target: "fc1", kind: "grad_zero", params: {} });
    expect(el.querySelector('[data-testid="status"]').getAttribute("data-state")).toBe("running");
    model.change("summary", { ...seedSummary(), hooks: [{ target: "fc1", kind: "grad_zero", params: {} }] });
    model.emit("msg:custom", { type: "status", request_id: add.request_id, state: "done", text: "added" });
    await tick();
    const rerun = model.sent.at(-1);
    expect(rerun.type).toBe("rerun");
    model.emit("msg:custom", traceReply(rerun.request_id));
    await tick();
    model.emit("msg:custom", { type: "status", request_id: rerun.request_id, state: "done", text: "rerun done" });
    expect(el.querySelector('[data-testid="status"]').textContent).toBe("done: rerun done");
    expect(el.querySelector('[data-module="fc1"]').classList.contains("changed")).toBe(true);
    expect(el.querySelector('[data-param="fc1.weight"] [data-testid="after"]').textContent).toBe("0");
    expect(el.querySelector('[data-param="fc1.weight"]').textContent).toContain("⚓");
    expect(el.querySelector('[data-param="fc2.weight"] [data-testid="rel-change"]').textContent).toBe("new");
    expect(el.querySelector('[data-testid="diff-loss"]').textContent).toContain("1.235");
    expect(el.querySelector('[data-testid="diff-loss"]').textContent).not.toContain("1.2345678");
    expect(el.querySelector('[data-testid="diff"]').textContent).toContain("hook-free");
    // Sorted by relative change, largest first ("new" counts as largest); a header click sorts by name.
    const order = () => [...el.querySelectorAll("[data-testid=diff] tr[data-param]")].map((r) => r.getAttribute("data-param"));
    expect(order()).toEqual(["fc2.weight", "fc1.weight", "fc2.bias"]);
    el.querySelector('[data-sort="name"]').dispatchEvent(new Event("click"));
    expect(order()).toEqual(["fc1.weight", "fc2.bias", "fc2.weight"]);
    expect(el.querySelector('[data-hook="grad_zero"]').checked).toBe(true);
  });

  it("a hook and a rerun made from Python show without any message: toggles, diff, changed marks", async () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    expect(el.querySelector('[data-hook="grad_zero"]').checked).toBe(false);
    model.change("summary", { ...seedSummary(), hooks: [{ target: "fc1", kind: "grad_zero", params: {} }, { target: "fc2", kind: "grad_scale", params: { factor: 2 } }] });
    expect(el.querySelector('[data-hook="grad_zero"]').checked).toBe(true);
    expect([...el.querySelectorAll("[data-hook-target]")].map((x) => `${x.getAttribute("data-hook-kind")}@${x.getAttribute("data-hook-target")}`))
      .toEqual(["grad_zero@fc1", "grad_scale@fc2"]); // every hook on, not only the selected layer's
    expect(el.querySelector('[data-testid="diff"]').textContent).toBe("");
    model.change("diff", { against: "baseline", hooks: ["fc1"], loss_before: 1.5, loss_after: 1.5,
      params: [{ name: "fc1.weight", before: 8.28, after: 0, rel_change: 1, cosine: null, hooked: true }],
      layers: {}, changed_nodes: ["MmBackward0#1"], changed_modules: ["fc1"] });
    expect(el.querySelector('[data-param="fc1.weight"] [data-testid="after"]').textContent).toBe("0");
    expect(el.querySelector('[data-module="fc1"]').classList.contains("changed")).toBe(true);
    model.change("summary", seedSummary()); // t.remove_hook from Python
    model.change("diff", null);
    expect(el.querySelector('[data-hook="grad_zero"]').checked).toBe(false);
    expect(el.querySelector('[data-testid="hooks-on"]')).toBeNull();
    expect(el.querySelector('[data-testid="diff"]').textContent).toBe("");
    expect(el.querySelector('[data-module="fc1"]').classList.contains("changed")).toBe(false);
  });

  it("a rerun from Python moves the status line off the first run's loss; a running command keeps its line", () => {
    const { model, el } = mount();
    const line = () => el.querySelector('[data-testid="status"]').textContent;
    expect(line()).toContain("loss 1.5");
    model.change("summary", { ...seedSummary(), loss: 0.25 });
    model.change("diff", { against: "baseline", hooks: ["fc1"], loss_before: 1.5, loss_after: 0.25,
      params: [{ name: "fc1.weight", before: 8.28, after: 0, rel_change: 1, cosine: null, hooked: true }],
      layers: {}, changed_nodes: ["MmBackward0#1"], changed_modules: ["fc1"] });
    expect(line()).toBe("rerun: loss 1.5 → 0.25 · 1 module changed · 3 modules");
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    el.querySelector('[data-hook="grad_zero"]').click(); // a command from the page: running until its reply
    model.change("summary", { ...seedSummary(), loss: 0.5 });
    expect(el.querySelector('[data-testid="status"]').getAttribute("data-state")).toBe("running");
  });

  it("when ipywidgets says the comm went (kernel restarted) it stays as a read-only snapshot", async () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    const pending = model.sent.at(-1);
    expect(el.querySelector('[data-hook="grad_zero"]').disabled).toBe(false);
    model.emit("comm_live_update");
    await tick();
    expect(el.querySelector('[data-testid="kernel-gone"]').textContent).toContain("run the cell again");
    expect(el.querySelector('[data-hook="grad_zero"]').disabled).toBe(true);
    expect(el.querySelector('[data-testid="detail"]').textContent).toContain("kernel disconnected"); // the pending detail
    const n = model.sent.length;
    el.querySelector('[data-module="fc2"]').dispatchEvent(new Event("click"));
    await tick();
    expect(model.sent.length).toBe(n); // nothing sent to a kernel that is gone
    expect(el.querySelector('[data-module="fc1"]')).not.toBeNull(); // the graph is still drawn
    model.emit("msg:custom", { type: "status", request_id: pending.request_id, state: "done", text: "late" });
    expect(el.querySelector('[data-testid="kernel-gone"]')).toBeNull(); // a kernel that answers is alive
    expect(el.querySelector('[data-hook="grad_zero"]').disabled).toBe(false);
  });

  it("a view restored from saved widget state (marked disconnected by ipywidgets) opens read-only", () => {
    const model = fakeModel({ summary: seedSummary(), readonly: false });
    const el = document.createElement("div");
    el.className = "jupyter-widgets-disconnected";
    document.body.append(el);
    render({ model, el });
    expect(el.querySelector('[data-testid="kernel-gone"]')).not.toBeNull();
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    expect(model.sent).toEqual([]);
    expect(el.querySelector('[data-hook="grad_zero"]').disabled).toBe(true);
  });

  it("a request without reply gives up after the timeout and still uses the late reply", async () => {
    vi.useFakeTimers();
    try {
      const { model, el } = mount();
      el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
      const req = model.sent.at(-1);
      await vi.advanceTimersByTimeAsync(REPLY_TIMEOUT_MS + 1);
      expect(el.querySelector('[data-testid="detail"]').textContent).toContain("no reply from the kernel");
      model.emit("msg:custom", ...detailReply("fc1", req.request_id));
      await vi.advanceTimersByTimeAsync(1);
      expect(el.querySelector('[data-testid="maxdiff"]').textContent).toBe("1.5e-7");
    } finally {
      vi.useRealTimers();
    }
  });

  it("a refused hook never reruns and its error stays beside the control until the user acts", async () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc2"]').dispatchEvent(new Event("click"));
    const box = () => el.querySelector('[data-hook="grad_scale"]');
    box().checked = true;
    box().dispatchEvent(new Event("change"));
    const add = model.sent.at(-1);
    model.emit("msg:custom", { type: "status", request_id: add.request_id, state: "error", text: "add_hook failed: ValueError: bad factor" });
    await tick();
    await new Promise((r) => setTimeout(r, 30));
    expect(model.sent.some((m) => m.type === "rerun")).toBe(false);
    const err = el.querySelector('[data-hook-error="grad_scale"]');
    expect(err.hidden).toBe(false);
    expect(err.textContent).toBe("add_hook failed: ValueError: bad factor");
    expect(box().checked).toBe(false);
    // An unrelated status message does not remove it; typing in the field does.
    model.emit("msg:custom", { type: "status", request_id: "zz", state: "done", text: "something else" });
    expect(el.querySelector('[data-hook-error="grad_scale"]').hidden).toBe(false);
    const inp = el.querySelector('[data-hook-row="grad_scale"] [data-param="factor"]');
    inp.value = "3";
    inp.dispatchEvent(new Event("input"));
    expect(el.querySelector('[data-hook-error="grad_scale"]').hidden).toBe(true);
  });

  it("a parameterised kind sends its number; an empty parameter is refused in the page, with the reason", () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc2"]').dispatchEvent(new Event("click"));
    const row = () => el.querySelector('[data-hook-row="grad_scale"]');
    row().querySelector('[data-param="factor"]').value = "";
    const n = model.sent.length;
    row().querySelector('[data-hook="grad_scale"]').checked = true;
    row().querySelector('[data-hook="grad_scale"]').dispatchEvent(new Event("change"));
    expect(model.sent.length).toBe(n);
    expect(el.querySelector('[data-hook-error="grad_scale"]').textContent).toMatch(/factor is empty/);
    row().querySelector('[data-param="factor"]').value = "2.5";
    row().querySelector('[data-hook="grad_scale"]').checked = true;
    row().querySelector('[data-hook="grad_scale"]').dispatchEvent(new Event("change"));
    expect(model.sent.at(-1)).toMatchObject({ type: "add_hook", kind: "grad_scale", params: { factor: 2.5 } });
  });

  it("shows the trace's notes: a banner when no gradients were captured", () => {
    const summary = { ...seedSummary(), has_grads: false, notes: ["no gradients captured: the code ran no backward (activations only)", "<b>x</b> note"],
      note_ids: ["no_grads", "other"] };
    const { el } = mount(summary);
    expect(el.querySelector('[data-testid="no-grads"]').textContent).toMatch(/no gradients captured/);
    expect(el.querySelector('[data-testid="notes"]').textContent).toContain("<b>x</b> note");
    expect(el.querySelector('[data-testid="notes"] b')).toBeNull();
    expect(el.querySelector('[data-testid="notes"] details').textContent).not.toMatch(/no gradients captured/);
  });

  it("finds the no-gradients note by its id, never by its text; has_grads alone still says so", () => {
    const byId = mount({ ...seedSummary(), notes: ["one", "activations only, said otherwise"], note_ids: ["x", "no_grads"] }).el;
    expect(byId.querySelector('[data-testid="no-grads"]').textContent).toBe("activations only, said otherwise");
    expect(byId.querySelector('[data-testid="notes"] details').textContent).toContain("1 note");
    const lookAlike = mount({ ...seedSummary(), notes: ["no gradients captured: a look-alike"], note_ids: ["other"] }).el;
    expect(lookAlike.querySelector('[data-testid="no-grads"]')).toBeNull();
    const noIds = mount({ ...seedSummary(), has_grads: false, notes: [] }).el;
    expect(noIds.querySelector('[data-testid="no-grads"]').textContent).toMatch(/no gradients captured/);
  });

  it("folds repeated blocks in the tree; keyboard moves, unfolds, selects and clears", () => {
    const mods = [{ name: "net", cls: "Net", parent: "MLP", params: 10, calls: 1, flags: [] }];
    for (let i = 0; i < 3; i++) {
      mods.push({ name: `net.h.${i}`, cls: "Block", parent: "net", params: 3, calls: 1, flags: [] });
      mods.push({ name: `net.h.${i}.lin`, cls: "Linear", parent: `net.h.${i}`, params: 3, calls: 2, flags: [] });
    }
    const { model, el } = mount(seedSummary(mods));
    expect(el.querySelector('[data-tree-module="net.h.1.lin"]')).toBeNull();
    const row = el.querySelector('[data-tree-module="net.h.1"]');
    expect(row.getAttribute("aria-expanded")).toBe("false");
    row.focus();
    row.dispatchEvent(new KeyboardEvent("keydown", { key: "ArrowRight", bubbles: true }));
    expect(el.querySelector('[data-tree-module="net.h.1.lin"]').textContent).toContain("×2");
    document.activeElement.dispatchEvent(new KeyboardEvent("keydown", { key: "ArrowDown", bubbles: true }));
    document.activeElement.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", bubbles: true }));
    expect(model.sent.at(-1)).toMatchObject({ type: "detail", target: "net.h.1.lin" });
    expect(el.querySelector('[data-tree-module="net.h.1.lin"]').classList.contains("selected")).toBe(true);
    document.activeElement.dispatchEvent(new KeyboardEvent("keydown", { key: "Escape", bubbles: true }));
    expect(el.querySelector(".hw-tree-row.selected")).toBeNull();
  });

  it("folds repeated blocks and shows tree names whole, counts formatted", () => {
    const blocks = [];
    for (let i = 0; i < 12; i++) blocks.push({ name: `transformer.h.${i}`, cls: "GPT2Block", parent: "transformer", params: 7357000, calls: 1, flags: [] });
    const summary = seedSummary([{ name: "transformer", cls: "GPT2Model", parent: "MLP", params: 88_300_000, calls: 1, flags: [] }, ...blocks]);
    const { el } = mount(summary);
    const row = el.querySelector('[data-tree-module="transformer.h.11"]');
    expect(row.querySelector(".hw-tree-name").textContent).toBe("h.11");
    expect(row.textContent).toContain("7.36 M params");
    const fold = [...buildHierarchy(summary.modules).values()].find((g) => g.repeat);
    expect(`${fold.label} · ${fold.cls}`).toBe("h.0 … h.11 · GPT2Block × 12");
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
