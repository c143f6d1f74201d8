"""Tiers: where each kind of state lives and what it may hold (the memory layer, DESIGN §3).

- ``tier``: a budgeted place for tensors (``device``, ``host``), its accounting by kind, ``make_tiers``;
- ``blocks``: buffers whose home is a tier, loaded and stored a piece at a time;
- ``nvme``: the tier of swap files, holding blocks only;
- ``link``: what crosses between host memory and the device, and the copier of shards onto it;
- ``streams``: the side streams those copies run on, made in one place;
- ``ram``: refusals before anything is allocated, against the budgets and the RAM the machine has;
- ``device_memory``: what a CUDA device's budget covers besides the engine's tensors, and the allocator's cap;
- ``host_allocator``, ``buffer_arena``: how host memory is mapped, and engine buffers kept for reuse.
"""
from ..kinds import Kind
from .blocks import ASIDE, Block, IOStats
from .link import DeviceCopier, LinkStats
from .nvme import NvmeTier, open_swap, stored_bytes, swap_bytes, swap_free_bytes, swap_paths
from .ram import available_ram, check_plan, check_ram
from .tier import BudgetError, DeviceTier, HostTier, MemoryPlan, Tier, close_tiers, make_tiers, release_idle

__all__ = ["ASIDE", "Block", "BudgetError", "DeviceCopier", "DeviceTier", "HostTier", "IOStats", "Kind", "LinkStats",
           "NvmeTier", "MemoryPlan", "Tier", "available_ram", "check_plan", "check_ram", "close_tiers", "make_tiers",
           "open_swap", "release_idle", "stored_bytes", "swap_bytes", "swap_free_bytes", "swap_paths"]
