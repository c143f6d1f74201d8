"""Saving a checkpoint (sharded's [Note: checkpoint layout]): the state taken at a step boundary
(``begin_save``: the tag's ``.partial`` directory, this rank's data files started, the manifest's values
gathered), then finished (``BegunSave.finish``: the writes waited for and fsynced, every rank's file
records gathered, the manifest written and the tag published). A blocking save does both at once; a
non-blocking one finishes in the background (async_save's [Note: saving in the background]).
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..block_stream import checkpoint_depth, wait_each
from ..comm import all_gather_object, barrier
from ..io import AsyncIO
from ..tiers import Block
from ..training_state import Trainable
from .files import (
    CheckpointError,
    ChecksummedWriter,
    StagingRing,
    begin_partial,
    file_record,
    out_of_space,
    publish,
    write_manifest,
)
from .layout import FORMAT, VERSION, rank_file, shard_segments

if TYPE_CHECKING:
    from ..comm import Comm
    from ..optim.state import UnitOptimizerState
    from ..zero.partition import FlatUnit
    from ..zero.step_updates import StepUpdates

__all__ = ["BegunSave", "RankWriters", "begin_save", "default_tag", "persistent_buffers", "rank_file_bytes",
           "save_checkpoint"]


def default_tag(step: int) -> str:
    return f"step{step:08d}"


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``module.state_dict()`` holds, by name: non-persistent ones are not saved."""
    saved = module.state_dict(keep_vars=True)
    return [(name, buffer) for name, buffer in module.named_buffers() if name in saved]


# ---------------------------------------------------------------------------------------------- layout
def _unit_record(unit: "FlatUnit") -> dict:
    layout = unit.layout
    return {"name": layout.name, "shards": layout.shards, "shard_numel": layout.shard_numel,
            "slots": [{"names": list(s.names), "offset": s.offset, "numel": s.numel, "shape": list(s.shape),
                       "trainable": s.trainable} for s in layout.slots]}


# ---------------------------------------------------------------------------------------------- save
def save_checkpoint(engine: Trainable, directory: str | os.PathLike, tag: str | None = None,
                    client_state: dict | None = None, updates: "StepUpdates | None" = None) -> Path:
    """Write ``engine``'s full training state (see the note); collective: every rank calls it.
    ``updates``: the step's, joined before anything is read (``begin_save``)."""
    return begin_save(engine, directory, tag, client_state, updates=updates).finish(engine.comm)


class BegunSave:
    """A save whose state is taken (``begin_save``): its data files written or being written, the rest
    of its manifest known. ``finish`` completes it: waits for the writes, fsyncs, gathers the files'
    records and publishes the tag (async_save's [Note: saving in the background])."""

    def __init__(self, partial: Path, tag: str, writers: "RankWriters", manifest: dict | None):
        self.partial, self.tag, self.writers, self.manifest = partial, tag, writers, manifest
        self.path = partial.parent / tag

    def finish(self, comm: "Comm") -> Path:
        """Collective over ``comm`` (the engine's, or a group of the saves' own): every rank's files, or
        its error; a rank that failed raises its own error, the others one naming it; nothing is
        published unless every rank's files are durable."""
        try:
            files, failure = self.writers.close(), None
        except (OSError, CheckpointError) as error:
            files, failure = {}, error
        everyone = all_gather_object(comm, (files, None if failure is None else str(failure), self.writers.steps))
        if failure is not None:
            raise failure
        failed = [(rank, message) for rank, (_, message, _) in enumerate(everyone) if message is not None]
        if failed:
            raise CheckpointError(f"{self.partial}: rank {failed[0][0]} could not write its files ({failed[0][1]}); "
                                  "nothing was published, the previous checkpoint is unchanged")
        if comm.rank == 0:
            self.manifest["files"] = {name: f for per_rank, _, _ in everyone for name, f in per_rank.items()}
            self.manifest["steps"] = {name: step for _, _, steps in everyone for name, step in steps.items()}
            write_manifest(self.partial, self.manifest)
            publish(self.partial, self.tag)
        barrier(comm)
        return self.path


def begin_save(engine: Trainable, directory: str | os.PathLike, tag: str | None = None,
               client_state: dict | None = None, ring: StagingRing | None = None,
               updates: "StepUpdates | None" = None) -> BegunSave:
    """Take ``engine``'s state at this step boundary: check the tag, make ``<tag>.partial``, start
    this rank's data files' writes (staged in ``ring`` when given, which bounds what is left in flight;
    else written through a few buffers before this returns) and take the manifest's values; collective
    over the engine's group (on the calling thread). ``updates``: the step's, which may still run: joined
    here, or waited for before the state is read where every part is written from where it lies
    (async_save's note)."""
    directory = Path(directory)
    tag = tag or default_tag(engine.window.global_steps)
    _check_tag(tag)
    if not _jsonable(client_state):
        raise TypeError(f"client_state must be JSON-serializable (it goes into the manifest): {client_state!r:.200}")
    rank = engine.comm.rank
    partial = begin_partial(directory, tag) if rank == 0 else directory / f"{tag}.partial"
    barrier(engine.comm)
    writers = _write_rank_files(engine, partial, ring, updates)
    manifest = _manifest(engine, tag, client_state) if rank == 0 else None
    return BegunSave(partial, tag, writers, manifest)


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or tag.startswith(".") or tag.endswith((".partial", ".replaced", ".tmp")) \
            or tag == "latest":
        raise ValueError(f"checkpoint tag {tag!r}: expected a plain directory name, not 'latest', without '/' "
                         "and not ending in .partial, .replaced or .tmp")


class RankWriters:
    """This rank's data files being written into ``partial``. ``stage`` (a save's staging thread, else
    ``close``) writes the parts left for it (``deferred``: views of resident state, which stays as it is
    until ``staged`` is set); ``close`` writes the RNG
    states, waits for every write, fsyncs and gives the records (name -> size and CRC32C). Out of room: a
    ``CheckpointError`` naming the directory and the bytes, and this rank's files removed (the previous
    checkpoint stays). ``steps``: this rank's parameters' optimizer steps (``local_steps``), read with the
    deferred parts. Where every part is written from where it lies, ``stage`` first waits for the step's
    updates to end (``after_updates``)."""

    def __init__(self, partial: Path, rank: int, size: int, aio: AsyncIO, engine: Trainable):
        self.partial, self.rank, self.size, self.aio = partial, rank, size, aio
        self._engine = engine
        self.steps: dict[str, float] = {}
        self.writers: list[ChecksummedWriter] = []
        self.files: dict[str, dict] = {}
        self.deferred: list[tuple[torch.Tensor | Block, int, Any]] = []
        """(part, bytes, range) of the rank file left for ``close``: a part of resident state to copy into
        the ring or to write from where it lies, or a block on NVMe whose stored bytes are its segments,
        copied in the kernel into its segments' ranges (``ChecksummedWriter.reserve``; async_save's note)."""
        self.staged = threading.Event()
        """Set once nothing of the live state is read any more: the state may change."""
        self.after_updates: Callable[[], bool] = lambda: True
        """Waits until the step's updates that write the deferred parts' state ended; whether every one ran
        (``StepUpdates.last_update``; ``begin_save``)."""
        self._failure: BaseException | None = None
        """A failure of the staging (``stage``: off the thread that closes), for ``close``."""
        self._written_in_place = False
        """Some part is written from the live state: ``staged`` waits until those writes landed."""
        self.rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            self.rng["cuda"] = torch.cuda.get_rng_state_all()

    def close(self) -> dict[str, dict]:
        try:
            with self.aio:
                try:
                    self.stage()
                    if self._failure is not None:
                        raise self._failure
                    rng_path = self.partial / rank_file(self.rank, "pt")
                    torch.save(self.rng, rng_path)
                    self.files[rng_path.name] = file_record(rng_path)
                finally:
                    wait_each((lambda w=writer: self._close(w)) for writer in self.writers)  # every one
            return self.files
        except OSError as error:
            self.remove()
            clear = out_of_space(error, self.partial, self.size)
            if clear is None:
                raise
            raise clear from error

    def stage(self) -> None:
        """Once (later calls return at once): the step's updates ended (``after_updates``; failed ones
        fail the save), the deferred parts written or copied, those written from the live state landed,
        then ``staged`` set; never raises: a failure is kept for ``close``."""
        if self.staged.is_set():
            return
        try:
            if not self.after_updates():
                raise CheckpointError(f"{self.partial}: the step's updates failed before this save read the "
                                      "state (their error is raised by the engine's next call); nothing was "
                                      "published, the previous checkpoint is unchanged")
            self._write_deferred()
            if self._written_in_place:
                self.writers[0].landed()  # written from the live state: it may change once they landed
        except BaseException as error:
            self._failure = error
        finally:
            self.deferred = []
            self.staged.set()

    def _write_deferred(self) -> None:
        """The steps read, and every deferred part's write started (the state does not change before
        ``staged`` is set)."""
        self.steps = local_steps(self._engine)
        deferred, self.deferred = self.deferred, []
        for part, nbytes, at in deferred:
            if isinstance(part, Block) and part.resident:
                self.writers[0].write_from(part.data, at)
                self._written_in_place = True
            elif isinstance(part, Block):
                self.writers[0].copy_in(part, at)
            else:
                self.writers[0].write(part, nbytes, at)

    def _close(self, writer: ChecksummedWriter) -> None:
        self.files[writer.path.name] = writer.close()

    def abandon(self) -> None:
        """After a failure while the writes were being started: let them land, remove the files."""
        self.deferred = []
        with contextlib.suppress(Exception):
            self.close()
        self.remove()

    def remove(self) -> None:
        for name in (rank_file(self.rank, "bin"), rank_file(self.rank, "pt"), "buffers.bin" if self.rank == 0 else ""):
            if name:
                with contextlib.suppress(OSError):
                    (self.partial / name).unlink()


def _write_rank_files(engine: Trainable, partial: Path, ring: StagingRing | None,
                      updates: "StepUpdates | None") -> RankWriters:
    """Start this rank's files in ``partial`` (``RankWriters``): its unit shards (units it holds a shard
    of), then rank 0's buffers. With a ``ring`` (a save in the background), blocks on NVMe stored as they
    are saved are left for ``close`` to copy in the kernel, and so are the other shards when their blocks
    are resident, to copy into the ring (the engine's next call that may change them waits for it:
    ``Saves.check``); the rest is copied here, each block while it is loaded. Where every shard is written
    from where it lies, ``stage`` waits for the step's ``updates`` to end (``RankWriters.after_updates``)
    and starts those writes then, so the updates still run beside the next forward; else they are joined
    here."""
    rank = engine.comm.rank
    size = rank_file_bytes(engine)
    mine = [state for state in engine.opt_states if rank < state.unit.layout.shards]
    copied = [state for state in mine if ring is not None and _saved_as_stored(engine, state)]
    staged = [state for state in mine if state not in copied]
    later = ring is not None and all(state.block.resident for state in staged)
    in_place = ring is not None and not staged and all(state.block.resident for state in copied)
    if updates is not None and not in_place:
        updates.join()
    writers = RankWriters(partial, rank, size, AsyncIO(engine.config.aio), engine)
    try:
        depth = checkpoint_depth(engine.config.aio)
        writer = ChecksummedWriter(partial / rank_file(rank, "bin"), writers.aio, size, writes_in_flight=depth,
                                   ring=ring)
        writers.writers.append(writer)
        loaded = engine.state_dicts.visit(write=False, states=staged) if staged else iter(())  # visit joins
        for state in mine:  # in file order
            if state in copied and state.block.resident:  # one range: the segments lie as in the block
                writers.deferred.append((state.block, 0, writer.reserve(state.block.nbytes)))
                continue
            if state in copied:
                ranges = [writer.reserve(nbytes) for nbytes in _segments(engine, state)]
                writers.deferred.append((state.block, 0, ranges))
                continue
            next(loaded)  # ``state`` loaded: staged ones come in the same order
            parts = [engine.state_dicts.fp32_shard(state)]
            parts += [part for name in state.moment_names for part in state.stored_moment(name)]
            for part, nbytes in zip(parts, _segments(engine, state), strict=True):
                if later:
                    at = writer.reserve(max(nbytes, part.numel() * part.element_size()))
                    writers.deferred.append((part, nbytes, at))
                else:
                    writer.write(part, nbytes)
        next(loaded, None)  # the stream ends (its last block let go)
        if rank == 0:
            buffers = ChecksummedWriter(partial / "buffers.bin", writers.aio, writes_in_flight=depth)
            writers.writers.append(buffers)
            for _, buffer in persistent_buffers(engine.module):
                buffers.write(buffer)
        if in_place and updates is not None:
            writers.after_updates = updates.last_update()
    except BaseException as error:
        writers.abandon()
        clear = out_of_space(error, partial, size) if isinstance(error, OSError) else None
        if clear is None:
            raise
        raise clear from error
    return writers


def _saved_as_stored(engine: Trainable, state: "UnitOptimizerState") -> bool:
    """Whether ``state``'s block holds its checkpoint segments byte for byte: an fp32 master and fp32
    moments, each part as long as its segment, over a unit without frozen parameters (their values are
    the weights'; past the parameters, padding: zeros in the block, as in the segments), no split master,
    no compact moments. Then a block on NVMe is copied file to file (``Block.copy_out``; the swap's
    digests on), and one in host memory is written from where it lies, no copy made."""
    stored = state.block.data.device.type == "cpu" if state.block.resident else engine.config.nvme.checksum
    return (stored and state.has_master and not state.split
            and engine.config.optimizer.moments == "fp32" and all(s.trainable for s in state.unit.layout.slots)
            and state.block.nbytes == sum(_segments(engine, state)))


def rank_file_bytes(engine: Trainable) -> int:
    """Bytes of this rank's data file: its unit shards' segments."""
    return sum(sum(_segments(engine, s)) for s in engine.opt_states if engine.comm.rank < s.unit.layout.shards)


def _segments(engine: Trainable, state: "UnitOptimizerState") -> list[int]:
    """Bytes of each segment of ``state``'s unit shard in a rank file (``layout.shard_segments``)."""
    return shard_segments(_unit_record(state.unit), len(state.moment_names), engine.config.optimizer.moments)


def local_steps(engine: Trainable) -> dict[str, float]:
    """The optimizer step count of each trainable parameter this rank holds a piece of, by its first name."""
    mine = {}
    for state in engine.opt_states:
        for piece, tensor in state.pieces:
            step = engine.optimizer.state[tensor].get("step")
            mine[state.unit.layout.slots[piece.slot_index].names[0]] = 0.0 if step is None else float(step)
    return mine


def optimizer_steps(engine: Trainable) -> dict[str, float]:
    """``local_steps`` from every rank (a parameter may have pieces on several ranks, or on one only).
    Collective."""
    steps: dict[str, float] = {}
    for per_rank in all_gather_object(engine.comm, local_steps(engine)):
        steps.update(per_rank)
    return steps


def _manifest(engine: Trainable, tag: str, client_state: dict | None) -> dict:
    """The manifest's values at the call; its ``steps`` and ``files`` are filled as the save finishes."""
    optimizer = engine.optimizer
    return {
        "format": FORMAT, "version": VERSION, "tag": tag, "world_size": engine.comm.world_size,
        "stage": engine.config.zero.stage, "precision": engine.config.train.precision, "config": engine.config.to_toml(),
        "moments": list(engine.opt_states[0].moment_names) if engine.opt_states else [],
        "moment_format": engine.config.optimizer.moments,
        "units": [_unit_record(u) for u in engine.units],
        "steps": {},
        "groups": [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in optimizer.param_groups],
        "scheduler": None if engine.lr_scheduler is None else _scheduler_state(engine.lr_scheduler),
        "scaler": engine.scaler.state(),
        "counters": {"global_steps": engine.window.global_steps, "micro_steps": engine.window.micro_steps,
                     "skipped_steps": engine.window.skipped_steps},
        "buffers": [{"name": n, "dtype": str(b.dtype).removeprefix("torch."), "shape": list(b.shape)}
                    for n, b in persistent_buffers(engine.module)],
        "client_state": client_state,
        "files": {},
    }


def _scheduler_state(scheduler: Any) -> dict:
    return {k: v for k, v in scheduler.state_dict().items() if _jsonable(v)}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
