"""The side streams copies run on, made in one place, and the one way a copy runs on one.

[Note: side streams]
On a CUDA device three kinds of copies overlap the compute, each on a stream of its own, so that none
queues behind another:
- ``shards``: stage 3 parameter shards that live off the device, copied in ahead of their gathers
  (``link.DeviceCopier``);
- ``activations``: checkpointed block inputs on their way to the host in forward and back in backward
  (``activation_offload.HostActivations``);
- ``updates``: a CPU update's gradient down and new weights up (zero.update_copies' [Note: the update's
  copies]), beside the backward or forward the device computes meanwhile.
Each is made here (FSDP2 makes its streams in one place too, ``FSDPCommContext.lazy_init``), each the
first time a copier asks for it. A copy on a side stream (``side_copy``) first waits for what the current
stream has queued (its source may still be being written there, its target still read), and records an
event after itself that its consumer waits on. On a CPU device there are no streams: copies run where
they are called, and a host tensor is used in place.
"""
from __future__ import annotations

import torch

__all__ = ["SideStreams", "side_copy"]


class SideStreams:
    """The side streams of one engine's device (see the note); None on a CPU device."""

    PURPOSES = ("shards", "activations", "updates")

    def __init__(self, device: torch.device):
        self.device = device
        self._streams: dict[str, torch.cuda.Stream] = {}

    def get(self, purpose: str) -> torch.cuda.Stream | None:
        """The stream of ``purpose`` (one of ``PURPOSES``), made on first use; None off CUDA."""
        if purpose not in self.PURPOSES:
            raise ValueError(f"no side stream for {purpose!r}: one of {self.PURPOSES}")
        if self.device.type != "cuda":
            return None
        if purpose not in self._streams:
            self._streams[purpose] = torch.cuda.Stream(self.device)
        return self._streams[purpose]


def side_copy(stream: torch.cuda.Stream | None, target: torch.Tensor, source: torch.Tensor,
              after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
    """``target.copy_(source)`` on ``stream`` (at once without one), once the current stream's queued
    work and ``after`` are done; the event recorded after the copy (None without a stream)."""
    if stream is None:
        target.copy_(source)
        return None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        target.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done
