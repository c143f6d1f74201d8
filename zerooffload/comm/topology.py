"""Which ranks share a node: read once from the launcher's environment, checked equal on every node.

[Note: nodes]
A *node* is a machine (or, in bench/two_nodes.py, a network namespace): its ranks talk over shared
memory or loopback, while bytes between nodes cross a link that is often the step's bottleneck.
torchrun says how many ranks each node runs (``LOCAL_WORLD_SIZE``, from ``--nproc-per-node``) and which
node this is (``GROUP_RANK``, from ``--node-rank``), and numbers ranks *node-major*: node n holds ranks
n·L .. n·L + L − 1 for L ranks a node. This module is the one place that reads those variables
(``memory_plan`` asks it how many ranks share the RAM); without them every rank is on one node.
ZeRO++'s hierarchy needs the same L on every node, so ``init_comm`` gathers each rank's view and
refuses a job whose nodes disagree (``check_agreement``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import ConfigError

__all__ = ["Topology", "read_topology", "local_world_size", "check_agreement"]


@dataclass(frozen=True, slots=True)
class Topology:
    """This rank's place among the job's nodes (see [Note: nodes])."""

    world_size: int
    rank: int
    local_world_size: int
    """Ranks a node (the same on every node)."""
    local_rank: int
    """This rank's index within its node: ``rank % local_world_size``."""
    node: int
    """This rank's node: ``rank // local_world_size``."""
    nodes: int
    """How many nodes: ``world_size // local_world_size``."""

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def node_ranks(self, node: int | None = None) -> list[int]:
        """The ranks of ``node`` (this rank's by default), in rank order."""
        first = (self.node if node is None else node) * self.local_world_size
        return list(range(first, first + self.local_world_size))

    def peer_ranks(self, local_rank: int | None = None) -> list[int]:
        """The ranks with ``local_rank`` (this rank's by default) on every node, in node order."""
        local = self.local_rank if local_rank is None else local_rank
        return [node * self.local_world_size + local for node in range(self.nodes)]

    def split(self, ranks: list[int]) -> tuple[int, int]:
        """How many of ``ranks`` other than this one share its node, and how many do not."""
        others = [r for r in ranks if r != self.rank]
        intra = sum(1 for r in others if self.node_of(r) == self.node)
        return intra, len(others) - intra


def local_world_size(world_size: int, given: int | None = None) -> int:
    """Ranks a node: ``given``, else torchrun's ``LOCAL_WORLD_SIZE``, else all ``world_size`` (one node)."""
    if given is not None:
        return int(given)
    text = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        return int(text) if text else world_size
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE={text!r} is not a number of ranks: launch with torchrun "
                          f"--nproc-per-node N or unset it") from None


def read_topology(world_size: int, rank: int, local: int | None = None) -> Topology:
    """This rank's ``Topology`` from torchrun's environment (``local`` overrides ``LOCAL_WORLD_SIZE``:
    tests give it without a launcher); a layout that is not node-major is refused in one line."""
    local = local_world_size(world_size, local)
    if local < 1 or world_size % local:
        raise ConfigError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world_size}: every node must "
                          f"run the same number of ranks (torchrun --nproc-per-node)")
    node = rank // local
    group_rank = os.environ.get("GROUP_RANK") if local != world_size else None
    if group_rank not in (None, "") and int(group_rank) != node:
        raise ConfigError(f"rank {rank} is on node GROUP_RANK={group_rank}, but with LOCAL_WORLD_SIZE={local} "
                          f"ranks are laid out node-major (node = rank // {local} = {node}): launch with torchrun")
    return Topology(world_size, rank, local, rank % local, node, world_size // local)


def check_agreement(views: list[tuple[int, int]]) -> None:
    """Refuse, on every rank alike, a job whose ranks see different node sizes (``views``: each rank's
    ``(node, local_world_size)``, gathered in rank order)."""
    sizes = {}
    for node, local in views:
        sizes.setdefault(local, node)
    if len(sizes) > 1:
        seen = ", ".join(f"{local} on node {node}" for local, node in sorted(sizes.items()))
        raise ConfigError(f"LOCAL_WORLD_SIZE differs between nodes ({seen}): run the same number of ranks on "
                          f"every node (torchrun --nproc-per-node)")
