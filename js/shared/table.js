// The one sortable table: a header row whose cells sort the rows (click, Enter or Space), with aria-sort and
// an arrow on the sorted column. Missing values (null) sort last in either direction. Used by the explorer's
// diff table and its layer overview.
import { h } from "./dom.js";

/**
 * cols: [{key, label, title, desc (first click sorts descending), cls}]; `attr`: the header cells' data
 * attribute naming their column; `valueOf(row, key)`: what a column sorts by; `tie(p, q)`: order of equal
 * values (0: as given); `onSort()`: redraw (the header cell of the column keeps the focus).
 */
export function createSortable({ cols, initial, attr = "data-sort", valueOf = (r, k) => r[k], tie = () => 0, onSort }) {
  let sort = { ...initial };
  let root = null;

  function sorted(rows) {
    return [...rows].sort((p, q) => {
      const x = valueOf(p, sort.key), y = valueOf(q, sort.key);
      if (x === null || y === null) return x === y ? tie(p, q) : x === null ? 1 : -1;
      const c = x < y ? -1 : x > y ? 1 : tie(p, q);
      return sort.desc ? -c : c;
    });
  }

  function sortBy(key) {
    sort = sort.key === key ? { key, desc: !sort.desc } : { key, desc: cols.find((c) => c.key === key).desc === true };
    onSort();
    root?.querySelector(`[${attr}="${key}"]`)?.focus?.();
  }

  /** The header row; `within` is the element the table is drawn in (to give the focus back after a sort). */
  function head(within) {
    root = within;
    return h("tr", {}, ...cols.map((c) => h("th", {
      class: "hw-sortable" + (c.cls ? ` ${c.cls}` : ""), [attr]: c.key, title: c.title, tabindex: "0",
      "aria-sort": sort.key === c.key ? (sort.desc ? "descending" : "ascending") : "none",
      text: c.label + (sort.key === c.key ? (sort.desc ? " ▾" : " ▴") : ""),
      onclick: () => sortBy(c.key),
      onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { sortBy(c.key); e.preventDefault(); } },
    })));
  }

  return { sorted, head, get key() { return sort.key; } };
}
