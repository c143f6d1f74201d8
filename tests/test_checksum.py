"""The digest (native/checksum.h): CRC32C at every level and from numpy equal to an independent bitwise
reference and to the published check values, its combine, and the guarantees it is chosen for, each
checked on the implementation within one swap chunk (``CHUNK``, 4 MiB): every 1- and 2-bit error,
every burst of up to 32 bits."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from zerooffload.io import checksum
from zerooffload.io.checksum import crc32c, crc32c_combine, digest, digest_simd
from zerooffload.io.swap_digests import CHUNK

NATIVE = digest_simd() != "numpy"
# (offset in a buffer, length): around the avx512 level's 256-byte steps and its 512-byte least, the sse42
# level's block sizes (3 x 65536, 3 x 256) and its alignment bytes, and the numpy path's 64-byte lanes.
CASES = [(offset, n) for n in (0, 1, 7, 8, 9, 63, 64, 65, 511, 512, 767, 768, 781, 1024 + 255, 196607, 196608,
                               197389, 393221) for offset in (0, 3)] + [(5, 4096), (1, 100)]


def _bitwise(byte: int) -> int:
    for _ in range(8):
        byte = (byte >> 1) ^ (0x82F63B78 if byte & 1 else 0)
    return byte


_TABLE = [_bitwise(byte) for byte in range(256)]


def _reference(data: bytes, crc: int = 0) -> int:
    """CRC32C by its definition, a byte at a time through a table made bit by bit: independent of every
    implementation here."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ _TABLE[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def _buffer() -> bytes:
    """The bytes CASES are cut from (a level's process makes them again with the same code)."""
    return np.random.default_rng(0).integers(0, 256, max(o + n for o, n in CASES), dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def expected() -> list[int]:
    data = _buffer()
    return [_reference(data[offset:offset + n]) for offset, n in CASES]


@pytest.fixture(params=["native", "numpy"])
def path(request, monkeypatch):
    """The public functions as they run with the extension, and as they run without it."""
    if request.param == "native" and not NATIVE:
        pytest.skip("the native extension is not built")
    if request.param == "numpy":
        monkeypatch.setattr(checksum, "native_aio", lambda: (None, "not built"))
    return request.param


# ------------------------------------------------------------------ the definition
def test_the_published_check_values(path):
    """"123456789" (the CRC catalogue's check) and RFC 3720's B.4 vectors (iSCSI)."""
    pdu = bytes.fromhex("01c00000000000000000000000000000140000000000040000000014000000182800000000000000"
                        "0200000000000000")
    vectors = {b"123456789": 0xE3069283, bytes(32): 0x8A9136AA, b"\xff" * 32: 0x62A8AB43,
               bytes(range(32)): 0x46DD794E, bytes(range(31, -1, -1)): 0x113FDB5C, pdu: 0xD9963A56}
    for data, value in vectors.items():
        assert _reference(data) == value
        assert crc32c(data) == digest(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == value, data


def test_every_length_and_alignment_equals_the_reference(path, expected):
    data = _buffer()
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for (offset, n), value in zip(CASES, expected):
        assert digest(tensor[offset:offset + n]) == value, (offset, n)
        cut = n // 3  # a running value, continued as zlib.crc32 is
        assert crc32c(data[offset + cut:offset + n], crc32c(data[offset:offset + cut])) == value, (offset, n)


_LEVEL = r"""
import importlib.util, json, sys
import numpy as np
spec = importlib.util.spec_from_file_location("zerooffload._aio", sys.argv[1])  # no torch: a fast start
aio = importlib.util.module_from_spec(spec)
spec.loader.exec_module(aio)
cases = json.loads(sys.argv[2])
data = np.random.default_rng(0).integers(0, 256, max(o + n for o, n in cases), dtype=np.uint8)  # _buffer's
try:
    level = aio.crc32c_simd()
except ValueError as exc:
    level = str(exc)
crcs = [aio.crc32c(data.ctypes.data + offset, n, 0) for offset, n in cases]
print(json.dumps({"level": level, "crcs": crcs}))
"""


@pytest.mark.skipif(not NATIVE, reason="the native extension is not built")
@pytest.mark.parametrize("asked", ["table", "sse42", "avx512", "avx9"])
def test_every_level_equals_the_reference(asked, expected):
    """Each level in a process of its own (it is chosen once per process); a name that is no level is
    refused by ``digest_simd`` in one line, and the CRC still runs, on the best level."""
    from zerooffload import _aio

    done = subprocess.run([sys.executable, "-c", _LEVEL, _aio.__file__, json.dumps(CASES)],
                          env={**os.environ, "ZO_CRC32C_SIMD": asked}, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    assert report["crcs"] == expected
    if asked == "avx9":
        assert report["level"] == "ZO_CRC32C_SIMD = 'avx9': expected 'avx512', 'sse42' or 'table' (or unset)"
    else:  # a CPU without the level asked runs its best
        levels = ["table", "sse42", "avx512"]
        assert report["level"] == levels[min(levels.index(asked), levels.index(digest_simd()))]


def test_combine_joins_two_ranges(path):
    data = np.random.default_rng(1).integers(0, 256, 20000, dtype=np.uint8).tobytes()
    for cut in (0, 1, 4096, 12345, 20000):
        a, b = data[:cut], data[cut:]
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(data), cut
    if NATIVE:  # lengths no buffer here holds: the native and the numpy combine, each its own code
        from zerooffload import _aio

        for length in (1 << 33, (1 << 63) + 12345):
            assert _aio.crc32c_combine(0x12345678, 0x9ABCDEF0, length) == crc32c_combine(0x12345678, 0x9ABCDEF0,
                                                                                         length)


def test_a_buffer_of_any_kind_is_read_in_place():
    array = np.arange(1000, dtype=np.float32)
    assert digest(array) == digest(torch.from_numpy(array).view(torch.uint8)) == digest(bytearray(array.tobytes()))
    with pytest.raises(ValueError, match="contiguous"):
        digest(torch.arange(10, dtype=torch.uint8)[::2])


# ------------------------------------------------------------------ the guarantees, within a chunk
# A CRC is linear: for equal lengths crc32c(m ^ e) = crc32c(m) ^ crc32c(e) ^ crc32c(zeros), so whether an
# error e is seen depends on e alone, through its syndrome crc32c(e) ^ crc32c(zeros) (0: unseen). An
# error in the byte d bytes before the end has the syndrome of that byte at the end times x^(8d) mod P,
# which is what crc32c_combine(syndrome, 0, d) computes.
def _syndrome_at_end(pattern: bytes) -> int:
    return crc32c(pattern) ^ crc32c(bytes(len(pattern)))


def _times_x_to(nbytes: int, values: np.ndarray) -> np.ndarray:
    """``values`` (uint32) times x^(8 nbytes) mod P: a linear map, as four byte tables made by combine."""
    table = np.array([[crc32c_combine(b << 8 * j, 0, nbytes) for b in range(256)] for j in range(4)], dtype=np.uint32)
    return table[0][values & 0xFF] ^ table[1][(values >> 8) & 0xFF] ^ table[2][(values >> 16) & 0xFF] ^ \
        table[3][values >> 24]


def _bit_syndromes(nbytes: int) -> np.ndarray:
    """The syndrome of every single-bit error in ``nbytes`` bytes, bit 8i + b for bit b of byte i."""
    syndromes = np.array([_syndrome_at_end(bytes([1 << bit])) for bit in range(8)], dtype=np.uint32)
    while syndromes.size < 8 * nbytes:  # the bytes before those covered so far, then those
        syndromes = np.concatenate([_times_x_to(syndromes.size // 8, syndromes), syndromes])
    return syndromes


def _chunk(seed: int) -> torch.Tensor:
    return torch.randn(CHUNK // 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes", [64 << 10, pytest.param(CHUNK, marks=pytest.mark.slow)])
def test_every_1_and_2_bit_error_in_a_chunk_changes_the_digest(nbytes):
    """Exhaustive by linearity: the single-bit syndromes of ``nbytes`` are all nonzero (every 1-bit error
    seen) and all different (every 2-bit error seen: its syndrome is the XOR of two). A whole chunk is
    2^25 of them (3 s, sorting most: slow); 64 KiB in CI. Tied to the digest by errors made in a real
    chunk at sampled positions."""
    syndromes = _bit_syndromes(nbytes)
    assert syndromes.size == 8 * nbytes
    ordered = np.sort(syndromes)
    assert ordered[0] != 0 and bool((ordered[1:] != ordered[:-1]).all())
    chunk = _chunk(0).view(torch.uint8)[:nbytes]
    clean = digest(chunk)
    for bit in np.random.default_rng(2).integers(0, 8 * nbytes, 24):
        chunk[bit // 8] ^= 1 << int(bit % 8)
        assert digest(chunk) ^ clean == syndromes[bit], bit
        chunk[bit // 8] ^= 1 << int(bit % 8)


def test_paired_sign_flips_change_the_digest():
    """Sign bits of two fp32 values 32 k apart (what left the lane sums unchanged), one pair and 256 pairs."""
    values = _chunk(3)
    clean = digest(values.view(torch.uint8))
    rng = np.random.default_rng(3)
    for k in (1, 2, 7, 1000, CHUNK // 4 // 32 - 1):
        first = int(rng.integers(0, CHUNK // 4 - 32 * k))
        values[first] *= -1
        values[first + 32 * k] *= -1
        assert digest(values.view(torch.uint8)) != clean, k
        values[first] *= -1
        values[first + 32 * k] *= -1
    firsts = rng.choice(CHUNK // 4 // 2, 256, replace=False)
    values[firsts] *= -1
    values[firsts + 32 * 1024] *= -1
    assert digest(values.view(torch.uint8)) != clean


def _rank(vectors) -> int:
    """The rank over GF(2) of 32-bit vectors (Gaussian elimination on each one's leading bit)."""
    pivots: dict[int, int] = {}
    for vector in vectors:
        while vector:
            top = vector.bit_length() - 1
            if top not in pivots:
                pivots[top] = vector
                break
            vector ^= pivots[top]
    return len(pivots)


def test_every_burst_of_up_to_32_bits_changes_the_digest():
    """A burst lies in 32 consecutive bits, 40 at most of the last 5 bytes once moved to the end. By
    linearity it is seen wherever it lies when the syndromes of each 32-bit window there are
    independent (rank 32), and when moving it a byte further from the end (times x^8 mod P) loses
    nothing (rank 32). Tied to the digest by random bursts in a real chunk."""
    end = [_syndrome_at_end((1 << bit).to_bytes(5, "little")) for bit in range(40)]
    assert all(_rank(end[start:start + 32]) == 32 for start in range(9))
    assert _rank([crc32c_combine(1 << bit, 0, 1) for bit in range(32)]) == 32
    chunk = _chunk(4).view(torch.uint8).numpy()
    clean = digest(chunk)
    rng = np.random.default_rng(4)
    for _ in range(200):
        length = int(rng.integers(1, 33))
        burst = 1 | (1 << (length - 1)) | int(rng.integers(0, 1 << 32)) & ((1 << length) - 1)
        start = int(rng.integers(0, 8 * CHUNK - length))
        byte, shift = start // 8, start % 8
        span = chunk[byte:byte + 5]
        original = span.copy()
        span ^= np.frombuffer((burst << shift).to_bytes(8, "little")[:span.size], dtype=np.uint8)
        assert digest(chunk) != clean, (start, length, burst)
        span[:] = original
