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
