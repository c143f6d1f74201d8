"""Tiers: where a kind of state lives, what it may hold, and what it holds now.

[Note: tiers and kinds]
- A *tier* is a place for tensors with a torch device and a byte *budget*: ``device`` (the compute
  device; on a CPU-only machine, RAM accounted against ``memory.device_budget``), ``host`` (page-aligned
  RAM, pinned when CUDA is present) and, in a later layer, ``nvme``.
- A *kind* says what a tensor is for (parameters, gradients, optimizer state, engine buffers); every
  allocation names its kind so ``memory_report`` can say bytes per tier × kind and the peak.
- The engine never asks which tier it has: it asks the tier for tensors (``empty``/``zeros``), gives
  them back (``free``), and copies between tiers' devices; a tier that would pass its budget raises
  ``BudgetError``. ``check_plan`` refuses a whole run up front, before anything is allocated.

[Note: blocks]
A *block* is a buffer whose home is a tier, for state that is worked on a piece at a time (a unit's
optimizer state, a unit's parameter shard). ``load(buffer)`` makes ``block.data`` valid, ``store()``
writes changes home, ``unload()`` lets the memory go. On a resident tier (device, host) ``data`` is
always the block's own tensor, and the three are no-ops; on the ``nvme`` tier the bytes live in a swap
file and ``data`` is the caller's host buffer while loaded, read and written through the async-I/O
engine. Callers treat every block alike; the tier decides what moving means. A *prefix block* reads
the first elements of another NVMe block (a partitioned unit's fp32 shard inside its optimizer block)
and is never written through.
Blocks are moved a few at a time through bounded host buffers by ``block_stream``'s pipelines.

[Note: the host-device link]
What crosses between host memory and the device tier is counted in ``LinkStats`` (bus traffic on a
GPU, a copy or an in-place read on a CPU machine). Shards that live off the device go up through a
``DeviceCopier``: on CUDA a side stream, an event the consuming stream waits on, and the host buffer
let go only after the copy is done.
"""
from __future__ import annotations

import abc
import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import psutil
import torch

from .buffer_arena import BufferArena
from .config import Config, ConfigError, MemoryConfig
from .host_allocator import advise_fresh
from .io.aio import AsyncIO
from .io.buffers import aligned_empty
from .io.swapfile import SwapStore
from .kinds import Kind
from .trace import RECORDER

__all__ = ["Kind", "Tier", "DeviceTier", "HostTier", "NvmeTier", "Block", "IOStats", "LinkStats", "DeviceCopier",
           "BudgetError", "make_tiers", "open_swap", "close_tiers", "release_idle", "swap_bytes", "check_plan",
           "check_ram", "Plan", "swap_paths"]


class BudgetError(ConfigError):
    """A tier cannot hold what the run needs; the message has the numbers and the keys to change."""


Plan = dict[str, dict[Kind, int]]
"""Bytes a run will need, by tier name and kind (steady state plus the largest temporaries)."""


class Tier(abc.ABC):
    """A budgeted place for tensors; subclasses decide how memory is allocated."""

    budget_key = ""
    resident = True
    """Whether the tier's tensors are memory the compute can address (device, host) or not (nvme)."""

    def __init__(self, name: str, device: torch.device, budget: int | None):
        self.name = name
        self.device = device
        self.budget = budget
        self.usage = {kind: 0 for kind in Kind}
        self.peak = 0
        self.arena = BufferArena() if self.resident and device.type == "cpu" else None
        """Engine buffers kept for reuse in CPU memory (buffer_arena's [Note: buffer arena])."""
        self._huge_pages = self.resident and device.type == "cpu" and not torch.cuda.is_available()
        """Whether torch's fresh CPU buffers (the device tier's, storage restored) get huge pages
        (host_allocator's [Note: huge pages for engine buffers]); not where CUDA is, whose host buffers are
        pinned. The host tier's aligned buffers get them from ``aligned_empty``."""

    @property
    def used(self) -> int:
        return sum(self.usage.values())

    @property
    def idle(self) -> int:
        """Bytes the arena keeps for reuse: held, though no tensor uses them now."""
        return 0 if self.arena is None else self.arena.idle_bytes

    def _account(self, kind: Kind, nbytes: int) -> None:
        if self.budget is not None and self.used + self.idle + nbytes > self.budget:
            self.release_idle()  # what the arena keeps yields to what is asked for
        if self.budget is not None and self.used + nbytes > self.budget:
            raise BudgetError(
                f"{self.name} tier: allocating {nbytes} bytes of {kind.value} would hold {self.used + nbytes} bytes, "
                f"over {self.budget_key} = {self.budget}; raise it or move state to another tier")
        self.usage[kind] += nbytes
        self.peak = max(self.peak, self.used + self.idle)
        RECORDER.counter(self.name, self.used)

    @abc.abstractmethod
    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh 1-D tensor in this tier's memory."""

    def empty(self, kind: Kind, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-D tensor of ``numel`` elements, counted against this tier as ``kind``
        (an engine buffer may be one the arena kept)."""
        reused = self.arena.take(numel, dtype) if kind is Kind.BUFFER and self.arena is not None else None
        self._account(kind, numel * dtype.itemsize)
        if reused is not None:
            return reused
        tensor = self._allocate(numel, dtype)
        if kind is Kind.BUFFER and self.arena is not None:
            self.arena.lend(tensor)
        return tensor

    def zeros(self, kind: Kind, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(kind, numel, dtype).zero_()

    def free(self, kind: Kind, tensor: torch.Tensor | None) -> None:
        """Stop counting ``tensor`` (the caller drops its references; memory returns when they are gone,
        or an engine buffer waits in the arena for its next use)."""
        if tensor is not None:
            self.usage[kind] -= tensor.numel() * tensor.element_size()
            RECORDER.counter(self.name, self.used)
            if kind is Kind.BUFFER and self.arena is not None:
                self.arena.give_back(tensor)

    def release_idle(self) -> None:
        """Let the buffers the arena keeps go: at the end of a phase, or to make room."""
        if self.arena is not None:
            self.arena.clear()

    def release_storage(self, kind: Kind, tensor: torch.Tensor) -> None:
        """Free ``tensor``'s memory now but keep the tensor, and every view of it, for ``restore_storage``.

        Views saved by autograd share the storage, so they are freed too and come back with it.
        """
        tensor.untyped_storage().resize_(0)
        self.free(kind, tensor)

    def close(self) -> None:
        """Release what the tier holds outside memory (the NVMe tier's swap files)."""

    def block(self, kind: Kind, key: str, numel: int, dtype: torch.dtype, *, aside: bool = False,
              segments: int = 1) -> "Block":
        """A buffer of ``numel`` ``dtype`` elements whose home is this tier (see [Note: blocks]); a block
        in memory is changed in place, so it keeps no version ``aside`` (NVMe blocks do). ``segments``:
        equal parts that may be read on their own (verified apart on NVMe: swapfile's note)."""
        if aside:
            raise ValueError(f"block {key!r} on the {self.name} tier is changed in place: it cannot keep a version "
                             "aside (only NVMe blocks can)")
        return Block(self.empty(kind, numel, dtype))

    def restore_storage(self, kind: Kind, tensor: torch.Tensor) -> None:
        """Give a tensor whose storage was released its memory back (contents undefined), counted as ``kind``."""
        nbytes = tensor.numel() * tensor.element_size()
        self._account(kind, nbytes)
        tensor.untyped_storage().resize_(nbytes)
        if self._huge_pages:
            advise_fresh(tensor)


class DeviceTier(Tier):
    """The compute device's memory (RAM on a CPU-only machine)."""

    budget_key = "memory.device_budget"

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(numel, dtype=dtype, device=self.device)
        if self._huge_pages:
            advise_fresh(tensor)
        return tensor


class HostTier(Tier):
    """Page-aligned host RAM, pinned when CUDA is present so copies to the device run asynchronously."""

    budget_key = "memory.host_budget"

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return aligned_empty(numel * dtype.itemsize, dtype)


class _Done:
    """A finished move (resident blocks never wait)."""

    def wait(self) -> int:
        return 0


class Block:
    """A resident block: ``data`` is always its own tensor; loading and storing move nothing."""

    resident = True
    writable = True

    def __init__(self, data: torch.Tensor):
        self.data: torch.Tensor | None = data
        self.numel, self.dtype = data.numel(), data.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def load(self, buffer: torch.Tensor | None = None, *, read: bool = True) -> Any:
        """Make ``data`` valid (``read=False``: contents to be overwritten, nothing is read)."""
        return _Done()

    def store(self) -> Any:
        """Write ``data`` home."""
        return _Done()

    def unload(self) -> torch.Tensor | None:
        """Let the memory go; returns the caller's host buffer for reuse (None when resident)."""
        return None

    def hold(self) -> None:
        """Keep a version aside (``_SwappedBlock.hold``): a block in memory is changed in place, so only an
        empty one (a frozen shard's span) can, having nothing to keep."""
        if self.numel:
            raise TypeError("a block in memory is changed in place: it cannot keep its old version aside")

    def commit(self) -> None:
        """Nothing was kept aside (``hold``)."""

    def discard(self) -> None:
        """Nothing was kept aside (``hold``)."""


@dataclass(slots=True)
class IOStats:
    """What the NVMe tier moved since the last ``reset``: bytes each way and time callers were blocked."""

    read_bytes: int = 0
    """NVMe -> host."""
    write_bytes: int = 0
    """host -> NVMe."""
    wait_seconds: float = 0.0
    """Time spent waiting for reads and writes to finish (I/O not hidden behind compute)."""

    def reset(self) -> None:
        self.read_bytes = self.write_bytes = 0
        self.wait_seconds = 0.0


@dataclass(slots=True)
class LinkStats:
    """Bytes moved between host memory and the device tier since the last ``reset``: over the bus on a
    GPU machine; on a CPU-only one a copy between the two tiers' buffers (or none, where the update reads
    them in place), counted the same way so that the figures mean the same on both."""

    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0

    def reset(self) -> None:
        self.host_to_device_bytes = self.device_to_host_bytes = 0


class DeviceCopier:
    """Host tensors onto the device tier ahead of their use, counted in ``link``.

    On CUDA each copy runs on a side stream, from pinned memory, so it overlaps the compute; the
    stream that uses the copy waits on an event recorded after it, and the host waits on that event
    before its buffer may be reused. On a CPU device the host tensor is used in place.
    """

    def __init__(self, device_tier: Tier, link: LinkStats):
        self.tier, self.link = device_tier, link
        self.stream = torch.cuda.Stream(device_tier.device) if device_tier.device.type == "cuda" else None

    def to_device(self, source: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """``source`` on the device, usable on the current stream, and what to call once its user is
        done: wait for the copy (the host buffer is then free to reuse) and free the device buffer."""
        self.link.host_to_device_bytes += source.numel() * source.element_size()
        if self.stream is None:
            return source, lambda: None
        target = self.tier.empty(Kind.BUFFER, source.numel(), source.dtype)
        self.stream.wait_stream(torch.cuda.current_stream(self.tier.device))  # target's memory is free there
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        torch.cuda.current_stream(self.tier.device).wait_event(copied)

        def release() -> None:
            copied.synchronize()
            self.tier.free(Kind.BUFFER, target)
        return target, release


class _TimedHandle:
    """A swap transfer whose ``wait`` counts the time it blocks toward the tier's ``IOStats``, and
    which an armed trace shows from submission to that wait (trace's [Note: step traces])."""

    def __init__(self, handle: Any, stats: IOStats, track: str, key: str, nbytes: int):
        self.handle, self.stats, self.track, self.key = handle, stats, track, key
        self.trace_id = RECORDER.transfer_started(track, nbytes, key)
        self.nbytes = nbytes

    def wait(self) -> int:
        start = time.perf_counter()
        try:
            return self.handle.wait()
        finally:
            end = time.perf_counter()
            self.stats.wait_seconds += end - start
            if end - start > 1e-4:
                RECORDER.complete(f"wait: {self.track} {self.key}", "waits", start, end, bytes=self.nbytes)
            RECORDER.transfer_done(self.track, self.trace_id, self.key)
            self.trace_id = None


ASIDE = "~aside"
"""Suffix of the swap key under which a held block stores its tentative version."""


class _SwappedBlock(Block):
    """A block in the NVMe tier's swap store, paged through a caller's host buffer."""

    resident = False
    prefix = False
    """Whether the block is the first elements of a longer swap entry (``_SwappedPrefix``)."""

    def __init__(self, store: SwapStore, key: str, numel: int, dtype: torch.dtype, stats: IOStats, segments: int = 1):
        self.store_, self.key, self.stats = store, key, stats
        self.numel, self.dtype = numel, dtype
        self.segment = self.nbytes // segments
        """Bytes of each part verified on its own (``SwapStore.write``'s ``segment``)."""
        self.data = None
        self._buffer: torch.Tensor | None = None
        self._store_key = key
        """Where ``store`` writes: the block's key, or while stores are held its version aside."""

    def load(self, buffer: torch.Tensor | None = None, *, read: bool = True) -> Any:
        if buffer is None or buffer.numel() * buffer.element_size() < self.nbytes:
            raise ValueError(f"block {self.key!r} needs a host buffer of at least {self.nbytes} bytes")
        self._buffer = buffer
        self.data = buffer.view(torch.uint8)[:self.nbytes].view(self.dtype)
        if not read:
            return _Done()
        self.stats.read_bytes += self.nbytes
        return _TimedHandle(self.store_.read(self.key, self.data, prefix=self.prefix), self.stats, "nvme read",
                            self.key, self.nbytes)

    def store(self) -> Any:
        self.stats.write_bytes += self.nbytes
        return _TimedHandle(self.store_.write(self._store_key, self.data, segment=self.segment), self.stats,
                            "nvme write", self.key, self.nbytes)

    def unload(self) -> torch.Tensor | None:
        buffer, self._buffer, self.data = self._buffer, None, None
        return buffer

    def hold(self) -> None:
        """Store later versions aside, until ``commit`` makes the last one the block's or ``discard``
        drops it; loads read the block as it was all the while. For an update that may have to be
        redone from the state before it (backward_updates' [Note: tentative updates]); the space aside
        was counted when the block was made (``NvmeTier.block``'s ``aside``)."""
        self.discard()  # a version left aside by a window that failed is no one's
        self._store_key = self.key + ASIDE

    def commit(self) -> None:
        """The version stored aside (if one was) becomes the block's; stores go to the block again. Call
        once no store is in flight."""
        aside, self._store_key = self._store_key, self.key
        if aside != self.key and aside in self.store_:
            self.store_.rename(aside, self.key)

    def discard(self) -> None:
        """Drop the version stored aside (if one was): the block is what it was before ``hold``."""
        aside, self._store_key = self._store_key, self.key
        if aside != self.key and aside in self.store_:
            self.store_.free(aside)


class _SwappedPrefix(_SwappedBlock):
    """The first ``numel`` elements of another swapped block, read-only: a second way to read part of
    a block that its owner writes (a partitioned unit's fp32 shard inside its optimizer block)."""

    writable = False
    prefix = True

    def store(self) -> Any:
        raise TypeError(f"the first {self.numel} elements of swap block {self.key!r} are written by its owner only")


class NvmeTier(Tier):
    """Swap files on NVMe (``nvme.path``, striped over a list): blocks only, never addressable tensors.

    Its space is checked and preallocated when it opens (``reserve``), so a disk too small refuses
    the run at start with the numbers; ``close`` removes the files.
    """

    budget_key = "nvme.path free space"
    resident = False

    def __init__(self, config: Config, rank: int, reserve: int):
        super().__init__("nvme", torch.device("cpu"), None)
        self.io = IOStats()
        self._aio = AsyncIO(config.aio)
        try:
            self.swap = SwapStore(swap_paths(config), self._aio, rank=rank, reserve=reserve,
                                  checksum=config.nvme.checksum, direct=config.aio.direct)
        except BaseException:
            self._aio.close()
            raise

    def close(self) -> None:
        self.swap.close()
        self._aio.close()

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError("the nvme tier holds blocks (Tier.block), not tensors the compute can address")

    def block(self, kind: Kind, key: str, numel: int, dtype: torch.dtype, *, aside: bool = False,
              segments: int = 1) -> Block:
        """``aside``: the block may keep a second version while its stores are held (``hold``), so its
        space is counted twice."""
        self._account(kind, numel * dtype.itemsize * (2 if aside else 1))
        return _SwappedBlock(self.swap, key, numel, dtype, self.io, segments)

    def prefix_block(self, key: str, numel: int, dtype: torch.dtype) -> Block:
        """A read-only view of the first ``numel`` elements of block ``key`` (no space of its own)."""
        return _SwappedPrefix(self.swap, key, numel, dtype, self.io)


def swap_paths(config: Config) -> list[str]:
    """``nvme.path``, or the ``offload.*.path`` that overrides it for the states that live on NVMe."""
    offload = config.offload
    chosen = {section.path for section in (offload.param, offload.optimizer) if section.tier == "nvme" and section.path}
    if len(chosen) > 1:
        raise ConfigError(f"offload.param.path and offload.optimizer.path differ ({sorted(chosen)}): one swap "
                          "directory set per run in this version; set nvme.path (a list stripes) instead")
    return [chosen.pop()] if chosen else config.nvme.paths


def swap_free_bytes(config: Config) -> int:
    """Free bytes where ``config``'s swap files would go, each filesystem counted once (a missing
    directory holds nothing)."""
    filesystems: dict[int, int] = {}
    for path in swap_paths(config):
        with contextlib.suppress(OSError):
            filesystems[os.stat(path).st_dev] = shutil.disk_usage(path).free
    return sum(filesystems.values())


def _device_budget(value: int | str, device: torch.device) -> int | None:
    if value != "auto":
        return int(value)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return None  # a CPU "device" is RAM the OS pages; no budget unless the user sets one


def make_tiers(memory: MemoryConfig, device: torch.device) -> dict[str, Tier]:
    """The resident tiers of a run, by the names config uses (``offload.*.tier``); the engine adds
    ``nvme`` once it knows how much swap space to reserve."""
    host_budget = None if memory.host_budget == "auto" else int(memory.host_budget)
    return {"device": DeviceTier("device", device, _device_budget(memory.device_budget, device)),
            "host": HostTier("host", torch.device("cpu"), host_budget)}


def open_swap(tiers: dict[str, Tier], plan: Plan, config: Config, rank: int) -> IOStats:
    """Add the ``nvme`` tier when ``plan`` puts state there, its swap space reserved for the plan's
    bytes; returns the I/O counters the run reports (empty without NVMe)."""
    if "nvme" not in plan:
        return IOStats()
    tiers["nvme"] = NvmeTier(config, rank, reserve=swap_bytes(plan))
    return tiers["nvme"].io


def release_idle(tiers: dict[str, Tier]) -> None:
    """A phase (a backward, a step) is over: the buffers every tier's arena kept for reuse go."""
    for tier in tiers.values():
        tier.release_idle()


def close_tiers(tiers: dict[str, Tier]) -> None:
    """Stop accounting every tier's tensors and release what the tiers hold (swap files)."""
    for tier in tiers.values():
        tier.usage = {kind: 0 for kind in Kind}
        tier.close()
    release_idle(tiers)


def swap_bytes(plan: Plan) -> int:
    """The swap space ``plan`` needs on NVMe (per rank)."""
    return sum(plan.get("nvme", {}).values())


RAM_MARGIN = 0.10
"""Share of RAM (at least ``RAM_MARGIN_MIN``) kept out of the "auto" budgets: activations, the
allocator's slack, torch and the interpreter are not the engine's tensors but live in the same RAM."""
RAM_MARGIN_MIN = 1 << 30


def available_ram() -> int:
    """Bytes of RAM this process can still take: the kernel's estimate (MemAvailable), lowered to
    what the cgroup limit leaves when a container has one (the OOM killer acts on that)."""
    available = psutil.virtual_memory().available
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        with contextlib.suppress(OSError, ValueError):
            with open(limit_path) as limit, open(usage_path) as usage:
                available = min(available, int(limit.read()) - int(usage.read()))  # "max" raises ValueError
    return max(available, 0)


def check_ram(plan: Plan, memory: MemoryConfig, device: torch.device, *, activations: int = 0, released: int = 0,
              local_ranks: int = 1, suggestion: Callable[[Callable[[Plan, int], bool]], str | None] = lambda fits: None
              ) -> None:
    """Refuse a run whose "auto" tiers cannot fit in the RAM the machine really has, before anything
    is allocated. The host tier lives in RAM; so does the device tier on a CPU-only machine, so there
    the two plans share it, with the device's ``activations`` (measured bytes; 0 when unknown, left to
    the margin). ``released``: bytes the model holds now that its flattening gives back (an eagerly
    built model's parameters). ``local_ranks`` processes of the job share this RAM, each with a plan
    like ``plan``. ``suggestion(fits)`` names a layout that would fit (``fits(plan, activations)``)."""
    in_ram = [name for name, auto in (("host", memory.host_budget == "auto"),
                                      ("device", device.type == "cpu" and memory.device_budget == "auto")) if auto]
    available, margin = available_ram(), max(RAM_MARGIN_MIN, int(RAM_MARGIN * psutil.virtual_memory().total))
    room = (available - margin) // local_ranks + released

    def need(candidate: Plan, activation_bytes: int) -> dict[str, int]:
        return {name: sum(candidate.get(name, {}).values()) + (activation_bytes if name == "device" else 0)
                for name in in_ram}

    def fits(candidate: Plan, activation_bytes: int) -> bool:
        return sum(need(candidate, activation_bytes).values()) <= room

    if not in_ram or fits(plan, activations):
        return
    needed = need(plan, activations)
    parts = "; ".join(f"{name} tier {n:,} ({_kinds(plan[name], activations if name == 'device' else 0)})"
                      for name, n in needed.items() if n)
    layout = suggestion(fits)
    fix = (f"a layout that fits: {layout}" if layout else "no layout of this model fits here: use a machine with "
           "more RAM, or set memory.device_budget/host_budget if you know better")
    shared = f", shared by {local_ranks} ranks" if local_ranks > 1 else ""
    given_back = f", plus {released:,} the model's weights give back" if released else ""
    kept_for = "the allocator and torch" if activations else "activations, the allocator and torch"
    raise BudgetError(f"the run needs {sum(needed.values()):,} bytes of RAM per rank ({parts}) but "
                      f"this machine has {max(room, 0):,} for it ({available:,} available, less {margin:,} kept for "
                      f"{kept_for}{shared}{given_back}; memory.*_budget = \"auto\"); {fix}")


def _kinds(kinds: dict[Kind, int], activations: int) -> str:
    """``param 1,024, grad 2,048, ...``: the kinds a tier's plan holds, and the measured activations."""
    parts = [f"{k.value} {b:,}" for k, b in kinds.items() if b]
    return ", ".join(parts + ([f"activations {activations:,}"] if activations else []))


def check_plan(plan: Plan, tiers: dict[str, Tier], activations: int = 0) -> None:
    """Refuse a run whose planned bytes (and the device's measured ``activations``) exceed a tier's
    budget, before anything is allocated."""
    for name, kinds in plan.items():
        extra = activations if name == "device" else 0
        tier, total = tiers.get(name), sum(kinds.values()) + extra
        if tier is not None and tier.budget is not None and total > tier.budget:  # nvme: checked as it opens
            parts = ", ".join(f"{kind.value} {n}" for kind, n in kinds.items() if n)
            parts += f", activations {extra}" if extra else ""
            raise BudgetError(
                f"the {name} tier needs {total} bytes ({parts}) but {tier.budget_key} is "
                f"{tier.budget} bytes ({total - tier.budget} short): raise {tier.budget_key}, "
                "use a higher zero.stage, or move state to another tier (offload.optimizer.tier, offload.param.tier)")
