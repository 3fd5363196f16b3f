// The shares panel: which samples carried the step's gradient, and where in a sample. A signed bar per sample
// (s_b = ⟨G_b, G⟩ / ‖G‖², sorted, largest first; red pulled with the step, blue against it), of the whole model
// or of the layer selected; a click on a sample shows its positions as a strip coloured by their shares, with the
// text of each token where the kernel has a decode function (user data: set as text, never parsed as markup).
// Nothing is asked of the kernel until the panel is opened (views/payload/shares.py computes on request).
import { colourOf } from "./charts.js";
import { h } from "../shared/dom.js";
import { fmt } from "../shared/format.js";
import { decodeTensor, shares as sharesRequest } from "../shared/protocol.js";
import { DARK_VARS, installStyles, THEME_VARS } from "../shared/theme.js";

const CSS = `
.hw-shares {${THEME_VARS}
  font: 12px/1.4 var(--jp-ui-font-family, system-ui, sans-serif); color: var(--hw-fg); background: var(--hw-bg);
  border: 1px solid var(--hw-border); border-radius: 6px; padding: 4px 8px; margin-top: 6px; box-sizing: border-box; }
@media (prefers-color-scheme: dark) { .hw-standalone .hw-shares { ${DARK_VARS} } }
.hw-shares > summary { cursor: pointer; font-weight: 600; padding: 2px 0; }
.hw-shares-body { display: flex; flex-wrap: wrap; gap: 6px 16px; align-items: flex-start; padding: 4px 0; }
.hw-shares-bars { flex: 0 1 420px; min-width: 260px; max-height: 320px; overflow: auto; }
.hw-shares-strip { flex: 1 1 420px; min-width: 260px; }
.hw-share-row { display: grid; grid-template-columns: 5ch 1fr 1fr 8ch; align-items: center; gap: 4px; width: 100%;
  font: inherit; color: inherit; background: none; border: 0; padding: 1px 2px; cursor: pointer; text-align: left; }
.hw-share-row:hover { background: var(--hw-bg2); }
.hw-share-row[aria-pressed="true"] { outline: 2px solid #2563eb; }
.hw-share-neg, .hw-share-pos { height: 10px; display: flex; }
.hw-share-neg { justify-content: flex-end; border-right: 1px solid var(--hw-dim); }
.hw-share-neg > span { background: #2563eb; } .hw-share-pos > span { background: #dc2626; }
.hw-share-val { text-align: right; font-variant-numeric: tabular-nums; }
.hw-tokens { display: flex; flex-wrap: wrap; gap: 2px; max-height: 260px; overflow: auto; padding: 2px 0; }
.hw-token { white-space: pre; font-family: var(--jp-code-font-family, ui-monospace, monospace); padding: 1px 3px;
  border-radius: 2px; border: 1px solid var(--hw-border); color: #111827; }
.hw-token.strong { color: #fff; }
.hw-shares-note { color: var(--hw-dim); margin: 2px 0; }
.hw-shares-error { color: #dc2626; }
.hw-shares-progress { width: min(320px, 100%); height: 8px; }
`;

const WHOLE = "whole model";

/** The panel; `request(msg)` resolves with {ok, msg, buffers} or {ok: false, text} (explorer.js's request). */
export function createSharesPanel({ request, nonce }) {
  const title = h("summary", { "data-testid": "shares-title" });
  const body = h("div", { class: "hw-shares-body", "data-testid": "shares-body" });
  const el = h("details", { class: "hw-shares", "data-testid": "shares" }, title, body);
  installStyles(el, nonce, CSS);
  let scope = ""; // "" = the whole model, else the selected layer
  let sample = null; // the selected sample, per scope
  let token = 0; // bumps on every load: a reply for an older one is dropped
  let current = null; // the key on screen or being asked for: opening the panel twice asks once
  let asked = null; // the request_id of the request awaited: its progress shows in place of "computing"
  const cache = new Map(); // `${scope}\u0000${sample}` -> decoded reply

  el.addEventListener("toggle", () => { if (el.open) load(); });
  setTitle();

  function setTitle() {
    title.textContent = `Which samples carried the step's gradient · ${scope || WHOLE}`;
  }

  async function load() {
    const key = `${scope}\u0000${sample ?? -1}`;
    if (key === current) return;
    current = key;
    const mine = ++token;
    let got = cache.get(key);
    if (!got) {
      body.replaceChildren(h("div", { class: "hw-shares-note", "data-testid": "shares-computing", text: "computing the shares…" }));
      const msg = sharesRequest(scope, sample ?? -1);
      asked = msg.request_id;
      const r = await request(msg);
      if (asked === msg.request_id) asked = null;
      if (mine !== token) return;
      if (!r.ok) { current = null; body.replaceChildren(h("div", { class: "hw-shares-error", "data-testid": "shares-error", text: r.text })); return; }
      try { got = decodeShares(r.msg.meta, r.buffers); } catch (e) {
        current = null;
        body.replaceChildren(h("div", { class: "hw-shares-error", "data-testid": "shares-error", text: `shares: ${e.message}` }));
        return;
      }
      cache.set(key, got);
    }
    if (mine === token) body.replaceChildren(...renderShares(got, (b) => { sample = b; load(); }));
  }

  return {
    el,
    /** The selected layer (null: none, the whole model): the panel follows it, reloading only when open. */
    setScope(layer) {
      const next = layer || "";
      if (next === scope) return;
      scope = next;
      sample = null;
      setTitle();
      current = null;
      if (el.open) load(); else body.replaceChildren();
    },
    /** A "running" status of the request this panel awaits (the kernel's fraction done, where the shares take
     * over half a second): shown as a progress bar in place of the "computing" line. False: not this panel's. */
    progress(requestId, fraction, text) {
      if (requestId === undefined || requestId !== asked) return false;
      const bar = h("progress", { class: "hw-shares-progress", "data-testid": "shares-progress", max: "1" });
      if (typeof fraction === "number" && Number.isFinite(fraction)) bar.value = Math.min(1, Math.max(0, fraction));
      body.replaceChildren(h("div", { class: "hw-shares-note", "data-testid": "shares-computing", text }), bar);
      return true;
    },
    /** A new trace (a rerun): every cached answer is stale. */
    reset() { cache.clear(); sample = null; token++; current = null; if (el.open) load(); else body.replaceChildren(); },
  };
}

/** The reply's meta with its vectors decoded ({values, index} of the bar, positions of the strip). */
export function decodeShares(meta, buffers) {
  const vec = (info) => (info ? Array.from(decodeTensor(info, buffers[info.buffer])) : null);
  return { ...meta, values: vec(meta.samples), indices: vec(meta.index), positionValues: vec(meta.positions) };
}

/** The bar (sorted by share, largest first) and, for the selected sample, its strip; `onPick(b)` selects b. */
export function renderShares(d, onPick) {
  const rows = d.indices.map((b, i) => [b, d.values[i]]).sort((x, y) => y[1] - x[1]);
  const absmax = Math.max(1e-300, ...rows.map(([, v]) => Math.abs(v)));
  const bars = h("div", { class: "hw-shares-bars", "data-testid": "share-bars" },
    h("div", { class: "hw-shares-note", text: `${fmt(d.n)} sample${d.n === 1 ? "" : "s"}${d.step !== null ? ` · step ${d.step}` : ""} · shares sum to ${fmt(d.sum)}${d.left_out ? ` · ${d.left_out} parameter${d.left_out === 1 ? "" : "s"} left out (see notes)` : ""}` }),
    h("div", { class: "hw-shares-note", text: "red: pulled with the step · blue: against it (a negative share) · click a sample for its positions" }),
    ...rows.map(([b, v]) => h("button", { type: "button", class: "hw-share-row", "data-testid": "share-bar", "data-sample": String(b), "data-value": String(v),
      "aria-pressed": String(d.sample === b), title: `sample ${b}: share ${v}`, onclick: () => onPick(b) },
    h("span", { text: `#${b}` }),
    h("span", { class: "hw-share-neg" }, sized(v < 0 ? (100 * -v) / absmax : 0)),
    h("span", { class: "hw-share-pos" }, sized(v > 0 ? (100 * v) / absmax : 0)),
    h("span", { class: "hw-share-val", text: fmt(v) }))));
  const notes = (d.notes || []).length ? h("ul", { class: "hw-shares-note", "data-testid": "shares-notes" }, ...d.notes.map((n) => h("li", { text: n }))) : null;
  return [bars, h("div", { class: "hw-shares-strip" }, d.sample === null ? h("div", { class: "hw-shares-note", text: "click a sample to see which of its positions carried its share" }) : strip(d), notes)];
}

/** A part of a share worth showing: not float rounding of the shares, which sum to 1 (|x| <= 1e-9). */
const offPositions = (x) => typeof x === "number" && Math.abs(x) > 1e-9;

/** A bar `pct` % of its half wide (its width set through the CSSOM, which the page's CSP allows). */
function sized(pct) {
  const bar = h("span", {});
  bar.style.width = `${pct}%`;
  return bar;
}

/** One sample's positions coloured by share (symmetric scale over the sample); each shows its token's text, else
 * its id, else its position; the title has all three and the exact share. */
export function strip(d) {
  const head = h("div", { class: "hw-panel-title", "data-testid": "strip-title", text: `sample ${d.sample}: share ${fmt(d.values[d.indices.indexOf(d.sample)])}` });
  if (!d.positionValues) return h("div", {}, head, h("div", { class: "hw-shares-note", "data-testid": "positions-note", text: d.positions_note || "positions not attributed here" }));
  const v = d.positionValues;
  const absmax = Math.max(1e-300, ...v.map(Math.abs));
  const placed = v.reduce((s, x) => s + x, 0);
  const cells = v.map((x, t) => {
    const text = d.tokens ? d.tokens[t] : d.ids ? String(d.ids[t]) : String(t);
    const [r, g, b] = colourOf(x, absmax);
    const tip = `position ${t}${d.ids ? ` · id ${d.ids[t]}` : ""}${d.tokens ? ` · ${JSON.stringify(d.tokens[t])}` : ""} · share ${x}`;
    const cell = h("span", { class: `hw-token${Math.abs(x) > 0.6 * absmax ? " strong" : ""}`, "data-testid": "token", "data-position": String(t),
      "data-value": String(x), title: tip, text: text.replace(/\n/g, "↵") || " " });
    cell.style.background = `rgb(${r}, ${g}, ${b})`; // through the CSSOM: the page's CSP refuses style attributes
    return cell;
  });
  return h("div", {}, head,
    h("div", { class: "hw-shares-note", text: `on its positions ${fmt(placed)}${offPositions(d.unplaced) ? ` · not on a position ${fmt(d.unplaced)}` : ""}${d.token_layer ? ` · tokens: the input of ${d.token_layer}` : ""}` }),
    h("div", { class: "hw-tokens", "data-testid": "token-strip" }, ...cells),
    d.positions_note ? h("div", { class: "hw-shares-note", "data-testid": "positions-note", text: d.positions_note }) : null,
    d.tokens_note ? h("div", { class: "hw-shares-note", "data-testid": "tokens-note", text: d.tokens_note }) : null);
}
