"""Bounded pipelines of block transfers: streaming blocks through host buffers, writing them home in the
background, reading them ahead of their use; and the core they (and the checkpoint writer) share.

[Note: block pipelines]
Work on state that lives off the compute's memory moves it a block at a time (``tiers``' [Note: blocks])
through a bounded set of host buffers, overlapping the transfers with the work. Every such pipeline is
built on ``InFlight``, which owns the rules they share:
- at most ``depth`` transfers in flight: before starting another, wait for the oldest (``make_room``);
- a transfer's buffer is let go (``release``) only once the transfer finished, well or not, so no
  memory is ever freed under the I/O engine;
- ``drain`` waits for every transfer, then raises the first failure; ``abandon`` (already failing)
  waits for every one and raises nothing, so the first error is the one to see.
The pipelines:
- ``stream_blocks``: read block i+1 ‖ the caller works on block i ‖ write block i−1 (the optimizer
  step, checkpoints and loads walk every unit's optimizer block this way); ``depth`` host buffers,
  ``depth − 2`` reads ahead (at least one);
- ``BlockWriter``: blocks overwritten (or changed in place) and stored in the background (offloaded
  gradients, new parameter shards), ``depth`` host buffers;
- ``BlockReader``: blocks read ahead of their use (offloaded gradients for the update), ``depth``
  host buffers, those in use included; a read ahead is skipped when none is free;
- ``checkpoint.files.ChecksummedWriter``: a checkpoint's data file, ``depth`` writes in flight;
- the prefetching scheduler's staged shards (``zero.scheduler``: reads of stage-3 shards from NVMe,
  bounded by its byte window) and the reducer's buckets (``zero.reduction``: ``MAX_BUCKETS_IN_FLIGHT``
  collectives, each handing its shards off as it is waited for) are ``InFlight`` queues too.
Their depth is ``aio.blocks_in_flight`` where set, else each one's own default: ``stream_depth``,
``grad_read_depth`` and ``checkpoint_depth`` say which. The memory plan counts the buffers these hold.

Transfers carry profiler labels (no-ops unless torch.profiler is recording): ``zerooffload::block_read``
and ``zerooffload::block_write`` where a transfer starts, ``zerooffload::block_wait`` where the caller
blocks on one.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from .kinds import Kind
from .trace import profiled

if TYPE_CHECKING:
    from .config import AioConfig
    from .tiers import Block, Tier

__all__ = ["InFlight", "wait_each", "stream_blocks", "BlockWriter", "BlockReader", "write_block", "STREAM_BUFFERS", "GRAD_READS",
           "CHECKPOINT_WRITES", "stream_depth", "grad_read_depth", "checkpoint_depth", "BLOCK_READ", "BLOCK_WRITE",
           "BLOCK_WAIT"]

STREAM_BUFFERS = 3
"""Host buffers a block stream holds by default: one being read, one being worked on, one being written;
and a ``BlockWriter``'s."""
GRAD_READS = 2
"""Host buffers of offloaded-gradient reads by default: the gradient in use and the next one read ahead."""
CHECKPOINT_WRITES = 3
"""Writes of a checkpoint data file in flight by default, each from its own staging buffer."""

BLOCK_READ = "zerooffload::block_read"
BLOCK_WRITE = "zerooffload::block_write"
BLOCK_WAIT = "zerooffload::block_wait"


def _configured(aio: "AioConfig | None", default: int) -> int:
    """``aio.blocks_in_flight`` where set (not 0), else ``default``."""
    depth = 0 if aio is None else aio.blocks_in_flight
    return depth or default


def stream_depth(aio: "AioConfig | None" = None) -> int:
    """Host buffers of a block stream and of a ``BlockWriter`` under ``aio`` (the config's ``aio``)."""
    return _configured(aio, STREAM_BUFFERS)


def grad_read_depth(aio: "AioConfig | None" = None) -> int:
    """Host buffers of the offloaded-gradient ``BlockReader`` under ``aio``."""
    return _configured(aio, GRAD_READS)


def checkpoint_depth(aio: "AioConfig | None" = None) -> int:
    """Writes in flight of a checkpoint data file under ``aio``."""
    return _configured(aio, CHECKPOINT_WRITES)


def wait_each(waits: Iterable[Callable[[], Any]]) -> None:
    """Call every wait, even after one fails (no buffer may be released under a transfer), then raise
    the first failure."""
    error = None
    for wait_one in waits:
        try:
            wait_one()
        except Exception as exc:  # keep waiting
            error = error or exc
    if error is not None:
        raise error


def wait(handle: Any) -> Any:
    """Block on one transfer, labelled for the profiler."""
    with profiled(BLOCK_WAIT):
        return handle.wait()


def _load(block: "Block", buffer: torch.Tensor | None, read: bool) -> Any:
    if not read:
        return block.load(buffer, read=False)
    with profiled(BLOCK_READ):
        return block.load(buffer)


def _store(block: "Block") -> Any:
    with profiled(BLOCK_WRITE):
        return block.store()


# ---------------------------------------------------------------------------------------------- the core
@dataclass(slots=True, eq=False)
class _Transfer:
    handle: Any
    item: Any
    release: Callable[[], None] | None


class InFlight:
    """Transfers in flight, at most ``depth``, finished oldest first (see [Note: block pipelines]).

    Each is added with the ``item`` it moves (kept alive until it finished; ``finish`` finds it by
    identity) and what to ``release`` once it finished, however it ended (give its buffer back).
    """

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"depth = {depth}: at least one transfer must be allowed in flight")
        self.depth = depth
        self._transfers: deque[_Transfer] = deque()

    def __len__(self) -> int:
        return len(self._transfers)

    def __contains__(self, item: Any) -> bool:
        return any(transfer.item is item for transfer in self._transfers)

    @property
    def oldest(self) -> Any:
        """The item of the oldest transfer in flight."""
        return self._transfers[0].item

    def make_room(self) -> None:
        """Wait for the oldest transfers until another may start."""
        while len(self._transfers) >= self.depth:
            self.wait_oldest()

    def add(self, handle: Any, item: Any = None, release: Callable[[], None] | None = None) -> None:
        """Track a transfer just started (``make_room`` first: it is in flight already)."""
        transfer = _Transfer(handle, item, release)
        if len(self._transfers) >= self.depth:  # a caller's bug: still, nothing is released under a transfer
            with contextlib.suppress(Exception):
                self._finish(transfer)
            raise RuntimeError(f"{len(self._transfers) + 1} transfers in flight, over the depth of {self.depth}: "
                               "make_room() must come before the transfer starts")
        self._transfers.append(transfer)

    def wait_oldest(self) -> Any:
        """Wait for the oldest transfer and release it; its failure raises (after the release)."""
        return self._finish(self._transfers.popleft())

    def finish(self, item: Any) -> Any:
        """Wait for the transfer of ``item`` (wherever it is in the queue) and release it."""
        for transfer in self._transfers:
            if transfer.item is item:
                self._transfers.remove(transfer)
                return self._finish(transfer)
        raise LookupError(f"no transfer of {item!r} in flight")

    def drain(self) -> None:
        """Wait for every transfer, oldest first; the first failure raises once all have finished."""
        wait_each(self.wait_oldest for _ in range(len(self._transfers)))

    def abandon(self) -> None:
        """After a failure: wait for every transfer and release it, raising nothing (the error to see
        is the one already raised)."""
        with contextlib.suppress(Exception):
            self.drain()

    @staticmethod
    def _finish(transfer: _Transfer) -> Any:
        try:
            return wait(transfer.handle)
        finally:
            if transfer.release is not None:
                transfer.release()


# ---------------------------------------------------------------------------------------------- stream
class _Buffers:
    """At most ``limit`` host buffers of ``size`` bytes, made on first need, counted as ``Kind.BUFFER``."""

    def __init__(self, tier: "Tier", size: int, limit: int):
        self.tier, self.size, self.limit = tier, size, limit
        self.owned: list[torch.Tensor] = []
        self.spare: list[torch.Tensor] = []

    def get(self) -> torch.Tensor | None:
        """A free buffer, or None when all ``limit`` are taken."""
        if not self.spare and len(self.owned) < self.limit:
            self.owned.append(self.tier.empty(Kind.BUFFER, self.size, torch.uint8))
            self.spare.append(self.owned[-1])
        return self.spare.pop() if self.spare else None

    def put(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self.spare.append(buffer)

    def free_all(self) -> None:
        for buffer in self.owned:
            self.tier.free(Kind.BUFFER, buffer)
        self.owned, self.spare = [], []


def stream_blocks(blocks: list["Block"], buffer_tier: "Tier", *, read: bool = True, write: bool = True,
                  depth: int = STREAM_BUFFERS) -> Iterator["Block"]:
    """Yield each block loaded, in order: later blocks load while the caller works on block i and
    earlier ones are stored, through at most ``depth`` host buffers (``Kind.BUFFER`` of
    ``buffer_tier``), ``depth − 2`` blocks read ahead (at least one; see [Note: block pipelines]).

    ``read=False`` skips the reads (the caller overwrites ``data``), ``write=False`` the stores. The
    caller must finish with a block before asking for the next: after that it is stored and unloaded.
    """
    if depth < 2:
        raise ValueError(f"a block stream needs depth >= 2 (one block worked on, the next read), not {depth}")
    ahead = max(1, depth - 2)
    buffers = _Buffers(buffer_tier, max((b.nbytes for b in blocks if not b.resident), default=0), depth)
    loading, storing = InFlight(ahead + 1), InFlight(depth)

    def recycle(block: "Block") -> None:
        buffers.put(block.unload())

    def start_load(block: "Block") -> None:
        if block.resident:
            loading.add(block.load(), block)
            return
        while (buffer := buffers.get()) is None:  # every buffer is being worked on, read or written
            storing.wait_oldest()  # there is a store: reads ahead and the block in use leave one buffer
        try:
            loading.add(_load(block, buffer, read), block)
        except BaseException:
            block.unload()
            buffers.put(buffer)
            raise

    def start_store(block: "Block") -> None:
        storing.make_room()  # resident blocks hold no buffer, so only their handles count here
        try:
            handle = _store(block)
        except BaseException:
            recycle(block)
            raise
        storing.add(handle, block, lambda: recycle(block))

    started = 0
    try:
        for index, block in enumerate(blocks):
            while started < min(index + 1 + ahead, len(blocks)):
                start_load(blocks[started])
                started += 1
            loading.wait_oldest()
            yield block
            if write:
                start_store(block)
            else:
                recycle(block)
        storing.drain()
    finally:
        loading.abandon()  # already failing, or nothing left: the first error is the one to see
        storing.abandon()
        buffers.free_all()


# ---------------------------------------------------------------------------------------------- writer
class BlockWriter:
    """Overwrites blocks with new values (or changes them in place) and stores them in the background,
    through at most ``depth`` host buffers (``Kind.BUFFER`` of ``buffer_tier``); ``finish`` waits for all."""

    def __init__(self, buffer_tier: "Tier", *, depth: int = STREAM_BUFFERS):
        self.buffer_tier = buffer_tier
        self._stores = InFlight(depth)

    def begin(self, block: "Block", *, read: bool = False) -> torch.Tensor:
        """``block.data`` to overwrite (a host buffer unless resident; with ``read``, holding what is
        home, to change in place); ``commit`` stores it."""
        if not block.resident:
            self._stores.make_room()  # this buffer and those of the stores in flight: at most depth
            buffer = self.buffer_tier.empty(Kind.BUFFER, block.nbytes, torch.uint8)
            try:
                wait(_load(block, buffer, read))
            except BaseException:
                block.unload()
                self.buffer_tier.free(Kind.BUFFER, buffer)
                raise
        return block.data

    def commit(self, block: "Block") -> None:
        """Start storing a block filled since ``begin``."""
        if block.resident:
            return

        def release() -> None:
            self.buffer_tier.free(Kind.BUFFER, block.unload())
        try:
            handle = _store(block)
        except BaseException:
            release()
            raise
        self._stores.add(handle, block, release)

    def write(self, block: "Block", values: torch.Tensor) -> None:
        self.begin(block).copy_(values)
        self.commit(block)

    def finish(self) -> None:
        """Wait for every store (the first failure raises after the rest are waited for)."""
        self._stores.drain()


def write_block(block: "Block", values: torch.Tensor, buffer_tier: "Tier") -> None:
    """Overwrite ``block`` with ``values`` (cast to its dtype) and store it home, now."""
    writer = BlockWriter(buffer_tier, depth=1)
    writer.write(block, values)
    writer.finish()


# ---------------------------------------------------------------------------------------------- reader
class BlockReader:
    """Blocks read ahead of their use, through at most ``depth`` host buffers (``Kind.BUFFER`` of
    ``buffer_tier``), counting those being read and those in use.

    ``prefetch`` starts a read when a buffer is free (else it does nothing: the read happens on use);
    ``loaded`` gives a block's data, waiting for its read (or, when every buffer is taken by reads
    ahead, waiting for the oldest of those and dropping it first) and lets the buffer go after use.
    """

    def __init__(self, buffer_tier: "Tier", *, depth: int = GRAD_READS):
        self.buffer_tier = buffer_tier
        self._reads = InFlight(depth)
        self._buffers: dict[Block, torch.Tensor] = {}
        """The buffer of every block being read or in use."""

    @property
    def depth(self) -> int:
        return self._reads.depth

    @property
    def held(self) -> int:
        """Host buffers held now (reads in flight and blocks in use)."""
        return len(self._buffers)

    def prefetch(self, block: "Block") -> bool:
        """Start reading ``block`` if it lives off memory, is not read or in use yet and a buffer is
        free; whether it is (being) read now."""
        if block.resident or block in self._buffers:
            return True
        if len(self._buffers) >= self.depth:
            return False
        self._start(block)
        return True

    @contextlib.contextmanager
    def loaded(self, block: "Block") -> Iterator[torch.Tensor]:
        """``block.data`` valid (a host buffer when it lives off memory) for the ``with`` body."""
        if block.resident:
            yield block.data
            return
        if block not in self._buffers:
            while len(self._buffers) >= self.depth and len(self._reads):
                self._drop(self._reads.oldest)
            if len(self._buffers) >= self.depth:
                raise RuntimeError(f"all {self.depth} read buffers are in use: blocks must be used one at a time")
            self._start(block)
        elif block not in self._reads:
            raise RuntimeError("a block is in use already: blocks must be used one at a time")
        try:
            self._reads.finish(block)
            yield block.data
        finally:
            self._release(block)

    def discard(self, block: "Block") -> None:
        """Drop a read ahead of ``block`` not used (its data is stale): waited for, its buffer freed."""
        if block in self._buffers:
            self._drop(block)

    def close(self) -> None:
        """Wait for every read ahead and free its buffer (the first failure raises after the rest)."""
        error = None
        while len(self._reads):
            try:
                self._drop(self._reads.oldest)
            except Exception as exc:  # keep waiting: no buffer may be freed under a transfer
                error = error or exc
        if error is not None:
            raise error

    def _start(self, block: "Block") -> None:
        buffer = self.buffer_tier.empty(Kind.BUFFER, block.nbytes, torch.uint8)
        self._reads.make_room()  # never waits: the buffers bound the reads
        try:
            handle = _load(block, buffer, True)
        except BaseException:
            block.unload()
            self.buffer_tier.free(Kind.BUFFER, buffer)
            raise
        self._buffers[block] = buffer
        self._reads.add(handle, block)

    def _drop(self, block: "Block") -> None:
        try:
            self._reads.finish(block)
        finally:
            self._release(block)

    def _release(self, block: "Block") -> None:
        block.unload()
        self.buffer_tier.free(Kind.BUFFER, self._buffers.pop(block))
