"""Real faults, each a clear AioError naming file, offset, length and errno, and none a hang.

Permission and file-size-limit faults run in a subprocess: CI runs as root, which no permission
stops, so that subprocess drops to nobody (65534); RLIMIT_FSIZE sends SIGXFSZ, which kills a process
that does not ignore it.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import tempfile

import pytest

from aio_helpers import BACKEND_NAMES, backend_params, config, host_buffer, run_python
from zerooffload.io import AioError, AsyncIO, aligned_empty, open_file
from zerooffload.io.backends import BACKENDS

MiB = 1 << 20


def test_missing_directory(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "f.bin"
    with pytest.raises(AioError) as info:
        open_file(path, "w")
    assert info.value.errno == errno.ENOENT and info.value.filename == str(path)
    assert str(info.value) == f"open of {path} failed: [Errno {errno.ENOENT}] No such file or directory"


_AS_NOBODY = """
import json, os, sys
from zerooffload.io import AioError, open_file
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
out = {}
for name, path, mode in (("file", sys.argv[1], "r"), ("dir", sys.argv[2], "w")):
    try:
        open_file(path, mode).close()
        out[name] = None
    except AioError as exc:
        out[name] = [exc.errno, exc.filename, str(exc)]
print(json.dumps(out))
"""


def test_permission_denied():
    """A 0o600 file and a 0o700 directory of another user, opened by nobody (root drops to it)."""
    top = tempfile.mkdtemp(prefix="zo-perm-")
    try:
        os.chmod(top, 0o755)  # nobody may pass through, not into what lies below
        secret, locked = os.path.join(top, "secret.bin"), os.path.join(top, "locked")
        with open(secret, "wb") as f:
            f.write(b"x" * 4096)
        os.chmod(secret, 0o600 if os.geteuid() == 0 else 0)
        os.mkdir(locked, 0o700 if os.geteuid() == 0 else 0o500)
        run = run_python(_AS_NOBODY, secret, os.path.join(locked, "new.bin"))
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
    finally:
        os.chmod(os.path.join(top, "locked"), 0o700)
        shutil.rmtree(top)
    assert out["file"][0] == errno.EACCES and out["file"][1] == secret and "Permission denied" in out["file"][2]
    assert out["dir"][0] == errno.EACCES and out["dir"][1].endswith("locked/new.bin")


_FILE_SIZE_LIMIT = """
import json, resource, signal, sys
from aio_helpers import config, host_buffer
from zerooffload.io import AioError, AsyncIO, aligned_empty, open_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # else the first write past the limit kills us
resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
out = {}
for i, name in enumerate(sys.argv[2:]):
    with AsyncIO(config(name, block_size=1 << 20)) as aio, open_file(f"{sys.argv[1]}/{name}.bin", "w") as f:
        for kind, buffer, offset in (("aligned", aligned_empty(4 << 20), 1 << 20),
                                     ("unaligned", host_buffer(3 << 20, 1), 12345)):
            try:
                aio.write(f, buffer, offset).wait()
                out[f"{name}/{kind}"] = None
            except AioError as exc:
                out[f"{name}/{kind}"] = [exc.errno, exc.offset, exc.length, exc.failed_offset, str(exc)]
print(json.dumps(out))
"""


def test_file_size_limit_is_efbig_on_every_backend(tmp_path):
    names = [n for n in BACKEND_NAMES if BACKENDS[n].unavailable_reason() is None]
    run = run_python(_FILE_SIZE_LIMIT, str(tmp_path), *names)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for name in names:
        code, offset, length, failed_at, message = out[f"{name}/aligned"]
        assert (code, offset, length, failed_at) == (errno.EFBIG, 1 << 20, 4 << 20, 2 << 20), name
        assert message == (f"write of {4 << 20} bytes at offset {1 << 20} in {tmp_path}/{name}.bin failed at "
                           f"offset {2 << 20}: [Errno {errno.EFBIG}] File too large")
        code, offset, length, failed_at, _ = out[f"{name}/unaligned"]
        assert (code, offset, length) == (errno.EFBIG, 12345, 3 << 20), name
        assert 2 << 20 <= failed_at < 12345 + (3 << 20), name  # edge blocks and chunks fail apart


_WRITES_IN_FLIGHT = """
import json, resource, signal, sys
from aio_helpers import config
from zerooffload.io import AioError, AsyncIO, aligned_empty, open_file
path, name, limit, block, count = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
buffers = [aligned_empty(block).fill_(i + 1) for i in range(count)]
with AsyncIO(config(name, block_size=16384, queue_depth=32)) as aio, open_file(path, "rw") as f:
    handles = [aio.write(f, b, i * block) for i, b in enumerate(buffers)]  # all in flight at once
    out = {"results": []}
    for handle in handles:
        try:
            out["results"].append(handle.wait(30))
        except AioError as exc:
            out["results"].append([exc.errno, exc.offset, exc.failed_offset, str(exc)])
    for b in buffers:  # reused at once: a write still in flight would now put zeros in the file
        b.zero_()
    back = aligned_empty(limit)
    out["read_back"] = aio.read(f, back, 0).wait(30)
    out["intact"] = all(bool((back[i * block:(i + 1) * block] == i + 1).all()) for i in range(limit // block))
    out["again"] = aio.write(f, buffers[0], 0).wait(30)  # the engine still works below the limit
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", ["uring", "pool"])
def test_writes_in_flight_past_a_size_limit(tmp_path, name):
    """Many writes in flight on a native engine, those past RLIMIT_FSIZE failing: each handle completes
    (no hang) with its own outcome; the ones that failed name where; the buffers are the caller's
    again when their handles complete (reusing them at once changes nothing in the file); the engine
    goes on working."""
    if BACKENDS[name].unavailable_reason() is not None:
        pytest.skip(BACKENDS[name].unavailable_reason())
    block, count, limit = 65536, 48, 1 << 20
    run = run_python(_WRITES_IN_FLIGHT, str(tmp_path / "f.bin"), name, str(limit), str(block), str(count))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    fits = limit // block
    assert out["results"][:fits] == [block] * fits
    for i, (code, offset, failed_at, message) in enumerate(out["results"][fits:], fits):
        assert (code, offset, failed_at) == (errno.EFBIG, i * block, i * block), i
        assert f"{tmp_path}/f.bin failed at offset {i * block}" in message
    assert out["read_back"] == limit and out["intact"] and out["again"] == block


_RING_FAILURE = """
import json, os, sys, time
from aio_helpers import config
from zerooffload.io import AioError, AsyncIO, aligned_empty, open_file
fifo, scenario, depth = sys.argv[1], sys.argv[2], 4

def uring_descriptors():
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[io_uring]":
                found.add(int(name))
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            pass
    return found

def wait_until_polled(ring, count):
    # until count requests of the ring wait for their file to be ready (the PollList of its fdinfo); a
    # kernel may leave its lists out of a read that finds the ring's lock taken (seen once in a suite run
    # under load), so only a PollList never seen in 10 s means a kernel without one
    deadline, seen = time.monotonic() + 10, False
    while time.monotonic() < deadline:
        with open(f"/proc/self/fdinfo/{ring}") as info:
            text = info.read()
        seen = seen or "PollList:" in text
        if text.partition("PollList:")[2].partition("CqOverflowList:")[0].count("op=") >= count:
            return
        time.sleep(0.01)
    if not seen:
        print(json.dumps({"skip": "this kernel's io_uring fdinfo has no PollList to see the reads in"}))
        sys.exit(0)
    raise AssertionError(f"io_uring {ring} has not polled {count} requests after 10 s")

def break_ring(ring):
    # what a stray close and reuse of the descriptor does: io_uring_enter on it fails for good
    stray = os.open("/dev/null", os.O_RDONLY)
    os.dup2(stray, ring)
    os.close(stray)

def errno_of(call):
    try:
        call()
    except AioError as exc:
        return exc.errno
    return None

os.mkfifo(fifo)
writer = os.open(fifo, os.O_RDWR)  # O_RDWR: the open does not wait for a reader
before = uring_descriptors()
aio = AsyncIO(config("uring", block_size=4096, queue_depth=depth))
(ring,) = uring_descriptors() - before
f = open_file(fifo, "r", direct=False, create=False)
out = {}
if scenario == "held":
    buffers = [aligned_empty(4096).zero_() for _ in range(depth)]
    handles = [aio.read(f, b, 0) for b in buffers]  # every slot held by a read waiting for data
    try:
        wait_until_polled(ring, depth + 1)  # + 1: the engine's wake read
    except BaseException:  # not polled, or no PollList to see (the skip's exit): data for the held reads,
        # so that the scenario ends with its error or skip instead of hanging in close at exit
        os.write(writer, bytes(4096 * depth))
        raise
    break_ring(ring)
    out["queued"] = errno_of(lambda: aio.read(f, aligned_empty(4096), 0).wait(10))  # wakes the owner
    time.sleep(0.3)
    out["done_before_data"] = [h.done() for h in handles]
    os.write(writer, b"".join(bytes([i]) * 4096 for i in range(1, depth + 1)))
    out["results"] = [h.wait(10) for h in handles]
    out["buffers"] = sorted(b.unique().tolist() for b in buffers)
    out["later"] = errno_of(lambda: aio.read(f, aligned_empty(4096), 0))
else:
    wait_until_polled(ring, 1)  # the wake read: the owner sleeps until a submission wakes it
    break_ring(ring)
    out["reads"] = [errno_of(lambda: aio.read(f, aligned_empty(4096), 0).wait(10)) for _ in range(depth)]
aio.close()
print(json.dumps(out))
"""


def _ring_failure(tmp_path, scenario: str) -> dict:
    """Run a ``_RING_FAILURE`` scenario in a subprocess: a regression there hangs in ``close``, which
    waits for every read, and the subprocess's timeout turns that into a failure."""
    if BACKENDS["uring"].unavailable_reason() is not None:
        pytest.skip(BACKENDS["uring"].unavailable_reason())
    run = run_python(_RING_FAILURE, str(tmp_path / "fifo"), scenario, timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def test_failed_ring_finishes_reads_only_once_the_kernel_is_done(tmp_path):
    """When io_uring_enter fails for good (the ring's descriptor replaced under the engine, as a stray
    close and reuse would), reads the kernel already holds must not complete until it is done with their
    buffers: completing them at once let the caller free or reuse memory the kernel then writes. The
    reads are of an empty FIFO, so they stay in the kernel until data comes."""
    out = _ring_failure(tmp_path, "held")
    assert out["queued"] == errno.EOPNOTSUPP  # the read that found no slot fails with the ring's error
    assert not any(out["done_before_data"]), "reads completed while the kernel still held their buffers"
    assert out["results"] == [4096] * 4 and out["buffers"] == [[1], [2], [3], [4]]
    assert out["later"] == errno.EOPNOTSUPP  # refused from then on


def test_failed_ring_fails_at_once_the_reads_it_never_took(tmp_path):
    """Reads whose submission is the io_uring_enter that fails never reach the kernel: they fail at once
    with the ring's error (waiting for their completions would wait forever), as do reads after it."""
    assert _ring_failure(tmp_path, "never_taken")["reads"] == [errno.EOPNOTSUPP] * 4


@pytest.mark.parametrize("name", backend_params())
def test_read_of_a_truncated_file(engines, tmp_path, name):
    """Reading past a file's end, aligned or not, is "unexpected end of file", never a short count."""
    aio, path = engines(name), tmp_path / "short.bin"
    with open_file(path, "rw") as f:
        aio.write(f, os.urandom(65536), 0).wait()
        os.truncate(path, 10_000)
        for buffer, offset in ((aligned_empty(65536), 0), (host_buffer(20_000, 1), 3), (bytearray(8192), 65536)):
            with pytest.raises(AioError) as info:
                aio.read(f, buffer, offset).wait()
            assert (info.value.errno, info.value.offset, info.value.length) == (errno.ENODATA, offset, len(buffer))
            assert info.value.strerror == "unexpected end of file" and str(path) in str(info.value)
        assert aio.read(f, bytearray(10_000 - 4001), 4001).wait() == 10_000 - 4001  # up to the end is fine


@pytest.mark.parametrize("name", backend_params())
def test_closed_file_is_ebadf(engines, tmp_path, name):
    aio = engines(name)
    f = open_file(tmp_path / "closed.bin", "rw")
    f.close()
    for buffer in (aligned_empty(8192), b"odd bytes"):
        with pytest.raises(AioError) as info:
            aio.write(f, buffer, 4096).wait()
        assert info.value.errno == errno.EBADF and info.value.length == len(buffer)


@pytest.mark.parametrize("name", backend_params())
def test_full_device_is_enospc(engines, name):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open_file("/dev/full", "w", direct=False, create=False) as f, pytest.raises(AioError) as info:
        engines(name).write(f, aligned_empty(1 << 20), 0).wait()
    assert info.value.errno == errno.ENOSPC and "No space left on device" in str(info.value)


def test_raw_mode_refuses_unaligned_transfers(tmp_path):
    with AsyncIO(config("python"), raw=True) as aio, open_file(tmp_path / "raw.bin", "rw") as f:
        assert aio.write(f, aligned_empty(8192), 4096).wait() == 8192
        for buffer, offset in ((aligned_empty(8192), 100), (aligned_empty(100), 0), (host_buffer(8192, 1), 0)):
            with pytest.raises(AioError) as info:
                aio.write(f, buffer, offset)
            assert info.value.errno == errno.EINVAL and "raw mode" in str(info.value)


def test_mode_and_offset_are_checked(engines, tmp_path):
    aio = engines("python")
    with open_file(tmp_path / "w.bin", "w") as f:
        with pytest.raises(AioError) as info:
            aio.read(f, bytearray(10), 0)
        assert info.value.errno == errno.EBADF and "mode 'w'" in str(info.value)
        with pytest.raises(AioError) as info:
            aio.write(f, b"x", -1)
        assert info.value.errno == errno.EINVAL
    with open_file(tmp_path / "w.bin", "r") as f, pytest.raises(TypeError, match="read-only"):
        aio.read(f, b"immutable", 0)


def test_aio_error_pickles_whole():
    error = AioError(errno.EFBIG, "File too large", "/x/y", op="write", offset=4096, length=8192,
                     failed_offset=8192)
    back = pickle.loads(pickle.dumps(error))
    assert (back.errno, back.filename, back.op, back.offset, back.length, back.failed_offset) == (
        errno.EFBIG, "/x/y", "write", 4096, 8192, 8192)
    assert str(back) == str(error) == ("write of 8192 bytes at offset 4096 in /x/y failed at offset 8192: "
                                       "[Errno 27] File too large")
    assert isinstance(back, OSError)


def test_aio_error_names_where_a_transfer_failed(tmp_path):
    """A read that meets end of file names the offset where the file ended; one refused before any backend
    ran it names no such offset."""
    with AsyncIO(config("pool" if BACKENDS["pool"].unavailable_reason() is None else "python")) as aio, \
            open_file(tmp_path / "short.bin", "rw") as f:
        aio.write(f, aligned_empty(3 * 65536).fill_(1), 0).wait()
        with pytest.raises(AioError) as info:
            aio.read(f, aligned_empty(4 * 65536), 65536).wait()
        assert (info.value.offset, info.value.failed_offset) == (65536, 3 * 65536)
        assert f"failed at offset {3 * 65536}: [Errno {errno.ENODATA}] unexpected end of file" in str(info.value)
        with pytest.raises(AioError) as info:
            aio.write(f, b"x", -1)
        assert info.value.failed_offset is None and "failed at" not in str(info.value)
