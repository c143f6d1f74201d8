"""``zerooffload doctor`` on real swap directories: it invents none, leaves the tree as it found it, names
the filesystem it measured, and tells an unwritable directory (permission, read-only mount) from a
filesystem without O_DIRECT. CI runs as root, which no mode stops: the permission case drops to nobody
(65534) in a subprocess; the read-only case mounts a read-only tmpfs where ``mount`` is permitted."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aio_helpers import run_python
from cli_helpers import run_in_process
from zerooffload.cli import doctor
from zerooffload.io.backends import BACKENDS
from zerooffload.io.probe import native_aio
from zerooffload.io.swap_space import PRIVATE_DIR


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerooffload", "doctor", *args], capture_output=True, text=True,
                          timeout=120)


def _tree(root: Path) -> list[tuple[str, int, int]]:
    """Every path under ``root`` with its mode and size: what doctor must leave as it was."""
    return sorted((str(p.relative_to(root)), p.lstat().st_mode, p.lstat().st_size) for p in root.rglob("*"))


def _swap_line(stdout: str, directory: Path | str) -> str:
    line, = [line for line in stdout.splitlines() if f"swap path {directory} " in line]
    return line


def _findmnt(directory: Path) -> str:
    """``<fstype> at <mount point> (device <source>)`` as util-linux's findmnt sees it: an independent oracle."""
    if shutil.which("findmnt") is None:
        pytest.skip("findmnt not installed")
    out = subprocess.run(["findmnt", "-n", "-r", "-T", str(directory), "-o", "FSTYPE,TARGET,SOURCE"],
                         capture_output=True, text=True, check=True).stdout.split()
    return f"{out[0]} at {out[1]} (device {out[2]})"


def _make(root: Path, state: str) -> Path:
    """The swap directory ``root/nvme`` as it is before doctor runs: absent, empty, or already used by a store."""
    nvme = root / "nvme"
    if state != "missing":
        nvme.mkdir()
    if state == "used":
        (nvme / PRIVATE_DIR).mkdir(mode=0o700)
        (nvme / PRIVATE_DIR / ".lock").write_bytes(b"")
    return nvme


@pytest.mark.parametrize("state", ["missing", "empty", "used"])
def test_doctor_leaves_the_tree_as_it_found_it(tmp_path, state):
    nvme = _make(tmp_path, state)
    before = _tree(tmp_path)
    run = run_in_process("doctor", f"nvme.path={nvme}")
    assert _tree(tmp_path) == before, run.stdout
    line = _swap_line(run.stdout, nvme)
    if state == "missing":
        assert run.returncode == 1
        assert re.fullmatch(rf"FAIL\s+swap path {nvme}\s+does not exist: mount the disk meant to be there or create "
                            r"the directory, or set nvme\.path to an existing one", line), line
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        probed = nvme / PRIVATE_DIR if state == "used" else nvme  # where the swap store would write
        assert re.fullmatch(rf"\s*ok\s+swap path {nvme}\s+O_DIRECT write\+read works in {probed}; "
                            rf"{re.escape(_findmnt(nvme))}: \d+\.\d GB free", line), line


def test_doctor_names_the_offload_key_of_a_missing_directory(tmp_path):
    run = run_in_process("doctor", f"nvme.path={tmp_path}", f"offload.optimizer.path={tmp_path}/gone")
    assert run.returncode == 1 and not (tmp_path / "gone").exists()
    assert "or set offload.optimizer.path to an existing one" in _swap_line(run.stdout, f"{tmp_path}/gone")


_AS_NOBODY = """
import os, sys
import locale, secrets  # what runs after the drop imports lazily; nobody may not read root's interpreter
import zerooffload.cli.doctor, zerooffload.io.swapfile
from zerooffload.cli.main import main
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
sys.exit(main(["doctor", f"nvme.path={sys.argv[1]}"]))
"""


@pytest.mark.slow
def test_doctor_says_a_directory_it_may_not_write_is_not_writable():
    """A 0o555 directory, seen by nobody (root drops to it): permission denied, not an O_DIRECT problem."""
    top = Path(tempfile.mkdtemp(prefix="zo-doctor-"))
    try:
        top.chmod(0o755)  # nobody may pass through, not write into what lies below
        locked = top / "locked"
        locked.mkdir(mode=0o555)
        before = _tree(top)
        run = run_python(_AS_NOBODY, str(locked))
        assert _tree(top) == before
    finally:
        shutil.rmtree(top)
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.fullmatch(rf"FAIL\s+swap path {locked}\s+{locked} is not writable \(permission denied\): choose a "
                        r"writable nvme\.path", _swap_line(run.stdout, locked))


@contextlib.contextmanager
def _tmpfs(point: Path, options: str):
    """A 1 MiB tmpfs mounted at ``point`` (made here) with ``options``; skips where this process may not mount."""
    point.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{options},size=1m", "tmpfs", str(point)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_doctor_says_a_read_only_filesystem_is_not_writable(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro") as point:
        run = _doctor(f"nvme.path={point}")
        assert os.listdir(point) == []
    assert run.returncode == 1
    assert re.fullmatch(rf"FAIL\s+swap path {point}\s+{point} is not writable \(read-only filesystem\): choose a "
                        r"writable nvme\.path", _swap_line(run.stdout, point))


def test_doctor_names_the_mount_a_swap_directory_is_on(tmp_path):
    """The mount point has a space, which /proc/self/mountinfo writes as \\040. (A warn for its 1 MiB, or a
    FAIL where tmpfs has no O_DIRECT, before Linux 6.6: the line names the filesystem either way.)"""
    with _tmpfs(tmp_path / "fast disk", "rw") as point:
        (point / "swap").mkdir()
        run = _doctor(f"nvme.path={point}/swap")
    assert f"; tmpfs at {point} (device tmpfs): " in _swap_line(run.stdout, f"{point}/swap")


# ------------------------------------------------------------------------------------------------
# The native extensions and the one io_uring probe


def _line(stdout: str, name: str) -> str:
    line, = [line for line in stdout.splitlines() if re.match(rf"\s*(ok|warn|FAIL)\s+{name}\s", line)]
    return line


def test_doctor_and_auto_ask_one_io_uring_probe(monkeypatch):
    """doctor's io_uring line is the native probe's answer, the one the uring backend (auto) is refused by."""
    native = native_aio()[0]
    if native is None:
        pytest.skip("the native extension zerooffload._aio is not built")
    check = doctor._io_uring()
    works = native.uring_probe() == 0
    assert (check.status is doctor.Status.OK) is works is (BACKENDS["uring"].unavailable_reason() is None)
    assert "Python probe" not in check.detail
    monkeypatch.setattr(native, "uring_probe", lambda: errno.EPERM)  # as under kernel.io_uring_disabled = 2
    check, reason = doctor._io_uring(), BACKENDS["uring"].unavailable_reason()
    assert check.status is doctor.Status.WARN
    assert check.detail == f"{reason}; the pool backend (threads + pread/pwrite) is used instead"
    assert reason == ("io_uring does not work here: [Errno 1] Operation not permitted (disabled: see "
                      "/proc/sys/kernel/io_uring_disabled, or blocked by seccomp)")


_WITHOUT = """
import sys
sys.modules[f"zerooffload.{sys.argv[1]}"] = None   # as if that optional extension had not been built
from zerooffload.cli.main import main
sys.exit(main(["doctor", f"nvme.path={sys.argv[2]}"]))
"""


@pytest.mark.parametrize("missing", ["_aio", "_cpu_adam"])
def test_doctor_without_one_extension_still_has_the_other(tmp_path, missing):
    """Each extension is built and loaded on its own; without _aio, io_uring is the Python stand-in's
    answer, and the line says so."""
    if native_aio()[0] is None:
        pytest.skip("the native extension zerooffload._aio is not built")
    pytest.importorskip("zerooffload._cpu_adam")
    run = run_python(_WITHOUT, missing, str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    aio, adam, uring = (_line(run.stdout, name) for name in ("native I/O", "native Adam", "io_uring"))
    backend = _line(run.stdout, "aio backend")
    if missing == "_aio":
        assert re.match(r"warn\s+native I/O\s+the native extension zerooffload._aio is not built", aio), aio
        assert re.match(r"\s*ok\s+native Adam\s+zerooffload._cpu_adam loaded from _cpu_adam\.", adam), adam
        assert re.fullmatch(r"warn\s+io_uring\s+.* \(Python probe, ring setup only: zerooffload._aio is not "
                            r"built\); the uring backend needs it built", uring), uring
        assert backend.endswith("auto -> python (the slowest; build the native extension zerooffload._aio)"), backend
    else:
        assert re.match(r"\s*ok\s+native I/O\s+zerooffload._aio loaded from _aio\.", aio), aio
        assert re.match(r"warn\s+native Adam\s+the native extension zerooffload._cpu_adam is not built", adam), adam
        assert "Python probe" not in uring and doctor._io_uring().detail in uring
        assert backend.endswith("auto -> uring" if native_aio()[0].uring_supported() else "auto -> pool"), backend
