// The theme both explorers share: JupyterLab / VS Code CSS variables where present, light fallbacks otherwise,
// and the dark fallbacks of a standalone page; and the one way a view installs its style sheet (nonce-tagged:
// the standalone page's CSP allows no other style).

/** The colour variables, to open a view's root rule. */
export const THEME_VARS = `
  --hw-bg: var(--jp-layout-color0, var(--vscode-editor-background, #ffffff));
  --hw-bg2: var(--jp-layout-color2, var(--vscode-sideBar-background, #f3f4f6));
  --hw-fg: var(--jp-ui-font-color0, var(--vscode-editor-foreground, #111827));
  --hw-dim: var(--jp-ui-font-color2, var(--vscode-descriptionForeground, #6b7280));
  --hw-border: var(--jp-border-color1, var(--vscode-panel-border, #d1d5db));`;

/** The same variables on a dark standalone page (no notebook theme to follow there). */
export const DARK_VARS = "--hw-bg: #111827; --hw-bg2: #1f2937; --hw-fg: #e5e7eb; --hw-dim: #9ca3af; --hw-border: #374151;";

/** Put `css` in a <style> at the start of `root`. */
export function installStyles(root, nonce, css) {
  const style = document.createElement("style");
  if (nonce) style.nonce = nonce;
  style.textContent = css;
  root.prepend(style);
}
