import { beforeEach, describe, expect, it } from "vitest";
import { createPanes, widthClass } from "../explorer/panes.js";

beforeEach(() => { document.body.replaceChildren(); localStorage.clear(); });

const make = () => {
  const root = document.createElement("div"), shell = document.createElement("div");
  shell.append(root);
  document.body.append(shell);
  return { root, panes: createPanes(root, shell) };
};

describe("panes", () => {
  it("sorts an output by width: wide, mid, narrow (stacked)", () => {
    expect(widthClass(1500)).toBe("wide");
    expect(widthClass(1100)).toBe("mid");
    expect(widthClass(700)).toBe("narrow");
  });

  it("at mid width the side pane opens with a selection, unless the user closed it (remembered)", () => {
    const { root, panes } = make();
    expect(root.classList.contains("hw-mid")).toBe(true);
    expect(root.classList.contains("hw-side-closed")).toBe(true);
    panes.select(true);
    expect(root.classList.contains("hw-side-closed")).toBe(false);
    panes.sideButton.dispatchEvent(new Event("click"));
    expect(root.classList.contains("hw-side-closed")).toBe(true);
    expect(JSON.parse(localStorage.getItem("hookwidget.explorer.panes"))).toEqual({ side: "closed" });
    // The next explorer remembers: closed even with a selection; the left pane toggles the same way.
    const next = make();
    next.panes.select(true);
    expect(next.root.classList.contains("hw-side-closed")).toBe(true);
    next.panes.leftButton.dispatchEvent(new Event("click"));
    expect(next.root.classList.contains("hw-left-closed")).toBe(true);
    expect(next.panes.leftButton.getAttribute("aria-pressed")).toBe("false");
  });
});
