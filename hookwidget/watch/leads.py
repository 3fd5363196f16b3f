"""The cause an anomaly points back to, computed from the watch's rows so that Python, the logs, the callbacks
and the view all read the same lead.

For an anomalous row a: the earliest row r in [a − LOOKBACK, a] where a leading statistic left its window — a
layer's update ratio ‖ΔW‖/‖W‖ (the update ratio jumping in most layers while their gradients stay normal is a
learning-rate or optimizer change), its ‖W.grad‖₂, its activation RMS, or the global gradient norm. A statistic
leaves its window when its log10 distance from the median of the WINDOW rows before it exceeds
max(log10(FACTOR), SIGMAS robust standard deviations), or it turns +Inf. Where the watch recorded learning rates,
a rise of one by LR_FACTOR or more in the lookback is the lead, named directly ("step 200: learning rate ×300
(0.001 → 0.3) in 3 layers"), ahead of any inferred one. Log scale because these statistics span decades; the
median and the MAD because the window may itself hold an earlier spike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

import numpy as np

WINDOW, MIN_WINDOW, LOOKBACK, FACTOR, SIGMAS = 20, 5, 10, 5.0, 5.0
LR_FACTOR = 5.0  # a learning rate rising this much over its last value is a direct lead (decay and warmup stay below)
LEAD_STATS = ("update_ratio", "grad_norm", "a_rms")
LABELS = {"lr": "learning rate", "update_ratio": "update ratio ‖ΔW‖/‖W‖", "grad_norm": "‖W.grad‖₂",
          "a_rms": "activation RMS", "step_grad_norm": "global ‖grad‖₂"}
_RANK = {"update_ratio": 0, "grad_norm": 1, "step_grad_norm": 2, "a_rms": 3}


@dataclass(frozen=True)
class Lead:
    """Where an anomaly's cause shows first. `step`: the step; `stat`: the statistic ("lr", "update_ratio",
    "grad_norm", "a_rms" or "step_grad_norm" for the global gradient norm); `layers`: the layers where it left its
    window ([] for the global norm); `ratio`: how far (median over those layers; inf for a jump to +Inf);
    `base`/`value`: its window's level and its value there; `lr`: a learning-rate (or optimizer) change;
    `text`: the one line the view and the logs show."""

    step: int
    stat: str
    layers: tuple
    ratio: float
    base: float
    value: float
    lr: bool
    text: str


class Rows:
    """The watch's rows as the lead rule reads them: stats (n, L, S) and step_stats (n, s) as float64 arrays."""

    def __init__(self, stats, step_stats, steps, layer_names, stat_names, step_stat_names):
        self.stats = np.asarray(stats, dtype=np.float64)
        self.step_stats = np.asarray(step_stats, dtype=np.float64)
        self.steps, self.layers = list(steps), list(layer_names)
        self.stat = {s: k for k, s in enumerate(stat_names)}
        self.step_stat = {s: k for k, s in enumerate(step_stat_names)}

    def series(self, stat: str, layer: int) -> np.ndarray:
        return self.step_stats[:, self.step_stat["grad_norm"]] if layer < 0 else self.stats[:, layer, self.stat[stat]]


def with_leads(anomalies: list, rows: Rows) -> list:
    """The anomalies, each with its lead (a step's anomalies share it); the rows are those on the host."""
    found = leads(rows, [a.step for a in anomalies])
    return [type(a)(*a, found.get(a.step)) for a in anomalies]


def leads(rows: Rows, anomaly_steps) -> dict:
    """step -> its Lead (or None) for each anomalous step."""
    index = {s: r for r, s in enumerate(rows.steps)}
    out = {}
    for step in anomaly_steps:
        if step not in out:
            out[step] = lead_of(rows, index[step]) if step in index else None
    return out


def lead_of(rows: Rows, a: int) -> Lead | None:
    """The lead of the anomaly at row a, or None."""
    direct = _lr_lead(rows, a)
    if direct is not None:
        return direct
    series = [(stat, layer) for stat in LEAD_STATS if stat in rows.stat for layer in range(len(rows.layers))]
    if "grad_norm" in rows.step_stat:
        series.append(("step_grad_norm", -1))
    cache = {s: _log(rows.series(*s)) for s in series}
    for r in range(max(0, a - LOOKBACK), a + 1):
        hits = [(stat, layer, d) for stat, layer in series
                if (d := departure(rows.series(stat, layer), r, cache[stat, layer])) is not None]
        if hits:
            return _describe(rows, r, hits)
    return None


def departure(values: np.ndarray, r: int, logs: np.ndarray | None = None):
    """(ratio, base, value) where values[r] left the window of the WINDOW values before it, else None."""
    v = float(values[r])
    if math.isnan(v):
        return None  # not measured (no optimizer step, a layer not run)
    logs = _log(values) if logs is None else logs
    hist = logs[max(0, r - WINDOW):r]
    hist = hist[np.isfinite(hist)]
    if len(hist) < MIN_WINDOW:
        return None
    med = float(np.median(hist))
    mad = float(np.median(np.abs(hist - med))) * 1.4826
    base = 10 ** med
    if v == math.inf:
        return math.inf, base, v
    x = float(logs[r])
    if not math.isfinite(x):
        return None
    far = max(math.log10(FACTOR), SIGMAS * mad)
    return (10 ** (x - med), base, v) if abs(x - med) > far else None


def _log(values: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(values > 0, np.log10(np.where(values > 0, values, 1.0)), np.nan)


def _describe(rows: Rows, r: int, hits: list) -> Lead:
    hits.sort(key=lambda h: (_RANK[h[0]], -abs(math.log10(h[2][0])) if math.isfinite(h[2][0]) else -math.inf))
    top = hits[0]
    same = sorted((h for h in hits if h[0] == top[0]), key=lambda h: h[1])
    names = tuple(rows.layers[h[1]] for h in same if h[1] >= 0)
    lr = False
    if top[0] == "update_ratio":  # the update ratio jumps in most measured layers while gradients stay in window
        k = rows.stat["update_ratio"]
        measured = int(np.sum(~np.isnan(rows.stats[r, :, k])))
        calm = not any(h[0] in ("grad_norm", "step_grad_norm") for h in hits) or "grad_norm" not in rows.stat
        lr = 2 * len(same) >= measured and calm
    finite = [h[2][0] for h in same if math.isfinite(h[2][0])]
    ratio = _median(finite) if finite else top[2][0]
    where = "" if top[1] < 0 else (f" in {len(names)} layers ({_few(names)})" if len(names) > 1 else f" of {names[0]}")
    times = (f"×{_ratio(ratio)}" if ratio >= 1 else f"×1/{_ratio(1 / ratio)}") if math.isfinite(ratio) else "→ Inf"
    text = f"step {rows.steps[r]}: {LABELS[top[0]]} {times}{where}"
    if lr:
        text += ", gradients in their window: the learning rate (or optimizer) changed"
    return Lead(int(rows.steps[r]), top[0], names, ratio, top[2][1], top[2][2], lr, text)


def _lr_lead(rows: Rows, a: int) -> Lead | None:
    """The earliest row in the lookback where a recorded learning rate rose by LR_FACTOR or more."""
    if "lr" not in rows.stat:
        return None
    k = rows.stat["lr"]
    for r in range(max(0, a - LOOKBACK), a + 1):
        rises = _lr_rises(rows, r, k)
        if not rises:
            continue
        names = tuple(rows.layers[layer] for layer, _, _, _ in rises)
        ratio = _upper_median([x[3] for x in rises])
        same = all(x[1] == rises[0][1] and x[2] == rises[0][2] for x in rises)
        times = f"×{_ratio(ratio)}" if math.isfinite(ratio) else "from 0"
        values = f" ({fmt(rises[0][1])} → {fmt(rises[0][2])})" if same else ""
        where = f" in {len(names)} layers ({_few(names)})" if len(names) > 1 else f" of {names[0]}"
        text = f"step {rows.steps[r]}: learning rate {times}{values}{where}"
        if "update_ratio" in rows.stat:
            moved = [d[0] for layer, *_ in rises
                     if (d := departure(rows.series("update_ratio", layer), r)) is not None and math.isfinite(d[0])]
            if moved:
                text += f", update ratio ‖ΔW‖/‖W‖ ×{_ratio(_upper_median(moved))}"
        return Lead(int(rows.steps[r]), "lr", names, ratio, rises[0][1], rises[0][2], True, text)
    return None


def _lr_rises(rows: Rows, r: int, k: int) -> list:
    """(layer, base, value, ratio) of each layer whose learning rate at row r rose LR_FACTOR over its latest
    recorded value in the WINDOW rows before."""
    out = []
    for layer in range(len(rows.layers)):
        value = float(rows.stats[r, layer, k])
        before = rows.stats[max(0, r - WINDOW):r, layer, k][::-1]
        before = before[~np.isnan(before)]
        if not value > 0 or not len(before):
            continue
        base = float(before[0])
        ratio = value / base if base > 0 else math.inf
        if ratio >= LR_FACTOR:
            out.append((layer, base, value, ratio))
    return out


def _median(xs: list) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _upper_median(xs: list) -> float:
    return sorted(xs)[len(xs) // 2]


def _few(names) -> str:
    return ", ".join(names[:2]) + (", …" if len(names) > 2 else "")


def _ratio(x: float) -> str:
    """As the view wrote a ratio: String(Math.round(x)) from 100 on (JavaScript's exponent form from 1e21)."""
    if x >= 1e21:
        return repr(float(math.floor(x + 0.5)))
    return str(math.floor(x + 0.5)) if x >= 100 else _precision(x, 2)


def _precision(x: float, digits: int) -> str:
    """JavaScript's x.toPrecision(digits) for 1e-6 ≤ |x| < 1e21 (the view's format, kept to the character): the
    exact binary value rounded half up, as the ECMAScript spec says (Python's format rounds half to even)."""
    d = Decimal(x)
    e = d.adjusted()
    q = d.scaleb(-e).quantize(Decimal(1).scaleb(1 - digits), rounding=ROUND_HALF_UP)
    if q.adjusted() > 0:  # 9.99 → 10.0: one more digit before the point
        e, q = e + 1, (q / 10).quantize(Decimal(1).scaleb(1 - digits), rounding=ROUND_HALF_UP)
    if e < -6 or e >= digits:
        return f"{q}e{'+' if e >= 0 else '-'}{abs(e)}"
    return f"{q.scaleb(e):f}"


def fmt(v: float, digits: int = 4) -> str:
    """The view's number format (js/shared/format.js fmt): 4 significant digits, exponent form below 1e-3."""
    if v != v:
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    a = abs(v)
    if float(v).is_integer() and a < 1e9:
        return ("-" if v < 0 else "") + f"{int(a):,}"
    if a < 1e-3 or a >= 1e9:  # JavaScript's toExponential(digits − 1), trailing zeros dropped
        d = Decimal(v)
        mant = d.scaleb(-d.adjusted()).quantize(Decimal(1).scaleb(1 - digits), rounding=ROUND_HALF_UP)
        ex = d.adjusted() + (1 if abs(mant) >= 10 else 0)
        mant = d.scaleb(-ex).quantize(Decimal(1).scaleb(1 - digits), rounding=ROUND_HALF_UP)
        text = f"{mant:f}"
        text = text.rstrip("0").rstrip(".") if "." in text else text
        return f"{text}e{ex}"
    text = repr(float(_precision(v, digits)))
    text = text[:-2] if text.endswith(".0") else text
    i, _, f = text.lstrip("-").partition(".")
    return ("-" if v < 0 else "") + f"{int(i):,}" + ("." + f if f else "")
