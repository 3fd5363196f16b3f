// The front-end's side of the one payload schema (hookwidget/views/payload_schema.json): its fixtures are what the
// kernel sends, and every message it sends (and the standalone page's stand-in model answers) follows it.
import { describe, expect, it } from "vitest";
import { createStaticModel } from "../explorer/static_model.js";
import * as P from "../shared/protocol.js";
import { liveOf } from "../watch/index.js";
import { detailReply, fakeModel, mount, rows, seedSummary, tick, traceReply, WATCH_META } from "./fake_model.js";
import { errorsOf, SPEC } from "./schema.js";

const sentBy = (type, explorer = true) => SPEC["x-messages"][explorer ? "explorer" : "watch"].requests.includes(type);

describe("payload schema", () => {
  it("holds for the fixtures the tests play the kernel with", () => {
    expect(errorsOf("summary", seedSummary())).toEqual([]);
    const [detail] = detailReply("fc1", "r1");
    expect(errorsOf("reply_detail", detail)).toEqual([]);
    expect(errorsOf("reply_trace", traceReply("r2"))).toEqual([]);
    expect(errorsOf("reply_rows", rows(0, 3)[0])).toEqual([]);
    expect(errorsOf("reply_status", { type: "status", request_id: "r3", state: "done", text: "ok" })).toEqual([]);
  });

  it("holds for every message the front-end builds", () => {
    const msgs = [P.detail("fc1"), P.addHook("fc1", "grad_scale", { factor: 2 }), P.removeHook("fc1", "grad_scale"), P.rerun(), P.sync(0), P.open(3)];
    for (const m of msgs) expect([m.type, errorsOf(`request_${m.type}`, m)]).toEqual([m.type, []]);
    expect(msgs.map((m) => m.type).filter((t) => sentBy(t) || sentBy(t, false))).toHaveLength(msgs.length);
  });

  it("holds for what the explorer and the watch really send", async () => {
    const { model, el } = mount();
    el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
    model.emit("msg:custom", ...detailReply("fc1", model.sent.at(-1).request_id));
    await tick();
    const box = el.querySelector('[data-hook="grad_zero"]');
    box.checked = true;
    box.dispatchEvent(new Event("change"));
    model.emit("msg:custom", { type: "status", request_id: model.sent.at(-1).request_id, state: "done", text: "added" });
    await tick();
    expect(model.sent.map((m) => m.type)).toEqual(["detail", "add_hook", "rerun"]);
    for (const m of model.sent) expect(errorsOf(`request_${m.type}`, m)).toEqual([]);

    const watch = fakeModel({ meta: { ...WATCH_META } });
    const { request } = liveOf(watch);
    request(P.open(0));
    expect(watch.sent.map((m) => m.type)).toEqual(["sync", "open"]);
    for (const m of watch.sent) expect(errorsOf(`request_${m.type}`, m)).toEqual([]);
  });

  it("holds for the replies of the standalone page's read-only model", async () => {
    const [detail, buffers] = detailReply("fc1", "x");
    const data = { summary: seedSummary(), diff: traceReply("x").diff, details: { fc1: { meta: detail.meta, buffers: buffers.map(() => btoa("\0\0\0\0")) } }, details_note: "" };
    const model = createStaticModel(data);
    const got = [];
    model.on("msg:custom", (m) => got.push(m));
    for (const m of [P.detail("fc1"), P.detail("AccumulateGrad#0"), P.detail("nope"), P.rerun()]) model.send(m);
    await tick();
    expect(got.map((m) => m.type)).toEqual(["detail", "detail", "status", "status"]);
    for (const m of got) expect(errorsOf(`reply_${m.type}`, m)).toEqual([]);
    expect(errorsOf("diff", data.diff)).toEqual([]);
  });

  it("refuses what the front-end would misread", () => {
    expect(errorsOf("summary", { ...seedSummary(), loss: NaN })).not.toEqual([]); // NaN travels as "nan"
    expect(errorsOf("request_detail", { ...P.detail("fc1"), code: "x" })).not.toEqual([]);
    expect(errorsOf("reply_status", { type: "status", request_id: "r", state: "weird", text: "" })).not.toEqual([]);
    const { own_params, ...partial } = seedSummary().modules[1];
    expect(own_params).toEqual(["fc1.weight"]);
    expect(errorsOf("module_row", partial)).toEqual(["$: missing own_params"]);
  });
});
