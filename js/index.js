// Entry of the explorer (anywidget ESM): wires the views to the model. The same code runs on the
// standalone page with a read-only model (static_model.js).
import { createControls } from "./controls.js";
import { createDetailPanel } from "./detail.js";
import { createDiffView } from "./diffview.js";
import { h } from "./dom.js";
import { createGraphView } from "./graph.js";
import * as P from "./protocol.js";
import { createStatusLine } from "./status.js";
import { installStyles } from "./styles.js";
import { createTreeView } from "./tree.js";

export function render({ model, el, nonce }) {
  let summary = model.get("summary");
  const readonly = Boolean(model.get("readonly"));
  let selected = null;
  let lastDiff = null;
  const cache = new Map(); // target -> {meta, tensors}
  const pending = new Map(); // request_id -> {type, target}

  const status = createStatusLine();
  const detail = createDetailPanel();
  const controls = createControls({ onToggle });
  const diffView = createDiffView();
  const graph = createGraphView({ onSelect: select, onStatus: (state, text) => status.set(state, text) });
  const tree = createTreeView({ onSelect: select });
  const root = h("div", { class: "hw-root" + (readonly ? " hw-readonly" : "") },
    tree.el, graph.el, h("div", { class: "hw-side" }, detail.el, controls.el), diffView.el, status.el);
  installStyles(root, nonce);
  el.replaceChildren(root);

  graph.setSummary(summary);
  tree.setSummary(summary);
  controls.render(null, summary, readonly);
  status.set("idle", readonly ? "read-only page: showing the recorded trace" : `loss ${summary.loss ?? "–"} · ${summary.modules.length} modules`);
  requestAnimationFrame?.(() => graph.fit());

  function send(msg) {
    pending.set(msg.request_id, { type: msg.type, target: msg.target });
    model.send(msg);
    return msg.request_id;
  }

  function select(sel) {
    selected = sel;
    graph.select(sel);
    tree.select(sel);
    if (sel.kind === "module") graph.expandTo(sel.target);
    controls.render(sel, summary, readonly);
    const hit = cache.get(sel.target);
    if (hit) { detail.render(hit.meta, hit.tensors, summary); return; }
    detail.loading(sel.target);
    send(P.detail(sel.target));
  }

  function onToggle(target, kind, on, params) {
    controls.setBusy(true);
    status.set("running", `${on ? "adding" : "removing"} ${kind} on ${target}`);
    send(on ? P.addHook(target, kind, params) : P.removeHook(target, kind));
    send(P.rerun());
  }

  function onMessage(raw, buffers = []) {
    const msg = P.parseIncoming(raw);
    if (!msg) return;
    const req = pending.get(msg.request_id);
    if (msg.type === "detail") {
      pending.delete(msg.request_id);
      let tensors;
      try { tensors = P.decodeTensors(msg.meta, buffers); }
      catch (e) { status.set("error", `detail of ${msg.target}: ${e.message}`); return; }
      cache.set(msg.target, { meta: msg.meta, tensors });
      if (selected && selected.target === msg.target) detail.render(msg.meta, tensors, summary);
    } else if (msg.type === "trace") {
      lastDiff = msg.diff;
      cache.clear();
      diffView.render(lastDiff);
      graph.setChanged(lastDiff.changed_nodes, lastDiff.changed_modules);
      tree.setSummary(summary, new Set(lastDiff.changed_modules));
      if (selected) { detail.loading(selected.target); send(P.detail(selected.target)); }
    } else if (msg.type === "status") {
      status.set(msg.state, msg.text);
      if (msg.state !== "running") pending.delete(msg.request_id);
      if (msg.state === "error" && req?.type === "detail" && selected?.target === req.target) detail.error(req.target, msg.text);
      if (msg.state === "error" || (msg.state === "done" && (req?.type === "rerun" || req === undefined))) controls.setBusy(false);
    }
  }

  function onSummary() {
    summary = model.get("summary");
    graph.setSummary(summary, { keepView: true });
    tree.setSummary(summary, new Set(lastDiff?.changed_modules || []));
    if (selected) { graph.select(selected); tree.select(selected); }
    if (lastDiff) graph.setChanged(lastDiff.changed_nodes, lastDiff.changed_modules);
    controls.render(selected, summary, readonly);
  }

  model.on("msg:custom", onMessage);
  model.on("change:summary", onSummary);
  return () => {
    model.off?.("msg:custom", onMessage);
    model.off?.("change:summary", onSummary);
  };
}

export default { render };
