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
                out[f"{name}/{kind}"] = [exc.errno, exc.offset, exc.length, str(exc)]
print(json.dumps(out))
"""


def test_file_size_limit_is_efbig_on_every_backend(tmp_path):
    names = [n for n in BACKEND_NAMES if BACKENDS[n].unavailable_reason() is None]
    run = run_python(_FILE_SIZE_LIMIT, str(tmp_path), *names)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for name in names:
        code, offset, length, message = out[f"{name}/aligned"]
        assert (code, offset, length) == (errno.EFBIG, 1 << 20, 4 << 20), name
        assert message == (f"write of {4 << 20} bytes at offset {1 << 20} in {tmp_path}/{name}.bin failed: "
                           f"[Errno {errno.EFBIG}] File too large")
        assert out[f"{name}/unaligned"][:3] == [errno.EFBIG, 12345, 3 << 20], name


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
    error = AioError(errno.EFBIG, "File too large", "/x/y", op="write", offset=4096, length=8192)
    back = pickle.loads(pickle.dumps(error))
    assert (back.errno, back.filename, back.op, back.offset, back.length) == (errno.EFBIG, "/x/y", "write", 4096, 8192)
    assert str(back) == str(error) == "write of 8192 bytes at offset 4096 in /x/y failed: [Errno 27] File too large"
    assert isinstance(back, OSError)
