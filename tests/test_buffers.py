"""Aligned host buffers, the bounded buffer pool, and the spans AsyncIO takes from user buffers."""
from __future__ import annotations

import array
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from zerooffload.io import HostBufferPool, aligned_empty
from zerooffload.io.buffers import host_span


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("nbytes", [0, 8, 4096, 12344, 1 << 20])
def test_aligned_empty(dtype, nbytes):
    t = aligned_empty(nbytes, dtype)
    assert t.dtype == dtype and t.nbytes == nbytes and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    t.fill_(1)  # the memory is ours to write


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


def _rss() -> int:
    """The process's resident bytes (/proc/self/smaps_rollup)."""
    line = next(line for line in Path("/proc/self/smaps_rollup").read_text().splitlines() if line.startswith("Rss:"))
    return int(line.split()[1]) * 1024


def _huge_bytes(first: int, nbytes: int) -> int:
    """AnonHugePages bytes of the mappings that hold bytes [first, first + nbytes), 0 once none is mapped.
    Read per mapping, not for the process: khugepaged may collapse some other advised region of the
    process between two readings (a CI run saw 2 MiB appear so)."""
    huge, holds = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        name = line.split()[0]
        if not name.endswith(":"):  # a mapping's header: start-end perms offset device inode path
            start, end = (int(bound, 16) for bound in name.split("-"))
            holds = start < first + nbytes and first < end
        elif holds and name == "AnonHugePages:":
            huge += int(line.split()[1]) * 1024
    return huge


def _huge_bytes_of(tensor: torch.Tensor) -> int:
    return _huge_bytes(tensor.data_ptr(), tensor.numel() * tensor.element_size())


@pytest.mark.skipif(_thp_mode() != "madvise" or torch.cuda.is_available(),
                    reason="huge pages only on advice, and unpinned host buffers, are what this checks")
def test_large_aligned_buffers_are_huge_pages_of_their_own():
    """[Note: huge pages for I/O buffers]: a 2 MiB-aligned buffer whose whole huge pages are huge once
    touched, its partial last one left 4 KiB pages (so it holds its own bytes, to the page), and whose
    memory leaves the process with the last view of it."""
    nbytes = (24 << 20) + 12 * 4096
    aligned_empty(nbytes, torch.uint8)  # once first: what the path loads (ctypes, libc) is not the buffer's
    _huge_bytes(0, 0)  # nor is the memory reading smaps takes
    rss_before = _rss()
    buffer = aligned_empty(nbytes, torch.float32)
    address = buffer.data_ptr()
    assert address % (2 << 20) == 0 and buffer.nbytes == nbytes
    buffer.fill_(1)
    assert nbytes <= _rss() - rss_before < nbytes + (1 << 20)
    assert _huge_bytes(address, nbytes) == 24 << 20
    view = buffer[-1:]
    del buffer
    assert _huge_bytes(address, nbytes) == 24 << 20  # a view keeps the mapping ...
    del view
    assert _huge_bytes(address, nbytes) == 0 and _rss() - rss_before < 1 << 20  # ... which goes


@pytest.mark.skipif(_thp_mode() != "madvise" or torch.cuda.is_available(),
                    reason="huge pages only on advice, and unpinned host buffers, are what this checks")
def test_the_device_tiers_fresh_and_restored_buffers_are_huge_pages():
    """host_allocator's [Note: huge pages for engine buffers]: a device-tier buffer torch allocates, and a
    stage-3 unit's storage brought back for a gather, are huge pages once touched (64 MiB each: mappings
    of their own whatever glibc's threshold); a plain tensor of the same size is not."""
    from zerooffload.tiers import DeviceTier, Kind

    tier, numel = DeviceTier("device", torch.device("cpu"), None), 16 << 20
    fresh = tier.empty(Kind.BUFFER, numel, torch.float32).fill_(1)
    assert _huge_bytes_of(fresh) >= 62 << 20
    gathered = torch.empty(numel)
    gathered.untyped_storage().resize_(0)
    tier.restore_storage(Kind.GATHERED, gathered)
    gathered.fill_(1)
    assert _huge_bytes_of(gathered) >= 62 << 20
    plain = torch.ones(numel)
    assert _huge_bytes_of(plain) == 0
    del fresh, gathered, plain


def test_aligned_empty_refuses_partial_elements():
    with pytest.raises(ValueError, match="multiple of 4"):
        aligned_empty(10, torch.float32)


def test_pool_reuses_by_size_class():
    pool = HostBufferPool(1 << 20)
    a = pool.acquire(5000)
    assert a.nbytes == 5000 and a.data_ptr() % 4096 == 0 and pool.held_bytes == 8192
    address = a.data_ptr()
    pool.release(a)
    b = pool.acquire(8000)  # same 8 KiB class: the same memory comes back
    assert b.data_ptr() == address and pool.held_bytes == 8192
    c = pool.acquire(100)  # another class: new memory
    assert c.data_ptr() != address and pool.held_bytes == 8192 + 4096


def test_pool_bound_evicts_cached_then_waits():
    pool = HostBufferPool(16384)
    small = pool.acquire(4096)
    pool.release(small)
    big = pool.acquire(16384)  # needs the cached 4 KiB buffer freed first
    assert pool.held_bytes == 16384
    with pytest.raises(TimeoutError, match="16384 of 16384"):
        pool.acquire(4096, timeout=0.05)

    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(4096, timeout=10)))
    waiter.start()
    pool.release(big)
    waiter.join(10)
    assert len(got) == 1 and pool.held_bytes == 4096


def test_pool_refuses_misuse():
    pool = HostBufferPool(8192)
    with pytest.raises(ValueError, match="limit"):
        pool.acquire(8193)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.empty(10, dtype=torch.uint8))
    t = pool.acquire(10)
    pool.release(t)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(t)
    with pytest.raises(ValueError, match="at least 4096"):
        HostBufferPool(100)


def test_pool_clear_frees_cached_buffers():
    pool = HostBufferPool(1 << 20)
    kept, cached = pool.acquire(4096), pool.acquire(65536)
    pool.release(cached)
    pool.clear()
    assert pool.held_bytes == 4096
    pool.release(kept)


def test_host_span_of_tensors_and_buffers():
    t = torch.arange(10, dtype=torch.float32)
    span = host_span(t, writable=True)
    assert (span.addr, span.nbytes, span.owner) == (t.data_ptr(), 40, t)
    grid = np.zeros((3, 5), dtype=np.int16)
    assert host_span(grid, writable=True).nbytes == 30
    assert host_span(array.array("d", [1.0, 2.0]), writable=True).nbytes == 16
    assert host_span(b"abc", writable=False).nbytes == 3
    with pytest.raises(TypeError, match="read-only bytes"):
        host_span(b"abc", writable=True)
    with pytest.raises(ValueError, match="not contiguous"):
        host_span(torch.zeros(4, 4).t(), writable=True)
    with pytest.raises(ValueError, match="not C-contiguous"):
        host_span(memoryview(bytearray(16))[::2], writable=True)
