"""CRC32C, the digest of swap chunks (and of any file read in pieces): native where built (``native/checksum.h``).

[Note: CRC32C digests]
- The digest is CRC32C, the Castagnoli CRC of ext4, Btrfs and iSCSI (RFC 3720): ``crc32c(b"123456789")``
  is ``0xE3069283``. It replaced a Fletcher-style pair of lane sums that a pair of sign flips 32 values
  apart left unchanged. Being linear over GF(2), a CRC gives guarantees within one swap chunk (4 MiB):
  every 1- and 2-bit error and every burst of up to 32 bits changes it; any other damage (a moved,
  zeroed or stale page) is missed with probability about 2^-32 per chunk. It catches accidents, not
  forgeries.
- Natively, carry-less multiplications (VPCLMULQDQ) fold the bytes 256 at a time at the memory's speed
  where the CPU has AVX-512, else the SSE4.2 crc32 instruction runs three interleaved streams, else
  tables (``digest_simd`` says which), with the GIL released, so the I/O engine's and a peer's threads run
  meanwhile. On one Zen 4 EPYC core (``bench/checksum_cost.py``), over 4 MiB chunks from DRAM: avx512 26.8
  GB/s where the core reads 26.7 (32.2 and 32.7 on a quieter run; 47 from cache), sse42 22.7 (26.1 from
  cache), table 2.0.
- ``crc32c(data, crc)`` continues a running value as ``zlib.crc32`` does; ``crc32c_combine`` joins two
  ranges' values knowing only the second's length (x^(8 len2) mod P): a file digested in parts, on
  several threads or out of order, gets its whole value.
- Without the native extension the same values come from numpy (``_numpy_crc32c``): the bytes in 64-byte
  lanes, every lane's register advanced four bytes a step through two 65,536-entry tables, the lanes
  then joined pairwise by multiplications by x^(8 len) mod P. It runs at 0.77 GB/s on that core (5.4 ms
  a 4 MiB chunk, 1.3 s of a core per GB written or read back), 35x slower than the native level.
  Verification stays on all the same: a build without the extension is already a slow one (its I/O runs
  on Python threads; ``zerooffload doctor`` says so), and the value must not depend on the build, for
  checkpoints written by one build are read by another.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .probe import native_aio

__all__ = ["crc32c", "crc32c_combine", "digest", "digest_simd"]

_POLY = 0x82F63B78
"""The Castagnoli polynomial, reflected, less its x^32 term."""
_MASK = 0xFFFFFFFF
_LANE = 64
"""Bytes per numpy lane (see the note): 16 table steps, then 65,536 lanes a 4 MiB chunk joined in 16 rounds."""
_PIECE = 1 << 20
"""Bytes the numpy path takes at once: its lane arrays stay in the CPU's cache."""


def digest(view) -> int:
    """The CRC32C of a contiguous host buffer (a torch tensor or any buffer-protocol object)."""
    return crc32c(view)


def crc32c(data, crc: int = 0) -> int:
    """The CRC32C of ``data`` (a contiguous torch tensor or buffer-protocol object) continuing ``crc``:
    ``crc32c(b, crc32c(a)) == crc32c(a + b)``, as ``zlib.crc32``."""
    native = native_aio()[0]
    if native is not None:
        addr, nbytes = _address(data)
        return native.crc32c(addr, nbytes, crc)
    array = _bytes(data)
    for start in range(0, array.nbytes, _PIECE):
        crc = _numpy_crc32c(array[start:start + _PIECE], crc)
    return crc


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of ``a + b`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)`` and ``len2 = len(b)``."""
    native = native_aio()[0]
    if native is not None:
        return native.crc32c_combine(crc1, crc2, len2)
    return _multiply(_x_to_bytes(len2), crc1) ^ crc2


def digest_simd() -> str:
    """The level the CRC runs on: "sse42", "table", or "numpy" without the extension; ValueError when
    the environment variable ZO_CRC32C_SIMD names no level."""
    native = native_aio()[0]
    return "numpy" if native is None else native.crc32c_simd()


def _address(data) -> tuple[int, int]:
    if hasattr(data, "data_ptr"):
        if not data.is_contiguous():
            raise ValueError("crc32c needs a contiguous tensor: its bytes are read as they lie in memory")
        return data.data_ptr(), data.numel() * data.element_size()
    array = _bytes(data)
    return array.ctypes.data, array.nbytes


def _bytes(data) -> np.ndarray:
    buffer = data.numpy() if hasattr(data, "numpy") else data
    return np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)


# ------------------------------------------------------------------ GF(2) arithmetic mod P (reflected)
def _multiply(a: int, b):
    """``a * b mod P``; ``b`` an int or a numpy uint32 array (each element times ``a``)."""
    product = b ^ b
    for bit in range(31, -1, -1):  # a's terms from x^0 up, b times x each round
        if a >> bit & 1:
            product = product ^ b
        b = (b >> 1) ^ ((b & 1) * _POLY)
    return product


@lru_cache(maxsize=None)
def _x_2k(k: int) -> int:
    """x^(2^k) mod P."""
    return 1 << 30 if k == 0 else _multiply(_x_2k(k - 1), _x_2k(k - 1))


def _x_to_bytes(nbytes: int) -> int:
    """x^(8 nbytes) mod P: what ``nbytes`` zero bytes do to a register."""
    power, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            power = _multiply(power, _x_2k(k))
        nbytes, k = nbytes >> 1, k + 1
    return power


@lru_cache(maxsize=None)
def _operator(nbytes: int) -> np.ndarray:
    """Multiplication by x^(8 nbytes) as four 256-entry tables, one per byte of a register."""
    values = np.arange(256, dtype=np.uint32)
    return np.stack([_multiply(_x_to_bytes(nbytes), values << np.uint32(8 * j)) for j in range(4)])


@lru_cache(maxsize=None)
def _step_tables() -> tuple[np.ndarray, np.ndarray]:
    """A register xored with four bytes, advanced past them: by its low and its high 16 bits."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = (table >> 1) ^ ((table & 1) * np.uint32(_POLY))
    slices = [table]  # slices[k][b]: byte b followed by k zero bytes
    for _ in range(3):
        slices.append((slices[-1] >> 8) ^ table[slices[-1] & 0xFF])
    low, high = np.arange(1 << 16, dtype=np.uint32) & 0xFF, np.arange(1 << 16, dtype=np.uint32) >> 8
    return slices[3][low] ^ slices[2][high], slices[1][low] ^ slices[0][high]


def _numpy_crc32c(data: np.ndarray, crc: int) -> int:
    """The CRC32C of ``data`` continuing ``crc``: its whole lanes, then the rest as one more lane padded
    in front (zero bytes ahead of a message leave a zero register as it is), joined; the preset
    register is added apart, multiplied past the data."""
    body = data.nbytes - data.nbytes % _LANE
    raw = _lanes(data[:body].view("<u4").reshape(-1, _LANE // 4))
    if body < data.nbytes:
        tail = np.zeros(_LANE, dtype=np.uint8)
        tail[body - data.nbytes:] = data[body:]
        raw = _multiply(_x_to_bytes(data.nbytes - body), raw) ^ _lanes(tail.view("<u4").reshape(1, -1))
    return ~(_multiply(_x_to_bytes(data.nbytes), ~crc & _MASK) ^ raw) & _MASK


def _lanes(words: np.ndarray) -> int:
    """The raw register (from zero) of the bytes of ``words``, one lane a row: every lane advanced a
    word at a time, then neighbours joined, an odd count evened by a zero lane in front."""
    low, high = _step_tables()
    registers, low_half, high_half = (np.zeros(words.shape[0], dtype=np.uint32) for _ in range(3))
    for column in range(words.shape[1]):
        registers ^= words[:, column]
        np.bitwise_and(registers, 0xFFFF, out=low_half)
        np.right_shift(registers, 16, out=high_half)
        np.take(low, low_half, out=registers)
        registers ^= np.take(high, high_half, out=high_half)
    length = _LANE
    while registers.size > 1:
        if registers.size % 2:
            registers = np.concatenate([np.zeros(1, dtype=np.uint32), registers])
        ahead, op = registers[0::2], _operator(length)
        registers = (op[0][ahead & 0xFF] ^ op[1][(ahead >> 8) & 0xFF] ^ op[2][(ahead >> 16) & 0xFF]
                     ^ op[3][ahead >> 24] ^ registers[1::2])
        length *= 2
    return int(registers[0]) if registers.size else 0
