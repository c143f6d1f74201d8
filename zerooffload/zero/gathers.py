"""How stage 3 gathers a unit's weights: over every rank, as they are or quantized (ZeRO++'s qwZ,
``zero.quantized_weights``), or within the node from secondary shards (hpZ, ``zero.hpz_partition_size``).

[Note: secondary shards]
With hpZ over N ranks (the ranks of a node), the first gather of a partitioned unit in a training pass
(its forward's) runs over every rank as usual; once it has arrived, each rank copies the share of the
gathered weights that its place in the node selects (``local_rank`` of N equal parts of the padded
buffer) into the unit's *secondary shard* (``FlatUnit.secondary``, ``Kind.SECONDARY`` on the device).
Any later gather of the unit in that pass (its backward, once ``zero.max_live_size`` made it go) is an
all-gather of the secondary shards over the node's group (``comm.intra``): the same values, so hpZ
alone is bitwise plain stage 3, and no byte of it crosses to another node. The pass's end drops every
secondary shard (``ParamScheduler.free_all``), before the step changes the weights they copy: they are
derived state, never stale and never saved. They live on the device whatever ``offload.param.tier``
says: what backward sends must be there, and from the device it needs no read from NVMe and no copy
from the host. Under qwZ they hold the dequantized weights, and the gather within the node is not
quantized again (the link within a node is not the one ZeRO++ saves; backward computes with exactly
forward's weights).
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm, all_gather, quantized_all_gather
from ..config import ConfigError
from ..tiers import Tier
from .partition import FlatUnit

__all__ = ["Gathers", "hpz_parts"]


def hpz_parts(comm: Comm, size: int) -> int:
    """The parts hpZ splits a gathered unit into (1: off), ``zero.hpz_partition_size`` checked against the
    job's nodes: it must be the ranks per node, whose group (``comm.intra``) the backward gathers run on
    (``comm`` makes one group per node, not one per part of a node)."""
    if size == 1:
        return 1
    local = comm.topology.local_world_size
    if size == local and comm.intra is not None:
        return size
    why = ("this job runs one rank a node: there is no node to share a secondary partition in"
           if local == 1 else
           f"it must equal the ranks per node, {local} (torchrun's LOCAL_WORLD_SIZE), whose process group the "
           f"backward gathers run on; a divisor of it would need a group per part of a node" if local % size == 0
           else f"it must equal the ranks per node, {local} (torchrun's LOCAL_WORLD_SIZE)")
    refusal = ConfigError(f"zero.hpz_partition_size = {size}: {why}; set it to {local if local > 1 else 1}, or 1 (off)")
    refusal.agreed = True  # every rank raises it here, from the topology init_comm checked alike on every node
    raise refusal


class Gathers:
    """The all-gathers of one engine's partitioned units (see [Note: secondary shards]), as their placements
    say (``quantized_gathers``, ``secondary_parts``)."""

    def __init__(self, comm: Comm, units: list[FlatUnit], tier: Tier):
        self.comm = comm
        self.tier = tier
        """Where secondary shards live: the device (see the note)."""
        self.parts = hpz_parts(comm, max((unit.placement.secondary_parts for unit in units), default=1))
        self.part = comm.topology.local_rank if self.parts > 1 else 0
        """This rank's share of a gathered unit under hpZ: its place in the node."""

    def start(self, unit: FlatUnit, output: torch.Tensor, source: torch.Tensor | None) -> Any:
        """Start gathering ``unit`` into ``output``: from the secondary shards where it has one, else from
        ``source`` (this rank's primary shard, on the device) over every rank, quantized under qwZ (alone,
        nothing crosses a wire, so nothing is quantized); returns the collective's work."""
        if unit.secondary is not None:
            return all_gather(self.comm, output, unit.secondary, group=self.comm.intra, async_op=True)
        if unit.placement.quantized_gathers and self.comm.world_size > 1:
            return quantized_all_gather(self.comm, output, source, async_op=True)
        return all_gather(self.comm, output, source, async_op=True)

    def arrived(self, unit: FlatUnit, training: bool) -> None:
        """``unit``'s gather arrived: in a training pass under hpZ, keep its secondary shard (if not yet kept)."""
        if training and self.parts > 1:
            unit.keep_secondary(self.tier, self.part, self.parts)

    def drop(self, units: list[FlatUnit]) -> None:
        """The pass ended: every secondary shard goes."""
        for unit in units:
            if unit.secondary is not None:
                unit.drop_secondary(self.tier)
