"""Tensors as pictures: never JSON lists but float32 buffers, each downsampled to at most MAX_SIDE cells per
side (block means) and described by `{buffer, dtype, shape, true_shape, layout, min, max, stats}`."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hookwidget.views.payload.numbers import _num, stats

MAX_SIDE = 200  # cells per side of a heatmap sent to the front-end
MAX_SAMPLES = 8  # samples of a (B, C, H, W) or (B, T, d) tensor sent as pictures (one selectable at a time)
MAX_CHANNELS = 64  # channel maps per sample of a conv activation / δ
MAP_SIDE = 32  # cells per side of one channel map


class _Buffers:
    """Collects downsampled float32 buffers and their descriptions."""

    def __init__(self, max_side: int = MAX_SIDE, memo: dict | None = None):
        self.max_side = max_side
        self.memo = memo
        self.meta: dict = {}
        self.buffers: list[bytes] = []

    def add(self, key: str, t, layout: str) -> None:
        if t is None:
            return
        hit = self.memo.get((id(t), layout)) if self.memo is not None else None
        if hit is not None and hit[0] is t:
            _, data, info = hit
        else:
            if layout == "rows" and t.dim() in (3, 4) and t.shape[0] > 0:
                view, info = samples(t, self.max_side)
            else:
                view, info = downsample(t, layout, self.max_side)
            data = view.tobytes()
            if self.memo is not None:
                self.memo[(id(t), layout)] = (t, data, info)  # holds t: its id is not reused meanwhile
        self.add_picture(key, data, info)

    def add_picture(self, key: str, data, info: dict) -> None:
        """A picture made elsewhere (bytes or a float32 array) with its description."""
        self.meta[key] = {**info, "buffer": len(self.buffers)}
        self.buffers.append(data if isinstance(data, bytes) else data.tobytes())



def downsample(t: torch.Tensor, layout: str = "rows", max_side: int = MAX_SIDE) -> tuple[np.ndarray, dict]:
    """A 2-D float32 view of `t` with at most max_side cells per side (block means), plus its description.

    layout "rows": leading dims flattened into rows, last dim as columns (activations, δ);
    "param": first dim as rows, the rest as columns (weights); "vector": 1-D, at most MAX_SIDE*5 bars."""
    MAX = max_side  # noqa: N806
    x = t.detach().to("cpu", torch.float32)
    if layout == "vector":
        x = x.reshape(-1)
        n = x.numel()
        if n > MAX_SIDE * 5:
            x = F.adaptive_avg_pool1d(x.view(1, 1, n), MAX_SIDE * 5).view(-1)
        arr = x.numpy()
        shape = [int(arr.shape[0])]
    else:
        if x.dim() == 0:
            x = x.reshape(1, 1)
        elif x.dim() == 1:
            x = x.reshape(1, -1)
        elif layout == "param":
            x = x.reshape(x.shape[0], -1)
        else:
            x = x.reshape(-1, x.shape[-1])
        rows, cols = x.shape
        if rows > MAX or cols > MAX:
            x = F.adaptive_avg_pool2d(x.view(1, 1, rows, cols), (min(rows, MAX), min(cols, MAX)))[0, 0]
        arr = x.contiguous().numpy()
        shape = [int(arr.shape[0]), int(arr.shape[1])]
    arr = np.ascontiguousarray(arr, dtype="<f4")
    return arr, describe(arr, shape, list(t.shape), "matrix", t)



def samples(t: torch.Tensor, max_side: int = MAX_SIDE) -> tuple[np.ndarray, dict]:
    """Pictures that fit the tensor, for the first MAX_SAMPLES samples:

    (B, C, H, W) -> (S, C', h, w): per-channel maps (C' ≤ MAX_CHANNELS, h, w ≤ MAP_SIDE), layout "channels";
    (B, T, d)    -> (S, T', d'): one T × d picture per sample (≤ max_side per side), layout "sequence"."""
    x = t.detach().to("cpu", torch.float32)[:MAX_SAMPLES]
    if x.dim() == 4:
        s, c, hh, ww = x.shape
        x = x[:, :MAX_CHANNELS]
        side = min(MAP_SIDE, max_side)
        if hh > side or ww > side:
            x = F.adaptive_avg_pool2d(x, (min(hh, side), min(ww, side)))
        layout = "channels"
    else:
        s, tt, d = x.shape
        if tt > max_side or d > max_side:
            x = F.adaptive_avg_pool2d(x.unsqueeze(1), (min(tt, max_side), min(d, max_side)))[:, 0]
        layout = "sequence"
    arr = np.ascontiguousarray(x.contiguous().numpy(), dtype="<f4")
    info = describe(arr, [int(v) for v in arr.shape], list(t.shape), layout, t)
    info["samples"] = int(arr.shape[0])
    return arr, info



def describe(arr: np.ndarray, shape: list, true_shape: list, layout: str, t: torch.Tensor | None = None) -> dict:
    """The picture's own range (for its colour scale) and the statistics of the FULL tensor `t` beside it; null
    statistics for a picture made without the tensor (views/payload/grads.py's, from the factors)."""
    finite = arr[np.isfinite(arr)]
    return {"dtype": "float32", "shape": shape, "true_shape": [int(s) for s in true_shape], "layout": layout,
            "min": _num(float(finite.min())) if finite.size else None,
            "max": _num(float(finite.max())) if finite.size else None,
            "nonfinite": int(arr.size - finite.size), "stats": stats(t) if t is not None else None}
