// The watch view's words: a step's readout, the kept steps' buttons and the list of anomalies with the lead the
// kernel worked out for each (leads.js). Names from user code are set as text only.
import { fmt } from "../shared/format.js";
import { leadsOf } from "./leads.js";
import { lrText } from "./lr.js";
import { fmtOver, overflowAt, stepOverflowAt } from "./overflow.js";
import { h, STAT_LABELS } from "./ui.js";

const LAYERS_READ = 24; // layers a step's readout names (w.series has them all)

/** A step's leading statistics: its learning rate(s), the update ratio and gradient norm of its first layers, the
 * global gradient norm; a row the view holds only in bins says so. */
export function stepText(store, r) {
  const { meta } = store;
  if (!store.received(r)) return `step ${fmt(store.stepOf(r))}: its values are held in bins here (zoom in to read them at full resolution, or read w.series)`;
  const parts = [];
  for (const name of ["update_ratio", "grad_norm"]) {
    const k = meta.stats.indexOf(name);
    if (k < 0 || !store.received(r, k)) continue;
    const named = meta.layers.slice(0, LAYERS_READ).map((layer, l) => `${layer} ${fmtOver(store.value(r, l, k), overflowAt(store, r, l, k))}`);
    parts.push(`${STAT_LABELS[name] || name}: ${named.join(", ")}${meta.layers.length > LAYERS_READ ? `, … (${fmt(meta.layers.length - LAYERS_READ)} more)` : ""}`);
  }
  return `step ${fmt(store.stepOf(r))} · loss ${fmt(store.stepValue(r, 0))} · ${lrText(store, r)} · global ‖grad‖₂ ${fmtOver(store.stepValue(r, 1), stepOverflowAt(store, r, 1))} · ${parts.join(" · ")}`;
}

/** The kept steps as buttons that open their Trace (`open(step)`). */
export function keptButtons(el, store, openStep, open) {
  const byStep = store.anomalyMap();
  const buttons = store.kept.map((s) => {
    const why = byStep.get(s);
    const text = `step ${fmt(s)}` + (why ? ` · ${why[0][0]}: ${why[0][1]}` : s === store.kept[store.kept.length - 1] ? " · latest" : s === 0 ? " · first" : "");
    return h("button", { "data-kept-step": String(s), class: (why ? "anomalous" : "") + (s === openStep ? " on" : ""), title: `open the full Trace of step ${s}`, text: text.length > 80 ? text.slice(0, 79) + "…" : text, onclick: () => open(s) });
  });
  const more = store.dropped ? [h("span", { class: "hw-w-dim", text: `(${fmt(store.dropped)} anomalous step${store.dropped === 1 ? "" : "s"} not kept: max_kept reached)` })] : [];
  el.replaceChildren(h("span", { class: "hw-w-dim", text: buttons.length ? "kept Traces:" : "no Trace kept (flight recorder off, or no step yet)" }), ...buttons, ...more);
}

function leadButton(lead, showLead) {
  return h("button", { class: "hw-w-lead", "data-lead-step": String(lead.step), title: "zoom the steps to it and select it", text: `lead: ${lead.text}`, onclick: () => showLead(lead) });
}

/** The anomalies (the first 200), each with its lead as a button that zooms to it (`showLead(lead)`) and, with
 * per_sample=True, the samples that carried its step (the kernel's text: watch/carriers.py), set as text. */
export function anomalyList(el, store, showLead) {
  const list = store.anomalies;
  el.hidden = list.length === 0;
  if (list.length && !el.dataset.opened) { el.open = true; el.dataset.opened = "1"; }
  const shown = list.slice(0, 200), leads = leadsOf(store), first = list.length ? leads.get(list[0][0]) : null;
  const seen = new Set();
  const item = ([step, where, reason, , carried]) => {
    const first = !seen.has(step), lead = first ? leads.get(step) : null;
    seen.add(step);
    const after = store.nonfinite.get(step);
    return h("li", { "data-step": String(step) }, h("span", { text: `step ${fmt(step)} · ${where}: ${reason}` }),
      after ? h("span", { class: "hw-w-dim", "data-testid": "watch-nonfinite-after", text: ` · then ${fmt(after)} more non-finite step${after === 1 ? "" : "s"}` }) : null,
      lead ? leadButton(lead, showLead) : null,
      first && carried && carried.text ? h("span", { class: "hw-w-dim", "data-testid": "watch-anomaly-samples", title: "which samples carried the step's gradient: their shares ⟨G_b, G⟩/‖G‖² (w.anomalies[i].samples)", text: ` · ${carried.text}` }) : null);
  };
  el.replaceChildren(h("summary", { "data-testid": "watch-first-lead", text: `${fmt(list.length)} anomal${list.length === 1 ? "y" : "ies"}${list.length ? ` (first at step ${fmt(list[0][0])}${first ? ` · lead: ${first.text}` : ""})` : ""}` }),
    h("ul", { class: "hw-w-anoms" }, ...shown.map(item),
      list.length > shown.length ? h("li", { class: "hw-w-dim", text: `… ${fmt(list.length - shown.length)} more (w.anomalies)` }) : null));
}
