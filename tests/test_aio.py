"""AsyncIO round trips through every backend on real O_DIRECT files, checked against plain reads.

Every write is checked by reading the file with Python's own ``open``/``os.pread`` (and a SHA-256 for
the large ones), every read against the bytes written, and every byte the write should not touch
against what was there before.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aio_helpers import backend_params, config, host_buffer, run_python
from zerooffload.io import AioFile, AsyncIO, aligned_empty, open_file
from zerooffload.io.backends import BACKENDS
from zerooffload.optim import simd_level

MiB = 1 << 20


def _file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------------------------------------
# Round trips

_sizes = st.one_of(st.integers(1, 64), st.integers(1, 3 * 4096), st.integers(1, MiB),
                   st.sampled_from([4096, 8192, 65536, 65537, 4 * 4096 - 1]))
_offsets = st.one_of(st.just(0), st.integers(0, 3 * 4096), st.integers(0, 256).map(lambda b: b * 4096),
                     st.integers(0, MiB))
_shifts = st.sampled_from([0, 0, 1, 7, 512, 4095])


@pytest.mark.parametrize("name", backend_params())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=_sizes, offset=_offsets, shift=_shifts, read_shift=_shifts, before=st.integers(0, 300_000),
       from_bytes=st.booleans())
def test_round_trip(engines, tmp_path, name, size, offset, shift, read_shift, before, from_bytes):
    """Write at any size/offset/alignment over an existing file, then read back; other bytes stay."""
    aio, path = engines(name), tmp_path / "data.bin"
    old, data = os.urandom(before), os.urandom(size)
    path.write_bytes(old)
    expected = bytearray(old) + bytes(max(0, offset + size - before))
    expected[offset:offset + size] = data
    with open_file(path, "rw") as f:
        assert aio.write(f, data if from_bytes else host_buffer(data, shift), offset).wait() == size
        assert _file_bytes(path) == expected
        back = host_buffer(size, read_shift)
        assert aio.read(f, back, offset).wait() == size
    assert back.numpy().tobytes() == data


@pytest.fixture(scope="module")
def big_data() -> torch.Tensor:
    return torch.randint(0, 256, (64 * MiB + 4097,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", backend_params())
def test_large_transfers(tmp_path, big_data, name):
    """64 MiB + 4097 bytes from unaligned memory at an odd offset; then 64 MiB on the aligned path."""
    path, offset, size = tmp_path / "big.bin", 3 * 4096 + 5, big_data.numel()
    with AsyncIO(config(name, block_size=MiB, queue_depth=32)) as aio, open_file(path, "rw") as f:
        aio.write(f, host_buffer(big_data.numpy().tobytes(), 3), offset).wait()
        assert os.path.getsize(path) == offset + size
        assert hashlib.sha256(_pread(path, size, offset)).digest() == hashlib.sha256(big_data.numpy()).digest()
        back = host_buffer(size, 0)
        assert aio.read(f, back, offset).wait() == size
        assert torch.equal(back, big_data)

        aligned = aligned_empty(64 * MiB)
        aligned.copy_(big_data[:64 * MiB])
        aio.write(f, aligned, 0).wait()
        assert _pread(path, 64 * MiB, 0) == aligned.numpy().tobytes()
        back = aligned_empty(64 * MiB)
        aio.read(f, back, 0).wait()
        assert torch.equal(back, aligned)


def _pread(path, size: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", backend_params())
def test_tensor_dtypes_round_trip(engines, tmp_path, name):
    """Any dtype: the transfer moves the tensor's bytes (nbytes from data_ptr)."""
    aio = engines(name)
    source = torch.randn(3000, dtype=torch.float32).to(torch.bfloat16)
    with open_file(tmp_path / "t.bin", "rw") as f:
        aio.write(f, source, 100).wait()
        back = torch.empty_like(source)
        aio.read(f, back, 100).wait()
    assert torch.equal(back, source)


def test_buffered_files_pass_straight_through(engines, tmp_path):
    """A file opened without O_DIRECT takes unaligned transfers on the fast path."""
    aio = engines("pool" if BACKENDS["pool"].unavailable_reason() is None else "python")
    with open_file(tmp_path / "b.bin", "rw", direct=False) as f:
        aio.write(f, b"hello", 3).wait()
        back = bytearray(5)
        aio.read(f, back, 3).wait()
    assert back == b"hello" and _file_bytes(tmp_path / "b.bin") == b"\0\0\0hello"


# ------------------------------------------------------------------------------------------------
# Concurrency


def _records(seed: int, count: int, start: int) -> list[tuple[int, bytes]]:
    """Records of random sizes packed end to end from ``start``, so neighbours share edge blocks."""
    rng, out, at = random.Random(seed), [], start
    for _ in range(count):
        size = rng.choice([1, 3, 100, 4095, 4096, 5000, rng.randint(1, 70_000)])
        out.append((at, rng.randbytes(size)))
        at += size
    return out


@pytest.mark.parametrize("name", backend_params())
def test_many_threads_many_requests(engines, tmp_path, name):
    """6 threads x 50 requests in flight at once on one file, then read back concurrently."""
    aio, path = engines(name), tmp_path / "many.bin"
    per_thread = [_records(k, 50, k * 50 * 80_000) for k in range(6)]
    with open_file(path, "rw") as f:
        def write_all(records):
            for handle in [aio.write(f, data, at) for at, data in records]:
                handle.wait()

        def read_all(records, failures):
            buffers = [bytearray(len(data)) for _, data in records]
            for handle in [aio.read(f, buf, at) for buf, (at, _) in zip(buffers, records)]:
                handle.wait()
            failures += [at for buf, (at, data) in zip(buffers, records) if buf != data]

        _run_threads(write_all, [(r,) for r in per_thread])
        content = _file_bytes(path)
        assert all(content[at:at + len(data)] == data for records in per_thread for at, data in records)
        failures: list[int] = []
        _run_threads(read_all, [(r, failures) for r in per_thread])
        assert failures == []


def _run_threads(target, arg_lists) -> None:
    errors = []

    def guarded(*args):
        try:
            target(*args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=args) for args in arg_lists]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("name", backend_params())
def test_one_byte_writes_into_one_block(engines, tmp_path, name):
    """256 one-byte writes to one block, all in flight together: none may undo another."""
    aio, path = engines(name), tmp_path / "bytes.bin"
    data = os.urandom(256)
    with open_file(path, "rw") as f:
        handles = [aio.write(f, data[i:i + 1], 1000 + i) for i in range(256)]
        assert [h.wait() for h in handles] == [1] * 256
    assert _file_bytes(path) == bytes(1000) + data


@pytest.mark.parametrize("name", backend_params())
def test_interleaved_reads_and_writes(engines, tmp_path, name):
    """Two threads each write record i of one file while reading back record i - 1."""
    aio, path = engines(name), tmp_path / "mixed.bin"
    records = [_records(10 + k, 40, k * 3 * MiB) for k in range(2)]
    checks: list[bool] = []
    with open_file(path, "rw") as f:
        def pipeline(own):
            writes, reads = [], []
            for i, (at, data) in enumerate(own):
                writes.append(aio.write(f, host_buffer(data, i % 3), at))
                if i:
                    writes[i - 1].wait()
                    prev_at, prev = own[i - 1]
                    buffer = bytearray(len(prev))
                    reads.append((aio.read(f, buffer, prev_at), buffer, prev))
            writes[-1].wait()
            checks.extend(h.wait() == len(prev) and buffer == prev for h, buffer, prev in reads)

        _run_threads(pipeline, [(own,) for own in records])
    assert len(checks) == 78 and all(checks)


# ------------------------------------------------------------------------------------------------
# Handles and lifetime


def test_handle_wait_repeats_and_times_out(tmp_path):
    """wait() may be repeated; a transfer held up raises TimeoutError until it can finish."""
    with AsyncIO(config("python")) as aio, open_file(tmp_path / "h.bin", "rw") as f:
        first = aio.write(f, b"x" * 10, 0)
        assert first.wait() == 10 and first.wait() == 10 and first.done()
        with f.write_state.edges([0]):  # hold the edge block the next write must patch
            held = aio.write(f, b"y", 5)
            with pytest.raises(TimeoutError):
                held.wait(timeout=0.05)
            assert not held.done()
        assert held.wait(timeout=10) == 1
    assert _file_bytes(tmp_path / "h.bin") == b"xxxxxyxxxx"


def test_close_waits_for_transfers_in_flight(tmp_path):
    aio = AsyncIO(config("python"))
    with open_file(tmp_path / "c.bin", "rw") as f:
        handles = [aio.write(f, os.urandom(5000), i * 5000) for i in range(50)]
        aio.close()
        aio.close()
        assert all(h.done() for h in handles) and [h.wait() for h in handles] == [5000] * 50
        with pytest.raises(ValueError, match="closed"):
            aio.write(f, b"late", 0)
    assert os.path.getsize(tmp_path / "c.bin") == 250_000


def test_native_wait_releases_the_gil(tmp_path):
    """A thread blocked in a native wait (an io_uring read of an empty pipe) lets others run."""
    if BACKENDS["uring"].unavailable_reason() is not None:
        pytest.skip(BACKENDS["uring"].unavailable_reason())
    rfd, wfd = os.pipe()
    try:
        with AsyncIO(config("uring")) as aio:
            handle = aio.read(AioFile(rfd, "<pipe>", "r", direct=False), bytearray(4096), 0)
            waiter = threading.Thread(target=handle.wait)
            waiter.start()
            began = time.monotonic()
            for _ in range(50):
                time.sleep(0.001)  # each wake-up needs the GIL back
            assert time.monotonic() - began < 1.0
            assert not handle.done()
            os.write(wfd, b"z" * 4096)
            waiter.join(10)
            assert not waiter.is_alive() and handle.wait() == 4096
    finally:
        os.close(rfd)
        os.close(wfd)


# ------------------------------------------------------------------------------------------------
# Choosing a backend


def test_auto_prefers_uring_and_says_why(caplog):
    caplog.set_level(logging.INFO, logger="zerooffload.io")
    with AsyncIO(config("auto")) as aio:
        expected = next(n for n in ("uring", "pool", "python") if BACKENDS[n].unavailable_reason() is None)
        assert aio.backend == expected
    assert any(f"auto -> {expected}" in r.getMessage() for r in caplog.records)


def test_auto_asks_the_native_io_uring_probe(monkeypatch, caplog):
    """Where the native probe refuses io_uring (EPERM: kernel.io_uring_disabled), auto takes the pool and
    logs the probe's words, the same the uring backend (and doctor) give."""
    from zerooffload.io.probe import native_aio

    native = native_aio()[0]
    if native is None:
        pytest.skip("the native extension zerooffload._aio is not built")
    monkeypatch.setattr(native, "uring_probe", lambda: errno.EPERM)
    caplog.set_level(logging.INFO, logger="zerooffload.io")
    with AsyncIO(config("auto")) as aio:
        assert aio.backend == "pool"
    reason = BACKENDS["uring"].unavailable_reason()
    assert reason.startswith("io_uring does not work here: [Errno 1] ")
    assert any(f"auto -> pool (uring unavailable: {reason})" in r.getMessage() for r in caplog.records)


def test_without_the_native_extension():
    """auto falls back to python and says so; asking for uring by name says why not and what to use. The
    Adam extension is built and loaded apart, so it is still there."""
    script = """
import logging, sys
sys.modules["zerooffload._aio"] = None   # as if the optional extension had not been built
logging.basicConfig(level=logging.INFO, format="%(message)s")
from zerooffload.config import AioConfig
from zerooffload.io import AsyncIO
from zerooffload.optim import simd_level
print("adam", simd_level())
with AsyncIO() as aio:
    print("backend", aio.backend)
try:
    AsyncIO(AioConfig(backend="uring"))
except RuntimeError as exc:
    print("error", exc)
"""
    run = run_python(script)
    assert run.returncode == 0, run.stderr
    assert "backend python" in run.stdout
    assert "auto -> python" in run.stderr and "not built" in run.stderr
    error = run.stdout.split("error ", 1)[1]
    assert "'uring' is unavailable" in error and "not built" in error and "'python'" in error
    assert f"adam {simd_level()}" in run.stdout


_FORK_CHILD_EXITS = """
import json, os, sys, time, warnings
warnings.simplefilter("ignore")  # "fork() of a multi-threaded process": exactly the case under test
from aio_helpers import config
from zerooffload.io import AsyncIO, aligned_empty, open_file
out = {}
for name in sys.argv[2:]:
    aio = AsyncIO(config(name))
    with open_file(f"{sys.argv[1]}/{name}.bin", "rw") as f:
        aio.write(f, aligned_empty(1 << 20), 0).wait()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # exit runs the finalizer and frees the engine in a process without its threads
    deadline = time.monotonic() + 20
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if status[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    out[name] = "hung" if status[0] == 0 else os.waitstatus_to_exitcode(status[1])
    aio.close()
print(json.dumps(out))
"""


def test_forked_child_exits_cleanly(tmp_path):
    """A fork (a DataLoader worker) inherits an AsyncIO but not its threads; its exit must not hang or crash."""
    names = [n for n in ("uring", "pool", "python", "aiofiles") if BACKENDS[n].unavailable_reason() is None]
    run = run_python(_FORK_CHILD_EXITS, str(tmp_path), *names)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {name: 0 for name in names}
