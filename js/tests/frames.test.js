import { describe, expect, it } from "vitest";
import { crossings, tabX } from "../explorer/graph.js";

describe("a frame's title tab", () => {
  const frame = { x0: 428, x1: 641 };

  it("finds where edges cross the tab's band", () => {
    const lines = [[{ x: 450, y: 200 }, { x: 534, y: 250 }, { x: 534, y: 300 }], [{ x: 100, y: 0 }, { x: 100, y: 50 }]];
    expect(crossings(lines, 280, 296)).toEqual([534]);
    expect(crossings(lines, 210, 226).map((x) => Math.round(x))).toEqual([480]);
  });

  it("stays at the frame's corner where no edge crosses it", () => {
    expect(tabX(frame, 104, [])).toBe(428);
    expect(tabX(frame, 104, [300, 700])).toBe(428);
  });

  it("moves off an edge that would run through its text: right of it inside the frame, else left of it", () => {
    expect(tabX(frame, 80, [470])).toBe(477); // right of the edge, still inside the frame
    const x = tabX(frame, 104, [534]); // no room on the right: hangs left of the edge
    expect(x + 104).toBeLessThan(534 - 5);
  });
});
