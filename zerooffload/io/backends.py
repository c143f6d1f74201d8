"""Backends: the engines that move bytes between host memory and files, and how ``auto`` picks one.

[Note: backend vocabulary]
- A *request* (``Request``) is one transfer: op, descriptor, host address, length, file offset. A *batch*
  is the requests of one ``submit`` call; they complete together, as one *ticket*.
- A *piece* is a slice of a request of at most ``block_size`` bytes: the unit every backend moves, so
  a large request keeps several pieces in flight and no single read or write is larger than the disk
  wants. Short transfers continue from where they stopped; a read that meets end of file before its
  length fails with ``EEOF``.
- A *ticket* answers ``wait(timeout)`` with the batch's total bytes, or ``None`` when the timeout
  passes first, or raises ``TransferFailed`` (of the failed piece that comes first: lowest request
  index, then lowest offset, whatever order the pieces finished in, as in the native engine);
  ``done()`` says whether ``wait`` would return at once.
- The backends: ``uring`` (native io_uring, queue_depth pieces in flight), ``pool`` (native pthreads
  running pread/pwrite, ``threads`` pieces in flight), ``python`` (os.preadv/os.pwritev on a
  ThreadPoolExecutor of ``threads`` workers) and ``aiofiles`` (aiofiles' executor wrappers on an
  asyncio loop in a background thread). The last two are baselines for benchmarks and the fallback
  when the native extension ``zerooffload._aio`` is not built.
- *Availability*: each backend class says why it cannot run here (``unavailable_reason``; uring's is
  the native io_uring probe that doctor prints too, ``probe.probe_io_uring``); ``auto`` takes the first
  of uring, pool, python that can, and logs which and why.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import ctypes
import enum
import errno
import importlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

from .errors import EEOF, TransferFailed, describe_errno
from .probe import native_aio, probe_io_uring

if TYPE_CHECKING:
    from .settings import Settings

__all__ = [
    "AiofilesBackend", "Backend", "FutureTicket", "Op", "PoolBackend", "PythonBackend", "Request",
    "Ticket", "UringBackend", "open_backend",
]

log = logging.getLogger("zerooffload.io")


class Op(enum.IntEnum):
    """What a request does; the values are the native module's."""

    READ = 0
    """File to host memory."""
    WRITE = 1
    """Host memory to file."""


class Request(NamedTuple):
    op: Op
    fd: int
    addr: int
    length: int
    offset: int


class Ticket(Protocol):
    def wait(self, timeout: float | None) -> int | None: ...

    def done(self) -> bool: ...


class Backend(abc.ABC):
    """One engine: ``submit`` a batch of requests for a ticket; ``close`` after every ticket resolved."""

    name: ClassVar[str]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine, or None when it can."""
        return None

    @abc.abstractmethod
    def submit(self, requests: Sequence[Request]) -> Ticket: ...

    @abc.abstractmethod
    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------------
# Native backends


class _NativeTicket:
    __slots__ = ("_engine", "_ticket")

    def __init__(self, engine: object, ticket: int):
        self._engine = engine
        self._ticket = ticket

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self._engine.wait(self._ticket, timeout)
        except OSError as exc:
            if not hasattr(exc, "index"):
                raise
            raise TransferFailed(exc.errno, exc.index, exc.offset) from None

    def done(self) -> bool:
        try:
            return self._engine.poll(self._ticket)
        except ValueError:  # retired by another thread's wait, which only a finished batch allows
            return True


class _NativeBackend(Backend):
    def __init__(self, config: Settings):
        native, reason = native_aio()
        if native is None:
            raise RuntimeError(reason)
        self._ops = {Op.READ: native.READ, Op.WRITE: native.WRITE}
        self._engine = native.Engine(self.name, config.block_size, config.queue_depth, config.threads)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return native_aio()[1] or None

    def submit(self, requests: Sequence[Request]) -> Ticket:
        batch = [(self._ops[r.op], r.fd, r.addr, r.length, r.offset) for r in requests]
        return _NativeTicket(self._engine, self._engine.submit(batch))

    def close(self) -> None:
        self._engine.close()


class UringBackend(_NativeBackend):
    """io_uring through the native engine: ``queue_depth`` pieces in flight, one owner thread."""

    name = "uring"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """The native extension missing, else the native io_uring probe's answer (the one doctor prints)."""
        native, reason = native_aio()
        if native is None:
            return reason
        probe = probe_io_uring()
        return None if probe.ok else probe.detail


class PoolBackend(_NativeBackend):
    """pread/pwrite on ``threads`` native pthreads: io_uring's stand-in where it is missing."""

    name = "pool"


# ------------------------------------------------------------------------------------------------
# Python backends


class _Piece(NamedTuple):
    index: int
    op: Op
    fd: int
    addr: int
    length: int
    offset: int


def _split(requests: Sequence[Request], block_size: int) -> list[_Piece]:
    return [_Piece(i, r.op, r.fd, r.addr + at, min(block_size, r.length - at), r.offset + at)
            for i, r in enumerate(requests) for at in range(0, r.length, block_size)]


def _memory(addr: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def _advance(piece: _Piece, done: int, moved: int) -> int:
    """Bytes of the piece done after a call moved ``moved``; the same rule as the native engine's."""
    position = piece.offset + done + moved
    if moved == 0:  # nothing moved: end of file for a read; a write must not spin on it
        raise TransferFailed(EEOF if piece.op is Op.READ else errno.EIO, piece.index, position)
    if piece.op is Op.READ and done + moved < piece.length and position >= os.fstat(piece.fd).st_size:
        raise TransferFailed(EEOF, piece.index, position)  # see continue_or_eof in aio_engine.c
    return done + moved


def _move(piece: _Piece) -> int:
    """Move one piece with os.preadv/os.pwritev (which retry EINTR themselves); its length."""
    view, done = _memory(piece.addr, piece.length), 0
    call = os.preadv if piece.op is Op.READ else os.pwritev
    while done < piece.length:
        try:
            moved = call(piece.fd, [view[done:]], piece.offset + done)
        except OSError as exc:
            raise TransferFailed(exc.errno, piece.index, piece.offset + done) from None
        done = _advance(piece, done, moved)
    return done


def _comes_first(failure: BaseException, kept: BaseException | None) -> bool:
    """Whether ``failure`` is the one to report rather than ``kept`` (see [Note: backend vocabulary])."""
    if kept is None:
        return True
    both = isinstance(failure, TransferFailed) and isinstance(kept, TransferFailed)
    return both and (failure.index, failure.offset) < (kept.index, kept.offset)


class _CountdownTicket:
    """Done when all of its pieces have finished; keeps the failure that comes first."""

    def __init__(self, pieces: int):
        self._lock = threading.Lock()
        self._left = pieces
        self._bytes = 0
        self._failure: BaseException | None = None
        self._done = threading.Event()
        if pieces == 0:
            self._done.set()

    def finish(self, nbytes: int, failure: BaseException | None) -> None:
        with self._lock:
            self._bytes += nbytes
            if failure is not None and _comes_first(failure, self._failure):
                self._failure = failure
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self, timeout: float | None) -> int | None:
        if not self._done.wait(timeout):
            return None
        if self._failure is not None:
            raise self._failure
        return self._bytes

    def done(self) -> bool:
        return self._done.is_set()


class FutureTicket:
    """A ticket over a concurrent.futures.Future that returns the bytes moved or raises."""

    def __init__(self, future: concurrent.futures.Future[int]):
        self._future = future

    def wait(self, timeout: float | None) -> int | None:
        finished, _ = concurrent.futures.wait([self._future], timeout)
        return self._future.result() if finished else None

    def done(self) -> bool:
        return self._future.done()


class PythonBackend(Backend):
    """os.preadv/os.pwritev on a ThreadPoolExecutor of ``threads`` workers, one piece per task."""

    name = "python"

    def __init__(self, config: Settings):
        self._block_size = config.block_size
        self._executor = concurrent.futures.ThreadPoolExecutor(config.threads, "zo-aio-python")

    def submit(self, requests: Sequence[Request]) -> Ticket:
        pieces = _split(requests, self._block_size)
        ticket = _CountdownTicket(len(pieces))
        for piece in pieces:
            self._executor.submit(self._run, piece, ticket)
        return ticket

    @staticmethod
    def _run(piece: _Piece, ticket: _CountdownTicket) -> None:
        try:
            moved = _move(piece)
        except BaseException as failure:  # any failure must finish the piece, or its waiter hangs
            ticket.finish(0, failure)
        else:
            ticket.finish(moved, None)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class AiofilesBackend(Backend):
    """aiofiles on an asyncio loop in a background thread, its executor ``threads`` workers wide.

    aiofiles' file objects share one file position, so concurrent pieces of one file would race on
    seek+read; the pieces use aiofiles' own executor wrapping (``aiofiles.os.wrap``) of the positional
    calls instead, which is what aiofiles does for every call it offers.
    """

    name = "aiofiles"

    def __init__(self, config: Settings):
        import aiofiles.os

        self._calls = {Op.READ: aiofiles.os.wrap(os.preadv), Op.WRITE: aiofiles.os.wrap(os.pwritev)}
        self._block_size = config.block_size
        self._executor = concurrent.futures.ThreadPoolExecutor(config.threads, "zo-aio-aiofiles")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name="zo-aio-loop", daemon=True)
        self._thread.start()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            importlib.import_module("aiofiles.os")
        except ImportError as exc:
            return f"aiofiles is not installed ({exc})"
        return None

    def submit(self, requests: Sequence[Request]) -> Ticket:
        pieces = _split(requests, self._block_size)
        return FutureTicket(asyncio.run_coroutine_threadsafe(self._batch(pieces), self._loop))

    async def _batch(self, pieces: list[_Piece]) -> int:
        results = await asyncio.gather(*(self._move(p) for p in pieces), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return sum(results)

    async def _move(self, piece: _Piece) -> int:
        view, done = _memory(piece.addr, piece.length), 0
        while done < piece.length:
            try:
                moved = await self._calls[piece.op](piece.fd, [view[done:]], piece.offset + done)
            except OSError as exc:
                raise TransferFailed(exc.errno, piece.index, piece.offset + done) from None
            done = _advance(piece, done, moved)
        return done

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._executor.shutdown(wait=True)


# ------------------------------------------------------------------------------------------------
# Choosing one

BACKENDS: dict[str, type[Backend]] = {
    b.name: b for b in (UringBackend, PoolBackend, PythonBackend, AiofilesBackend)}
_AUTO_ORDER = ("uring", "pool", "python")


def open_backend(config: Settings) -> Backend:
    """The backend ``config.backend`` names, or for ``auto`` the first of uring, pool, python that works.

    An explicit backend that cannot run raises RuntimeError saying why and which to use instead.
    """
    if config.backend != "auto":
        return _open_named(config)
    skipped: list[str] = []
    for name in _AUTO_ORDER[:-1]:
        backend, reason = _try_open(BACKENDS[name], config)
        if backend is not None:
            log.info("aio backend auto -> %s%s", name, f" ({'; '.join(skipped)})" if skipped else "")
            return backend
        skipped.append(f"{name} unavailable: {reason}")
    log.warning("aio backend auto -> python, the slowest (%s)", "; ".join(skipped))
    return PythonBackend(config)


def _try_open(cls: type[Backend], config: Settings) -> tuple[Backend | None, str]:
    reason = cls.unavailable_reason()
    if reason is not None:
        return None, reason
    try:
        return cls(config), ""
    except OSError as exc:
        return None, f"the {cls.name} engine failed to start: [Errno {exc.errno}] {describe_errno(exc.errno)}"


def _open_named(config: Settings) -> Backend:
    if config.backend not in BACKENDS:
        raise ValueError(f"aio.backend = {config.backend!r}: expected 'auto' or one of {sorted(BACKENDS)}")
    backend, reason = _try_open(BACKENDS[config.backend], config)
    if backend is not None:
        log.info("aio backend %s (asked for by name)", config.backend)
        return backend
    usable = [n for n in _AUTO_ORDER if n != config.backend and BACKENDS[n].unavailable_reason() is None]
    raise RuntimeError(f"aio.backend = {config.backend!r} is unavailable: {reason}; "
                       f"use aio.backend = 'auto' (picks {usable[0]!r} here) or one of {usable}")
