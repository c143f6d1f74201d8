"""Checkpointed activations off the device between forward and backward (``offload.activations.tier``).

[Note: activation offload]
ZeRO-R's *Pa+cpu*: with ``train.activation_checkpointing`` a block unit keeps only its inputs from its
forward to its backward (activations' note). torch's non-reentrant checkpoint saves those inputs
through autograd's saved-tensor hooks *outside* its own, so one pair of hooks around each
checkpointed call sees exactly them and nothing else. ``HostActivations`` packs each into a host
buffer of the host tier (``Kind.ACTIVATION``: counted, budgeted and reported with the rest; pinned
where CUDA is present), copied on a side stream while the next block computes. Backward unpacks the
inputs in the reverse order, and each unpack first starts the copy back of the one packed before it
(the block backward reaches next), so every transfer overlaps the recompute and backward of the block
in hand; its host buffer is freed once it is back. On a CPU device, where device and host memory are
the same RAM, nothing would be gained by a copy: the engine installs no hooks there
(``placement.activations_leave_device``) and the memory plan counts the inputs where they stay.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from .kinds import Kind
from .tiers.streams import SideStreams, side_copy

__all__ = ["HostActivations"]


class _Packed:
    """One saved input on its way to the host and back."""

    def __init__(self, index: int, host: torch.Tensor, copied: torch.cuda.Event | None):
        self.index, self.host = index, host
        """The input's position in its forward, and its host copy (shaped as the input) until it is back."""
        self.copied = copied
        """Recorded after the copy to the host (CUDA): the copy back waits for it."""
        self.back: torch.Tensor | None = None
        """The input on the device again, once fetched (kept for a second unpack)."""
        self.arrived: torch.cuda.Event | None = None


class HostActivations:
    """Saved-tensor hooks that keep checkpointed inputs in ``host`` memory (see the note)."""

    def __init__(self, host: Any, device: torch.device, streams: SideStreams):
        """``host``: the host tier (``tiers.Tier``); ``device``: where the compute runs; the copies run on
        the ``activations`` side stream (streams' note)."""
        self.host, self.device = host, device
        self.stream = streams.get("activations")
        self._packed: list[_Packed] = []
        """This forward's saved inputs, in the order they were packed."""
        self.trace: list[tuple[str, int]] = []
        """``("fetch", i)`` as input i's copy back starts, ``("use", i)`` as backward takes it, since the
        last forward began: the order of events, which shows each copy started ahead of its use."""

    def begin_forward(self) -> None:
        """A forward starts: its inputs are numbered afresh (earlier ones stay with their graph)."""
        self._packed, self.trace = [], []

    def hooks(self) -> contextlib.AbstractContextManager:
        """Enter around a checkpointed call: its saved inputs go to the host."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def prefetch_last(self) -> None:
        """Backward is about to start: bring back the input packed last, which it needs first."""
        if self._packed:
            self._fetch(self._packed[-1])

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device != self.device:
            return tensor
        host = self.host.empty(Kind.ACTIVATION, tensor.numel(), tensor.dtype).view(tensor.shape)
        copied = side_copy(self.stream, host, tensor)
        if self.stream is not None:
            tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
        packed = _Packed(len(self._packed), host, copied)
        self._packed.append(packed)
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        previous = packed.index - 1
        if 0 <= previous < len(self._packed) and self._packed[previous] is not packed:
            self._fetch(self._packed[previous])  # the next one backward needs, during this block's
        self._fetch(packed)
        self.trace.append(("use", packed.index))
        if packed.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(packed.arrived)
            packed.back.record_stream(torch.cuda.current_stream(self.device))
        self._release(packed)
        return packed.back

    def _fetch(self, packed: _Packed) -> None:
        """Start copying ``packed`` back to the device (once)."""
        if packed.back is not None or packed.host is None:
            return
        self.trace.append(("fetch", packed.index))
        packed.back = torch.empty_like(packed.host, device=self.device)
        packed.arrived = side_copy(self.stream, packed.back, packed.host, after=packed.copied)
        if self.stream is not None:
            packed.back.record_stream(self.stream)  # not reused before the copy into it is done

    def _release(self, packed: _Packed) -> None:
        """The input is on the device again: its host buffer goes back (after the copy has read it)."""
        if packed.host is None:
            return
        if packed.arrived is not None:
            packed.arrived.synchronize()
        self.host.free(Kind.ACTIVATION, packed.host.view(-1))
        packed.host = None
