"""The output directory of ``zerooffload train``: one run owns it, and it is known to be writable first.

[Note: owning --out]
- *One run at a time.* Rank 0 holds an exclusive ``flock`` on ``OUT/.lock`` for the run's life and
  writes its PID and host there. The kernel drops the lock when the process ends, however it ends (a
  SIGKILL, the OOM killer), so a killed run never blocks its own ``--resume``; a second ``train`` on an
  ``--out`` in use is refused at once, naming the holder.
- *A fresh run does not take over an old one.* Without ``--resume``, an ``--out`` whose ``checkpoints/``
  holds a checkpoint is refused, and nothing of the old run changes: continue it with ``--resume``, or
  pass ``--overwrite``, which removes its checkpoints and ``summary.json`` (under the lock) first.
- *Every path is checked before the model is built.* ``--out``, ``checkpoints/`` (when the run saves),
  ``summary.json`` and ``--trace`` are each written to (a probe file, or an open for append)
  and refused in one line if they cannot be: a read-only ``--out`` is found in a second, not after the
  run; an unwritable ``--trace`` before step 1, not at step 3.
- *No links inside.* ``--out`` and the directories above it may be links (a disk mounted elsewhere),
  but the names the run creates, locks or removes in it are not followed: ``.lock`` is opened with
  ``O_NOFOLLOW`` (and must be a plain file with one name: it is truncated), and a link at
  ``checkpoints``, ``summary.json`` or among the checkpoints' own names (``latest``, step tags,
  ``.partial``) is refused in one line before the model is built (io.files' [Note: no links followed]):
  in a shared ``--out`` another user could plant ``.lock -> ~/.bashrc`` for the run to truncate.
Ranks other than 0 only check their paths (a job's ranks share ``--out``); the lock and the rules about
old checkpoints are rank 0's, and torchrun stops the other ranks when rank 0 exits with the refusal.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import socket
import stat
from pathlib import Path
from typing import Iterator

from ..checkpoint import LATEST, read_latest, refuse_links
from ..config import ConfigError
from ..io.files import open_nofollow, refuse_link
from .run_checkpoints import STEP_TAG

__all__ = ["RunDirError", "owned_out", "write_summary"]

LOCK = ".lock"


class RunDirError(OSError):
    """``--out`` cannot be used by this run: in use, holding another run, or not writable (one line)."""


@contextlib.contextmanager
def owned_out(args: argparse.Namespace, rank: int) -> Iterator[Path]:
    """``--out``, checked and (on rank 0) locked for the ``with`` block (see [Note: owning --out])."""
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts afresh and --resume continues: pass one of them")
    out = Path(args.out)
    _writable_dir(out, "--out")
    lock = _lock(out) if rank == 0 else None
    try:
        checkpoints = out / "checkpoints"
        for path in (checkpoints, out / "summary.json"):
            refuse_link(path)
        if checkpoints.is_dir():
            refuse_links(checkpoints, STEP_TAG)
        if rank == 0 and not args.resume:
            _fresh(out, checkpoints, args.overwrite)
        if args.save_every:  # a resume finds its checkpoints itself, and says so when there are none
            _writable_dir(checkpoints, "--out's checkpoints directory")
        _writable_file(out / "summary.json", "summary.json")
        if args.trace:
            _writable_file(Path(args.trace), "--trace")
        yield out
    finally:
        if lock is not None:
            os.close(lock)  # closing the descriptor releases the flock


def write_summary(out: Path, text: str) -> None:
    """``OUT/summary.json``, opened without following a link: one planted there while the run trained
    (the start checked it) is refused in one line, its target left as it was."""
    with open(open_nofollow(out / "summary.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "w") as f:
        f.write(text)


def _lock(out: Path) -> int:
    """An exclusive flock on ``out/.lock`` with this process's PID and host written in it; refused in
    one line naming the holder; a link there is refused, and so is a file it would truncate that is not
    a plain file of its own (a hard link, a device)."""
    fd = open_nofollow(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise RunDirError(errno.EEXIST, f"{out / LOCK} is not a plain file of its own ({info.st_nlink} names, mode "
                                        f"{stat.filemode(info.st_mode)}): zerooffload truncates it; remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that wrote no PID"
        os.close(fd)
        raise RunDirError(errno.EBUSY, f"--out {out} is in use by another zerooffload train ({holder}); wait for "
                                       "it to finish, or pass another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def _fresh(out: Path, checkpoints: Path, overwrite: bool) -> None:
    """Refuse to start afresh over an earlier run's checkpoints, or with ``--overwrite`` remove them."""
    found = sorted(p.name for p in checkpoints.iterdir() if STEP_TAG.fullmatch(p.name) or p.name == LATEST) \
        if checkpoints.is_dir() else []
    if not found:
        return
    if not overwrite:
        latest = read_latest(checkpoints) or found[-1]
        raise RunDirError(errno.EEXIST, f"--out {out} holds the checkpoints of an earlier run (newest: {latest}); "
                                        "continue it with --resume, or pass --overwrite to remove them and start "
                                        "afresh, or pass another --out")
    shutil.rmtree(checkpoints)
    (out / "summary.json").unlink(missing_ok=True)
    print(f"zerooffload: --overwrite: removed the earlier run's checkpoints in {checkpoints}")


def _writable_dir(path: Path, what: str) -> None:
    """Create ``path`` if need be and write a probe file in it; one line naming ``what`` if that fails."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
        os.close(open_nofollow(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))  # a new file, never one found there
        probe.unlink()
    except OSError as error:
        raise RunDirError(error.errno, f"{what} {path} cannot be written ({error.strerror}); pass a directory you "
                                       "can write to") from None


def _writable_file(path: Path, what: str) -> None:
    """Open ``path`` for append (created if missing, and then removed again); one line if that fails."""
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as error:
        raise RunDirError(error.errno, f"{what} {path} cannot be written ({error.strerror}); pass a path you can "
                                       "write to") from None
    if not existed:
        path.unlink()
