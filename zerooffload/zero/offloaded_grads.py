"""Gradient shards kept off the device, from their reduction to the optimizer step.

[Note: offloaded gradients]
At stages 2–3 with ``offload.optimizer.tier`` host or NVMe, a unit's reduced gradient shard leaves the
device as soon as it is reduced: it is a block (``tiers.Block``) on its grad home, in the compute dtype:
the optimizer's tier, or host memory for optimizer state on NVMe when the run fits it there
(memory_plan's [Note: where kept gradients wait]); on a resident tier the writes and reads below are
the block's own memory, no byte moved. The first reduced part of an accumulation window is written
home in the background (``block_stream.BlockWriter``: at most three host buffers by default); a later
part (gradient accumulation) is added to what is home: read back, added to, and written home again in
the background. The norm of what is home is taken each time it is written, so the step's global norm
reads nothing; the update reads each block once, ahead of its use (``block_stream.BlockReader``: shared
by the units, at most ``GRAD_READS`` host buffers by default; without one, each unit reads through a
buffer of its own). On NVMe that is one write and one read of the gradient per step (2 × 2 B/param in
bf16) beside the 24 B/param the optimizer blocks move; either way it frees the device of Ψ/Nd gradient
elements. When the update needs no global view of the gradients, units are updated in backward
instead and no shard is kept here at all (backward_updates' [Note: updates in backward]); a tentative
update in backward (under a clip) keeps it, for the step may redo that update. A unit with frozen
parameters keeps only its shard's trainable span here (unit_layout's [Note: unit vocabulary]): the
rest of its gradient is zeros.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator

import torch

from ..block_stream import BlockReader, BlockWriter
from ..optim.cpu_adam import sum_squares
from ..tiers import Block, Tier

__all__ = ["OffloadedGrad"]


class OffloadedGrad:
    """One unit's reduced gradient shard on its grad home (see the note)."""

    def __init__(self, block: Block, writer: BlockWriter, host: Tier, *, reader: BlockReader | None = None):
        """``reader``: the units' shared reads ahead (``BlockReader(host, depth=grad_read_depth(config.aio))``);
        None: one buffer of this unit's own, as many reads ahead as the caller prefetches."""
        self.block, self.writer, self.host = block, writer, host
        self.reader = BlockReader(host, depth=1) if reader is None else reader
        self.written = False
        self.sumsq = torch.zeros((), dtype=torch.float64)
        """The squared norm of the gradient home now, taken as it was written (``sum_squares``)."""

    def add(self, reduced: torch.Tensor) -> None:
        """Accumulate one micro-batch's reduced shard into the window's gradient: the first part is
        written home, a later one added to what is home (read back); stored in the background either way.
        The engine finishes the writer after each backward, so a part is home before the next is added."""
        with self.adding(reduced):
            pass

    @contextlib.contextmanager
    def adding(self, reduced: torch.Tensor) -> Iterator[torch.Tensor]:
        """``add``, lending the window's gradient so far (this part included) to the caller before it is
        stored: a tentative update in backward reads the very values the step would read for its redo."""
        data = self.writer.begin(self.block, read=self.written)
        reduced = reduced[:self.block.numel]  # the block holds the trainable span: frozen slots' are zeros
        if self.written:  # a shard on the GPU comes to the host first: add_, unlike copy_, stays on one device
            data.add_(reduced.to(data.device))
        else:
            data.copy_(reduced)
        yield data
        self.sumsq = sum_squares(data)
        self.writer.commit(self.block)
        self.written = True

    def prefetch(self) -> None:
        """Start reading the gradient now, so that ``loaded`` later finds it (or finds it arriving);
        nothing when the reader's buffers are all taken (it is read on use then)."""
        self.reader.prefetch(self.block)

    def loaded(self) -> ContextManager[torch.Tensor]:
        """The window's gradient in memory (a host buffer when it lives on NVMe)."""
        return self.reader.loaded(self.block)

    def clear(self) -> None:
        """The window is over: the next reduced part overwrites the block (a read ahead not used is dropped)."""
        self.written = False
        self.reader.discard(self.block)
