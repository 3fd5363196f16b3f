// The one colour-map builder: a lookup table of any colour map (a d3 interpolator or stops of our own),
// read by position in [0, 1]. The explorer's heatmaps (diverging), the layer overview (blue → pale → red)
// and the watch's heatmap (viridis) are all built from it.

/** Magenta: the colour every view gives NaN. */
export const NAN_RGB = [255, 0, 255];

/** [r, g, b] of a colour as d3 writes it ("#rrggbb" or "rgb(r, g, b)"), or an [r, g, b] given as is. */
function rgbOf(c) {
  if (Array.isArray(c)) return c;
  const m = /^#([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})$/i.exec(c) || /rgb\((\d+),\s*(\d+),\s*(\d+)\)/.exec(c);
  return !m ? [0, 0, 0] : c.startsWith("#") ? [1, 2, 3].map((j) => parseInt(m[j], 16)) : [+m[1], +m[2], +m[3]];
}

/** A colour map from `stops` ([r, g, b] each, evenly spaced): t in [0, 1] -> [r, g, b], linear in RGB between two. */
export function stopsMap(stops) {
  const k = stops.length - 1;
  return (t) => {
    const seg = Math.min(k - 1, Math.floor(t * k)), u = t * k - seg;
    const [a, b] = [stops[seg], stops[seg + 1]];
    return a.map((x, i) => Math.round(x + (b[i] - x) * u));
  };
}

/** A lookup table of `n` colours of `map` (t in [0, 1] -> a colour), and its reader. */
export function colourMap(map, n = 256) {
  const lut = new Uint8ClampedArray(n * 3);
  for (let i = 0; i < n; i++) lut.set(rgbOf(map(i / (n - 1))), i * 3);
  /** [r, g, b] at position t in [0, 1] (rounded to the nearest entry). */
  return (t) => { const i = Math.round(t * (n - 1)) * 3; return [lut[i], lut[i + 1], lut[i + 2]]; };
}

export const cssOf = (rgb) => `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;
