"""The swap checksum (native/checksum.h): every level gives the definition's digest, and it changes
with the damage it exists to catch."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from zerooffload.io.checksum import _numpy_digest, digest, digest_simd

SIZES = (0, 1, 3, 4, 63, 64, 65, 4096, 100_003, 1 << 20)


def _reference(data: torch.Tensor) -> int:
    """checksum.h's definition, word by word in Python integers: independent of both implementations."""
    raw = bytes(data.numpy()) + bytes(-len(data) % 64)
    words = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
    vectors = len(words) // 16
    a = [sum(words[16 * k + lane] for k in range(vectors)) % 2**32 for lane in range(16)]
    b = [sum((vectors - k) * words[16 * k + lane] for k in range(vectors)) % 2**32 for lane in range(16)]
    mask = 2**64 - 1

    def mix(h: int) -> int:
        h ^= h >> 30
        h = h * 0xBF58476D1CE4E5B9 & mask
        h ^= h >> 27
        h = h * 0x94D049BB133111EB & mask
        return h ^ h >> 31

    h = mix(len(data) ^ 0x9E3779B97F4A7C15)
    for lane in range(16):
        h = mix(h ^ (b[lane] << 32 | a[lane]))
    return h


def test_the_digest_is_the_definitions():
    generator = torch.Generator().manual_seed(0)
    for n in (0, 1, 5, 64, 130, 1000):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
        assert digest(data) == _numpy_digest(data.numpy()) == _reference(data), n


@pytest.mark.parametrize("level", ["avx512", "avx2", "scalar"])
def test_every_level_gives_the_same_digest(level):
    """Each level in a process of its own (the level is chosen once per process), against numpy's."""
    code = ("import sys, torch\nfrom zerooffload.io.checksum import digest, digest_simd, _numpy_digest\n"
            "g = torch.Generator().manual_seed(1)\n"
            f"for n in {SIZES}:\n"
            "    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)\n"
            "    assert digest(x) == _numpy_digest(x.numpy()), n\n"
            "print(digest_simd())\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ZO_CHECKSUM_SIMD": level},
                         capture_output=True, text=True, check=True).stdout.strip()
    if digest_simd() == "numpy":
        pytest.skip("the native extension is not built")
    assert out == level or (level == "avx512" and out in ("avx2", "scalar")), out  # a CPU without it runs lower


def test_the_damage_a_swap_file_meets_changes_the_digest():
    data = torch.randn(1 << 18).view(torch.uint8)
    reference = digest(data)
    zero_filled, truncated, swapped, flipped = (data.clone() for _ in range(4))
    zero_filled[4096:8192] = 0
    truncated[-4096:] = 0  # what a read past a shortened file's end would leave
    swapped[:4], swapped[64:68] = data[64:68].clone(), data[:4].clone()  # two words of one lane traded
    flipped[12345] ^= 1
    for damaged in (zero_filled, truncated, swapped, flipped):
        assert digest(damaged) != reference
    assert digest(torch.zeros(4096, dtype=torch.uint8)) != digest(torch.zeros(8192, dtype=torch.uint8))


def test_a_buffer_of_any_kind_is_digested_in_place():
    array = np.arange(1000, dtype=np.float32)
    assert digest(array) == digest(torch.from_numpy(array).view(torch.uint8)) == digest(bytearray(array.tobytes()))
