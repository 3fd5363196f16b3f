"""Whether reading a tensor's value on the host is free: on the CPU it is; on an accelerator it waits for the
device to reach that point of its queue (a sync), so the CPU can no longer run ahead of it.

The statistics take cheaper branches where a read is free (a non-finite count only where the norm is not
finite); the device path reads nothing and moves values with non-blocking copies (watch/arrivals.py). Every such
choice asks this one predicate, so that a test can send a CPU run down the device path and count what it reads
(tests/test_watch_no_sync.py)."""

from __future__ import annotations

import torch


def free(device: torch.device) -> bool:
    """True where reading a value on `device` costs no device sync (the CPU)."""
    return device.type == "cpu"
