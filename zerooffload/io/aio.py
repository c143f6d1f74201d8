"""The async-I/O facade: ``AsyncIO`` reads and writes host buffers at file offsets and returns Handles.

[Note: AsyncIO vocabulary]
- A *transfer* is one ``read`` or ``write`` a user asks for: a host buffer (a contiguous CPU tensor of
  any dtype, or any C-contiguous buffer-protocol object), an AioFile and a file offset. It completes
  as one ``Handle``.
- The *fast path*: a transfer whose address, offset and length are all 4 KiB-aligned, or any transfer
  on a file that is not direct, goes to the backend as one request (split into pieces there).
- The *bounce path*: any other transfer on a direct file runs on a bounce worker (bounce.py), with
  read-modify-write of its edge blocks. ``raw=True`` refuses such transfers with EINVAL instead, so
  that benchmarks never measure copies by accident.
- A Handle *resolves* once: it keeps its byte count or its AioError, so ``wait`` can be repeated.
  Until then the AsyncIO holds it (and through it the buffer, which the engine is still using), and
  ``close`` waits for every one, so memory is never freed under a transfer in flight.
"""
from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from .backends import Backend, Op, Request, Ticket, open_backend
from .bounce import Bouncer
from .buffers import HostSpan, host_span, is_aligned
from .errors import AioError, TransferFailed, describe_errno
from .files import AioFile, open_file
from .settings import IOSettings

if TYPE_CHECKING:
    from .settings import Settings

# The facade also re-exports the file API and its error, so callers need one import.
__all__ = ["AioError", "AioFile", "AsyncIO", "Handle", "open_file"]

_WAIT_SLICE = 0.1
"""Seconds a wait blocks in native code at a time, so Ctrl-C is seen while waiting forever."""


class _Context:
    """What a transfer's errors name: the operation, the file, the offset and length asked for."""

    __slots__ = ("op", "path", "offset", "length")

    def __init__(self, op: Op, path: str, offset: int, length: int):
        self.op, self.path, self.offset, self.length = op, path, offset, length

    def error(self, code: int, detail: str = "", failed_offset: int | None = None) -> AioError:
        return AioError(code, describe_errno(code) + detail, self.path, op=self.op.name.lower(),
                        offset=self.offset, length=self.length, failed_offset=failed_offset)


class Handle:
    """One transfer in flight: ``wait(timeout=None)`` returns its bytes or raises AioError; ``done()``."""

    def __init__(self, ticket: Ticket, context: _Context, span: HostSpan, registry: _Registry):
        self._ticket = ticket
        self._context = context
        self._span: HostSpan | None = span  # keeps the buffer alive until the transfer resolves
        self._registry = registry
        self._lock = threading.Lock()
        self._result: int | None = None
        self._error: AioError | None = None

    def _resolved(self) -> bool:
        return self._result is not None or self._error is not None

    def done(self) -> bool:
        """Whether ``wait`` would return (or raise) at once."""
        return self._resolved() or self._ticket.done()

    def wait(self, timeout: float | None = None) -> int:
        """Bytes moved. Raises AioError if the transfer failed, TimeoutError if ``timeout`` s pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            raise TimeoutError(f"transfer not done after {timeout} s")
        try:
            while not self._resolved():
                left = _WAIT_SLICE if deadline is None else deadline - time.monotonic()
                if not self._resolve(max(0.0, min(_WAIT_SLICE, left))) and (
                        deadline is not None and time.monotonic() >= deadline):
                    raise TimeoutError(f"transfer not done after {timeout} s")
        finally:
            self._lock.release()
        if self._error is not None:
            raise self._error
        return self._result

    def _resolve(self, timeout: float) -> bool:
        """Take the ticket's outcome if it comes within ``timeout``; whether it did. Caller holds _lock."""
        try:
            result = self._ticket.wait(timeout)
        except TransferFailed as failure:
            self._error = self._context.error(failure.errno, failed_offset=failure.offset)
        else:
            if result is None:
                return False
            self._result = result
        self._span = None
        self._registry.discard(self)
        return True

    def _try_resolve(self) -> None:
        """Resolve now if already done and nobody else is waiting (for the registry's sweeps)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._resolved() and self._ticket.done():
                    self._resolve(0)
            finally:
                self._lock.release()


class _Registry:
    """The unresolved Handles of one AsyncIO. Swept when it has doubled, so forgotten handles do not pile up."""

    _SWEEP_MIN = 256

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False
        self._handles: set[Handle] = set()
        self._sweep_at = self._SWEEP_MIN

    def add(self, handle: Handle) -> bool:
        """Add a handle (caller holds ``lock``); whether a sweep is due."""
        self._handles.add(handle)
        return len(self._handles) >= self._sweep_at

    def discard(self, handle: Handle) -> None:
        with self.lock:
            self._handles.discard(handle)

    def sweep(self) -> None:
        with self.lock:
            handles = list(self._handles)
        for handle in handles:
            handle._try_resolve()
        with self.lock:
            self._sweep_at = max(self._SWEEP_MIN, 2 * len(self._handles))

    def close(self) -> None:
        """Refuse new handles and resolve every one (errors stay with their handles)."""
        with self.lock:
            self.closed = True
            handles = list(self._handles)
        for handle in handles:
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - the handle keeps its error for its owner; closing goes on
                pass


def _shutdown(pid: int, registry: _Registry, bouncer: Bouncer, backend: Backend) -> None:
    if os.getpid() != pid:  # a forked child has none of the engine's threads: joining them would hang
        return
    registry.close()
    bouncer.close()
    backend.close()


class AsyncIO:
    """Reads and writes of host buffers at file offsets, asynchronous, on one backend.

    ``config`` is the I/O settings (``settings``; the config's ``aio`` section, or defaults when None); ``backend`` names the backend in use. Safe to
    use from several threads. ``close`` (also on leaving a ``with`` block, on garbage collection and
    at exit) waits for every transfer in flight.
    """

    def __init__(self, config: Settings | None = None, raw: bool = False):
        if config is None:
            config = IOSettings()
        self.config = config
        self.raw = raw
        self._backend = open_backend(config)
        self._bouncer = Bouncer(self._backend, config)
        self._registry = _Registry()
        self._finalizer = weakref.finalize(self, _shutdown, os.getpid(), self._registry, self._bouncer,
                                          self._backend)

    @property
    def backend(self) -> str:
        """The backend in use: "uring", "pool", "python" or "aiofiles" (``auto`` resolved)."""
        return self._backend.name

    def write(self, file: AioFile, buffer: object, offset: int) -> Handle:
        """Write all of ``buffer`` to ``file`` at ``offset``."""
        return self._submit(Op.WRITE, file, buffer, offset)

    def read(self, file: AioFile, buffer: object, offset: int) -> Handle:
        """Fill all of ``buffer`` from ``file`` at ``offset``; a file that ends first is an AioError."""
        return self._submit(Op.READ, file, buffer, offset)

    def _submit(self, op: Op, file: AioFile, buffer: object, offset: int) -> Handle:
        span = host_span(buffer, writable=op is Op.READ)
        context = _Context(op, file.path, offset, span.nbytes)
        if not (file.readable if op is Op.READ else file.writable):
            raise context.error(errno.EBADF, f" (file opened with mode {file.mode!r})")
        if offset < 0:
            raise context.error(errno.EINVAL, " (negative offset)")
        fast = not file.direct or span.nbytes == 0 or is_aligned(span.addr, offset, span.nbytes)
        if not fast and self.raw:
            raise context.error(errno.EINVAL, f" (raw mode: address {span.addr:#x}, offset and length must "
                                              f"be multiples of 4096 on a direct file)")
        with self._registry.lock:
            if self._registry.closed:
                raise ValueError("I/O on a closed AsyncIO")
            if op is Op.WRITE:
                file.write_state.note_end(offset + span.nbytes)
            ticket = self._start(op, file, span, offset, fast, context)
            handle = Handle(ticket, context, span, self._registry)
            sweep = self._registry.add(handle)
        if sweep:
            self._registry.sweep()
        return handle

    def _start(self, op: Op, file: AioFile, span: HostSpan, offset: int, fast: bool, context: _Context) -> Ticket:
        try:
            if fast:
                return self._backend.submit([Request(op, file.fd, span.addr, span.nbytes, offset)])
            return self._bouncer.submit(op, file.fd, file.write_state, span.addr, span.nbytes, offset)
        except OSError as exc:  # the engine refused the batch outright (ENOMEM, ESHUTDOWN)
            raise context.error(exc.errno) from exc

    def close(self) -> None:
        """Wait for every transfer in flight, then stop the backend (idempotent)."""
        self._finalizer()

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if not self._finalizer.alive else "open"
        return f"AsyncIO(backend={self.backend!r}, raw={self.raw}, {state})"
