"""Unaligned transfers on O_DIRECT files, done as aligned ones through bounce buffers.

[Note: bounce vocabulary]
- A transfer's *span* is the bytes [offset, offset + length) of the file it reads or writes.
- The *edges* are the 4 KiB blocks at either end of the span that it covers only in part (one block
  when the span lies inside one). A write reads each edge block (zeros past end of file), copies the
  user's bytes over it and writes it whole, holding the block in ``FileWriteState.edges`` meanwhile; a
  read reads the block whole and copies the user's part out.
- The *interior* is the whole blocks between the edges. It moves straight between the file and the
  user's memory when that memory is aligned where the interior starts; otherwise through *chunks*:
  one aligned buffer of at most ``block_size * queue_depth`` bytes (enough to keep the backend's queue
  full), filled and moved one chunk after another.
- Edge blocks are read synchronously (os.preadv) on the bounce worker: they are at most two blocks,
  and a synchronous read tells a block cut short by end of file (fine when the span ends before that)
  from a failure, which a backend rightly reports a short read as.
- *Bounce workers*: ``threads`` threads run these transfers, so ``AsyncIO.read``/``write`` return at
  once; their buffers come from a HostBufferPool sized for every worker at once, so none ever waits.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .backends import Backend, FutureTicket, Op, Request, Ticket
from .buffers import ALIGNMENT, HostBufferPool, is_aligned
from .errors import EEOF, TransferFailed
from .files import FileWriteState

if TYPE_CHECKING:
    from .settings import Settings

__all__ = ["Bouncer"]


def _down(value: int) -> int:
    return value - value % ALIGNMENT


def _up(value: int) -> int:
    return _down(value + ALIGNMENT - 1)


@dataclass(frozen=True, slots=True)
class _Transfer:
    op: Op
    fd: int
    addr: int
    length: int
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def edges(self) -> list[int]:
        """File offsets of the blocks the span covers only in part."""
        head = _down(self.offset) if self.offset % ALIGNMENT else None
        tail = _down(self.end) if self.end % ALIGNMENT else None
        return sorted({b for b in (head, tail) if b is not None})

    def user(self, position: int) -> int:
        """The host address of the file byte at ``position``."""
        return self.addr + position - self.offset


class Bouncer:
    """Runs unaligned transfers for one AsyncIO; its workers and buffers are made on first use."""

    def __init__(self, backend: Backend, config: Settings):
        self._backend = backend
        self._chunk = config.block_size * config.queue_depth
        self._threads = config.threads
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool: HostBufferPool | None = None

    def submit(self, op: Op, fd: int, state: FileWriteState, addr: int, length: int, offset: int) -> Ticket:
        with self._lock:
            if self._executor is None:
                self._pool = HostBufferPool(self._threads * (self._chunk + 2 * ALIGNMENT))
                self._executor = concurrent.futures.ThreadPoolExecutor(self._threads, "zo-aio-bounce")
        transfer = _Transfer(op, fd, addr, length, offset)
        return FutureTicket(self._executor.submit(_run, self._backend, self._pool, self._chunk, state, transfer))

    def close(self) -> None:
        """Wait for running transfers, stop the workers, free the buffers."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._pool.clear()


def _run(backend: Backend, pool: HostBufferPool, chunk: int, state: FileWriteState, t: _Transfer) -> int:
    """One unaligned transfer; its length, or TransferFailed (also for the synchronous calls' OSError)."""
    try:
        if t.op is Op.WRITE:
            return _write(backend, pool, chunk, state, t)
        return _read(backend, pool, chunk, t)
    except OSError as exc:
        raise TransferFailed(exc.errno, 0, t.offset) from exc


def _write(backend: Backend, pool: HostBufferPool, chunk: int, state: FileWriteState, t: _Transfer) -> int:
    edges = t.edges()
    with state.edges(edges), state.padded_tail(t.fd, t.end, _up(t.end)), _borrow(pool, len(edges)) as blocks:
        for block, buffer in zip(edges, blocks):
            _read_block(t.fd, buffer, block)  # past end of file: zeros
            lo, hi = max(t.offset, block), min(t.end, block + ALIGNMENT)
            ctypes.memmove(buffer.data_ptr() + lo - block, t.user(lo), hi - lo)
        _move(backend, pool, chunk, t, [Request(Op.WRITE, t.fd, b.data_ptr(), ALIGNMENT, e)
                                        for e, b in zip(edges, blocks)])
    return t.length


def _read(backend: Backend, pool: HostBufferPool, chunk: int, t: _Transfer) -> int:
    edges = t.edges()
    with _borrow(pool, len(edges)) as blocks:
        for block, buffer in zip(edges, blocks):
            got = _read_block(t.fd, buffer, block)
            lo, hi = max(t.offset, block), min(t.end, block + ALIGNMENT)
            if got < hi - block:
                raise TransferFailed(EEOF, 0, block + got)
            ctypes.memmove(t.user(lo), buffer.data_ptr() + lo - block, hi - lo)
        _move(backend, pool, chunk, t, [])
    return t.length


def _move(backend: Backend, pool: HostBufferPool, chunk: int, t: _Transfer, requests: list[Request]) -> None:
    """Move ``requests`` and the interior together: one batch, plus chunks if the memory is unaligned.

    The batch is in file order, so that a failure it reports is the one at the lowest offset (a
    backend reports the failed request that comes first).
    """
    lo, hi = _up(t.offset), _down(t.end)
    chunked = hi > lo and not is_aligned(t.user(lo))
    if hi > lo and not chunked:
        requests = [*requests, Request(t.op, t.fd, t.user(lo), hi - lo, lo)]
    ticket = backend.submit(sorted(requests, key=lambda r: r.offset)) if requests else None
    try:
        if chunked:
            _chunks(backend, pool, chunk, t, lo, hi)
    finally:  # the batch's buffers must outlive it, whatever the chunks did
        if ticket is not None:
            ticket.wait(None)


def _chunks(backend: Backend, pool: HostBufferPool, chunk: int, t: _Transfer, lo: int, hi: int) -> None:
    with _borrow(pool, 1, min(chunk, hi - lo)) as (buffer,):
        for at in range(lo, hi, chunk):
            n = min(chunk, hi - at)
            if t.op is Op.WRITE:
                ctypes.memmove(buffer.data_ptr(), t.user(at), n)
            backend.submit([Request(t.op, t.fd, buffer.data_ptr(), n, at)]).wait(None)
            if t.op is Op.READ:
                ctypes.memmove(t.user(at), buffer.data_ptr(), n)


def _read_block(fd: int, buffer: torch.Tensor, block: int) -> int:
    """Read one aligned block; bytes past end of file read as zeros. Returns the bytes in the file.

    One call suffices: an O_DIRECT read of one block comes back short only at end of file.
    """
    got = os.preadv(fd, [buffer.numpy()], block)
    buffer[got:].zero_()
    return got


@contextlib.contextmanager
def _borrow(pool: HostBufferPool, count: int, nbytes: int = ALIGNMENT) -> Iterator[list[torch.Tensor]]:
    buffers: list[torch.Tensor] = []
    try:
        buffers.extend(pool.acquire(nbytes) for _ in range(count))
        yield buffers
    finally:
        for buffer in buffers:
            pool.release(buffer)
