// The one place numbers are formatted for reading: 4 significant digits, thousands separators,
// counts as 7.36 M, norms named. Every view imports from here.

const GROUP = /\B(?=(\d{3})+(?!\d))/g;
const sep = (intText) => intText.replace(GROUP, ",");

/** A number from the kernel for reading ("nan"/"inf" strings stay as they are; null -> "–"). */
export function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "string") return v;
  if (typeof v === "bigint") return sep(v.toString());
  if (Number.isNaN(v)) return "nan";
  if (!Number.isFinite(v)) return v > 0 ? "inf" : "-inf";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (Number.isInteger(v) && a < 1e9) return (v < 0 ? "-" : "") + sep(String(a));
  if (a < 1e-3 || a >= 1e9) {
    const [m, e] = v.toExponential(digits - 1).split("e");
    return `${m.includes(".") ? m.replace(/\.?0+$/, "") : m}e${e.replace("+", "")}`;
  }
  const text = Number(v.toPrecision(digits)).toString();
  const [i, f] = text.replace("-", "").split(".");
  return (v < 0 ? "-" : "") + sep(i) + (f ? "." + f : "");
}

/** A count (parameters, floats): 950, 12.3 k, 7.36 M, 1.2 G. */
export function fmtCount(n) {
  if (n === null || n === undefined) return "–";
  const a = Math.abs(n);
  for (const [d, u] of [[1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (a >= d) return `${Number((n / d).toPrecision(3))} ${u}`;
  }
  return String(n);
}

/** "7.36 M params" / "12 params"; "" for none. */
export const fmtParams = (n) => (n ? `${fmtCount(n)} param${n === 1 ? "" : "s"}` : "");

export function fmtShape(shape) {
  if (shape === null || shape === undefined) return "–";
  return "(" + shape.join(", ") + (shape.length === 1 ? ",)" : ")");
}

/** ‖·‖₂ = 1.234 */
export const fmtNorm = (v) => `‖·‖₂ = ${fmt(v)}`;

/** Statistics of a whole tensor, as the kernel computed them: min, max, mean, std, NaN/Inf counts. */
export function fmtStats(st) {
  if (!st) return "";
  const parts = [`min ${fmt(st.min)}`, `max ${fmt(st.max)}`, `mean ${fmt(st.mean)}`, `std ${fmt(st.std)}`];
  if (st.norm !== undefined && st.norm !== null) parts.push(fmtNorm(st.norm));
  const bad = [st.nan ? `${fmt(st.nan)} NaN` : "", st.inf ? `${fmt(st.inf)} Inf` : ""].filter(Boolean);
  parts.push(bad.length ? bad.join(", ") : "no NaN/Inf");
  return parts.join(" · ");
}
