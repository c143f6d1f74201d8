#!/usr/bin/env python3
"""The swap digest's speed on one core (CRC32C, ``zerooffload.io.checksum``) against the memory's.

For each level (``ZO_CRC32C_SIMD``: the native "avx512", "sse42" and "table", each in a process of its own since
the level is chosen once per process) and for the numpy path a build without the extension runs, in
GB/s (1e9 B/s) of bytes digested, best of --repeats:
  cache  a 768 KiB buffer digested over and over (it stays in a 1 MiB L2);
  DRAM   a --size buffer (1 GiB: far past the last-level cache) digested in 4 MiB chunks, as the swap
         store digests what it reads and writes;
beside what one core's memory moves from DRAM: a read (numpy's XOR reduction over the same buffer) and
a copy (bytes copied). A diagnosis, not a comparison of two sides: each figure is recorded as a
``check`` without a target. What the digest costs a training step is ``zero3_nvme.py --only checksum``.

    python bench/checksum_cost.py [--size 1GiB] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from pairs import record

CACHE_BYTES = 768 << 10
CHUNK_BYTES = 4 << 20  # what the swap store digests at once


def _best_rate(work, nbytes: int, repeats: int) -> float:
    """GB/s of the fastest of ``repeats`` runs of ``work`` over ``nbytes``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def measure(size: int, repeats: int) -> dict:
    """This process's level: the digest's rates from cache and DRAM, and the memory's from DRAM."""
    from zerooffload.io import checksum

    if os.environ.get("ZO_CRC32C_SIMD") == "numpy":  # as a build without the extension runs
        checksum.native_aio = lambda: (None, "measured without the extension")
        size = min(size, 64 * CHUNK_BYTES)
    big = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    small = big[:CACHE_BYTES].copy()
    rounds = max(1, min(size, 1 << 30) // CACHE_BYTES)

    def from_cache():
        for _ in range(rounds):
            checksum.crc32c(small)

    target = np.empty_like(big)
    target[:] = 1  # its pages made before the copy is timed
    words = big.view(np.uint64)
    return {"level": checksum.digest_simd(),
            "cache": _best_rate(from_cache, rounds * CACHE_BYTES, repeats),
            "DRAM": _best_rate(lambda: [checksum.crc32c(big[start:start + CHUNK_BYTES])
                                        for start in range(0, size, CHUNK_BYTES)], size, repeats),
            "read": _best_rate(lambda: np.bitwise_xor.reduce(words), size, repeats),
            "copy": _best_rate(lambda: np.copyto(target, big), size, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="the DRAM buffer (the numpy path digests at most 256 MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--side", action="store_true", help="measure this process's level alone (JSON)")
    args = parser.parse_args()
    from zerooffload.config import parse_size

    size = parse_size(args.size)
    if args.side:
        print(json.dumps(measure(size, args.repeats)))
        return
    print(f"machine: {os.cpu_count()} CPUs; one core; DRAM buffer {size} bytes\n\n| level | cache GB/s | DRAM GB/s | "
          "memory read GB/s | memory copy GB/s | DRAM / read |\n|---|---|---|---|---|---|")
    for asked in ("avx512", "sse42", "table", "numpy"):
        done = subprocess.run([sys.executable, __file__, "--side", "--size", str(size), "--repeats",
                               str(args.repeats)], env={**os.environ, "ZO_CRC32C_SIMD": asked},
                              capture_output=True, text=True, check=True)
        rates = json.loads(done.stdout)
        if asked != "numpy" and rates["level"] != asked:
            print(f"| {asked} | not on this CPU (runs {rates['level']}) | | | | |")
            continue
        print(f"| {rates['level']} | {rates['cache']:.2f} | {rates['DRAM']:.2f} | {rates['read']:.2f} | "
              f"{rates['copy']:.2f} | {rates['DRAM'] / rates['read']:.2f} |", flush=True)
        for where in ("cache", "DRAM"):
            record("check", title=f"CRC32C {rates['level']}, one core, from {where} (GB/s)", value=rates[where],
                   target="—", met=None, detail=f"memory read {rates['read']:.2f} GB/s, copy {rates['copy']:.2f}")


if __name__ == "__main__":
    main()
