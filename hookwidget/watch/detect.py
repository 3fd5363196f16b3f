"""Anomalies, found on the host when a batch of steps arrives there: non-finite values, spikes, a user predicate.

The step's scalars (its loss and global gradient norm: non-finite, or a spike) can be judged on their own, as soon
as the step ends (`judge`): the flight recorder decides from them and from one flag (any non-finite count in the
row) which step to keep, while the rows go on moving to the host in batches; `check` lists the verdicts when the
row arrives, in the same order as if both were made then.

A run that turns non-finite stays so (NaN weights make every later loss, δ and .grad NaN): one anomaly names the
onset (where it arose: the first layer whose δ is non-finite in backward order, else whose input is in forward
order, else whose .grad is, else the loss; the reason lists each), and the recorded steps after it that are
non-finite too are counted (`stretches`: onset -> count), not listed; the flight recorder keeps the onset's Trace,
not theirs. A finite step ends the stretch; a later non-finite step is a new onset. A step a GradScaler skipped is
listed on its own, as before (the scaler handled it)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from hookwidget.capture.stat_rows import STAT_NAMES, S

_COUNTS = [S[c] for c in ("delta_nan", "delta_inf", "a_nonfinite", "grad_nan", "grad_inf")]


class Anomaly(tuple):
    """A step the watch flagged, as the tuple `(step, where, reason)`, with its `lead` beside it.

    - `step`: the recorded step.
    - `where`: `"loss"`, `"grad_norm"`, a layer name, `"scaler"` or `"keep"` (the user's predicate).
    - `reason`: one line saying what was found.
    - `lead`: where the anomaly's cause shows first, worked out from the rows when the anomalies are read, or
      None. It rides beside the tuple (it takes no part in ==, unpacking or len). Its fields: `step`; `stat`, the
      statistic ("lr", "update_ratio", "grad_norm", "a_rms", or "step_grad_norm" for the global gradient norm);
      `layers`, where it left its window ([] for the global norm); `ratio`, how far (median over those layers;
      inf for a jump to +Inf); `base` and `value`, its window's level and its value there; `lr`, a learning-rate
      (or optimizer) change; `text`, the one line the view and the logs show.
    - `samples`: with `hw.watch(model, per_sample=True)`, which samples carried the step's gradient (a
      `Carried`, watch/carriers.py: `samples`, ((index, share), ...) largest share first; `position` and
      `position_share`, the first one's top token; `text`), from the step's own row; None where not recorded or
      not known (an optimizer step of several backward passes). Beside the tuple too.

    Example:

    ```python
    step, where, reason = spiked.anomalies[0]     # a tuple: unpack it, compare it
    spiked.anomalies[0].lead.text                 # where its cause shows first, in one line
    ```
    """
    # the lead: watch/leads.py's Lead

    def __new__(cls, step: int, where: str, reason: str, lead: Any = None, samples: Any = None):
        self = super().__new__(cls, (step, where, reason))
        self.lead, self.samples = lead, samples
        return self

    def __getnewargs__(self):
        return (*self, self.lead, self.samples)

    step = property(lambda self: self[0])
    where = property(lambda self: self[1])
    reason = property(lambda self: self[2])

    def __repr__(self) -> str:
        return (f"Anomaly(step={self[0]!r}, where={self[1]!r}, reason={self[2]!r}, lead={self.lead!r}, "
                f"samples={self.samples!r})")


# What a kept Trace of an anomalous step is worth beside the others (FlightRecorder keeps at most max_kept):
# a non-finite value is what the recorder is for; the user's keep= asked; a spike or a GradScaler skip is a
# warning that a run can give many times (the early steps of training, the scaler finding its scale).
NONFINITE, ASKED, WARNING = 2, 1, 0


class Detector:
    def __init__(self, layer_names: list, spike: float, window: int, keep):
        self.layer_names, self.spike, self.window, self.keep = layer_names, float(spike), window, keep
        self.anomalies: list[Anomaly] = []
        self._ranks: dict = {}  # step -> the highest _rank of its anomalies
        self._early: dict = {}  # step -> its scalars' verdicts (judge), until check() lists them
        self._count_index: dict = {}  # device -> the count columns' indices (scalars)
        self._later: dict = {}  # step -> (its scalars on their way to the host, has_loss): judge_later
        self._counted: set = set()  # judged steps with a non-zero count, whose row check() has not located yet
        self._history = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}
        self.stretches: dict = {}  # onset step of a non-finite stretch -> non-finite recorded steps after it
        self._onset = None  # the onset of the stretch running now
        self._quiet: deque = deque(maxlen=64)  # recent steps counted into a stretch: no Trace to keep

    def rank(self, step: int) -> int | None:
        """None where nothing flagged the step, else what a kept Trace of it is worth (NONFINITE, ASKED, WARNING)."""
        if step in self._quiet:
            return None
        early = self._early.get(step)
        ranks = [self._ranks[step]] if step in self._ranks else []
        if early is not None:
            bad_loss, spikes = early
            ranks += [NONFINITE] * bool(bad_loss) + [WARNING] * bool(spikes)
        return max(ranks, default=None)

    def scalars(self, row: torch.Tensor, step_row: torch.Tensor) -> torch.Tensor:
        """What judges a step whose row is still on its device, as one small device tensor: its scalars (loss,
        global gradient norm) and the row's count columns (non-finite δ, input, .grad): judge_later moves it."""
        index = self._count_index.get(row.device)
        if index is None:
            index = self._count_index[row.device] = torch.tensor(_COUNTS, device=row.device)
        return torch.cat([step_row, row.index_select(1, index).flatten()])

    def judge_later(self, step: int, values, has_loss: bool) -> None:
        """Judge `step` once `values` (arrivals.InFlight of scalars()) reach the host: `arrived` asks."""
        self._later[step] = (values, has_loss)

    def arrived(self, step: int, wait: bool = False) -> bool | None:
        """Judge `step` if its values (judge_later) have reached the host, or (`wait`) once they have. None while
        they are on their way; else whether a count is non-zero (a non-finite δ, input or .grad), so that the
        row must come to the host for check() to locate it."""
        if step in self._later:
            values, has_loss = self._later[step]
            if not (wait or values.arrived()):
                return None
            del self._later[step]
            loss, gnorm, *counts = values.read()
            self.judge(step, loss if has_loss else None, gnorm)
            if any(c > 0 for c in counts):  # NaN (not counted) is not > 0
                self._counted.add(step)
        return step in self._counted

    def forget(self, steps: list) -> None:
        """Early verdicts on `steps`, whose rows are to be added up into one (the values they added to the spike
        history stay: a spike is judged against `window` steps)."""
        for k in steps:
            self._early.pop(k, None)
            self._later.pop(k, None)
            self._counted.discard(k)

    def judged(self, step: int) -> bool:
        """Whether the step's scalars were judged ahead of its row (judge), or are on their way to be
        (judge_later), not yet listed by check."""
        return step in self._early or step in self._later

    def _add(self, step: int, where: str, reason: str, rank: int = NONFINITE) -> None:
        self.anomalies.append(Anomaly(step, where, reason))
        self._ranks[step] = max(self._ranks.get(step, WARNING), rank)

    def judge(self, step: int, loss: float | None, gnorm: float) -> bool:
        """The verdicts on a step's scalars (loss None: backward started from no scalar), made once per step and
        in step order (each spike is judged against the steps before it); listed by check(). True if any."""
        bad_loss = [] if loss is None or math.isfinite(loss) else [("loss", f"non-finite loss ({loss})")]
        spikes = []
        for name, value in (("loss", loss), ("grad_norm", gnorm)):
            if value is None or not math.isfinite(value):
                continue
            hist = self._history[name]
            if len(hist) == self.window:
                mean = sum(hist) / len(hist)
                std = math.sqrt(sum((v - mean) ** 2 for v in hist) / len(hist))
                if value - mean > self.spike * max(std, 1e-6 * abs(mean)):
                    spikes.append((name, f"spike: {value:.6g} > mean {mean:.6g} + {self.spike:g}·std {std:.3g} "
                                         f"of the previous {self.window} recorded steps"))
            hist.append(value)
        self._early[step] = (bad_loss, spikes)
        return bool(bad_loss or spikes)

    def check(self, step: int, row: torch.Tensor, step_row: torch.Tensor, order: dict, a_order: dict,
              has_loss: bool = True, skipped: str | None = None) -> None:
        """`row`, `step_row`: host float64 rows. skipped: why a GradScaler skipped this step (its non-finite
        values are then said to be the scaler's found-inf, not left to read as the model's fault)."""
        first = len(self.anomalies)
        self.arrived(step, wait=True)  # its scalars were sent before its row: they have arrived
        self._counted.discard(step)
        if skipped is not None:
            self._add(step, "scaler", skipped, WARNING)
        loss, gnorm = step_row.tolist()
        if step not in self._early:
            self.judge(step, loss if has_loss else None, gnorm)
        bad_loss, spikes = self._early.pop(step)
        counts = bool((row.numpy()[:, _COUNTS] > 0).any())  # else (the usual case) nothing to locate (NaN: not counted)
        if skipped is not None or not (bad_loss or counts):
            for where, reason in bad_loss:
                self._add(step, where, reason)
            if counts:
                for where, reason in self._located(row, order, a_order):
                    self._add(step, where, reason)
            if skipped is None:
                self._onset = None
        elif self._onset is not None:  # the stretch goes on: counted
            self.stretches[self._onset] += 1
            self._quiet.append(step)
        else:  # the onset: one anomaly, where it arose
            found = self._located(row, order, a_order) if counts else []
            where = found[0][0] if found else "loss"
            parts = [reason for _, reason in bad_loss] + [f"{layer}: {reason}" for layer, reason in found]
            self._add(step, where, "non-finite from here on (the later non-finite steps are counted: w.nonfinite) | "
                      + " | ".join(parts))
            self._onset, self.stretches[step] = step, 0
        for where, reason in spikes:
            self._add(step, where, reason, WARNING)
        if skipped is not None:
            for i in range(first + 1, len(self.anomalies)):
                a = self.anomalies[i]
                note = " (the GradScaler skipped this step: see where='scaler')"
                self.anomalies[i] = Anomaly(a.step, a.where, a.reason + note, a.lead, a.samples)
            self._ranks[step] = WARNING  # its non-finite values are the scaler's found-inf, which it handled
        if self.keep is not None:
            stats = {n: row[:, i] for i, n in enumerate(STAT_NAMES)}
            stats.update(loss=loss if has_loss else math.nan, global_grad_norm=gnorm)
            if self.keep(step, stats):
                self._add(step, "keep", "user predicate keep(step, stats) returned True", ASKED)

    def _located(self, row: torch.Tensor, order: dict, a_order: dict) -> list:
        """(layer, reason) of the first non-finite δ (backward order), input (forward order) and .grad."""
        found = [self._first_bad(row, order, ("delta_nan", "delta_inf"), "δ (output gradient) non-finite: the first "
                                 "layer in backward order whose δ is; every layer the gradient reached before it had "
                                 "a finite δ"),
                 self._first_bad(row, a_order, ("a_nonfinite",), "input activation non-finite: the first layer in "
                                 "forward order whose input is"),
                 self._first_bad(row, order, ("grad_nan", "grad_inf"), ".grad non-finite (first such layer in "
                                 "backward order)")]
        return [f for f in found if f is not None]

    def _first_bad(self, row: torch.Tensor, order: dict, cols: tuple, reason: str):
        bad = sum(row[:, S[c]].nan_to_num(0.0) for c in cols) > 0
        where = bad.nonzero().flatten().tolist()
        if not where:
            return None
        first = min(where, key=lambda i: (order.get(i, math.inf), i))
        counts = ", ".join(f"{c.split('_')[1]} {int(row[first, S[c]])}" for c in cols)
        more = f"; {len(where)} layers in all" if len(where) > 1 else ""
        return self.layer_names[first], reason + (f" ({counts})" if counts else "") + more
