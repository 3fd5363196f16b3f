// The time axis of the watch view: which rows [v0, v1) the heatmap and charts show. The whole run by
// default (and while it grows); a wheel zooms around the pointer, a drag on the axis brushes a range,
// so one step can be CELL px wide: a target to click. Pure functions of the row count, for vitest.

/** A view of `n` rows: {v0, v1} or null for all of them. */
export function clampView(view, n) {
  if (!view || n <= 0) return null;
  let span = Math.max(1, Math.min(n, Math.round(view.v1 - view.v0)));
  let v0 = Math.round(view.v0);
  v0 = Math.max(0, Math.min(n - span, v0));
  if (span >= n) return null;
  return { v0, v1: v0 + span };
}

/** The rows shown: [v0, v1). */
export const visible = (view, n) => { const v = clampView(view, n); return v ? [v.v0, v.v1] : [0, n]; };

/** Zoom by `factor` (< 1 in, > 1 out) keeping the row at fraction `at` (0..1 of the width) where it is. */
export function zoom(view, n, at, factor, minSpan = 1) {
  if (!Number.isFinite(at)) at = 0.5;
  const [v0, v1] = visible(view, n);
  const span = v1 - v0, next = Math.max(minSpan, Math.min(n, Math.round(span * factor) || 1));
  if (next === span && factor < 1 && span > minSpan) return clampView({ v0: v0, v1: v0 + span - 1 }, n);
  const pivot = v0 + at * span;
  return clampView({ v0: Math.round(pivot - at * next), v1: Math.round(pivot - at * next) + next }, n);
}

/** The view of rows [a, b] (inclusive, either order), at least `minSpan` rows. */
export function brush(n, a, b, minSpan = 1) {
  let lo = Math.min(a, b), hi = Math.max(a, b) + 1;
  if (hi - lo < minSpan) { const mid = (lo + hi) / 2; lo = Math.round(mid - minSpan / 2); hi = lo + minSpan; }
  return clampView({ v0: lo, v1: hi }, n);
}

/** A view of `span` rows centred on row r. */
export const around = (n, r, span) => clampView({ v0: r - Math.floor(span / 2), v1: r - Math.floor(span / 2) + span }, n);

/** Shift by `rows` (positive: later). */
export function pan(view, n, rows) {
  const [v0, v1] = visible(view, n);
  return clampView({ v0: v0 + rows, v1: v1 + rows }, n);
}

/** The pointer on the plots: the wheel zooms around the pointer (shift+wheel pans), a drag along `axis` brushes. */
export function bindAxis({ plots, axis, n, layout, view, setView, rowAt, minSpan = 3 }) {
  for (const c of plots) c.addEventListener("wheel", (e) => {
    const lay = layout();
    if (!lay?.n) return;
    e.preventDefault();
    const x = e.clientX - c.getBoundingClientRect().left, width = lay.cols * lay.colW || 1;
    if (e.shiftKey) setView(pan(view(), n(), Math.sign(e.deltaY || e.deltaX) * Math.max(1, Math.round((lay.v1 - lay.v0) / 5))));
    else setView(zoom(view(), n(), Math.max(0, Math.min(1, x / width)), e.deltaY < 0 ? 0.6 : 1 / 0.6, minSpan));
  }, { passive: false });
  let drag = null;
  axis.addEventListener("mousedown", (e) => { drag = rowAt(e); e.preventDefault(); });
  axis.addEventListener("mouseup", (e) => {
    const r = rowAt(e);
    if (drag !== null && r !== null && r !== drag) setView(brush(n(), drag, r, minSpan));
    drag = null;
  });
}
