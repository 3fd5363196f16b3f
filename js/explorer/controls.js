// Hook controls for the selected layer or node: every registered intervention kind with its parameters.
// A toggle (data-hook="<kind>") asks the kernel to add or remove the hook, then to rerun. A refused
// hook's error stays beside its control (data-testid="hook-error") until the user acts on it again.
import { h } from "../shared/dom.js";

export function createControls({ onToggle }) {
  const body = h("div", { class: "hw-controls-body" });
  const el = h("div", { class: "hw-controls", "data-testid": "controls" }, h("div", { class: "hw-panel-title", text: "hooks" }), body);
  let busy = false;
  let current = null;
  const errors = new Map(); // `${target}\u0000${kind}` -> text
  const typed = new Map(); // `${target}\u0000${kind}\u0000${param}` -> what the user typed (kept across redraws)

  /** Every hook on, whatever is selected: the same list as t.interventions in Python. */
  function hooksOn(summary) {
    const on = summary.hooks || [];
    if (!on.length) return [];
    return [h("div", { class: "hw-hooks-on", "data-testid": "hooks-on" }, h("span", { class: "hw-dim", text: `${on.length} on: ` }),
      ...on.map((x, i) => h("span", { class: "hw-hook-on", "data-hook-target": x.target, "data-hook-kind": x.kind,
        text: `${x.kind} on ${x.target || "(root)"}${i < on.length - 1 ? ", " : ""}` })))];
  }

  function render(sel, summary, readonly) {
    current = { sel, summary, readonly };
    if (!sel) { body.replaceChildren(...hooksOn(summary), h("div", { class: "hw-dim", text: "select a module or node to attach a hook" })); return; }
    const target = sel.target;
    const active = new Map(summary.hooks.filter((x) => x.target === target).map((x) => [x.kind, x]));
    const rows = [...hooksOn(summary), h("div", { class: "hw-dim" }, "on ", h("b", { text: target || "(root)" }))];
    if (readonly) rows.push(h("div", { class: "hw-note", "data-testid": "readonly-note", text: "read-only page: hook toggles need a running kernel (open the notebook and use t.widget())" }));
    for (const kind of summary.kinds) {
      const key = `${target}\u0000${kind.name}`;
      const layerOnly = kind.attach === "out" && sel.kind !== "module";
      const on = active.has(kind.name);
      const inputs = kind.params.map((p) => {
        const tkey = `${key}\u0000${p.name}`;
        const value = on ? active.get(kind.name).params[p.name] : typed.get(tkey) ?? p.default ?? defaultFor(kind.name, p.name);
        const inp = h("input", { type: kind.python_only ? "text" : "number", step: "any", name: p.name, "data-param": p.name, value: value ?? "",
          disabled: readonly || kind.python_only || on || busy, oninput: () => { typed.set(tkey, inp.value); errors.delete(key); errLine.textContent = ""; errLine.hidden = true; inp.classList.remove("invalid"); } });
        return h("label", { class: "hw-param" }, p.name, " ", inp);
      });
      const errLine = h("div", { class: "hw-error hw-hook-error", "data-testid": "hook-error", "data-hook-error": kind.name, role: "alert", text: errors.get(key) || "" });
      errLine.hidden = !errors.has(key);
      const box = h("input", { type: "checkbox", "data-hook": kind.name, disabled: readonly || kind.python_only || layerOnly || busy, title: kind.doc });
      box.checked = on;
      box.addEventListener("change", () => {
        errors.delete(key);
        const params = {};
        for (const inp of inputs.map((l) => l.querySelector("input"))) {
          const name = inp.getAttribute("data-param");
          const v = Number(inp.value);
          if (inp.value.trim() === "" || !Number.isFinite(v)) {
            box.checked = !box.checked;
            inp.classList.add("invalid");
            setError(target, kind.name, `${kind.name}: ${name} ${inp.value.trim() === "" ? "is empty" : "is not a number"}: enter a number`);
            return;
          }
          params[name] = v;
        }
        onToggle(target, kind.name, box.checked, params);
      });
      const why = kind.python_only ? "set from Python: t.add_hook(target, \"" + kind.name + "\", fn=...)" : layerOnly ? "needs a layer, not a graph node" : kind.doc;
      rows.push(h("div", { class: "hw-hook" + (on ? " on" : ""), "data-hook-row": kind.name },
        h("label", { class: "hw-hook-name" }, box, " ", kind.name), ...inputs, h("span", { class: "hw-dim", text: why }), errLine));
    }
    body.replaceChildren(...rows);
  }

  function setError(target, kind, text) {
    errors.set(`${target}\u0000${kind}`, String(text ?? "").split("\n")[0]);
    if (current) render(current.sel, current.summary, current.readonly);
    // Keep the error in view beside its control (the side panel scrolls).
    body.querySelector(`[data-hook-error="${kind}"]`)?.scrollIntoView?.({ block: "nearest" });
  }

  return {
    el, render, setError,
    setBusy(b) { busy = b; if (current) render(current.sel, current.summary, current.readonly); },
  };
}

function defaultFor(kind, param) {
  return { grad_scale: { factor: 0.5 }, out_scale: { factor: 0.5 }, grad_clamp: { min: -0.01, max: 0.01 }, grad_clip_norm: { max_norm: 1 } }[kind]?.[param];
}
