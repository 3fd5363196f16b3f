import { beforeEach, describe, expect, it, vi } from "vitest";
import { createPanes, widthClass } from "../explorer/panes.js";
import { headInView, reveal } from "../shared/dom.js";

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

describe("a click answers where the eye is", () => {
  const placed = (top, height = 300) => {
    const el = document.createElement("div");
    document.body.append(el);
    el.getBoundingClientRect = () => ({ top, bottom: top + height, left: 0, right: 100, width: 100, height });
    el.scrollIntoView = vi.fn();
    return el;
  };

  it("scrolls a detail whose head is below or above the view to the top, and leaves one in view alone", () => {
    for (const [top, scrolls] of [[2000, true], [-400, true], [100, false], [window.innerHeight - 30, true]]) {
      const el = placed(top);
      reveal(el);
      expect(el.scrollIntoView.mock.calls.length > 0).toBe(scrolls);
      if (scrolls) expect(el.scrollIntoView).toHaveBeenCalledWith({ block: "start" });
    }
  });

  it("an element not laid out counts as shown", () => {
    const el = placed(0, 0);
    el.getBoundingClientRect = () => ({ top: 0, bottom: 0, left: 0, right: 0, width: 0, height: 0 });
    expect(headInView(el)).toBe(true);
  });
});
