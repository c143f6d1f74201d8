"""NVMe swap store on real files: reuse, striping, two stores on one path, stale files, cleanup, space."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from zerooffload.io import AsyncIO
from zerooffload.io.swapfile import PRIVATE_DIR, SwapSpaceError, SwapStore


@pytest.fixture(scope="module")
def aio():
    with AsyncIO() as engine:
        yield engine


def _random(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_round_trip_reuse_and_free(tmp_path, aio):
    with SwapStore(str(tmp_path), aio) as store:
        tensors = {f"k{i}": _random(n, i) for i, n in enumerate([1, 4095, 4096, 10_000, 3 << 20])}
        for key, t in tensors.items():
            store.write(key, t).wait()
        for key, t in tensors.items():
            out = torch.empty_like(t)
            store.read(key, out).wait()
            assert torch.equal(out, t)
        span = store.file_bytes
        store.free("k3")
        store.write("k5", _random(8000, 9)).wait()  # fits in k3's freed 12 KiB extent
        assert store.file_bytes == span
        assert store.stored_bytes == sum(t.numel() for k, t in tensors.items() if k != "k3") + 8000
        store.free("k4")  # the last extent, merged with k3's unused 4 KiB tail: the file's end comes back
        assert store.file_bytes == span - (3 << 20) - 4096
        f32 = torch.randn(1000)
        store.write("float", f32).wait()
        back = torch.empty(1000)
        store.read("float", back).wait()
        assert torch.equal(back, f32)
        with pytest.raises(ValueError, match="holds 4000 bytes but the destination has 4"):
            store.read("float", torch.empty(1))
        with pytest.raises(KeyError, match="'k3' is not stored"):
            store.read("k3", torch.empty(1))


def test_files_are_private_and_named(tmp_path, aio):
    with SwapStore(str(tmp_path), aio, rank=3) as store:
        path = store.paths[0]
        assert path.parent == tmp_path / PRIVATE_DIR
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert ".rank3." in path.name and os.uname().nodename in path.name
    assert not path.exists()


def test_striping_spreads_each_tensor_over_every_directory(tmp_path, aio):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")]
    with SwapStore(dirs, aio) as store:
        data = _random(3 * 4096 * 100 + 17, 1)
        store.write("x", data).wait()
        third = -(-data.numel() // 3)
        share = -(-third // 4096) * 4096  # a third, rounded up to 4 KiB
        lengths = [share, share, data.numel() - 2 * share]
        raw = b"".join(p.read_bytes()[:n] for p, n in zip(store.paths, lengths))
        assert raw == data.numpy().tobytes()  # an independent read of the three files, end to end
        out = torch.empty_like(data)
        store.read("x", out).wait()
        assert torch.equal(out, data)


def test_a_prefix_read_returns_the_first_bytes_across_stripes(tmp_path, aio):
    with SwapStore([str(tmp_path / "a"), str(tmp_path / "b")], aio) as store:
        data = _random(4096 * 30, 2)
        store.write("x", data).wait()
        for nbytes in (4096, 4096 * 15, 4096 * 16, 4096 * 30):  # within the first stripe, at and past its end
            out = torch.empty(nbytes, dtype=torch.uint8)
            store.read("x", out, prefix=True).wait()
            assert torch.equal(out, data[:nbytes]), nbytes
        with pytest.raises(ValueError, match="holds 122880 bytes but the destination has 126976"):
            store.read("x", torch.empty(4096 * 31, dtype=torch.uint8), prefix=True)
    with SwapStore(str(tmp_path), aio, checksum=True) as store:
        store.write("k", _random(8192, 3)).wait()
        with pytest.raises(ValueError, match="a part cannot be verified"):
            store.read("k", torch.empty(4096, dtype=torch.uint8), prefix=True)


def test_two_stores_on_one_path_do_not_share(tmp_path, aio):
    with SwapStore(str(tmp_path), aio) as one, SwapStore(str(tmp_path), aio) as two:
        assert one.paths[0] != two.paths[0]
        one.write("k", _random(8192, 1)).wait()
        two.write("k", _random(8192, 2)).wait()
        out = torch.empty(8192, dtype=torch.uint8)
        one.read("k", out).wait()
        assert torch.equal(out, _random(8192, 1))


_OWNER = textwrap.dedent("""
    import sys, time
    from zerooffload.io import AsyncIO
    from zerooffload.io.swapfile import SwapStore
    store = SwapStore(sys.argv[1], AsyncIO())
    print(store.paths[0], flush=True)
    time.sleep(600)
""")


def _start_owner(path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(path)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_stale_file_of_a_killed_owner_is_cleaned_and_live_one_kept(tmp_path, aio):
    dead, dead_file = _start_owner(tmp_path)
    live, live_file = _start_owner(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert os.path.exists(dead_file)  # SIGKILL leaves it behind
        with SwapStore(str(tmp_path), aio):
            assert not os.path.exists(dead_file) and os.path.exists(live_file)
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_files_removed_on_signal(tmp_path, signum):
    owner, path = _start_owner(tmp_path)
    assert os.path.exists(path)
    owner.send_signal(signum)
    owner.wait(timeout=30)
    assert not os.path.exists(path)


def test_files_removed_at_exit(tmp_path):
    code = "import sys; from zerooffload.io import AsyncIO; from zerooffload.io.swapfile import SwapStore; " \
           "print(SwapStore(sys.argv[1], AsyncIO()).paths[0])"
    path = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert path and not os.path.exists(path)


def test_preflight_refuses_with_the_numbers(tmp_path, aio):
    with pytest.raises(SwapSpaceError, match=r"needs [0-9.]+ GB but has [0-9.]+ GB free"):
        SwapStore(str(tmp_path), aio, reserve=1 << 60)
    assert list((tmp_path / PRIVATE_DIR).glob("*.swap")) == []
    with SwapStore(str(tmp_path), aio, reserve=8 << 20) as store:
        assert store.paths[0].stat().st_blocks * 512 >= 8 << 20  # blocks really claimed


def test_checksum_catches_corruption_on_disk(tmp_path, aio):
    with SwapStore(str(tmp_path), aio, checksum=True) as store:
        data = _random(8192, 5)
        store.write("k", data).wait()
        fd = os.open(store.paths[0], os.O_WRONLY)
        os.pwrite(fd, b"\xff\x00", 100)
        os.fsync(fd)
        os.close(fd)
        with pytest.raises(OSError, match="checksum mismatch reading swap key 'k'"):
            store.read("k", torch.empty_like(data)).wait()
