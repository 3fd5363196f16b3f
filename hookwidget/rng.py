"""The state of every global RNG a cell may draw from, read before it runs and put back for a rerun.

torch's generators have cheap getters. numpy's global RandomState and random's Random do not: np.random.get_state()
costs 25 µs and random.getstate() 8 µs per trace (each builds 624 Python ints), so their Mersenne Twister states
are copied from memory instead (2.5 KB, under 1 µs), at offsets found once and checked against the getters."""

from __future__ import annotations

import ctypes
import random
import struct
import sys

import torch


def read_all() -> tuple:
    """Every RNG a cell may draw from: torch (CPU, CUDA when initialised), numpy's global, random's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, _NUMPY.read(), _PYTHON.read()


def write_all(state: tuple) -> None:
    """Put back what read_all read."""
    cpu, cuda, np_state, py_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if np_state is not None:
        _NUMPY.write(np_state)
    _PYTHON.write(py_state)


# -- reading the Mersenne Twisters of numpy and random ------------------------------------------------------
# Every trace reads every RNG before the code runs. np.random.get_state() costs 25 µs and random.getstate()
# 8 µs (each builds 624 Python ints); copying their C state (2.5 KB) costs under 1 µs. Where that copy is
# taken is found once, on private instances, and checked against the getters on the global instances;
# anything that does not match (another numpy, another Python, a bit generator other than MT19937, a
# replaced instance) makes the reader use the getter, so a rerun always puts every RNG back exactly.
_WORDS = 624  # the Twister's state: 624 32-bit words and a position


class _NumpyReader:
    """numpy's legacy global RandomState: its MT19937 state (at the bit generator's state address) and the
    Gaussian it caches (has_gauss, gauss: fields of the RandomState object, which get_state alone exposes)."""

    def __init__(self):
        self.flag_at = self.gauss_at = None
        try:
            import numpy as np

            self.np = np
            self._calibrate()
        except Exception:  # no numpy (the RNG restore must not need it), or a layout not understood
            self.flag_at = None

    def _calibrate(self) -> None:
        np = self.np
        probe = np.random.RandomState(7)
        key, pos = probe.get_state()[1:3]
        size = type(probe).__basicsize__
        raws = []
        for flag, value in ((1, 0.1234567890123), (0, -9.876543210987)):
            probe.set_state(("MT19937", key, pos, flag, value))
            raws.append((flag, value, ctypes.string_at(id(probe), size)))
        gauss = [i for i in range(0, size - 7) if all(r[i:i + 8] == struct.pack("d", v) for _, v, r in raws)]
        flags = [i for i in range(0, size - 3) if all(int.from_bytes(r[i:i + 4], sys.byteorder) == f
                                                    for f, _, r in raws)]
        flags = [i for i in flags if gauss and gauss[0] - 8 <= i < gauss[0]]
        if len(gauss) != 1 or len(flags) != 1:
            return
        self.gauss_at, self.flag_at = gauss[0], flags[0]
        if not (self._matches(probe) and self._matches(np.random.mtrand._rand)):
            self.flag_at = None

    def _matches(self, rs) -> bool:
        got, want = self._raw(rs), rs.get_state()
        if got is None:
            return False
        key, pos, flag, gauss = self._unpack(got)
        return (want[0] == "MT19937" and bool((key == want[1]).all()) and pos == want[2] and flag == want[3]
                and gauss == want[4])

    def _raw(self, rs):
        bg = rs._bit_generator
        if self.flag_at is None or type(bg) is not self.np.random.MT19937:
            return None
        with bg.lock:  # as get_state: a draw in another thread (numpy releases the GIL) must not tear the copy
            words = ctypes.string_at(bg.ctypes.state_address, 4 * _WORDS + 4)
            extra = ctypes.string_at(id(rs) + self.flag_at, self.gauss_at + 8 - self.flag_at)
        return "raw", words, extra

    def _unpack(self, raw) -> tuple:
        _, words, extra = raw
        key = self.np.frombuffer(words, dtype=self.np.uint32, count=_WORDS).copy()
        pos = int.from_bytes(words[4 * _WORDS:], sys.byteorder, signed=True)
        flag = int.from_bytes(extra[:4], sys.byteorder, signed=True)
        return key, pos, flag, struct.unpack_from("d", extra, self.gauss_at - self.flag_at)[0]

    def read(self):
        if self.flag_at is None:
            return self.np.random.get_state() if hasattr(self, "np") else None
        rs = self.np.random.mtrand._rand
        return self._raw(rs) or rs.get_state()

    def write(self, state) -> None:
        if isinstance(state, tuple) and state[0] == "raw":
            state = ("MT19937", *self._unpack(state))
        self.np.random.set_state(state)


class _PythonReader:
    """random's global Random: its index and 624 words (fields of the object), and gauss_next."""

    def __init__(self):
        self.at = None
        try:
            probe = random.Random(7)
            probe.random()
            _, internal, _ = probe.getstate()
            raw = ctypes.string_at(id(probe), type(probe).__basicsize__)
            words = struct.pack(f"{_WORDS}I", *internal[:_WORDS])
            at = raw.find(words)
            if at >= 4 and raw.find(words, at + 1) < 0 and struct.unpack_from("i", raw, at - 4)[0] == internal[-1]:
                self.at = at - 4
            if self.at is not None and not (self._read(probe) == probe.getstate()
                                             and self._read(random._inst) == random.getstate()):
                self.at = None
        except Exception:  # a layout not understood: the getter
            self.at = None

    def _read(self, inst) -> tuple:
        return self._unpack(("raw", ctypes.string_at(id(inst) + self.at, 4 + 4 * _WORDS), inst.gauss_next))

    @staticmethod
    def _unpack(raw) -> tuple:
        _, data, gauss_next = raw
        index = struct.unpack_from("i", data)[0]
        return 3, struct.unpack_from(f"{_WORDS}I", data, 4) + (index,), gauss_next

    def read(self):
        inst = random._inst
        if self.at is None or type(inst) is not random.Random:
            return random.getstate()
        return "raw", ctypes.string_at(id(inst) + self.at, 4 + 4 * _WORDS), inst.gauss_next

    def write(self, state) -> None:
        random.setstate(self._unpack(state) if state[0] == "raw" else state)


_NUMPY = _NumpyReader()
_PYTHON = _PythonReader()
