// The shares panel (explorer/shares.js): asked for only when opened, the bar sorted and signed, a sample's strip
// coloured by its positions' shares with the token text as text (never markup), and the standalone page's answers.
import { beforeEach, describe, expect, it } from "vitest";
import { createSharesPanel, decodeShares, renderShares } from "../explorer/shares.js";
import { sharesReply } from "../explorer/static_model.js";
import * as P from "../shared/protocol.js";
import { mount, tick } from "./fake_model.js";
import { errorsOf } from "./schema.js";

beforeEach(() => { document.body.replaceChildren(); });

const f64 = (xs) => new Uint8Array(new Float64Array(xs).buffer);
const i32 = (xs) => new Uint8Array(new Int32Array(xs).buffer);

/** A shares reply as the kernel sends it (payload_schema.json, reply_shares): 3 samples, sample 1 picked with 4
 * positions whose tokens came from user code. */
export function sharesFixture(requestId, { sample = null, tokens = ["<b>hi</b>", " the", "\n", "x"], layer = "" } = {}) {
  const meta = { scope: layer, step: null, n: 3, sum: 1, total_sq: 2.5, left_out: 0, samples: { dtype: "float64", shape: [3], buffer: 0 },
    index: { dtype: "int32", shape: [3], buffer: 1 }, notes: ["a note"], sample };
  const buffers = [f64([0.3, 0.9, -0.2]), i32([0, 1, 2])];
  if (sample !== null) {
    Object.assign(meta, { positions: { dtype: "float64", shape: [4], buffer: 2 }, true_positions: 4, unplaced: 0.1, positions_note: null,
      ids: [7, 8, 9, 10], tokens, tokens_note: null, token_layer: "wte" });
    buffers.push(f64([0.5, 0.4, -0.1, 0]));
  }
  return [{ type: "shares", request_id: requestId, layer, meta }, buffers];
}

describe("shares panel", () => {
  it("asks nothing until opened, then the whole model's shares; a layer's when one is selected", async () => {
    const sent = [];
    const panel = createSharesPanel({ request: async (m) => { sent.push(m); return { ok: true, msg: sharesFixture(m.request_id)[0], buffers: sharesFixture(m.request_id)[1] }; } });
    panel.setScope("fc1");
    expect(sent).toEqual([]); // closed: nothing computed
    panel.setScope(null);
    panel.el.open = true;
    panel.el.dispatchEvent(new Event("toggle"));
    await tick();
    expect(sent.map((m) => [m.layer, m.sample])).toEqual([["", -1]]);
    for (const m of sent) expect(errorsOf("request_shares", m)).toEqual([]);
    panel.setScope("fc1");
    await tick();
    expect(sent.map((m) => [m.layer, m.sample])).toEqual([["", -1], ["fc1", -1]]);
    expect(panel.el.querySelector('[data-testid="shares-title"]').textContent).toContain("fc1");
  });

  it("follows the explorer's selection: a layer with parameters its own shares, a container the whole model's", async () => {
    const { el, model } = mount();
    const panel = el.querySelector('[data-testid="shares"]');
    panel.open = true;
    panel.dispatchEvent(new Event("toggle"));
    const asked = () => model.sent.filter((m) => m.type === "shares").map((m) => m.layer);
    expect(asked()).toEqual([""]);
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    expect(asked()).toEqual(["", "fc1"]);
    expect(el.querySelector('[data-testid="shares-title"]').textContent).toMatch(/· fc1$/);
    el.querySelector('[data-tree-module="MLP"]').dispatchEvent(new Event("click"));
    await tick();
    expect(asked().at(-1)).toBe("");
    expect(el.querySelector('[data-testid="shares-title"]').textContent).toMatch(/· whole model$/);
  });

  it("shows the kernel's progress of its own request in the panel, then the answer", async () => {
    const { el, model } = mount();
    const panel = el.querySelector('[data-testid="shares"]');
    panel.open = true;
    panel.dispatchEvent(new Event("toggle"));
    const rid = model.sent.at(-1).request_id;
    expect(el.querySelector('[data-testid="shares-computing"]').textContent).toBe("computing the shares…");
    const running = { type: "status", request_id: rid, state: "running", text: "computing the shares: 40%", fraction: 0.4 };
    expect(errorsOf("reply_status", running)).toEqual([]);
    model.emit("msg:custom", running);
    const bar = el.querySelector('[data-testid="shares-progress"]');
    expect(bar.value).toBeCloseTo(0.4);
    expect(el.querySelector('[data-testid="shares-computing"]').textContent).toBe("computing the shares: 40%");
    model.emit("msg:custom", { ...running, request_id: "someone-else", text: "rerunning", fraction: 0.9 });
    expect(el.querySelector('[data-testid="shares-progress"]').value).toBeCloseTo(0.4); // not this panel's
    model.emit("msg:custom", ...sharesFixture(rid));
    await tick();
    expect(el.querySelector('[data-testid="shares-progress"]')).toBeNull();
    expect(el.querySelectorAll('[data-testid="share-bar"]').length).toBe(3);
    model.emit("msg:custom", { ...running, fraction: 1 }); // a late one, after the answer: ignored
    expect(el.querySelector('[data-testid="shares-progress"]')).toBeNull();
  });

  it("sorts the bar largest first, signed: a negative share is drawn on the left", () => {
    const [msg, buffers] = sharesFixture("r1");
    const root = document.createElement("div");
    root.append(...renderShares(decodeShares(msg.meta, buffers), () => {}));
    const rows = [...root.querySelectorAll('[data-testid="share-bar"]')];
    expect(rows.map((r) => r.getAttribute("data-sample"))).toEqual(["1", "0", "2"]);
    const widths = (r) => [...r.querySelectorAll(".hw-share-neg > span, .hw-share-pos > span")].map((s) => s.style.width);
    expect(widths(rows[0])).toEqual(["0%", "100%"]);
    expect(widths(rows[2])).toEqual([`${(100 * 0.2) / 0.9}%`, "0%"]);
    expect(root.textContent).toContain("click a sample");
  });

  it("shows a sample's strip with its tokens' text as text, coloured by share", async () => {
    const { el, model } = mount();
    const panel = el.querySelector('[data-testid="shares"]');
    panel.open = true;
    panel.dispatchEvent(new Event("toggle"));
    model.emit("msg:custom", ...sharesFixture(model.sent.at(-1).request_id));
    await tick();
    el.querySelector('[data-testid="share-bar"][data-sample="1"]').dispatchEvent(new Event("click"));
    const req = model.sent.at(-1);
    expect(req).toMatchObject({ type: "shares", layer: "", sample: 1 });
    model.emit("msg:custom", ...sharesFixture(req.request_id, { sample: 1 }));
    await tick();
    const cells = [...el.querySelectorAll('[data-testid="token"]')];
    expect(cells.map((c) => c.textContent)).toEqual(["<b>hi</b>", " the", "↵", "x"]);
    expect(el.querySelector('[data-testid="token-strip"] b')).toBeNull(); // user text, never markup
    expect(cells[0].style.background).toMatch(/rgb/);
    expect(cells[0].className).toContain("strong");
    expect(cells[1].title).toContain("id 8");
    expect(el.querySelector('[data-testid="share-bar"][data-sample="1"]').getAttribute("aria-pressed")).toBe("true");
    expect(el.querySelector('[data-testid="strip-title"]').textContent).toBe("sample 1: share 0.9");
  });

  it("says so in one line where positions are not attributed, and shows a kernel error as text", () => {
    const [msg, buffers] = sharesFixture("r1");
    const meta = { ...msg.meta, sample: 0, positions: null, unplaced: 0.3, positions_note: "positions not attributed here: no layer", tokens: null, ids: null, tokens_note: null, token_layer: null };
    expect(errorsOf("shares_meta", meta)).toEqual([]);
    const root = document.createElement("div");
    root.append(...renderShares(decodeShares(meta, buffers), () => {}));
    expect(root.querySelector('[data-testid="positions-note"]').textContent).toMatch(/^positions not attributed here/);
    expect(root.querySelector('[data-testid="token-strip"]')).toBeNull();
  });

  it("shows ids, then positions, where no text was given", () => {
    const [msg, buffers] = sharesFixture("r1", { sample: 1, tokens: null });
    const root = document.createElement("div");
    root.append(...renderShares(decodeShares(msg.meta, buffers), () => {}));
    expect([...root.querySelectorAll('[data-testid="token"]')].map((c) => c.textContent)).toEqual(["7", "8", "9", "10"]);
  });

  it("follows the schema, and the standalone page answers from what it inlined", () => {
    for (const [m] of [sharesFixture("a"), sharesFixture("b", { sample: 1 })]) expect(errorsOf("reply_shares", m)).toEqual([]);
    const b64 = (u8) => btoa(String.fromCharCode(...u8));
    const [bar, barBufs] = sharesFixture("x");
    const [one, oneBufs] = sharesFixture("x", { sample: 1 });
    const inlined = { bar: { meta: bar.meta, buffers: barBufs.map(b64) }, strips: { 1: { meta: one.meta, buffers: oneBufs.map(b64) } }, note: "" };
    const [strip] = sharesReply(inlined, P.shares("", 1));
    expect(strip.meta.tokens[1]).toBe(" the");
    const [missing] = sharesReply({ ...inlined, strips: {}, note: "live only" }, P.shares("", 0));
    expect(missing.meta.positions_note).toBe("live only");
    const [layer] = sharesReply(inlined, P.shares("fc1", -1));
    expect(layer).toMatchObject({ type: "status", state: "error" });
    for (const m of [strip, missing, layer]) expect(errorsOf(`reply_${m.type}`, m)).toEqual([]);
  });
});
