"""Which samples carried a recorded step (`hw.watch(per_sample=True)`), read from its per-sample column: the
anomalies name them (`Anomaly.samples`), the view lists them, the logs and saved watches hold the column.

Why a step's own column and not a Trace: every recorded step has it (capture/sample_shares.py fills it on device),
so an anomaly names its samples even where the flight recorder kept no Trace of it."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hookwidget.capture.sample_shares import COLUMNS, TOP


class Carried(NamedTuple):
    """The samples with the largest shares s_b = ⟨G_b, G⟩ / ‖G‖² of a step's gradient G (over the layers with an
    exact per-sample rule), as the watch recorded them.

    - `samples`: ((index in the batch, share), ...), largest share first (at most 3; fewer in a smaller batch).
    - `position`: of the first of them, the position (token) with the largest share, or None (no layer applied
      per position); `position_share`: that position's share of the whole step, or None.
    - `text`: one line, as the view and the logs show it.
    """

    samples: tuple
    position: int | None
    position_share: float | None
    text: str


def carried(column: np.ndarray) -> Carried | None:
    """A step's per-sample column (COLUMNS floats: capture/sample_shares.py) read as Carried; None where its
    shares are not known (NaN: an accumulated step, a step whose gradients were not whole) or not recorded (a
    column of 2, from before shares were)."""
    if column.shape[-1] < COLUMNS:
        return None
    pairs = column[2:2 + 2 * TOP].reshape(TOP, 2)
    samples = tuple((int(i), float(s)) for i, s in pairs if math.isfinite(i) and math.isfinite(s))
    if not samples:
        return None
    t, share = column[2 + 2 * TOP:2 + 2 * TOP + 2]
    known = math.isfinite(t) and math.isfinite(share)
    text = "samples " + ", ".join(f"{i} ({s:.2f})" for i, s in samples) + " of the step's gradient"
    if known:
        text += f"; sample {samples[0][0]}'s position {int(t)} ({share:.2f})"
    return Carried(samples, int(t) if known else None, float(share) if known else None, text)
