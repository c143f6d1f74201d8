"""The files of a checkpoint directory: tag directories published atomically, ``latest``, manifests
with a digest, checksummed data files, and recovery from a save that was killed at any point.

[Note: publishing a tag]
A save writes everything into ``<tag>.partial/`` — rank files, the manifest, then
``manifest.sha256`` (the manifest's digest) — fsyncs it all, and only then publishes it:
1. ``<tag>`` already exists (the same tag saved again, e.g. a fixed ``"last"``): it is renamed
   to ``<tag>.replaced``; 2. ``<tag>.partial`` is renamed to ``<tag>``; 3. ``latest`` is rewritten
   (a temporary file, fsync, rename); 4. ``<tag>.replaced`` is removed. Directory fsyncs follow
   every rename. A kill between 1 and 2 leaves ``<tag>`` missing and the previous copy complete in
   ``<tag>.replaced``: the loader reads it there, and the next save moves it back before anything
   else (``recover``). So whatever the kill point, ``latest`` names a loadable checkpoint, the
   old one or the new one. ``<tag>.partial`` directories of saves that failed or were killed are
   removed by the next save into the directory.

[Note: integrity]
Every data file's size and CRC32C are in the manifest (``io.checksum``'s [Note: CRC32C digests]: the
swap's digest, so one CRC runs through swap files and checkpoints; version 1 checkpoints hold zlib's
CRC-32 instead, under the key ``crc32``, and still load: ``FILE_DIGESTS``); the manifest's SHA-256 is in
``manifest.sha256`` beside it, so a flipped bit that keeps valid JSON (a learning rate, a step
count, the client state) is caught too. A checkpoint of this format without the digest file (written
before it existed) still loads, with a warning. Anything malformed — unreadable, truncated, not
JSON, missing keys — is a ``CheckpointError`` that names the file.

[Note: links in a checkpoint directory]
The directory given may be a link (a disk mounted elsewhere); the names a save creates, replaces or
removes in it — ``latest`` and its temporary, ``<tag>``, ``<tag>.partial``, ``<tag>.replaced``, the
tags a prune removes — are never followed: a link there is refused before the save writes anything
(``refuse_links``), and each is checked again where it is renamed or removed (io.files' [Note: no
links followed]). ``latest`` is not read through a link either. A tag that is a link may still be
loaded by name (reading follows it, as a user's archived checkpoint linked in would need).
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import zlib
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from ..block_stream import BLOCK_WRITE, CHECKPOINT_WRITES, InFlight
from ..errors import CheckpointError
from ..io import AsyncIO, aligned_empty, open_file
from ..io.checksum import crc32c, crc32c_combine
from ..io.files import open_nofollow, refuse_link
from ..tiers import Block
from ..trace import profiled

__all__ = ["CheckpointError", "ChecksummedWriter", "StagingRing", "MANIFEST", "LATEST", "begin_partial", "publish",
           "recover", "resolve_tag", "load_manifest_json", "write_manifest", "verify_file", "file_record", "fsync_dir",
           "out_of_space", "read_latest", "refuse_links", "remove_tree", "write_text_atomically"]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DIGEST = "manifest.sha256"
DIGEST_KEY = "crc32c"
"""The key of a data file's digest in a manifest's record (version 2 on)."""
FILE_DIGESTS: dict[str, tuple[str, Callable[[Any, int], int]]] = {"crc32c": ("CRC32C", crc32c),
                                                                   "crc32": ("CRC-32", zlib.crc32)}
"""A record's digest by its key, with its name in messages: CRC32C, or zlib's CRC-32 (version 1)."""
LATEST = "latest"
PARTIAL = ".partial"
REPLACED = ".replaced"


# ---------------------------------------------------------------------------------------------- fsync
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path``, fsynced; a link at ``path`` is refused, never truncated."""
    with open(open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomically(path: Path, text: str) -> None:
    """``text`` as ``path``, replaced whole (a temporary, fsynced, renamed; the directory fsynced); a link
    at ``path`` is refused."""
    refuse_link(path)
    temporary = path.with_name(path.name + ".tmp")
    _write_durably(temporary, (text + "\n").encode())
    os.replace(temporary, path)
    fsync_dir(path.parent)


# ---------------------------------------------------------------------------------------------- data files
ALIGN = 4096
"""O_DIRECT's alignment of buffers, offsets and lengths."""


class StagingRing:
    """Host memory a save's state is copied into before its writes land, used as a ring: pieces are
    taken in order and given back in the order their writes finish (oldest first)."""

    def __init__(self, capacity: int):
        self.capacity = -(-capacity // ALIGN) * ALIGN
        self.buffer = aligned_empty(self.capacity)
        self.piece = max(ALIGN, min(16 << 20, self.capacity // 4) // ALIGN * ALIGN)
        """Most bytes one write stages: a quarter of the ring at most, so writes overlap; few submissions."""
        self._spans: deque[tuple[int, int]] = deque()

    def take(self, nbytes: int, wait_oldest: Callable[[], object]) -> torch.Tensor:
        """``nbytes`` (at most ``piece``) of the ring, after ``wait_oldest`` gave back as many pieces as it
        took to make room."""
        length = -(-nbytes // ALIGN) * ALIGN
        start = self._room(length)
        while start is None:
            wait_oldest()
            start = self._room(length)
        self._spans.append((start, start + length))
        return self.buffer[start:start + nbytes]

    def release(self) -> None:
        """The oldest piece's write finished: its bytes are free."""
        self._spans.popleft()

    def _room(self, length: int) -> int | None:
        if not self._spans:
            return 0
        tail, head = self._spans[0][0], self._spans[-1][1]
        if self._spans[-1][0] >= tail:  # in use: [tail, head)
            if head + length <= self.capacity:
                return head
            return 0 if length <= tail else None
        return head if head + length <= tail else None  # in use: [tail, capacity) and [0, head)


class ChecksummedWriter:
    """A file written with O_DIRECT through the async-I/O engine, ``writes_in_flight`` transfers at a
    time (``block_stream.InFlight``: [Note: block pipelines]), its CRC32C computed from the bytes as they
    go out.

    Each write is copied into its own aligned buffer first (or a piece of a ``ring``), so the caller's
    tensor (often a stream's host buffer about to be reused) is free at once and reading the next block
    overlaps this write. A known ``size`` is preallocated: ext4 serializes writes that extend a file
    (half speed here). The file is cut into *ranges* in order, each a write or a range ``reserve``d for
    later (a write ``at`` it, or a copy in the kernel, ``copy_in``); each range keeps its own CRC, and
    the file's joins them in file order (``crc32c_combine``), whatever order they were filled in.
    """

    def __init__(self, path: Path, aio: AsyncIO, size: int = 0, writes_in_flight: int = CHECKPOINT_WRITES,
                 ring: StagingRing | None = None):
        self.path = path
        self.aio = aio
        self.ring = ring
        """Where staged bytes go instead of a buffer of their own: a non-blocking save's (async_save's note)."""
        self._writes = InFlight(1 << 30 if ring else writes_in_flight)  # each with its staging, kept until it finished
        self.file = open_file(path, "w", direct=aio.config.direct, follow=False)
        self.bytes = 0
        self._ranges: list[list[int]] = []
        """[CRC32C, bytes] of each range, in file order."""
        if size:
            try:
                os.posix_fallocate(self.file.fd, 0, size)
            except OSError as error:
                self.file.close()
                raise OSError(error.errno, f"claiming {size:,} bytes: {error.strerror}", str(path)) from error

    @property
    def writes_in_flight(self) -> int:
        return self._writes.depth

    @property
    def crc(self) -> int:
        """The CRC32C of the file's ranges so far, once their writes landed."""
        crc = 0
        for value, length in self._ranges:
            crc = crc32c_combine(crc, value, length)
        return crc

    def reserve(self, nbytes: int) -> tuple[int, list[int]]:
        """The next ``nbytes`` of the file kept for later: their offset and range (to write ``at``)."""
        self._ranges.append(span := [0, nbytes])
        self.bytes += nbytes
        return self.bytes - nbytes, span

    def write(self, tensor: torch.Tensor, nbytes: int = 0, at: tuple[int, list[int]] | None = None) -> None:
        """``tensor``'s bytes next in the file (or in the range ``at`` names: ``reserve``); with ``nbytes``,
        zeros after them up to that many (a segment padded to its size), filled in the staging buffer, not
        in a padded copy first. Into a ``ring``, in pieces of at most ``ring.piece`` bytes, each waiting for
        room there (the oldest writes to land)."""
        data = tensor.detach().reshape(-1).view(torch.uint8)
        total = max(nbytes, data.numel())
        offset, span = at or self.reserve(total)
        step = self.ring.piece if self.ring else total
        for start in range(0, total, step or 1):
            length = min(step, total - start)
            if self.ring:
                staging = self.ring.take(length, self._writes.wait_oldest)
            else:
                self._writes.make_room()
                staging = aligned_empty(length)
            filled = max(0, min(length, data.numel() - start))
            staging[:filled].copy_(data[start:start + filled])  # one copy, from wherever it lives
            staging[filled:].zero_()
            if not self.ring:
                span[0] = crc32c(staging, span[0])
            with profiled(BLOCK_WRITE):
                handle = self.aio.write(self.file, staging, offset + start)
            self._writes.add(handle, staging, (lambda piece=staging: self._landed(piece, span)) if self.ring else None)

    def write_from(self, data: torch.Tensor, at: tuple[int, list[int]]) -> None:
        """``data`` (host memory) into the range ``at`` names, written from where it lies, no copy made: it
        must not change until ``landed``. Its CRC32C is taken here, from those bytes."""
        offset, span = at
        view = data.detach().reshape(-1).view(torch.uint8)
        span[0] = crc32c(view, span[0])
        with profiled(BLOCK_WRITE):
            handle = self.aio.write(self.file, view, offset)
        self._writes.add(handle, view)

    def landed(self) -> None:
        """Wait for every write started so far (the first failure raises once all landed)."""
        self._writes.drain()

    def copy_in(self, block: Block, ranges: list[tuple[int, list[int]]]) -> None:
        """Each segment of ``block``'s stored bytes into its range of ``ranges`` (``reserve``), copied in the
        kernel (``Block.copy_out``), each range's CRC32C joined from the digests they were written with."""
        digests = block.copy_out(self.file.fd, [offset for offset, _ in ranges])
        if digests is None:
            raise TypeError(f"{self.path}: a block held in memory has nothing to copy in the kernel: write it")
        for (offset, span), chunks in zip(ranges, digests, strict=True):
            if sum(length for _, length in chunks) != span[1]:
                raise ValueError(f"{self.path}: a segment of {sum(n for _, n in chunks)} bytes copied into a range "
                                 f"of {span[1]} bytes at {offset}")
            for crc, length in chunks:
                span[0] = crc32c_combine(span[0], crc, length)

    def _landed(self, piece: torch.Tensor, span: list[int]) -> None:
        """A ring piece's write ended: its CRC taken into its range's (a range's pieces end oldest first, so
        in order, and off the thread that staged them when a save's own thread waits for them) and its
        room given back."""
        try:
            span[0] = crc32c(piece, span[0])
        finally:
            self.ring.release()

    def close(self) -> dict:
        """Wait for every write (the first failure raises once all landed), fsync and close; the
        file's record for the manifest."""
        try:
            self._writes.drain()
            os.fsync(self.file.fd)
        finally:
            self._writes.abandon()  # interrupted while draining: let the others land before the file closes
            self.file.close()
        return {"bytes": self.bytes, DIGEST_KEY: self.crc}


def file_record(path: Path) -> dict:
    """Size and CRC32C of a file written by other means (fsynced here)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, DIGEST_KEY: _file_digest(path, crc32c)}


def _file_digest(path: Path, digest: Callable[[Any, int], int]) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(64 << 20):
            value = digest(chunk, value)
    return value


def verify_file(path: Path, expected: dict) -> None:
    """``path`` against its manifest record: its size, then its CRC32C (zlib's CRC-32 in a version 1
    checkpoint's record)."""
    if not path.exists():
        raise CheckpointError(f"{path}: missing (the manifest lists it); the checkpoint is incomplete")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes but the manifest says {expected['bytes']}: truncated or "
                              "overwritten")
    key = next((key for key in FILE_DIGESTS if key in expected), None)
    if key is None:
        raise CheckpointError(f"{path}: the manifest's record of it has no digest ({' or '.join(FILE_DIGESTS)})")
    name, digest = FILE_DIGESTS[key]
    value = _file_digest(path, digest)
    if value != expected[key]:
        raise CheckpointError(f"{path}: {name} {value:#010x} but the manifest says {expected[key]:#010x}: "
                              "the file is corrupt")


def out_of_space(error: OSError, path: Path, needed: int) -> CheckpointError | None:
    """A clear error for a save that ran out of room (ENOSPC, EDQUOT) or met a file size limit (EFBIG),
    naming the file and offset where the write failed; else None."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    where = str(error) if type(error).__str__ is not OSError.__str__ else (  # AioError: file and offset
        f"{error.filename}: {error.strerror}" if error.filename else error.strerror)
    if error.errno == errno.EFBIG:
        return CheckpointError(f"{path}: cannot save the checkpoint ({where}): a file size limit (ulimit -f) is "
                               f"below the {needed:,} bytes this rank writes; the previous checkpoint is unchanged. "
                               "Raise the limit")
    try:
        free = f"{shutil.disk_usage(path).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return CheckpointError(f"{path}: no room to save the checkpoint ({where}): this rank needs {needed:,} bytes there "
                           f"and the filesystem has {free}; the previous checkpoint is unchanged. Free space or save "
                           "to another directory")


# ---------------------------------------------------------------------------------------------- manifests
def write_manifest(directory: Path, manifest: dict) -> None:
    """``manifest.json`` and its digest, both fsynced (the directory is not published yet)."""
    data = json.dumps(manifest, indent=1).encode()
    _write_durably(directory / MANIFEST, data)
    _write_durably(directory / DIGEST, f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n".encode())


def load_manifest_json(directory: Path) -> dict:
    """The manifest of a published tag directory, checked against its digest."""
    path = directory / MANIFEST
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror})") from None
    digest_path = directory / DIGEST
    if digest_path.exists():
        expected = digest_path.read_text(errors="replace").split()[:1]
        actual = hashlib.sha256(data).hexdigest()
        if expected != [actual]:
            raise CheckpointError(f"{path}: SHA-256 {actual} but {digest_path.name} says "
                                  f"{expected[0] if expected else 'nothing'}: the manifest is corrupt")
    else:
        logger.warning("%s: no %s (a checkpoint from before manifests had digests): its manifest is not verified",
                       directory, DIGEST)
    try:
        manifest = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not a valid manifest ({error})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: not a valid manifest (a JSON {type(manifest).__name__}, not an object)")
    return manifest


# ---------------------------------------------------------------------------------------------- tags
def resolve_tag(directory: Path, tag: str | None) -> Path:
    """The published directory of ``tag`` (default: the one ``latest`` names), or of its copy set
    aside by a save killed mid-publication (see [Note: publishing a tag])."""
    if tag is None:
        tag = read_latest(directory)
        if tag is None:
            raise CheckpointError(f"{directory}: no '{LATEST}' file, so no complete checkpoint to load; pass a tag")
    path = directory / tag
    if not path.exists() and (directory / (tag + REPLACED) / MANIFEST).exists():
        logger.warning("%s is missing but %s%s is complete (a save was killed while replacing it): loading that",
                       path, tag, REPLACED)
        path = directory / (tag + REPLACED)
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{path}: no {MANIFEST}: not a complete checkpoint (a save that did not finish "
                              f"leaves only a {PARTIAL} directory)")
    return path


def read_latest(directory: Path) -> str | None:
    """The tag ``latest`` names, None without one; a link there is refused, not read."""
    latest = directory / LATEST
    refuse_link(latest)
    try:
        return latest.read_text(errors="replace").strip()
    except FileNotFoundError:
        return None


def refuse_links(directory: Path, tags: re.Pattern[str] | None = None) -> None:
    """Refuse (``LinkRefused``) a symbolic link among the names a save or a prune creates, replaces or
    removes in ``directory``: ``latest`` and its temporary, ``*.partial``, ``*.replaced``, and the tags
    ``tags`` matches (see [Note: links in a checkpoint directory])."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_symlink() and (entry.name in (LATEST, LATEST + ".tmp") or entry.name.endswith(
                    (PARTIAL, REPLACED)) or (tags is not None and tags.fullmatch(entry.name))):
                refuse_link(entry.path)


def recover(directory: Path) -> None:
    """Undo what killed saves left: a tag set aside but never replaced moves back; leftover
    ``.partial`` directories and ``.replaced`` copies of tags that were replaced go. A link among
    them is refused first (``refuse_links``)."""
    refuse_links(directory)
    for replaced in directory.glob("*" + REPLACED):
        final = replaced.with_name(replaced.name.removesuffix(REPLACED))
        refuse_link(final)  # else the copy would be removed below, with the link left as the tag
        if not final.exists():
            logger.warning("%s is missing (a save was killed while replacing it): restoring it from %s", final,
                           replaced.name)
            os.replace(replaced, final)
            fsync_dir(directory)
    for leftover in [*directory.glob("*" + PARTIAL), *directory.glob("*" + REPLACED)]:
        if leftover.is_dir():
            logger.info("removing %s, left by a save that did not finish", leftover)
            shutil.rmtree(leftover)


def begin_partial(directory: Path, tag: str) -> Path:
    """A fresh ``<tag>.partial`` directory to write into (after ``recover``); refused before anything
    is written when ``<tag>`` or another name the save will replace is a link."""
    directory.mkdir(parents=True, exist_ok=True)
    refuse_link(directory / tag)
    recover(directory)
    partial = directory / (tag + PARTIAL)
    partial.mkdir()
    return partial


def publish(partial: Path, tag: str) -> Path:
    """Publish a complete, fsynced ``<tag>.partial`` as ``<tag>`` and point ``latest`` at it."""
    directory = partial.parent
    final, replaced = directory / tag, directory / (tag + REPLACED)
    fsync_dir(partial)
    refuse_link(final)  # checked by begin_partial too, but the save took a while
    set_aside = final.exists()
    if set_aside:  # not deleted until the new one is in place (the loader finds it there)
        os.replace(final, replaced)
        fsync_dir(directory)
    os.replace(partial, final)
    fsync_dir(directory)
    write_text_atomically(directory / LATEST, tag)
    if set_aside:  # only what was set aside here, never a name someone else put there meanwhile
        shutil.rmtree(replaced)
    return final


def remove_tree(path: Path) -> None:
    """Rename ``path`` to ``<path>.partial``, then remove it: a removal cut short leaves a name no
    loader takes for a checkpoint (and the next save's recovery removes), never one that looks complete.
    A link at ``path`` is refused: neither it nor what it points to is removed."""
    refuse_link(path)
    doomed = path.with_name(path.name + PARTIAL)
    os.replace(path, doomed)
    shutil.rmtree(doomed)
