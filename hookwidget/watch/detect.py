"""Anomalies, found on the host when a batch of steps arrives there: non-finite values, spikes, a user predicate."""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import torch

from hookwidget.capture.stat_rows import STAT_NAMES, S

_COUNTS = [S[c] for c in ("delta_nan", "delta_inf", "a_nonfinite", "grad_nan", "grad_inf")]


class Anomaly(NamedTuple):
    step: int
    where: str  # "loss", "grad_norm", a layer name, or "keep" (the user's predicate)
    reason: str


class Detector:
    def __init__(self, layer_names: list, spike: float, window: int, keep):
        self.layer_names, self.spike, self.window, self.keep = layer_names, float(spike), window, keep
        self.anomalies: list[Anomaly] = []
        self._flagged: set = set()
        self._history = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}

    def flagged(self, step: int) -> bool:
        return step in self._flagged

    def _add(self, step: int, where: str, reason: str) -> None:
        self.anomalies.append(Anomaly(step, where, reason))
        self._flagged.add(step)

    def check(self, step: int, row: torch.Tensor, step_row: torch.Tensor, order: dict, a_order: dict,
              has_loss: bool = True, skipped: str | None = None) -> None:
        """`row`, `step_row`: host float64 rows. skipped: why a GradScaler skipped this step (its non-finite
        values are then said to be the scaler's found-inf, not left to read as the model's fault)."""
        first = len(self.anomalies)
        if skipped is not None:
            self._add(step, "scaler", skipped)
        loss, gnorm = step_row.tolist()
        if not has_loss:
            loss = None  # backward started from no scalar: nothing to judge
        if loss is not None and not math.isfinite(loss):
            self._add(step, "loss", f"non-finite loss ({loss})")
        if (row.numpy()[:, _COUNTS] > 0).any():  # else (the usual case) nothing to locate (NaN: not counted)
            self._first_bad(step, row, order, ("delta_nan", "delta_inf"), "δ (output gradient) non-finite: the first "
                            "layer in backward order whose δ is; every layer the gradient reached before it had a "
                            "finite δ")
            self._first_bad(step, row, a_order, ("a_nonfinite",), "input activation non-finite: the first layer in "
                            "forward order whose input is")
            self._first_bad(step, row, order, ("grad_nan", "grad_inf"), ".grad non-finite (first such layer in "
                            "backward order)")
        for name, value in (("loss", loss), ("grad_norm", gnorm)):
            if value is None or not math.isfinite(value):
                continue
            hist = self._history[name]
            if len(hist) == self.window:
                mean = sum(hist) / len(hist)
                std = math.sqrt(sum((v - mean) ** 2 for v in hist) / len(hist))
                if value - mean > self.spike * max(std, 1e-6 * abs(mean)):
                    self._add(step, name, f"spike: {value:.6g} > mean {mean:.6g} + {self.spike:g}·std {std:.3g} "
                                          f"of the previous {self.window} recorded steps")
            hist.append(value)
        if skipped is not None:
            for i in range(first + 1, len(self.anomalies)):
                a = self.anomalies[i]
                note = " (the GradScaler skipped this step: see where='scaler')"
                self.anomalies[i] = a._replace(reason=a.reason + note)
        if self.keep is not None:
            stats = {n: row[:, i] for i, n in enumerate(STAT_NAMES)}
            stats.update(loss=loss if loss is not None else math.nan, global_grad_norm=gnorm)
            if self.keep(step, stats):
                self._add(step, "keep", "user predicate keep(step, stats) returned True")

    def _first_bad(self, step: int, row: torch.Tensor, order: dict, cols: tuple, reason: str) -> None:
        bad = sum(row[:, S[c]].nan_to_num(0.0) for c in cols) > 0
        where = bad.nonzero().flatten().tolist()
        if not where:
            return
        first = min(where, key=lambda i: (order.get(i, math.inf), i))
        counts = ", ".join(f"{c.split('_')[1]} {int(row[first, S[c]])}" for c in cols)
        more = f"; {len(where)} layers in all" if len(where) > 1 else ""
        self._add(step, self.layer_names[first], reason + (f" ({counts})" if counts else "") + more)
