"""Blocks over a unit's shard: an empty one for a span of nothing, and a shard home split in two.

A partitioned unit's shard on NVMe with both trainable and frozen elements is stored as two blocks
(``SplitShardBlock``), so that a step rewrites its trainable span alone (partition's [Note:
partitioned units (stage 3)]).
"""
from __future__ import annotations

import contextlib

import torch

from ..block_stream import wait_each
from ..tiers import Block, Kind, Tier

__all__ = ["SplitShardBlock", "span_block"]


def span_block(tier: Tier, kind: Kind, key: str, numel: int, dtype: torch.dtype, *, aside: bool = False,
               segment: int = 0) -> Block:
    """``tier.block(...)`` for state over a trainable span; a span of nothing (a frozen shard) gets an
    empty resident block instead: streams load and store it at no cost, and no tier counts it."""
    if numel == 0:
        return Block(torch.empty(0, dtype=dtype, device=tier.device))
    return tier.block(kind, key, numel, dtype, aside=aside, segment=segment)


class _Both:
    """The moves of a block's two parts, waited for together (every one, even after a failure)."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self) -> int:
        wait_each(handle.wait for handle in self.handles)
        return 0


class SplitShardBlock(Block):
    """A partitioned unit's shard home on NVMe kept as two blocks: ``head``, the trainable span, which a
    step rewrites (``publication``: read first, for the few frozen values in its last granule), and
    ``tail``, the frozen values past it, which only whole writes store (first values, loads,
    ``gathered``). Loading reads both into one buffer, so to the scheduler the shard is one tensor;
    storing writes both. Frozen weights are thus read every pass and never written back by a step
    (bar those sharing the head's last 4 KiB-aligned granule, rewritten as read), and each block's
    digests (``nvme.checksum``) cover its own bytes."""

    resident = False

    def __init__(self, head: Block, tail: Block):
        self.head, self.tail = head, tail
        self.numel, self.dtype = head.numel + tail.numel, head.dtype
        self.data: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None

    def load(self, buffer: torch.Tensor | None = None, *, read: bool = True) -> _Both:
        raw = buffer.view(torch.uint8)
        self._buffer, self.data = buffer, raw[:self.nbytes].view(self.dtype)
        head = self.head.load(raw[:self.head.nbytes], read=read)
        try:
            return _Both([head, self.tail.load(raw[self.head.nbytes:], read=read)])
        except BaseException:
            with contextlib.suppress(Exception):  # already failing: the first error is the one to see
                head.wait()  # the buffer must not be freed under the head's transfer
            raise

    def store(self) -> _Both:
        return _Both([self.head.store(), self.tail.store()])

    def unload(self) -> torch.Tensor | None:
        self.head.unload()
        self.tail.unload()
        buffer, self._buffer, self.data = self._buffer, None, None
        return buffer
