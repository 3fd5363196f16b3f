import { describe, expect, it } from "vitest";
import { createStaticModel, nodeMeta } from "../explorer/static_model.js";
import { seedSummary } from "./fake_model.js";

const flush = () => new Promise((r) => setTimeout(r, 0));

describe("read-only model of the standalone page", () => {
  it("answers detail from the inlined buffers (base64) and node detail from the summary", async () => {
    const buf = btoa(String.fromCharCode(...new Uint8Array(new Float32Array([1.5, -2]).buffer)));
    const model = createStaticModel({ summary: seedSummary(), details: { fc1: { meta: { kind: "layer", tensors: {} }, buffers: [buf] } } });
    const got = [];
    model.on("msg:custom", (m, b) => got.push([m, b]));
    model.send({ type: "detail", target: "fc1", request_id: "1" });
    model.send({ type: "detail", target: "SumBackward0#0", request_id: "2" });
    model.send({ type: "add_hook", target: "fc1", kind: "grad_zero", params: {}, request_id: "3" });
    await flush();
    expect(Array.from(new Float32Array(got[0][1][0].buffer))).toEqual([1.5, -2]);
    expect(got[1][0].meta).toMatchObject({ kind: "node", name: "SumBackward0", next: ["MmBackward0#0"], prev: ["MulBackward0#0"] });
    expect(got[2][0]).toMatchObject({ type: "status", state: "error" });
    expect(model.get("readonly")).toBe(true);
  });

  it("has no node meta for an unknown id", () => {
    expect(nodeMeta(seedSummary().graph, "nope")).toBeNull();
  });
});
