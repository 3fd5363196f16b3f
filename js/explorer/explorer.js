// The explorer: wires the views to the model. Every command is a request awaited until its reply
// (shared/protocol.js's createRequests: one reply per request_id, a detail, trace or status message), so an
// error stays next to the control that caused it. The same code runs on the standalone page with a
// read-only model (static_model.js).
import { h, reveal } from "../shared/dom.js";
import { fmt } from "../shared/format.js";
import * as P from "../shared/protocol.js";
import { createControls } from "./controls.js";
import { createDetailPanel } from "./detail.js";
import { createDiffView } from "./diffview.js";
import { createGraphView } from "./graph.js";
import { createLeftPane, createOverview } from "./overview.js";
import { createPanes } from "./panes.js";
import { createSharesPanel } from "./shares.js";
import { createStatusLine } from "./status.js";
import { installStyles } from "./styles.js";
import { createTreeView } from "./tree.js";

const KERNEL_GONE = "kernel disconnected: a snapshot of the recorded trace (layers not opened before show no detail); run the cell again to explore";
const NO_REPLY = "no reply from the kernel in 10 s: it is busy running a cell (the answer still shows when it comes), or this output outlived its kernel (run the cell again)";
export const REPLY_TIMEOUT_MS = 10_000;
const NO_GRADS = "no_grads"; // the id of the note "no gradients captured" (record/'s notes catalogue)

export function render({ model, el, nonce }) {
  globalThis.performance?.mark?.("hookwidget:render-start"); // read by benchmarks/explorer_time.py
  let summary = model.get("summary");
  let readonly = Boolean(model.get("readonly"));
  let disconnected = false; // the kernel is gone: see setDisconnected
  let selected = null;
  let lastDiff = model.get("diff") || null; // the last rerun's changes (a trait: survives a re-render, exported)
  let generation = 0; // bumps on each new trace: replies for an older one are dropped from the cache
  const cache = new Map(); // target -> {meta, tensors}
  const requests = P.createRequests(model, { noReply: NO_REPLY });

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
  // The shell is measured (panes.js): in a narrow output (a notebook beside its file browser, the watch's kept
  // Trace) the panes stack below the graph instead of squeezing it; either pane closes, remembered.
  // Below the explorer, full width (the token strip wraps there), asked for only when opened (shares.js).
  const shares = createSharesPanel({ request: (msg) => request(msg), nonce });
  shares.el.hidden = summary.has_grads === false;
  const shell = h("div", { class: "hw-shell" }, root, shares.el);
  el.replaceChildren(shell);
  const panes = createPanes(root, shell);
  graph.toolbar.prepend(panes.leftButton);
  graph.toolbar.append(panes.sideButton);
  root.addEventListener("keydown", (e) => { if (e.key === "Escape" && !e.target.closest?.("input")) clear(); });

  graph.setSummary(summary);
  tree.setSummary(summary);
  overview.setSummary(summary);
  left.update();
  controls.render(null, summary, readonly);
  renderBanner();
  if (lastDiff) { diffView.render(lastDiff); graph.setChanged(lastDiff.changed_nodes, lastDiff.changed_modules); tree.setSummary(summary, new Set(lastDiff.changed_modules)); }
  status.set("idle", readonly ? "read-only page: showing the recorded trace" : idleText());
  // A view restored from a notebook's saved widget state has no comm: ipywidgets marks its element disconnected.
  const marked = () => Boolean(el.closest?.(".jupyter-widgets-disconnected"));
  if (marked()) setDisconnected(true);
  requestAnimationFrame?.(() => { panes.measure(); graph.defaultView(); if (marked()) setDisconnected(true); });
  globalThis.performance?.mark?.("hookwidget:render-end");

  /** The resting status line: the trace on screen, and what its last rerun changed (from the explorer or Python). */
  function idleText() {
    const modules = `${fmt(summary.modules.length)} modules`;
    if (!lastDiff) return `loss ${fmt(summary.loss)} · ${modules}`;
    const changed = (lastDiff.changed_modules || []).length;
    return `rerun: loss ${fmt(lastDiff.loss_before)} → ${fmt(lastDiff.loss_after)} · ${changed} module${changed === 1 ? "" : "s"} changed · ${modules}`;
  }

  /** A change made from Python (t.rerun(), t.add_hook) shows in the status line unless a command is running. */
  function restStatus() { if (!readonly && status.state !== "running") status.set("idle", idleText()); }

  /** The notes banner. The "no gradients" note is found by its id (summary.note_ids, beside summary.notes),
   * never by its text; a summary without ids says so with has_grads. */
  function renderBanner() {
    const notes = summary.notes || [];
    const at = (summary.note_ids || []).indexOf(NO_GRADS);
    const noGrads = at >= 0 || summary.has_grads === false;
    const items = [];
    if (disconnected) items.push(h("div", { class: "hw-banner-main", "data-testid": "kernel-gone", text: KERNEL_GONE }));
    if (noGrads) items.push(h("div", { class: "hw-banner-main", "data-testid": "no-grads", text: at >= 0 ? notes[at] : "no gradients captured: the code ran no backward (activations only)" }));
    const rest = notes.filter((_, i) => i !== at);
    if (rest.length) items.push(h("details", { class: "hw-banner-notes" }, h("summary", { text: `${rest.length} note${rest.length === 1 ? "" : "s"} on this trace` }),
      h("ul", {}, ...rest.map((n) => h("li", { text: n })))));
    banner.replaceChildren(...items);
    banner.hidden = items.length === 0;
  }

  // ipywidgets tells a model its comm went (kernel restarted or shut down) with "comm_live_update": the
  // explorer stays as a snapshot of the recorded trace, read-only, says so, and answers its pending
  // requests instead of waiting for a kernel that will not reply. Any later reply proves it alive again.
  function setDisconnected(gone) {
    if (gone === disconnected) return;
    disconnected = gone;
    readonly = gone || Boolean(model.get("readonly"));
    root.classList.toggle("hw-readonly", readonly);
    root.classList.toggle("hw-disconnected", gone);
    controls.render(selected, summary, readonly);
    renderBanner();
    if (gone) {
      requests.cancel(KERNEL_GONE);
      status.set("idle", "kernel disconnected: read-only");
    } else {
      status.set("idle", idleText());
    }
  }
  const onCommLive = () => setDisconnected(true);

  /** Send a command: its reply, {ok: false, text} on an error status, or, for all but a rerun, after REPLY_TIMEOUT_MS
   * without one (a view restored from a notebook's saved widget state has no kernel behind it); a reply that
   * comes later is still used (see onMessage). */
  function request(msg) {
    if (disconnected) return Promise.resolve({ ok: false, text: KERNEL_GONE });
    const slow = msg.type === "rerun" || msg.type === "shares"; // a rerun, a big model's shares: seconds, awaited
    return requests.request(msg, { timeout: slow ? 0 : REPLY_TIMEOUT_MS, gen: generation });
  }

  function clear() {
    selected = null;
    panes.select(false);
    graph.select(null);
    tree.select(null);
    overview.select(null);
    controls.render(null, summary, readonly);
    detail.clear();
    shares.setScope(null);
  }

  /** Select a module or node; `show`: the user asked (a click, a key), so its detail comes into view where it is
   * out of it (a narrow output stacks the detail below the graph and the layer list). */
  async function select(sel, show = true) {
    selected = sel;
    panes.select(true);
    graph.select(sel);
    tree.select(sel);
    overview.select(sel);
    if (sel.kind === "module") graph.expandTo(sel.target);
    // A layer with parameters of its own shows its own shares; a container, a ReLU or a graph node the whole model's.
    const own = sel.kind === "module" && summary.modules.find((m) => m.name === sel.target)?.own_params?.length;
    shares.setScope(own ? sel.target : null);
    graph.focus(sel);
    controls.render(sel, summary, readonly);
    const hit = cache.get(sel.target);
    if (hit) { detail.render(hit.meta, hit.tensors, summary); if (show) reveal(detail.el); return; }
    detail.loading(sel.target);
    if (show) reveal(detail.el);
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
    shares.reset();
    diffView.render(lastDiff);
    graph.setChanged(lastDiff.changed_nodes, lastDiff.changed_modules);
    tree.setSummary(summary, new Set(lastDiff.changed_modules));
    if (selected) select(selected, false);
  }

  function onMessage(raw, buffers = []) {
    const msg = P.parseIncoming(raw);
    if (!msg) return;
    setDisconnected(false); // it answered
    const req = requests.settle(msg, buffers);
    if (req?.late) { // the answer after we stopped waiting: keep a detail, show the rest
      if (msg.type === "detail" && req.gen === generation) lateDetail(msg, buffers); // not for an older trace
      else if (msg.type === "status") status.set(msg.state, msg.text);
      return;
    }
    if (msg.type === "trace") { if (!req) applyTrace(msg); return; } // no request: a rerun started elsewhere
    if (msg.type === "status" && msg.state === "running" && shares.progress(msg.request_id, msg.fraction, msg.text)) return;
    // A status: progress, a command's "done" (its error stays beside its control), or one no request awaits
    // (a rerun's closing "done", an error for a lost request).
    if (msg.type === "status" && (!req || msg.state !== "error")) status.set(msg.state, msg.text);
  }

  function lateDetail(msg, buffers) {
    try {
      const tensors = P.decodeTensors(msg.meta, buffers);
      cache.set(msg.target, { meta: msg.meta, tensors });
      if (selected?.target === msg.target) { detail.render(msg.meta, tensors, summary); status.set("idle", idleText()); }
    } catch { /* a late reply that cannot be decoded is dropped: the error shown stands */ }
  }

  function onSummary() {
    summary = model.get("summary");
    cache.clear(); // the kernel may show a newer trace (a rerun from Python): never serve an old detail
    generation++;
    shares.reset();
    shares.el.hidden = summary.has_grads === false;
    graph.setSummary(summary, { keepView: true });
    tree.setSummary(summary, new Set(lastDiff?.changed_modules || []));
    overview.setSummary(summary);
    left.update();
    if (selected) { graph.select(selected); tree.select(selected); overview.select(selected); }
    if (lastDiff) graph.setChanged(lastDiff.changed_nodes, lastDiff.changed_modules);
    controls.render(selected, summary, readonly);
    renderBanner();
    restStatus();
  }

  // A rerun made from Python (t.rerun() in a cell) arrives as new summary and diff traits, no message.
  function onDiff() {
    lastDiff = model.get("diff") || null;
    diffView.render(lastDiff);
    graph.setChanged(lastDiff?.changed_nodes || [], lastDiff?.changed_modules || []);
    tree.setSummary(summary, new Set(lastDiff?.changed_modules || []));
    restStatus();
  }

  model.on("msg:custom", onMessage);
  model.on("change:summary", onSummary);
  model.on("change:diff", onDiff);
  model.on("comm_live_update", onCommLive); // ipywidgets': fired when the model's comm goes
  return () => {
    model.off?.("msg:custom", onMessage);
    model.off?.("change:summary", onSummary);
    model.off?.("change:diff", onDiff);
    model.off?.("comm_live_update", onCommLive);
  };
}
