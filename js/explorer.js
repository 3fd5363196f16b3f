// The explorer: wires the views to the model. Every command is a request awaited until its reply
// (request_id -> promise resolved by the matching detail / trace / status message), so an error
// stays next to the control that caused it. The same code runs on the standalone page with a
// read-only model (static_model.js).
import { createControls } from "./controls.js";
import { createDetailPanel } from "./detail.js";
import { createDiffView } from "./diffview.js";
import { h } from "./dom.js";
import { fmt } from "./format.js";
import { createGraphView } from "./graph.js";
import { createLeftPane, createOverview } from "./overview.js";
import * as P from "./protocol.js";
import { createStatusLine } from "./status.js";
import { installStyles } from "./styles.js";
import { createTreeView } from "./tree.js";

export function render({ model, el, nonce }) {
  let summary = model.get("summary");
  const readonly = Boolean(model.get("readonly"));
  let selected = null;
  let lastDiff = model.get("diff") || null; // the last rerun's changes (a trait: survives a re-render, exported)
  let generation = 0; // bumps on each new trace: replies for an older one are dropped from the cache
  const cache = new Map(); // target -> {meta, tensors}
  const waiting = new Map(); // request_id -> {resolve, type, target}

  const status = createStatusLine();
  const detail = createDetailPanel();
  const controls = createControls({ onToggle });
  const diffView = createDiffView();
  const graph = createGraphView({ onSelect: select, onStatus: (state, text) => status.set(state, text) });
  const tree = createTreeView({ onSelect: select, onClear: clear });
  const overview = createOverview({ onSelect: select, onClear: clear });
  const left = createLeftPane(tree.el, overview);
  const banner = h("div", { class: "hw-banner", "data-testid": "notes" });
  const root = h("div", { class: "hw-root" + (readonly ? " hw-readonly" : "") },
    banner, left.el, graph.el, h("div", { class: "hw-side" }, detail.el, controls.el), diffView.el, status.el);
  installStyles(root, nonce);
  el.replaceChildren(root);
  root.addEventListener("keydown", (e) => { if (e.key === "Escape" && !e.target.closest?.("input")) clear(); });

  graph.setSummary(summary);
  tree.setSummary(summary);
  overview.setSummary(summary);
  left.update();
  controls.render(null, summary, readonly);
  renderBanner();
  if (lastDiff) { diffView.render(lastDiff); graph.setChanged(lastDiff.changed_nodes, lastDiff.changed_modules); tree.setSummary(summary, new Set(lastDiff.changed_modules)); }
  status.set("idle", readonly ? "read-only page: showing the recorded trace" : idleText());
  requestAnimationFrame?.(() => graph.defaultView());

  function idleText() { return `loss ${fmt(summary.loss)} · ${fmt(summary.modules.length)} modules`; }

  function renderBanner() {
    const notes = summary.notes || [];
    const noGrads = summary.has_grads === false || notes.some((n) => n.startsWith("no gradients captured"));
    const items = [];
    if (noGrads) items.push(h("div", { class: "hw-banner-main", "data-testid": "no-grads", text: notes.find((n) => n.startsWith("no gradients captured")) || "no gradients captured: the code ran no backward (activations only)" }));
    const rest = notes.filter((n) => !n.startsWith("no gradients captured"));
    if (rest.length) items.push(h("details", { class: "hw-banner-notes" }, h("summary", { text: `${rest.length} note${rest.length === 1 ? "" : "s"} on this trace` }),
      h("ul", {}, ...rest.map((n) => h("li", { text: n })))));
    banner.replaceChildren(...items);
    banner.hidden = items.length === 0;
  }

  /** Send a command; resolves with {ok: true, msg, buffers} on its reply or {ok: false, text} on an error status. */
  function request(msg) {
    return new Promise((resolve) => {
      waiting.set(msg.request_id, { resolve, type: msg.type, target: msg.target });
      try { model.send(msg); }
      catch (e) { waiting.delete(msg.request_id); resolve({ ok: false, text: `could not reach the kernel: ${e.message}` }); }
    });
  }

  function clear() {
    selected = null;
    graph.select(null);
    tree.select(null);
    overview.select(null);
    controls.render(null, summary, readonly);
    detail.clear();
  }

  async function select(sel) {
    selected = sel;
    graph.select(sel);
    tree.select(sel);
    overview.select(sel);
    if (sel.kind === "module") graph.expandTo(sel.target);
    graph.focus(sel);
    controls.render(sel, summary, readonly);
    const hit = cache.get(sel.target);
    if (hit) { detail.render(hit.meta, hit.tensors, summary); return; }
    detail.loading(sel.target);
    const gen = generation;
    const r = await request(P.detail(sel.target));
    if (!r.ok) { if (selected?.target === sel.target) detail.error(sel.target, r.text); status.set("error", r.text); return; }
    let tensors;
    try { tensors = P.decodeTensors(r.msg.meta, r.buffers); }
    catch (e) { detail.error(sel.target, `detail of ${sel.target}: ${e.message}`); return; }
    if (gen === generation) cache.set(sel.target, { meta: r.msg.meta, tensors });
    if (selected?.target === sel.target) detail.render(r.msg.meta, tensors, summary);
  }

  async function onToggle(target, kind, on, params) {
    controls.setBusy(true);
    status.set("running", `${on ? "adding" : "removing"} ${kind} on ${target}`);
    const r = await request(on ? P.addHook(target, kind, params) : P.removeHook(target, kind));
    if (!r.ok) {
      // The hook was refused: no rerun; the error stays beside the control until the user acts.
      controls.setBusy(false);
      controls.setError(target, kind, r.text);
      status.set("error", r.text);
      return;
    }
    status.set("running", "rerunning the traced code");
    const rr = await request(P.rerun());
    controls.setBusy(false);
    if (!rr.ok) { controls.setError(target, kind, rr.text); status.set("error", rr.text); return; }
    applyTrace(rr.msg);
  }

  function applyTrace(msg) {
    generation++;
    lastDiff = msg.diff;
    cache.clear();
    diffView.render(lastDiff);
    graph.setChanged(lastDiff.changed_nodes, lastDiff.changed_modules);
    tree.setSummary(summary, new Set(lastDiff.changed_modules));
    if (selected) select(selected);
  }

  function onMessage(raw, buffers = []) {
    const msg = P.parseIncoming(raw);
    if (!msg) return;
    const req = waiting.get(msg.request_id);
    if (msg.type === "detail" || msg.type === "trace") {
      if (req) { waiting.delete(msg.request_id); req.resolve({ ok: true, msg, buffers }); }
      else if (msg.type === "trace") applyTrace(msg); // a rerun started elsewhere
      return;
    }
    // status
    if (msg.state === "running") { status.set("running", msg.text); return; }
    if (req) {
      waiting.delete(msg.request_id);
      req.resolve(msg.state === "error" ? { ok: false, text: msg.text } : { ok: true, msg, buffers });
      if (msg.state === "done") status.set("done", msg.text);
    } else {
      status.set(msg.state, msg.text); // a rerun's closing "done", or an error for a lost request
    }
  }

  function onSummary() {
    summary = model.get("summary");
    cache.clear(); // the kernel may show a newer trace (a rerun from Python): never serve an old detail
    generation++;
    graph.setSummary(summary, { keepView: true });
    tree.setSummary(summary, new Set(lastDiff?.changed_modules || []));
    overview.setSummary(summary);
    left.update();
    if (selected) { graph.select(selected); tree.select(selected); overview.select(selected); }
    if (lastDiff) graph.setChanged(lastDiff.changed_nodes, lastDiff.changed_modules);
    controls.render(selected, summary, readonly);
    renderBanner();
  }

  model.on("msg:custom", onMessage);
  model.on("change:summary", onSummary);
  return () => {
    model.off?.("msg:custom", onMessage);
    model.off?.("change:summary", onSummary);
  };
}
