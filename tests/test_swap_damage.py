"""Damage that a CRC catches with odds, not by construction, on a real swap file: the store writes with
O_DIRECT, another hand changes whole 4 KiB pages of a live entry behind its back (two pages swapped, a
page zeroed, a stale page put back), and the read must stop with ``SwapDamage`` naming the file and a
range of the entry that holds the damaged page.

These are probabilistic guarantees: a CRC32C misses damage of this kind with probability about 2^-32 per
chunk (``checksum``'s [Note: CRC32C digests]), so each case here is seen but for that chance; the data
are fixed (seeded), so a test that passes passes every time. The damage found by construction (1- and
2-bit errors, bursts) is tested in test_checksum.py."""
from __future__ import annotations

import os

import pytest
import torch

from zerooffload.io import AsyncIO
from zerooffload.io.swap_digests import CHUNK
from zerooffload.io.swapfile import SwapDamage, SwapStore

PAGE = 4096


@pytest.fixture(scope="module")
def aio():
    with AsyncIO() as engine:
        yield engine


def _values(seed: int) -> torch.Tensor:
    """A block as the engine swaps them: fp32 values, here over two chunks and a piece of a third."""
    return torch.randn((2 * CHUNK + 16 * PAGE) // 4, generator=torch.Generator().manual_seed(seed))


def _stored(store: SwapStore, values: torch.Tensor) -> int:
    """Where the entry holding ``values`` starts in the swap file, found by reading the file (its bytes
    are random: the first page's occur once)."""
    store.write("filler", torch.ones(3 * PAGE, dtype=torch.uint8)).wait()  # the entry does not start at 0
    store.write("block", values).wait()
    raw = store.paths[0].read_bytes()
    start = raw.find(values.view(torch.uint8)[:PAGE].numpy().tobytes())
    assert start > 0 and start % PAGE == 0
    return start


def _pages(path, offset: int, count: int = 1) -> bytes:
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(count * PAGE)


def _put(path, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` behind the store's back, as another process or a failing disk would."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _assert_named(store: SwapStore, values: torch.Tensor, start: int, damaged: list[int]) -> None:
    """The read stops with SwapDamage naming the file and a range of the entry holding the damaged pages."""
    with pytest.raises(SwapDamage) as caught:
        store.read("block", torch.empty_like(values)).wait()
    error = caught.value
    assert error.filename == str(store.paths[0]) and "swap block 'block' is damaged" in str(error)
    assert start <= error.offset and error.offset + error.length <= start + values.numel() * 4
    assert any(error.offset <= page < error.offset + error.length for page in damaged), (error, damaged)


def test_two_pages_swapped_within_a_chunk(tmp_path, aio):
    values = _values(0)
    with SwapStore(str(tmp_path), aio) as store:
        start = _stored(store, values)
        one, two = start + CHUNK + 5 * PAGE, start + CHUNK + 300 * PAGE  # both in the second chunk
        first, second = _pages(store.paths[0], one), _pages(store.paths[0], two)
        _put(store.paths[0], one, second)
        _put(store.paths[0], two, first)
        _assert_named(store, values, start, [one, two])


def test_a_page_zeroed(tmp_path, aio):
    values = _values(1)
    with SwapStore(str(tmp_path), aio) as store:
        start = _stored(store, values)
        page = start + 2 * CHUNK + 7 * PAGE  # in the short last chunk
        _put(store.paths[0], page, bytes(PAGE))
        _assert_named(store, values, start, [page])


def test_a_stale_page(tmp_path, aio):
    """A page as an earlier write of the same entry left it (a write the disk lost, or a reordered one):
    the bytes are the entry's own, of the wrong version."""
    old, new = _values(2), _values(3)
    with SwapStore(str(tmp_path), aio) as store:
        start = _stored(store, old)
        page = start + 17 * PAGE
        stale = _pages(store.paths[0], page)
        store.write("block", new).wait()  # same size: rewritten in place
        assert _pages(store.paths[0], page) != stale
        check = torch.empty_like(new)
        store.read("block", check).wait()  # the new version reads back clean
        assert torch.equal(check, new)
        _put(store.paths[0], page, stale)
        _assert_named(store, new, start, [page])
