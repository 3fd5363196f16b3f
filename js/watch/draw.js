// Drawing primitives of the watch view: a series as a line (one value a column), or, where a column stands for a
// bin of several steps, as the bin's min–max band under its mean line, so a spike inside a bin stays drawn at its
// height; non-finite values as ticks (NaN magenta at the bottom, +Inf red at the top).
import { cssOf, INF_RGB, NAN_RGB, position } from "./scale.js";

/** Draw `pts` ({min, max, mean, nf} a column, `dx` px apart) in the box (x, y, boxH): the band where a column holds
 * more than one value (`band`), the mean line, and ticks where a column held a NaN or ±Inf. */
export function series(ctx, pts, scale, { x = 0, y, dx, boxH, colour, band }) {
  const at = (v) => { const t = position(v, scale); return t === null ? null : y + boxH - (t === -1 ? 0 : t) * boxH; };
  if (band) {
    ctx.save();
    ctx.globalAlpha = 0.28;
    ctx.fillStyle = colour;
    pts.forEach((p, i) => {
      const hi = at(p.max), lo = at(p.min);
      if (hi === null || lo === null) return;
      ctx.fillRect(x + i * dx, hi - 0.5, Math.max(1, dx), Math.max(1, lo - hi + 1));
    });
    ctx.restore();
  }
  ctx.strokeStyle = colour;
  ctx.lineWidth = 1.2;
  ctx.beginPath();
  let pen = false;
  const dots = [];
  pts.forEach((p, i) => {
    const px = x + (i + 0.5) * dx, py = at(band ? p.mean : p.last);
    if (p.nf) tick(ctx, p.nf, px, y, dx, boxH);
    if (py === null) { pen = false; return; }
    if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
    pen = true;
    if (dx >= 6) dots.push([px, py]); // few steps: each one visible, a lone one too
  });
  ctx.stroke();
  ctx.fillStyle = colour;
  for (const [px, py] of dots) ctx.fillRect(px - 1.5, py - 1.5, 3, 3);
}

/** A NaN tick (magenta, at the bottom) and/or an Inf tick (red: +Inf at the top, -Inf at the bottom). */
function tick(ctx, nf, px, y, dx, boxH) {
  const h = Math.max(2, Math.min(6, boxH / 3)), w = Math.max(1, dx * 0.6);
  ctx.save();
  if (nf & 1) { ctx.fillStyle = cssOf(NAN_RGB); ctx.fillRect(px - w / 2, y + boxH - h, w, h); }
  if (nf & 2) { ctx.fillStyle = cssOf(INF_RGB); ctx.fillRect(px - w / 2, y, w, h); }
  if (nf & 4) { ctx.fillStyle = cssOf(INF_RGB); ctx.fillRect(px - w / 2, y + boxH - h, w, h); }
  ctx.restore();
}
