"""Values on their way from the device to the host, without a sync: a non-blocking copy into pinned host memory
and an event recorded behind it on the current stream. The watch reads them once the event says they have
arrived (`arrived`), or waits for them where it cannot wait any longer (`wait`: a step late, or a user's read).

On the CPU (host_reads.free) nothing is in flight: the tensor is its own host copy and has always arrived."""

from __future__ import annotations

import torch

from hookwidget._torch import host_reads


class InFlight:
    """`values` (a device tensor) on their way to the host; `host` is the host tensor they arrive in."""

    __slots__ = ("host", "event")

    def __init__(self, values: torch.Tensor):
        if host_reads.free(values.device):
            self.host, self.event = values, None
            return
        # pinned where CUDA can pin: a non-blocking copy into pageable memory would wait for the device
        pin = values.device.type == "cuda"
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=pin)
        self.host.copy_(values, non_blocking=True)
        self.event = None
        if values.device.type != "cpu":  # a real device (a CPU run sent down the device path has no queue)
            self.event = torch.Event(values.device)
            self.event.record()

    def arrived(self) -> bool:
        """Whether the copy has reached the host (asks the event; never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has reached it (waiting for the device up to the copy, no further)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host

    def read(self) -> list:
        """The values as Python numbers, once they have reached the host (wait)."""
        return self.wait().tolist()
