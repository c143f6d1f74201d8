"""Who we are in the job: the engine's process group, its node-local and cross-node groups, the counters.

[Note: failing together]
A rank that raises while its peers are inside a collective, or about to enter one, would leave them
blocked until the process group's timeout (10 minutes by default). So the engine runs its collectives
on a group of its own (``new_group`` over the user's ranks, made in ``init_comm``), and an error that
leaves an engine call on one rank (``failing_together``) first records what went wrong in the job's
store, then ends that group there: on gloo its connections close, and every peer's pending or next
collective fails at once, so all ranks raise within a second or so; each peer raises an
``EngineGroupEnded`` that carries the first failure's message (the file and offset of an I/O error,
say), chained to its own "Connection closed by peer". The user's own process group is left as it
was; the engine's is gone, so the engine refuses every later call: restart it (from the last
checkpoint). NCCL cannot be interrupted this way; there the peers raise when the collective timeout
expires. An error marked ``agreed`` (``SkipStreakError``) is left alone: every rank raises it at the
same point from values they all-reduced, so no peer is left waiting.
"""
from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from ..errors import EngineGroupEnded
from .topology import Topology, check_agreement, read_topology

__all__ = ["Comm", "CommCounters", "EngineGroupEnded", "init_comm", "failing_together", "end_group",
           "end_process_groups", "backend_for"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CommCounters:
    """Elements and bytes moved since the last ``reset``, by data and control collectives
    (collectives' [Note: collective accounting] says what each counts)."""

    data_elements: int = 0
    """DESIGN §3's elements per rank: all-gather outputs, reduce-scatter inputs, twice all-reduces."""
    data_bytes: int = 0
    """Those elements in the bytes that represent them on the wire (int8 codes and scales when quantized)."""
    control_elements: int = 0
    intra_node_bytes: int = 0
    """Bytes this rank sent to ranks of its own node (data collectives)."""
    inter_node_bytes: int = 0
    """Bytes this rank sent to ranks of other nodes: what crosses the link between machines."""

    def reset(self) -> None:
        self.data_elements = self.data_bytes = self.control_elements = 0
        self.intra_node_bytes = self.inter_node_bytes = 0


@dataclass(slots=True)
class Comm:
    """Who we are in the job: the process group (None at world size 1), our rank, the compute device."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    topology: Topology | None = None
    """Which ranks share a node (topology's [Note: nodes]); one node of ``world_size`` ranks when not given."""
    intra: dist.ProcessGroup | None = None
    """The ranks of this rank's node, in rank order (the engine's ``group`` itself at one node); None at one
    rank a node. Made once, in ``init_comm``."""
    inter: dist.ProcessGroup | None = None
    """The ranks with this rank's local rank on every node, in node order; None at one node."""
    counters: CommCounters = field(default_factory=CommCounters)
    sequence: int = 0
    """Collectives run as direct exchanges so far: the next one's message tag."""
    staged: deque = field(default_factory=deque)
    """Multi-stage collectives issued and not yet waited, oldest first: a wait completes the older ones
    first, so every rank posts their later stages in the same order (quantized's [Note: stages])."""
    ended: str | None = None
    """Why the engine's group was ended after a failure ([Note: failing together]); None while alive."""

    def __post_init__(self) -> None:
        if self.topology is None:
            self.topology = Topology(self.world_size, self.rank, self.world_size, self.rank, 0, 1)

    @property
    def direct_exchange(self) -> bool:
        """Whether reduce-scatter and all-gather run as point-to-point exchanges (gloo; see the note)."""
        return self.group is not None and dist.get_backend(self.group) == "gloo"

    @property
    def peers(self) -> list[int]:
        """Every other rank, in rank order."""
        return [r for r in range(self.world_size) if r != self.rank]

    def next_tag(self) -> int:
        self.sequence += 1
        return self.sequence % (1 << 30)


def _compute_device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def backend_for(device: torch.device | str) -> str:
    """The collectives' backend on ``device``: NCCL on CUDA, gloo on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_comm(timeout: timedelta = timedelta(minutes=10), *, local_world_size: int | None = None) -> Comm:
    """Use the process group that exists, else start one from torchrun's environment, else run alone.

    NCCL on CUDA, gloo on CPU. Without a launcher (no WORLD_SIZE > 1) the engine runs as world size 1
    with no group at all, so a laptop script needs no rendezvous. The engine's group, and where the job
    spans nodes its node-local and cross-node groups, are made here once (``local_world_size`` overrides
    torchrun's ``LOCAL_WORLD_SIZE``, for tests without a launcher).
    """
    device = _compute_device()
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = backend_for(device)
        dist.init_process_group(backend, timeout=timeout)
        logger.info("started a %s process group of %d ranks", backend, dist.get_world_size())
    if dist.is_initialized() and dist.get_world_size() > 1:
        world, rank = dist.get_world_size(), dist.get_rank()
        topology = read_topology(world, rank, local_world_size)
        group = dist.new_group(list(range(world)), timeout=_default_group_timeout(device))
        views: list = [None] * world
        dist.all_gather_object(views, (topology.node, topology.local_world_size), group=group)
        check_agreement(views)  # every rank got the same views: all raise alike
        intra, inter = _node_groups(topology, group, _default_group_timeout(device))
        return Comm(group, rank, world, device, topology, intra, inter)
    return Comm(None, 0, 1, device)


def _node_groups(topology: Topology, group: dist.ProcessGroup, timeout: timedelta | None
                 ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's node-local group and cross-node group. ``new_group`` is collective over the whole job:
    every rank makes every node's group and every local rank's, in the same order, and keeps its own."""
    if topology.nodes == 1:
        return (group if topology.local_world_size > 1 else None), None
    intra = inter = None
    if topology.local_world_size > 1:
        for node in range(topology.nodes):
            made = dist.new_group(topology.node_ranks(node), timeout=timeout)
            intra = made if node == topology.node else intra
    for local in range(topology.local_world_size):
        made = dist.new_group(topology.peer_ranks(local), timeout=timeout)
        inter = made if local == topology.local_rank else inter
    return intra, inter


def _default_group_timeout(device: torch.device) -> timedelta | None:
    """The user's group's collective timeout, for the engine's group too (``new_group`` would take
    torch's 30-minute default); None (torch's default) where the backend does not say."""
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


@contextlib.contextmanager
def failing_together(comm: Comm) -> Iterator[None]:
    """Run an engine call; if it raises on this rank, end the engine's group first (see [Note: failing
    together]) so that no peer waits for this rank in a collective."""
    try:
        yield
    except BaseException as error:
        if comm.world_size == 1 or comm.group is None or getattr(error, "agreed", False):
            raise  # agreed: every rank raises it at the same point, from values they all-reduced
        first = _record_failure(comm, f"rank {comm.rank}: {type(error).__name__}: {error}")
        # The frames between the raise and here hold collectives in flight, and those hold the group's
        # connections open: drop their locals (the traceback's text stays), then the group.
        traceback.clear_frames(error.__traceback__)
        end_group(comm, first)
        if first is not None and not first.startswith(f"rank {comm.rank}: "):
            raise EngineGroupEnded(f"stopped because {first}") from error
        raise


def end_process_groups() -> None:
    """Destroy every process group of this process (the default one ``init_comm`` started from torchrun's
    environment, and the engine's), at the clean end of a command. Without it gloo's worker threads can
    outlive the interpreter and abort the finished process as it exits ("terminate called without an
    active exception", SIGABRT), which torchrun reports as a failed job. Only at a clean end: where a rank
    failed, its peers may still wait in a collective, and ending groups then is ``end_group``'s work."""
    if dist.is_initialized():
        dist.destroy_process_group()


def end_group(comm: Comm, reason: str | None = None) -> None:
    """Destroy the engine's group and drop this process's reference to it, which is what closes
    gloo's connections (idempotent)."""
    group, comm.group = comm.group, None
    subgroups = [g for g in (comm.intra, comm.inter) if g is not None and g is not group]
    comm.intra = comm.inter = None
    comm.ended = reason or "the engine's process group was ended"
    if group is not None and dist.is_initialized():
        logger.error("rank %d: ending the engine's process group (%s) so that the other ranks stop too",
                     comm.rank, comm.ended)
        for each in [group, *subgroups]:  # a peer may wait in a node's group as well as in the engine's
            with contextlib.suppress(Exception):  # the error to see is the one that brought us here
                dist.destroy_process_group(each)


def _record_failure(comm: Comm, message: str) -> str | None:
    """The job's first failure of this engine group: ours if no rank recorded one before (the store's
    compare-and-set decides), else the other rank's; None where the store cannot be reached."""
    key = f"zerooffload/failure/{comm.group.group_name}"
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set(key, "", message[:4000]).decode(errors="replace")
    return None
