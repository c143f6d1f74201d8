"""The host-device link: what crosses it, and the copier that brings shards onto the device.

[Note: the host-device link]
What crosses between host memory and the device tier is counted in ``LinkStats`` (bus traffic on a
GPU, a copy or an in-place read on a CPU machine). Shards that live off the device go up through a
``DeviceCopier``: on CUDA its side stream (``streams``' [Note: side streams]), an event the consuming
stream waits on, and the host buffer let go only after the copy is done.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kinds import Kind
from .streams import SideStreams, side_copy
from .tier import Tier

__all__ = ["DeviceCopier", "LinkStats"]


@dataclass(slots=True)
class LinkStats:
    """Bytes moved between host memory and the device tier since the last ``reset``: over the bus on a
    GPU machine; on a CPU-only one a copy between the two tiers' buffers (or none, where the update reads
    them in place), counted the same way so that the figures mean the same on both."""

    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0

    def reset(self) -> None:
        self.host_to_device_bytes = self.device_to_host_bytes = 0


class DeviceCopier:
    """Host tensors onto the device tier ahead of their use, counted in ``link``.

    On CUDA each copy runs on the ``shards`` side stream (streams' note), from pinned memory, so it
    overlaps the compute; the stream that uses the copy waits on an event recorded after it, and the
    host waits on that event before its buffer may be reused. On a CPU device the host tensor is used in
    place.
    """

    def __init__(self, device_tier: Tier, link: LinkStats, streams: SideStreams):
        self.tier, self.link = device_tier, link
        self.stream = streams.get("shards")

    def to_device(self, source: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """``source`` on the device, usable on the current stream, and what to call once its user is
        done: wait for the copy (the host buffer is then free to reuse) and free the device buffer."""
        self.link.host_to_device_bytes += source.numel() * source.element_size()
        if self.stream is None:
            return source, lambda: None
        target = self.tier.empty(Kind.BUFFER, source.numel(), source.dtype)
        copied = side_copy(self.stream, target, source)
        torch.cuda.current_stream(self.tier.device).wait_event(copied)

        def release() -> None:
            copied.synchronize()
            self.tier.free(Kind.BUFFER, target)
        return target, release
