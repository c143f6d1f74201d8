"""The copies of a CPU update of device tensors, across the host-device link, from host buffers made once.

[Note: the update's copies]
Where the CPU updates a unit whose gradient or weights are on a GPU (its optimizer state off the device), an
update moves two things across the link, both in the compute dtype (no fp32 unless the compute is: a reduced
shard was cast on the device as it left, ``Window._leaving``): the gradient down, which the native pass then
reads as it lies, and the new weights up, which the pass wrote as it updated the masters (a split master's
weights come down first: the pass reads them). Each copy runs on the ``updates`` side stream (tiers.streams'
[Note: side streams]) from one of two pinned host buffers, one for gradients and one for weights, made on
first use, grown to the largest unit's shard and kept across steps until ``close`` (the memory plan's
``update_grad``, 4 bytes an element, covers both in bf16), so no update allocates. The host waits for a copy
down before the pass reads it; the device's stream waits for a copy up before anything uses the weights, and
the weights' buffer is reused only once its copy up is done. One update runs at a time (the update worker,
or the step), so each buffer has one user. On a CPU device nothing crosses (the update reads and writes the
tensors where they are) and the same calls are plain copies.
"""
from __future__ import annotations

import torch

from ..tiers import Kind, Tier
from ..tiers.streams import side_copy

__all__ = ["UpdateCopies"]


class UpdateCopies:
    """The two host buffers of the update's copies and the stream they run on (see the note)."""

    def __init__(self, host: Tier, stream: "torch.cuda.Stream | None"):
        """``host``: where the buffers are made (pinned on CUDA); ``stream``: the ``updates`` side stream, None
        off CUDA."""
        self.host, self.stream = host, stream
        self._buffers: dict[str, torch.Tensor | None] = {"grad": None, "weights": None}
        self._weights_sent: "torch.cuda.Event | None" = None
        """The last copy up, which the weights' buffer waits for before it is filled again."""

    def _staging(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """``role``'s buffer as a host tensor shaped and typed like ``like`` (grown when too small)."""
        nbytes = like.numel() * like.element_size()
        buffer = self._buffers[role]
        if buffer is None or buffer.numel() < nbytes:
            self.host.free(Kind.BUFFER, buffer)
            buffer = self._buffers[role] = self.host.empty(Kind.BUFFER, nbytes, torch.uint8)
        return buffer[:nbytes].view(like.dtype).view(like.shape)

    def grad_down(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` in the gradient buffer, its copy done: what the pass reads until the next ``grad_down``."""
        host = self._staging("grad", grad)
        done = side_copy(self.stream, host, grad)
        if done is not None:
            done.synchronize()
        return host

    def weights_staging(self, target: torch.Tensor, read: bool) -> torch.Tensor:
        """The weights' buffer for ``target``'s new weights, holding them as they are with ``read`` (a split
        master's: the pass reads them), once its last copy up is done."""
        if self._weights_sent is not None:
            self._weights_sent.synchronize()
            self._weights_sent = None
        host = self._staging("weights", target)
        if read:
            done = side_copy(self.stream, host, target)
            if done is not None:
                done.synchronize()
        return host

    def weights_up(self, target: torch.Tensor, staged: torch.Tensor) -> None:
        """Send ``staged`` (from ``weights_staging``) into ``target``; the device's current stream waits for it."""
        self._weights_sent = side_copy(self.stream, target, staged)
        if self._weights_sent is not None:
            torch.cuda.current_stream(target.device).wait_event(self._weights_sent)

    def close(self) -> None:
        """Let the buffers go (the last copy up waited for)."""
        if self._weights_sent is not None:
            self._weights_sent.synchronize()
            self._weights_sent = None
        for role, buffer in self._buffers.items():
            self.host.free(Kind.BUFFER, buffer)
            self._buffers[role] = None
