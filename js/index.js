// Entry of the explorer front-end (anywidget ESM). Views are added in their own modules.
export function render({ el }) {
  el.textContent = "hookwidget";
}

export default { render };
