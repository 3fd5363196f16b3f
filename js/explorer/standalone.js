// Entry of the standalone page written by to_html: the same explorer on a read-only model.
import { render } from "./explorer.js";
import { createStaticModel } from "./static_model.js";

const nonce = document.currentScript?.nonce || "";
function start() {
  const data = JSON.parse(document.getElementById("hw-data").textContent);
  const el = document.getElementById("hw-app");
  const t0 = performance.now();
  render({ model: createStaticModel(data), el, nonce });
  window.__hwFirstPaintMs = performance.now() - t0;
  requestAnimationFrame(() => { window.__hwReady = true; document.body.setAttribute("data-ready", "1"); });
}
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
