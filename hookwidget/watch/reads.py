"""What a watch answers about its rows, shared by the live Watch and a loaded SavedWatch: rows by range, the
level-of-detail bins, the series. Each class gives `n_rows` and `_table(start, stop)` (the rows [start, stop) as
numpy arrays, from wherever they are held), and `_level()` (the in-RAM lod.Level, or None)."""

from __future__ import annotations

import numpy as np
import torch

from hookwidget.watch import lod


class Reads:
    """The read side of a watch, over `_table(start, stop) -> (steps, stats, step_stats)` numpy arrays."""

    def _range(self, start: int, stop: int | None, what: str) -> tuple[int, int]:
        n = self.n_rows
        if not isinstance(start, int) or not (stop is None or isinstance(stop, int)):
            raise TypeError(f"{what}: start and stop are row indices (ints), as in w.steps[start:stop]")
        return slice(start, stop).indices(n)[:2]

    def rows(self, start: int = 0, stop: int | None = None) -> tuple:
        """The recorded rows [start, stop) at full resolution (row indices, as `w.steps[start:stop]`; negative from
        the end), from RAM or from disk, whichever holds them.

        Returns:

        (steps, stats, step_stats): a LongTensor (n,) of step indices, (n, layers, statistics) and (n, 2) tensors
        in the storage's dtype (`w.stats`' dtype).

        Example:

        ```python
        steps, stats, step_stats = w.rows(-100)   # the latest 100 rows
        ```
        """
        start, stop = self._range(start, stop, "w.rows(start, stop)")
        steps, stats, step_stats = self._table(start, max(start, stop))
        return torch.from_numpy(np.asarray(steps, np.int64)), torch.from_numpy(stats), torch.from_numpy(step_stats)

    def lod(self, bins: int, start: int = 0, stop: int | None = None) -> lod.Bins:
        """The rows [start, stop) summarised in at most `bins` bins of one power-of-two size, aligned to multiples
        of it (watch/lod.py says what a bin holds): from the in-RAM summary where it covers the range at that size
        or finer, else from the rows.

        Raises:

        - `ValueError`: `bins` < 1.
        """
        if not isinstance(bins, int) or bins < 1:
            raise ValueError(f"w.lod(bins={bins!r}): bins is how many bins at most, an int >= 1")
        start, stop = self._range(start, stop, "w.lod(bins, start, stop)")
        stop = max(start, stop)
        size = lod.size_for(bins, start, stop)
        steps, stats, step_stats = self._table(start, stop)
        return lod.reduce(steps, stats, step_stats, start, size)
