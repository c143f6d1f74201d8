"""NVMe swap store on real files: reuse, striping, two stores on one path, clashing names, stale files,
cleanup at exit and on signals, space."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from zerooffload.io import AsyncIO
from zerooffload.io.swap_digests import CHUNK
from zerooffload.io.swap_space import PRIVATE_DIR
from zerooffload.io.swapfile import SwapDamage, SwapSpaceError, SwapStore


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


def test_a_version_written_aside_replaces_the_key_only_when_renamed(tmp_path, aio):
    """The commit of a tentative version (tiers' held blocks): until the rename, reads see the old bytes;
    after it, the new ones, and the old extents are free again (the file does not grow on the next round)."""
    old, new = _random(10_000, 1), _random(10_000, 2)
    with SwapStore(str(tmp_path), aio) as store:
        store.write("block", old).wait()
        spans = []
        for round_ in range(3):
            store.write("block~aside", new).wait()
            out = torch.empty_like(old)
            store.read("block", out).wait()
            assert torch.equal(out, old)
            spans.append(store.file_bytes)
            store.rename("block~aside", "block")
            store.read("block", out).wait()
            assert torch.equal(out, new) and "block~aside" not in store
            assert store.stored_bytes == 10_000
            old, new = new, _random(10_000, 3 + round_)
        assert spans == [2 * 12288] * 3  # two versions at most, whatever the rounds
        with pytest.raises(KeyError, match="'nothing' is not stored"):
            store.rename("nothing", "block")


def test_files_are_private_and_named(tmp_path, aio):
    with SwapStore(str(tmp_path), aio, rank=3) as store:
        path = store.paths[0]
        assert path.parent == tmp_path / PRIVATE_DIR
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert ".rank3." in path.name and os.uname().nodename in path.name
    assert not path.exists()


def test_a_missing_directory_is_refused_not_created(tmp_path, aio):
    """An unmounted disk's mount point must not become a directory on the root disk that swap fills."""
    missing = tmp_path / "mnt" / "nvme"
    with pytest.raises(FileNotFoundError, match=rf"swap directory {missing} does not exist: mount the disk meant "
                                                r"to be there or create the directory, or set nvme\.path"):
        SwapStore(str(missing), aio)
    assert list(tmp_path.iterdir()) == []
    missing.mkdir(parents=True)  # what the message asks for: then only the private directory is created
    with SwapStore(str(missing), aio) as store:
        assert store.paths[0].parent == missing / PRIVATE_DIR


def test_striping_spreads_each_tensor_over_every_directory(tmp_path, aio):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")]
    for directory in dirs:
        os.mkdir(directory)
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
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with SwapStore([str(tmp_path / "a"), str(tmp_path / "b")], aio, checksum=False) as store:
        data = _random(4096 * 30, 2)
        store.write("x", data).wait()
        for nbytes in (4096, 4096 * 15, 4096 * 16, 4096 * 30):  # within the first stripe, at and past its end
            out = torch.empty(nbytes, dtype=torch.uint8)
            store.read("x", out, prefix=True).wait()
            assert torch.equal(out, data[:nbytes]), nbytes
        with pytest.raises(ValueError, match="holds 122880 bytes but the destination has 126976"):
            store.read("x", torch.empty(4096 * 31, dtype=torch.uint8), prefix=True)
    with SwapStore(str(tmp_path), aio, checksum=True) as store:
        store.write("k", _random(8192 * 3, 3), segment=8192).wait()
        with pytest.raises(ValueError, match="would end inside a checksummed segment of 8192 bytes"):
            store.read("k", torch.empty(4096, dtype=torch.uint8), prefix=True)


def test_each_segment_is_verified_on_its_own(tmp_path, aio):
    """A prefix of whole segments reads and verifies without the rest; damage past it is not its concern,
    and is found by the read that covers it, which names the segment and where it lies."""
    with SwapStore(str(tmp_path), aio) as store:
        data = _random(8192 * 3, 4)
        store.write("k", data, segment=8192).wait()
        _scribble(store.paths[0], 8192 * 2 + 10)
        first = torch.empty(8192 * 2, dtype=torch.uint8)
        store.read("k", first, prefix=True).wait()
        assert torch.equal(first, data[:8192 * 2])
        with pytest.raises(SwapDamage, match=rf"swap block 'k' is damaged: .*\(segment 3 of 3\) \(8192 bytes at "
                                             rf"offset 16384 of {store.paths[0]}\).*resume from the last checkpoint"):
            store.read("k", torch.empty_like(data)).wait()


def test_a_large_entry_is_verified_chunk_by_chunk(tmp_path, aio):
    """An entry past ``CHUNK`` is verified in chunks as they land; the damaged one is named by where it lies."""
    with SwapStore(str(tmp_path), aio) as store:
        data = _random(CHUNK * 2 + 8192, 8)
        store.write("big", data).wait()
        out = torch.empty_like(data)
        store.read("big", out).wait()
        assert torch.equal(out, data)
        _scribble(store.paths[0], CHUNK * 2 + 100)
        with pytest.raises(SwapDamage, match=rf"\(8192 bytes at offset {CHUNK * 2} of "):
            store.read("big", out).wait()


def _scribble(path, offset: int) -> None:
    """Change two bytes of ``path`` at ``offset`` behind the store's back, as another process would."""
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, b"\xff\x00", offset)
    os.fsync(fd)
    os.close(fd)


def test_two_stores_on_one_path_do_not_share(tmp_path, aio):
    with SwapStore(str(tmp_path), aio) as one, SwapStore(str(tmp_path), aio) as two:
        assert one.paths[0] != two.paths[0]
        one.write("k", _random(8192, 1)).wait()
        two.write("k", _random(8192, 2)).wait()
        out = torch.empty(8192, dtype=torch.uint8)
        one.read("k", out).wait()
        assert torch.equal(out, _random(8192, 1))


_TWIN = textwrap.dedent("""
    import os, socket, sys
    import torch
    from zerooffload.io import AsyncIO
    from zerooffload.io.swapfile import SwapStore
    socket.gethostname = lambda: "node"  # what a second container with the same hostname sees
    os.getpid = lambda: 1
    os.environ["TORCHELASTIC_RUN_ID"] = "job"
    store = SwapStore(sys.argv[1], AsyncIO())
    data = torch.arange(4096, dtype=torch.uint8)
    store.write("k", data).wait()
    back = torch.empty_like(data)
    store.read("k", back).wait()
    print(store.paths[0], torch.equal(back, data), flush=True)
    sys.stdin.read()
""")


@pytest.mark.slow  # two spawned processes; the in-process ownership tests stay in CI
def test_same_host_job_and_pid_in_two_processes_get_their_own_files(tmp_path):
    twins, lines = [], []
    try:
        for _ in range(2):  # one after the other: the second starts while the first holds its file
            twins.append(subprocess.Popen([sys.executable, "-c", _TWIN, str(tmp_path)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True))
            line = twins[-1].stdout.readline()
            assert line.endswith(" True\n"), line  # it wrote and read back through its own store
            lines.append(line.split()[0])
        one, two = lines
        assert one != two and os.path.basename(one).startswith("node.job.rank0.1.")
        assert os.path.exists(one) and os.path.exists(two)
    finally:
        for twin in twins:
            twin.communicate("", timeout=60)
    assert [twin.returncode for twin in twins] == [0, 0]


def test_a_swap_file_locked_by_another_live_store_is_refused_by_name(tmp_path, aio, monkeypatch):
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes: "0" * 2 * nbytes)  # names now repeat
    with SwapStore(str(tmp_path), aio) as held:
        with pytest.raises(BlockingIOError, match=f"swap file {re.escape(str(held.paths[0]))} is locked by "
                                                  "another live process"):
            SwapStore(str(tmp_path), aio)
        held.write("k", _random(8192, 1)).wait()  # the refused store left the holder's file alone
        out = torch.empty(8192, dtype=torch.uint8)
        held.read("k", out).wait()
        assert torch.equal(out, _random(8192, 1))


_OWNER = textwrap.dedent("""
    import signal, sys, time
    from zerooffload.io import AsyncIO
    from zerooffload.io.swapfile import SwapStore
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, even if SIGINT came in ignored
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
def test_files_removed_on_a_signal_that_kills(tmp_path, signum):
    owner, path = _start_owner(tmp_path)
    assert os.path.exists(path)
    owner.send_signal(signum)  # SIGTERM's default kills; Python's uncaught KeyboardInterrupt re-raises SIGINT
    assert owner.wait(timeout=30) == -signum
    assert not os.path.exists(path)


_SURVIVOR = textwrap.dedent("""
    import json, os, select, signal, sys, zlib
    import torch
    from zerooffload.io import AsyncIO
    from zerooffload.io.swapfile import SwapStore
    got = []
    if sys.argv[2] == "handler":  # the preemption pattern: note it, save, exit when ready
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append("handler"))
    elif sys.argv[2] == "ignore":  # as under nohup or `cmd &`
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    store = SwapStore(sys.argv[1], AsyncIO(), checksum=True)
    before = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    store.write("before", before).wait()
    try:
        print(store.paths[0], flush=True)
        while not got and not select.select([sys.stdin], [], [], 0.01)[0]:
            pass  # until the handler ran, or the parent says the (ignored) signal was sent
    except KeyboardInterrupt:
        got.append("KeyboardInterrupt")
    after = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    store.write("after", after).wait()
    sums = []
    for key, data in (("before", before), ("after", after)):
        back = torch.empty_like(data)
        store.read(key, back).wait()
        sums.append([zlib.crc32(data.numpy()), zlib.crc32(back.numpy())])
    print(json.dumps({"got": got, "sums": sums, "exists": store.paths[0].exists()}), flush=True)
""")


@pytest.mark.parametrize("mode, signum, got", [("handler", signal.SIGTERM, ["handler"]),
                                               ("ignore", signal.SIGTERM, []),
                                               ("interrupt", signal.SIGINT, ["KeyboardInterrupt"])])
def test_a_signal_the_process_survives_leaves_its_files(tmp_path, mode, signum, got):
    child = subprocess.Popen([sys.executable, "-c", _SURVIVOR, str(tmp_path), mode],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    path = child.stdout.readline().strip()
    os.kill(child.pid, signum)
    out, _ = child.communicate("sent\n" if mode == "ignore" else "", timeout=60)
    assert child.returncode == 0
    report = json.loads(out)
    assert report["got"] == got
    assert all(written == read for written, read in report["sums"])
    assert report["exists"]  # while it ran on
    assert path and not os.path.exists(path)  # removed at its exit


def test_files_removed_at_exit(tmp_path):
    code = "import sys; from zerooffload.io import AsyncIO; from zerooffload.io.swapfile import SwapStore; " \
           "print(SwapStore(sys.argv[1], AsyncIO()).paths[0])"
    path = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert path and not os.path.exists(path)


def test_preflight_refuses_with_exact_byte_counts(tmp_path, aio):
    reserve = shutil.disk_usage(tmp_path).free + 1
    with pytest.raises(SwapSpaceError) as refused:
        SwapStore(str(tmp_path), aio, reserve=reserve)
    message = str(refused.value)
    assert f"swap store of {reserve} bytes (" in message
    numbers = re.search(r"needs (\d+) bytes \(.*\) but has (\d+) bytes \(.*\) free", message)
    need, free = map(int, numbers.groups())
    assert need == -(-reserve // 4096) * 4096 and free < need
    assert list((tmp_path / PRIVATE_DIR).glob("*.swap")) == []
    with SwapStore(str(tmp_path), aio, reserve=8 << 20) as store:
        assert store.paths[0].stat().st_blocks * 512 >= 8 << 20  # blocks really claimed


def test_checksum_catches_corruption_on_disk_by_default(tmp_path, aio):
    with SwapStore(str(tmp_path), aio) as store:
        data = _random(8192, 5)
        store.write("k", data).wait()
        _scribble(store.paths[0], 100)
        with pytest.raises(SwapDamage, match=f"swap block 'k' is damaged: its checksum differs .* \\(8192 bytes "
                                             f"at offset 0 of {store.paths[0]}\\)"):
            store.read("k", torch.empty_like(data)).wait()
    with SwapStore(str(tmp_path), aio, checksum=False) as store:  # off: the damage is read as data
        store.write("k", data).wait()
        _scribble(store.paths[0], 100)
        out = torch.empty_like(data)
        store.read("k", out).wait()
        assert not torch.equal(out, data) and torch.equal(out[:100], data[:100])


@pytest.mark.parametrize("stripes", [1, 2])
def test_a_truncated_swap_file_names_the_blocks_own_range_and_where_the_file_ends(tmp_path, aio, stripes):
    """'b' lies after 'a' in each file (found there by its bytes); a file cut inside 'b', then before it:
    the damage names b's own offset and length in that file (not where the read stopped), and the end."""
    dirs = [tmp_path / str(i) for i in range(stripes)]
    for directory in dirs:
        directory.mkdir()
    with SwapStore([str(d) for d in dirs], aio) as store:
        a, b = _random(8192 * stripes, 6), _random(8192 * stripes, 7)
        store.write("a", a).wait()
        store.write("b", b).wait()
        cut = store.paths[-1]  # the last stripe holds b's last 8192 bytes
        assert cut.read_bytes().find(b[-8192:].numpy().tobytes()) == 8192
        for end in (8192 + 4096, 4096):
            os.truncate(cut, end)
            with pytest.raises(SwapDamage) as damage:
                store.read("b", torch.empty_like(b)).wait()
            assert str(damage.value).startswith(
                f"swap block 'b' is damaged: the swap file ends at byte {end}, before the block's end (truncated) "
                f"(8192 bytes at offset 8192 of {cut}); something other than this run changed the swap file")


def test_a_cap_refuses_the_write_that_would_grow_the_files_past_it_before_it_is_made(tmp_path, aio):
    """``cap`` (a rank's share of nvme.max_bytes) holds as the file grows, preallocation included: the
    write that would pass it is refused in one line naming the cap and the bytes, the file left as it
    was; the store goes on, and a freed extent takes the write again."""
    cap = 16 * 4096
    with SwapStore(str(tmp_path), aio, cap=cap) as store:
        blocks = {f"k{i}": _random(12_000, i) for i in range(5)}  # 3 pages each: five fit in 16, a sixth not
        for key in blocks:
            store.write(key, blocks[key]).wait()
            assert os.stat(store.paths[0]).st_size <= cap
        before = store.paths[0].read_bytes()
        with pytest.raises(SwapSpaceError) as refused:
            store.write("k5", _random(12_000, 5))
        assert str(refused.value.strerror) == (
            "swap block 'k5' (12,000 bytes) needs this rank's swap files to grow to 73,728 bytes, past its share of "
            "nvme.max_bytes, 65,536 bytes (8,192 more): raise nvme.max_bytes, or keep more state in RAM "
            "(offload.*.tier)")
        assert store.paths[0].read_bytes() == before and "k5" not in store
        for key, data in blocks.items():
            out = torch.empty_like(data)
            store.read(key, out).wait()
            assert torch.equal(out, data)
        store.free("k2")
        store.write("k5", _random(12_000, 5)).wait()
        assert os.stat(store.paths[0]).st_size == cap


def test_a_cap_over_stripes_holds_the_files_together_and_refuses_a_reservation_past_it(tmp_path, aio):
    """Two stripes grow within one cap between them, to the cap's last page; a reservation past the cap
    is refused before any file is made."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    for directory in dirs:
        directory.mkdir()
    cap = 32 * 4096
    with SwapStore([str(d) for d in dirs], aio, cap=cap, reserve=5 * 4096) as store:
        for i in range(16):  # 2 pages each, one a stripe: 32 pages in all
            store.write(f"k{i}", _random(8192, i)).wait()
            assert sum(os.stat(p).st_size for p in store.paths) <= cap
        with pytest.raises(SwapSpaceError, match="needs this rank's swap files to grow to 139,264 bytes"):
            store.write("k16", _random(8192, 16))
    with pytest.raises(SwapSpaceError, match=r"a reservation of 135,168 bytes needs this rank's swap files to grow "
                                             r"to 135,168 bytes, past its share of nvme.max_bytes, 131,072 bytes"):
        SwapStore([str(d) for d in dirs], aio, cap=cap, reserve=cap + 4096)
    assert [p for d in dirs for p in (d / PRIVATE_DIR).iterdir() if p.name != ".lock"] == []


def test_the_engine_gives_each_rank_of_the_machine_an_even_share_of_max_bytes(tmp_path, monkeypatch):
    """nvme.max_bytes is the machine's: with four ranks here (torchrun's LOCAL_WORLD_SIZE) each store
    holds a quarter."""
    import zerooffload as zo
    from reference import make_model

    config = {"zero": {"stage": 3}, "offload": {"param": {"tier": "nvme"}}, "nvme": {"path": str(tmp_path),
                                                                                      "max_bytes": "64MiB"}}
    for ranks, share in ((None, 64 << 20), ("4", 16 << 20)):
        if ranks:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        with zo.initialize(make_model(), config) as engine:
            assert engine.tiers["nvme"].swap.cap == share
