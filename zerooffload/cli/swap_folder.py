"""The swap folder of a plain ``zerooffload train``: a temporary directory on ``--out``'s disk, made for one
run and removed with it (train_config's [Note: the default layout]).

[Note: the default run's swap folder]
- *Where.* In ``--out`` (``tempfile.mkdtemp``: a fresh random name made by ``mkdir``, mode 0700; a planted
  link cannot stand in for it, as ``mkdir`` never follows one), so on ``--out``'s disk: not ``/tmp``, often
  a tmpfs, which is RAM and may refuse O_DIRECT. Its path is printed when it is made and when it goes.
- *O_DIRECT first.* 4 KiB are written through O_DIRECT before anything else runs; a filesystem that
  refuses it ends the run in one line naming ``--out`` and what to pass instead. (io_uring needs
  nothing here: ``aio.backend = auto`` falls back to the thread pool where the kernel lacks it.)
- *Removed however the run ends.* At the end and on an error (a ``finally``); on Ctrl-C (during
  training ``StopOnSignal`` ends the run after the step, which then ends normally; before and after,
  Python's KeyboardInterrupt unwinds through the ``finally``); on SIGTERM (during training
  ``StopOnSignal`` again; before and after, ``_SigtermUnwinds`` turns it into ``SystemExit(143)``, whose
  unwinding runs the ``finally``, where the signal's default would end the process on the spot).
- *Killed outright* (SIGKILL, the OOM killer) nothing runs, so the folder holds ``.owner``, a file
  ``flock``-ed for the run's life: the kernel drops the lock when the process dies, and the next run in
  that ``--out`` removes every ``swap-*`` folder whose ``.owner`` nobody holds (the lock is taken before
  the file gets its name, so a folder being made is never taken for a dead run's; a folder without
  ``.owner`` is left alone). ``--out`` itself and the directories above it may be links; nothing the
  folder's removal walks is followed (``shutil.rmtree`` works on file descriptors and never follows a link).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from .run_dir import RunDirError

__all__ = ["PREFIX", "swap_folder"]

PREFIX = "swap-"
OWNER = ".owner"
_DIRECT_PROBE = ".o_direct"


@contextlib.contextmanager
def swap_folder(out: Path) -> Iterator[Path]:
    """A fresh swap folder in ``out`` for the ``with`` block, removed on leaving it (see the note);
    SIGTERM unwinds the block for as long as it lasts."""
    with _SigtermUnwinds():
        _remove_dead(out)
        folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=os.path.abspath(out)))  # named whole in the output
        owner = None
        try:
            owner = _own(folder)
            _check_direct(folder, out)
            yield folder
        finally:
            _remove(folder)
            if owner is not None:
                os.close(owner)  # after the removal: until then the folder is a live run's


def _own(folder: Path) -> int:
    """``folder/.owner``, locked before it takes its name (see the note); its descriptor, held for the run."""
    made = folder / (OWNER + ".new")
    fd = os.open(made, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(made, folder / OWNER)
    return fd


def _remove_dead(out: Path) -> None:
    """Remove the swap folders in ``out`` whose run died without removing them (their ``.owner`` is free)."""
    for entry in os.scandir(out):
        if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(Path(entry.path, OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # no .owner: a folder being made, or not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live run's
        else:
            _remove(Path(entry.path))
            print(f"zerooffload: removed {entry.path}, the swap folder of an earlier run that was killed",
                  file=sys.stderr)
        finally:
            os.close(fd)


def _check_direct(folder: Path, out: Path) -> None:
    """Write 4 KiB through O_DIRECT in ``folder``; one line naming ``out`` where its filesystem refuses."""
    block = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    path = folder / _DIRECT_PROBE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [block], 0)
        finally:
            os.close(fd)
            path.unlink()
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        raise RunDirError(errno.EINVAL, f"--out {out} is on a filesystem without O_DIRECT, where a plain train keeps "
                                        "its swap folder: pass an --out on a disk (ext4, xfs), or lay the run out "
                                        "yourself (nvme.path=DIR on such a disk, or zero.stage=2 to keep every "
                                        "state in memory)") from None


def _remove(folder: Path) -> None:
    """``folder`` and all in it; a file that cannot be removed is named in a warning, and the rest goes."""
    def left(function, path: str, error: BaseException) -> None:
        if not isinstance(error, FileNotFoundError):
            print(f"zerooffload: warning: could not remove {path} ({error}); remove it by hand", file=sys.stderr)

    if sys.version_info >= (3, 12):
        shutil.rmtree(folder, onexc=left)
    else:  # onerror, deprecated from 3.12 on, passes sys.exc_info()
        shutil.rmtree(folder, onerror=lambda function, path, info: left(function, path, info[1]))


class _SigtermUnwinds:
    """SIGTERM raises ``SystemExit(143)`` in the main thread for the block, after one line, so that the
    ``finally`` clauses below run (the note); a handler installed over this one for a while
    (``StopOnSignal``, the swap store's cleanup, which calls this one) decides while it is there.
    Once the block is left, a signal that still reaches this handler through such a chain gets what
    the handler it replaced would have done."""

    def __init__(self) -> None:
        self._previous: object = signal.SIG_DFL
        self._active = False

    def __enter__(self) -> "_SigtermUnwinds":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            return
        self._active = False
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)

    def _handle(self, signum: int, frame: object) -> None:
        if self._active:
            os.write(2, b"zerooffload: stopped by SIGTERM outside a training step; its swap folder is removed\n")
            raise SystemExit(128 + signum)
        if callable(self._previous):
            self._previous(signum, frame)
        elif self._previous != signal.SIG_IGN:  # the default: end the process as the signal would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
