"""Running a 2-process gloo test on CPU: a free port, the workers spawned, a hang turned into a failure."""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, out_dir, nprocs: int, timeout_s: float) -> None:
    """Run worker(rank, port, out_dir) in `nprocs` processes. A worker that died by a signal (gloo's teardown
    aborted once under load on the shared CI machine: "terminate called without an active exception") gets one
    more try on a new port; a hang, a Python error in a worker or a second death fails the test."""
    for attempt in range(2):
        ctx = mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    pytest.fail(f"workers did not finish within {timeout_s} s (hang)")
            return
        except mp.ProcessExitedException:
            for p in ctx.processes:
                p.kill()
            if attempt:
                raise
