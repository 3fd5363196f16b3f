import { describe, expect, it, vi } from "vitest";
import { addHook, base64ToBytes, createRequests, decodeTensor, decodeTensors, detail, open, parseIncoming, rerun, sync } from "../shared/protocol.js";
import { fakeModel } from "./fake_model.js";

describe("protocol", () => {
  it("builds messages with the schema's keys and a fresh request_id", () => {
    const a = detail("fc1"), b = detail("fc1");
    expect(Object.keys(a).sort()).toEqual(["request_id", "target", "type"]);
    expect(a.request_id).not.toBe(b.request_id);
    expect(Object.keys(addHook("fc1", "grad_scale", { factor: 2 })).sort()).toEqual(["kind", "params", "request_id", "target", "type"]);
    expect(Object.keys(rerun()).sort()).toEqual(["request_id", "type"]);
  });

  it("decodes a view into a larger buffer at its byteOffset", () => {
    const whole = new Float32Array([9, 9, 1, 2, 3, 4, 9]);
    const view = new DataView(whole.buffer, 8, 16);
    expect(Array.from(decodeTensor({ dtype: "float32", shape: [2, 2] }, view))).toEqual([1, 2, 3, 4]);
  });

  it("copies an unaligned view instead of failing", () => {
    const bytes = new Uint8Array(1 + 8);
    new DataView(bytes.buffer).setFloat32(1, 1.5, true);
    new DataView(bytes.buffer).setFloat32(5, -2, true);
    const t = decodeTensor({ dtype: "float32", shape: [2] }, new DataView(bytes.buffer, 1, 8));
    expect(Array.from(t)).toEqual([1.5, -2]);
  });

  it("refuses a buffer shorter than its shape", () => {
    expect(() => decodeTensor({ dtype: "float32", shape: [4] }, new ArrayBuffer(8))).toThrow(/too short/);
  });

  it("maps meta.tensors to their buffers by index", () => {
    const meta = { tensors: { b: { dtype: "float32", shape: [1], buffer: 1 }, a: { dtype: "float32", shape: [1], buffer: 0 } } };
    const out = decodeTensors(meta, [new Float32Array([7]), new Float32Array([8])]);
    expect(out.a.data[0]).toBe(7);
    expect(out.b.data[0]).toBe(8);
  });

  it("ignores unknown kernel messages", () => {
    expect(parseIncoming({ type: "eval", code: "alert(1)" })).toBeNull();
    expect(parseIncoming({ type: "status", state: "weird" })).toBeNull();
    expect(parseIncoming({ type: "status", state: "done", text: "" })).not.toBeNull();
  });

  it("decodes base64 (standalone buffers)", () => {
    expect(Array.from(base64ToBytes(btoa("\x01\x02\xff")))).toEqual([1, 2, 255]);
  });

  it("awaits one reply per request: progress keeps it waiting, an error status answers it, a late reply is marked", async () => {
    vi.useFakeTimers();
    try {
      const model = fakeModel({});
      const rq = createRequests(model, { noReply: "silent" });
      const a = open(3), b = sync(0), c = detail("fc1");
      const pa = rq.request(a), pb = rq.request(b), pc = rq.request(c, { timeout: 100, gen: 7 });
      expect(model.sent).toEqual([a, b, c]);
      expect(rq.settle({ type: "status", request_id: a.request_id, state: "running", text: "" })).toBeNull();
      expect(rq.settle({ type: "status", request_id: a.request_id, state: "done", text: "ok" })).not.toBeNull();
      expect(await pa).toMatchObject({ ok: true, msg: { text: "ok" } });
      rq.settle({ type: "status", request_id: b.request_id, state: "error", text: "no" });
      expect(await pb).toEqual({ ok: false, text: "no" });
      await vi.advanceTimersByTimeAsync(101);
      expect(await pc).toEqual({ ok: false, text: "silent" });
      expect(rq.settle({ type: "detail", request_id: c.request_id, target: "fc1", meta: {} })).toMatchObject({ late: true, gen: 7 });
      expect(rq.settle({ type: "detail", request_id: c.request_id, target: "fc1", meta: {} })).toBeNull();
      const pd = rq.request(rerun());
      rq.cancel("gone");
      expect(await pd).toEqual({ ok: false, text: "gone" });
    } finally { vi.useRealTimers(); }
  });
});
