"""The bounded block pipelines (block_stream) on real NVMe swap files: host buffers alive never past the
depth, bytes back bitwise, an I/O error raised only after every transfer landed and with every buffer
freed, the checkpoint writer's writes in flight bounded, and ``aio.blocks_in_flight`` checked by name."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import zerooffload as zo
from zerooffload.block_stream import (BLOCK_READ, BLOCK_WAIT, BLOCK_WRITE, CHECKPOINT_WRITES, GRAD_READS,
                                      STREAM_BUFFERS, BlockReader, BlockWriter, InFlight, checkpoint_depth,
                                      grad_read_depth, stream_blocks, stream_depth, write_block)
from zerooffload.checkpoint import ChecksummedWriter
from zerooffload.config import AioConfig, ConfigError
from zerooffload.io import AsyncIO
from zerooffload.tiers import HostTier, Kind, NvmeTier

NUMEL = 3000  # 12,000 bytes of float32: not a multiple of 4 KiB, so the swap store's padding is crossed too


class WatchedHost(HostTier):
    """A host tier that records the most ``Kind.BUFFER`` bytes it held at once."""

    def __init__(self) -> None:
        super().__init__("host", torch.device("cpu"), None)
        self.buffer_peak = 0

    def _account(self, kind: Kind, nbytes: int) -> None:
        super()._account(kind, nbytes)
        self.buffer_peak = max(self.buffer_peak, self.usage[Kind.BUFFER])


@pytest.fixture
def nvme(tmp_path):
    config = zo.Config.load({"nvme": {"path": str(tmp_path)}})
    tier = NvmeTier(config, rank=0, reserve=64 * NUMEL * 4)
    yield tier
    tier.close()


def _values(index: int) -> torch.Tensor:
    """Random bit patterns as float32 (NaNs and denormals included): a round trip must keep every bit."""
    bits = torch.randint(-2**31, 2**31 - 1, (NUMEL,), dtype=torch.int32, generator=torch.Generator().manual_seed(index))
    return bits.view(torch.float32)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32).clone()


def _blocks(nvme: NvmeTier, count: int, host: HostTier) -> list:
    blocks = [nvme.block(Kind.OPTIMIZER, f"b{i}", NUMEL, torch.float32) for i in range(count)]
    writer = BlockWriter(host)
    for i, block in enumerate(blocks):
        writer.write(block, _values(i))
    writer.finish()
    return blocks


class _Failing:
    """A handle that waits for the real transfer, then raises EIO (when ``fail``); it records, at its
    wait, whether its block still held its host buffer (it must, until the transfer is done)."""

    def __init__(self, handle, block, log: list, fail: bool, kind: str):
        self.handle, self.block, self.log, self.fail, self.kind = handle, block, log, fail, kind
        self.waited = False
        log.append(self)

    def wait(self):
        self.waited, self.held = True, self.block.data is not None
        self.handle.wait()
        if self.fail:
            raise OSError(errno.EIO, f"injected I/O error on {self.block.key}")
        return 0


class FaultyBlock:
    """A real NVMe block whose ``fail_on`` transfer ("load" or "store") fails (after it really ran)."""

    def __init__(self, block, log: list, fail_on: str | None = None):
        self.inner, self.log, self.fail_on = block, log, fail_on

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, buffer=None, *, read=True):
        return _Failing(self.inner.load(buffer, read=read), self.inner, self.log, self.fail_on == "load", "load")

    def store(self):
        return _Failing(self.inner.store(), self.inner, self.log, self.fail_on == "store", "store")

    def unload(self):
        return self.inner.unload()


# ---------------------------------------------------------------------------------------------- depth
@pytest.mark.parametrize("depth", [2, 3, 5])
def test_a_stream_holds_at_most_depth_buffers_and_round_trips_bitwise(nvme, depth):
    host = WatchedHost()
    blocks = _blocks(nvme, 8, host)
    host.buffer_peak = 0
    for i, block in enumerate(stream_blocks(blocks, host, depth=depth)):
        assert torch.equal(_bits(block.data), _bits(_values(i)))
        assert host.usage[Kind.BUFFER] <= depth * NUMEL * 4
        block.data.view(torch.int32).bitwise_not_()  # changed in place, stored home
    assert host.buffer_peak == depth * NUMEL * 4  # the stream used every buffer it may hold, and no more
    assert host.usage[Kind.BUFFER] == 0
    for i, block in enumerate(stream_blocks(blocks, host, write=False, depth=depth)):
        assert torch.equal(_bits(block.data), ~_bits(_values(i)))
    assert host.usage[Kind.BUFFER] == 0


def test_a_stream_without_writes_reads_depth_minus_two_ahead(nvme):
    host = WatchedHost()
    blocks = _blocks(nvme, 8, host)
    for depth in (3, 5):
        host.buffer_peak = 0
        assert sum(1 for _ in stream_blocks(blocks, host, write=False, depth=depth)) == 8
        assert host.buffer_peak == (depth - 1) * NUMEL * 4  # the block in use and depth − 2 ahead


def test_the_default_depth_is_todays(nvme):
    host = WatchedHost()
    blocks = _blocks(nvme, 6, host)
    host.buffer_peak = 0
    for _ in stream_blocks(blocks, host):
        pass
    assert STREAM_BUFFERS == 3 and host.buffer_peak == 3 * NUMEL * 4


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_writer_holds_at_most_depth_buffers(nvme, depth):
    host = WatchedHost()
    blocks = [nvme.block(Kind.OPTIMIZER, f"w{i}", NUMEL, torch.float32) for i in range(7)]
    writer = BlockWriter(host, depth=depth)
    for i, block in enumerate(blocks):
        writer.write(block, _values(i))
        assert host.usage[Kind.BUFFER] <= depth * NUMEL * 4
    writer.finish()
    assert host.buffer_peak == depth * NUMEL * 4 and host.usage[Kind.BUFFER] == 0
    reader = BlockReader(host)
    for i, block in enumerate(blocks):
        with reader.loaded(block) as data:
            assert torch.equal(_bits(data), _bits(_values(i)))


def test_a_reader_reads_ahead_within_its_depth(nvme):
    host = WatchedHost()
    blocks = _blocks(nvme, 5, host)
    host.buffer_peak = 0
    reader = BlockReader(host, depth=2)
    assert reader.prefetch(blocks[0]) and reader.prefetch(blocks[1])
    assert not reader.prefetch(blocks[2])  # both buffers taken: read on use instead
    assert reader.held == 2
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            reader.prefetch(blocks[i + 1])  # the next one's read overlaps this one's use
        with reader.loaded(block) as data:
            assert torch.equal(_bits(data), _bits(_values(i)))
            assert reader.held <= 2
    assert host.buffer_peak == 2 * NUMEL * 4 and host.usage[Kind.BUFFER] == 0
    reader.prefetch(blocks[0])
    reader.discard(blocks[0])  # a read ahead not used: waited for, its buffer freed
    assert reader.held == 0 and host.usage[Kind.BUFFER] == 0


def test_a_block_read_on_demand_drops_the_oldest_read_ahead_when_every_buffer_is_taken(nvme):
    host = WatchedHost()
    blocks = _blocks(nvme, 3, host)
    host.buffer_peak = 0
    reader = BlockReader(host, depth=1)
    reader.prefetch(blocks[0])
    with reader.loaded(blocks[2]) as data:  # not the one read ahead
        assert torch.equal(_bits(data), _bits(_values(2))) and reader.held == 1
    with reader.loaded(blocks[0]) as data:  # read again, from home
        assert torch.equal(_bits(data), _bits(_values(0)))
    assert host.buffer_peak == NUMEL * 4 and host.usage[Kind.BUFFER] == 0


def test_write_block_stores_now(nvme):
    host = WatchedHost()
    block = nvme.block(Kind.OPTIMIZER, "one", NUMEL, torch.float32)
    write_block(block, _values(7), host)
    assert host.usage[Kind.BUFFER] == 0 and block.data is None
    with BlockReader(host).loaded(block) as data:
        assert torch.equal(_bits(data), _bits(_values(7)))


# ---------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("fail_on", ["load", "store"])
def test_a_stream_io_error_raises_after_every_transfer_landed_and_frees_every_buffer(nvme, fail_on):
    host = WatchedHost()
    log: list = []
    blocks = [FaultyBlock(b, log) for b in _blocks(nvme, 6, host)]
    blocks[2].fail_on = fail_on
    seen = []
    with pytest.raises(OSError, match="injected I/O error on b2"):
        for block in stream_blocks(blocks, host):
            seen.append(block.key)
    assert seen == (["b0", "b1"] if fail_on == "load" else ["b0", "b1", "b2", "b3"])
    assert host.usage[Kind.BUFFER] == 0
    assert len(log) > len(seen) and all(h.waited for h in log)  # every transfer started was waited for ...
    assert all(h.held for h in log)  # ... before its buffer was let go


def test_a_writer_error_raises_after_the_rest_were_waited_for(nvme):
    host = WatchedHost()
    log: list = []
    blocks = [FaultyBlock(nvme.block(Kind.OPTIMIZER, f"w{i}", NUMEL, torch.float32), log) for i in range(3)]
    blocks[0].fail_on = "store"
    writer = BlockWriter(host, depth=3)
    for i, block in enumerate(blocks):
        writer.write(block, _values(i))
    with pytest.raises(OSError, match="injected I/O error on w0"):
        writer.finish()
    assert [h.block.key for h in log if h.kind == "store"] == ["w0", "w1", "w2"]
    assert all(h.waited and h.held for h in log)
    assert host.usage[Kind.BUFFER] == 0
    reader = BlockReader(host)
    for i in (1, 2):  # the stores after the failed one still landed
        with reader.loaded(blocks[i].inner) as data:
            assert torch.equal(_bits(data), _bits(_values(i)))


def test_a_reader_error_surfaces_and_frees_the_buffer(nvme):
    host = WatchedHost()
    log: list = []
    blocks = [FaultyBlock(b, log) for b in _blocks(nvme, 2, host)]
    blocks[0].fail_on = "load"
    reader = BlockReader(host)
    reader.prefetch(blocks[0])
    reader.prefetch(blocks[1])
    with pytest.raises(OSError, match="injected I/O error on b0"):
        with reader.loaded(blocks[0]):
            pass
    reader.close()  # the other read ahead: waited for, freed
    assert reader.held == 0 and host.usage[Kind.BUFFER] == 0 and all(h.waited and h.held for h in log)


def test_in_flight_raises_the_first_error_once_all_finished():
    order = []

    class Handle:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def wait(self):
            order.append(self.name)
            if self.error:
                raise self.error

    released = []
    pipeline = InFlight(3)
    for name, error in (("a", None), ("b", OSError("first")), ("c", OSError("second"))):
        pipeline.make_room()
        pipeline.add(Handle(name, error), name, lambda name=name: released.append(name))
    with pytest.raises(RuntimeError, match="over the depth of 3"):
        pipeline.add(Handle("d"), "d", lambda: released.append("d"))  # refused, but waited for first
    assert order == ["d"] and released == ["d"] and len(pipeline) == 3
    with pytest.raises(OSError, match="first"):
        pipeline.drain()
    assert order == ["d", "a", "b", "c"] and released == ["d", "a", "b", "c"] and len(pipeline) == 0
    with pytest.raises(ValueError, match="at least one transfer"):
        InFlight(0)


# ---------------------------------------------------------------------------------------------- checkpoint writer
class CountingAIO:
    """An ``AsyncIO`` whose writes in flight are counted (started, not yet waited for)."""

    def __init__(self, aio: AsyncIO):
        self.aio, self.config = aio, aio.config
        self.in_flight = self.most = 0

    def write(self, file, tensor, offset):
        handle, outer = self.aio.write(file, tensor, offset), self
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)

        class Counted:
            def wait(self):
                try:
                    return handle.wait()
                finally:
                    outer.in_flight -= 1
        return Counted()


@pytest.mark.parametrize("depth", [1, 2, CHECKPOINT_WRITES])
def test_the_checkpoint_writer_bounds_its_writes_in_flight(tmp_path: Path, depth):
    with AsyncIO() as aio:
        counting = CountingAIO(aio)
        writer = ChecksummedWriter(tmp_path / "data.bin", counting, 8 * NUMEL * 4, writes_in_flight=depth)
        for i in range(8):
            writer.write(_values(i))
        record = writer.close()
    assert counting.most == depth and counting.in_flight == 0
    data = (tmp_path / "data.bin").read_bytes()
    assert record["bytes"] == len(data) == 8 * NUMEL * 4
    assert data == b"".join(_values(i).numpy().tobytes() for i in range(8))


# ---------------------------------------------------------------------------------------------- profiler labels
def test_transfers_carry_profiler_labels(nvme):
    host = WatchedHost()
    blocks = _blocks(nvme, 3, host)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in stream_blocks(blocks, host):
            pass
    names = {event.name for event in profile.events()}
    assert {BLOCK_READ, BLOCK_WRITE, BLOCK_WAIT} <= names


# ---------------------------------------------------------------------------------------------- config
def test_blocks_in_flight_sets_every_pipelines_depth_and_zero_keeps_each_default():
    default = AioConfig()
    assert default.blocks_in_flight == 0
    assert (stream_depth(default), grad_read_depth(default), checkpoint_depth(default)) == (
        STREAM_BUFFERS, GRAD_READS, CHECKPOINT_WRITES) == (3, 2, 3)
    assert stream_depth(None) == 3
    five = zo.Config.load({"aio": {"blocks_in_flight": 5}}).aio
    assert (stream_depth(five), grad_read_depth(five), checkpoint_depth(five)) == (5, 5, 5)


@pytest.mark.parametrize("value, why", [(1, "must be 0 .* or at least 2"), (-1, "must be >= 0"),
                                        (65, "must be <= 64"), ("three", "expected an integer"),
                                        (2.5, "expected an integer")])
def test_bad_blocks_in_flight_is_refused_by_name(value, why):
    with pytest.raises(ConfigError, match=rf"aio\.blocks_in_flight = .*{why}"):
        zo.Config.load({"aio": {"blocks_in_flight": value}})


def test_a_stream_refuses_a_depth_below_two(nvme):
    with pytest.raises(ValueError, match="depth >= 2"):
        next(stream_blocks([], WatchedHost(), depth=1))
