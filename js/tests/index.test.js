import { describe, expect, it } from "vitest";
import widget from "../index.js";

describe("entry", () => {
  it("renders into the element it is given", () => {
    const el = document.createElement("div");
    widget.render({ el, model: null });
    expect(el.textContent).toBe("hookwidget");
  });
});
