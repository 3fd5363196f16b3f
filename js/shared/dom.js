// Tiny DOM builder. Text is always set with textContent, never parsed as markup:
// module names, class names and error messages come from user code.
const SVG_NS = "http://www.w3.org/2000/svg";

/** h("div", {class: "x", "data-testid": "y", onclick: fn}, child, "text") -> HTMLElement */
export function h(tag, attrs = {}, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** Same as h, in the SVG namespace. */
export function s(tag, attrs = {}, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

function build(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = String(v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export { fmt, fmtShape } from "./format.js";

/** Escape a value for an attribute selector. */
export const cssEscape = (v) => (globalThis.CSS?.escape ? globalThis.CSS.escape(v) : String(v).replace(/["\\\]]/g, "\\$&"));

/** Whether the head of `el` (its first `head` px) shows: inside the window and inside every ancestor that clips
 * it (a scrolled pane, JupyterLab's notebook panel). An element not laid out (hidden, or no layout engine) counts
 * as shown: there is nothing to scroll to. */
export function headInView(el, head = 60) {
  const r = el.getBoundingClientRect();
  if (!r.width && !r.height) return true;
  let top = 0, bottom = globalThis.innerHeight || 0;
  for (let p = el.parentElement; p; p = p.parentElement) {
    const o = getComputedStyle(p).overflowY;
    if (o !== "visible" && p.scrollHeight > p.clientHeight) {
      const b = p.getBoundingClientRect();
      top = Math.max(top, b.top);
      bottom = Math.min(bottom, b.bottom);
    }
  }
  return r.top >= top && r.top + Math.min(head, r.height) <= bottom;
}

/** Scroll `el` to the top of the view where its head is out of view (a click answers where the eye is). */
export function reveal(el) {
  if (!headInView(el)) el.scrollIntoView?.({ block: "start" });
}
