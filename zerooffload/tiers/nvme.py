"""The NVMe tier: swap files on the directories ``nvme.path`` names, holding blocks only.
"""
from __future__ import annotations

import contextlib
import os
import shutil

import torch

from ..config import Config, ConfigError
from ..io.aio import AsyncIO
from ..io.swapfile import SwapStore, placed_bytes
from ..kinds import Kind
from .blocks import Block, IOStats, SwappedBlock, SwappedPrefix
from .tier import MemoryPlan, Tier

__all__ = ["NvmeTier", "open_swap", "stored_bytes", "swap_bytes", "swap_free_bytes", "swap_paths"]


class NvmeTier(Tier):
    """Swap files on NVMe (``nvme.path``, striped over a list): blocks only, never addressable tensors.

    Its space is checked and preallocated when it opens (``reserve``), so a disk too small refuses
    the run at start with the numbers; ``close`` removes the files. ``nvme.max_bytes`` caps this
    machine's swap files: each of its ``local_ranks`` ranks may take an even share, which its store
    holds as its files grow (a write past it is refused before it is made).
    """

    budget_key = "nvme.path free space"
    resident = False

    def __init__(self, config: Config, rank: int, reserve: int, local_ranks: int = 1):
        super().__init__("nvme", torch.device("cpu"), None)
        self.io = IOStats()
        self._aio = AsyncIO(config.aio)
        try:
            self.swap = SwapStore(swap_paths(config), self._aio, rank=rank, reserve=reserve,
                                  checksum=config.nvme.checksum, direct=config.aio.direct,
                                  cap=config.nvme.max_bytes // local_ranks)
        except BaseException:
            self._aio.close()
            raise

    def close(self) -> None:
        self.swap.close()
        self._aio.close()

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError("the nvme tier holds blocks (Tier.block), not tensors the compute can address")

    def block(self, kind: Kind, key: str, numel: int, dtype: torch.dtype, *, aside: bool = False,
              segment: int = 0) -> Block:
        """``aside``: the block may keep a second version while its stores are held (``hold``), so its
        space is counted twice."""
        self._account(kind, numel * dtype.itemsize * (2 if aside else 1))
        return SwappedBlock(self.swap, key, numel, dtype, self.io, segment)

    def prefix_block(self, key: str, numel: int, dtype: torch.dtype) -> Block:
        """A read-only view of the first ``numel`` elements of block ``key`` (no space of its own)."""
        return SwappedPrefix(self.swap, key, numel, dtype, self.io)


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
    directory holds nothing), at most ``nvme.max_bytes`` when that is set."""
    filesystems: dict[int, int] = {}
    for path in swap_paths(config):
        with contextlib.suppress(OSError):
            filesystems[os.stat(path).st_dev] = shutil.disk_usage(path).free
    free = sum(filesystems.values())
    return min(free, config.nvme.max_bytes) if config.nvme.max_bytes else free


def open_swap(tiers: dict[str, Tier], plan: MemoryPlan, config: Config, rank: int, local_ranks: int = 1) -> IOStats:
    """Add the ``nvme`` tier when ``plan`` puts state there, its swap space reserved for the plan's
    bytes (``local_ranks``: the ranks on this machine, which share ``nvme.max_bytes``); returns the I/O
    counters the run reports (empty without NVMe)."""
    if "nvme" not in plan:
        return IOStats()
    tiers["nvme"] = NvmeTier(config, rank, reserve=swap_bytes(plan), local_ranks=local_ranks)
    return tiers["nvme"].io


def stored_bytes(tier: str, nbytes: int, swap_stripes: int) -> int:
    """A block of ``nbytes`` as ``tier`` holds it: the swap files in whole aligned extents over
    ``swap_stripes`` directories (``placed_bytes``), so the plan's NVMe bytes are what the store reserves."""
    return placed_bytes(nbytes, swap_stripes) if tier == "nvme" else nbytes


def swap_bytes(plan: MemoryPlan) -> int:
    """The swap space ``plan`` needs on NVMe (per rank)."""
    return sum(plan.get("nvme", {}).values())
