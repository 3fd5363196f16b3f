// The status line: what is running, done, or failed — one line, kernel errors shown as sent.
import { h } from "../shared/dom.js";

export function createStatusLine() {
  const text = h("span", { class: "hw-status-text" });
  const el = h("div", { class: "hw-status", "data-testid": "status", "data-state": "idle", role: "status", "aria-live": "polite" }, text);
  let timer = null;

  function set(state, message) {
    clearInterval(timer);
    el.setAttribute("data-state", state);
    const line = String(message ?? "").split("\n")[0];
    if (state === "running") {
      const start = Date.now();
      const tick = () => { text.textContent = `running: ${line} (${((Date.now() - start) / 1000).toFixed(1)} s)`; };
      tick();
      timer = setInterval(tick, 250);
    } else {
      text.textContent = state === "idle" ? line : `${state}: ${line}`;
    }
  }

  return { el, set, get state() { return el.getAttribute("data-state"); } };
}
