"""The swap store's checksum: a 64-bit digest of a host byte range (``native/checksum.h`` defines it).

[Note: swap checksums]
- The digest is a Fletcher-style pair of sums over 16 lanes of 32-bit words, folded into 64 bits:
  two vector additions per 64 bytes, so it runs at the memory's speed on one core (~12 GB/s from
  DRAM on the project machines, against ~5 GB/s for ``zlib.crc32`` holding the GIL); the native
  call releases the GIL, so other threads (the I/O engine's, a peer's collective) run meanwhile.
- Without the native extension the same digest comes from numpy (``_numpy_digest``): slower, never
  different, so a swap file's digests do not depend on the build that wrote them.
- It detects accidents (a file overwritten, truncated or zero-filled under a run, a stale or lost
  write); it is no defence against someone forging data.
"""
from __future__ import annotations

import numpy as np

from .probe import native_aio

__all__ = ["digest", "digest_simd"]

_LANES = 16
_MASK = (1 << 64) - 1


def digest(view) -> int:
    """The digest of a contiguous host buffer (a uint8 torch tensor or any buffer-protocol object)."""
    native = native_aio()[0]
    addr, nbytes = _address(view)
    if native is not None:
        return native.checksum(addr, nbytes)
    return _numpy_digest(np.frombuffer(memoryview(_as_buffer(view)).cast("B"), dtype=np.uint8))


def digest_simd() -> str:
    """The instruction set the digest runs on: "avx512", "avx2", "scalar", or "numpy" without the extension."""
    native = native_aio()[0]
    return "numpy" if native is None else native.checksum_simd()


def _address(view) -> tuple[int, int]:
    if hasattr(view, "data_ptr"):
        return view.data_ptr(), view.numel() * view.element_size()
    array = np.frombuffer(memoryview(view).cast("B"), dtype=np.uint8)
    return array.ctypes.data, array.nbytes


def _as_buffer(view):
    return view.numpy() if hasattr(view, "numpy") else view


def _mix(h: int) -> int:
    """splitmix64's finalizer, as checksum.c's ``mix``."""
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _MASK
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


def _numpy_digest(data: np.ndarray) -> int:
    """checksum.h's definition in numpy: the sums wrap modulo 2^64 and are then cut to 32 bits (2^32
    divides 2^64, so the result is theirs modulo 2^32)."""
    n = data.nbytes
    padded = np.zeros(-(-n // (4 * _LANES)) * 4 * _LANES, dtype=np.uint8)
    padded[:n] = data
    words = padded.view("<u4").reshape(-1, _LANES).astype(np.uint64)
    weights = np.arange(words.shape[0], 0, -1, dtype=np.uint64)[:, None]
    a = words.sum(axis=0, dtype=np.uint64) & 0xFFFFFFFF
    b = (words * weights).sum(axis=0, dtype=np.uint64) & 0xFFFFFFFF
    h = _mix(n ^ 0x9E3779B97F4A7C15)
    for lane in range(_LANES):
        h = _mix(h ^ ((int(b[lane]) << 32) | int(a[lane])))
    return h
