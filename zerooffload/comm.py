"""Process groups and collectives, as free functions that count what they move.

[Note: collective accounting]
Elements per rank per step, DESIGN §3's convention: an all-gather counts its output, a
reduce-scatter its input, an all-reduce twice its size (so DDP moves 2Ψ, stages 1–2 2Ψ, stage 3
3Ψ). *Data* collectives move model states and are what that convention counts; *control*
collectives (one small all-reduce per step of gradient-norm squares, overflow and used-parameter
flags) are counted apart. At world size 1 nothing is sent and nothing is counted.

[Note: direct exchange on gloo]
gloo's reduce-scatter is slow on CPU: on 2 ranks, 200 MB took 0.34 s against 0.14 s for an all-reduce
of the same 200 MB and 0.11 s for the same exchange done with point-to-point messages (measured on
this project's 2-core machine), and its all-gather 0.19 s against ~0.1 s. So on gloo both run as a
*direct exchange*: every rank posts its sends to and receives from every peer at once (each part
goes straight to the rank that needs it; (N−1)/N of the data leaves each rank, as in a ring), and
the handle's ``wait`` finishes the job (the reduce-scatter sums the received parts in rank order, so
every rank adds in the same order). Messages carry a tag from a per-``Comm`` sequence, which every
rank advances identically because ranks issue the same collectives in the same order. NCCL keeps
its own collectives.

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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .errors import EngineGroupEnded
from .trace import span

__all__ = ["Comm", "CommCounters", "EngineGroupEnded", "ExchangeWork", "init_comm", "failing_together", "end_group",
           "all_reduce", "reduce_scatter", "all_gather", "control_all_reduce", "broadcast", "barrier",
           "all_gather_object"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CommCounters:
    """Elements and bytes moved since the last ``reset``, by data and control collectives."""

    data_elements: int = 0
    data_bytes: int = 0
    control_elements: int = 0

    def reset(self) -> None:
        self.data_elements = self.data_bytes = self.control_elements = 0


@dataclass(slots=True)
class Comm:
    """Who we are in the job: the process group (None at world size 1), our rank, the compute device."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    counters: CommCounters = field(default_factory=CommCounters)
    sequence: int = 0
    """Collectives run as direct exchanges so far: the next one's message tag."""
    ended: str | None = None
    """Why the engine's group was ended after a failure ([Note: failing together]); None while alive."""

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


class ExchangeWork:
    """The handles of one direct exchange; ``wait`` completes them, then runs ``finish`` once."""

    def __init__(self, handles: list, finish: Callable[[], None]):
        self._handles = handles
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> bool:
        for handle in self._handles:
            handle.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def _exchange(comm: Comm, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor],
              finish: Callable[[], None], async_op: bool) -> ExchangeWork | None:
    """Post every send and receive with one tag; complete now unless ``async_op``."""
    tag = comm.next_tag()
    handles = [dist.isend(t, peer, group=comm.group, tag=tag) for peer, t in sends.items()]
    handles += [dist.irecv(t, peer, group=comm.group, tag=tag) for peer, t in receives.items()]
    work = ExchangeWork(handles, finish)
    if async_op:
        return work
    work.wait()
    return None


def _compute_device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def backend_for(device: torch.device | str) -> str:
    """The collectives' backend on ``device``: NCCL on CUDA, gloo on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_comm(timeout: timedelta = timedelta(minutes=10)) -> Comm:
    """Use the process group that exists, else start one from torchrun's environment, else run alone.

    NCCL on CUDA, gloo on CPU. Without a launcher (no WORLD_SIZE > 1) the engine runs as world size 1
    with no group at all, so a laptop script needs no rendezvous.
    """
    device = _compute_device()
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = backend_for(device)
        dist.init_process_group(backend, timeout=timeout)
        logger.info("started a %s process group of %d ranks", backend, dist.get_world_size())
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        group = dist.new_group(list(range(world)), timeout=_default_group_timeout(device))
        return Comm(group, dist.get_rank(), world, device)
    return Comm(None, 0, 1, device)


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
    comm.ended = reason or "the engine's process group was ended"
    if group is not None and dist.is_initialized():
        logger.error("rank %d: ending the engine's process group (%s) so that the other ranks stop too",
                     comm.rank, comm.ended)
        with contextlib.suppress(Exception):  # the error to see is the one that brought us here
            dist.destroy_process_group(group)


def _record_failure(comm: Comm, message: str) -> str | None:
    """The job's first failure of this engine group: ours if no rank recorded one before (the store's
    compare-and-set decides), else the other rank's; None where the store cannot be reached."""
    key = f"zerooffload/failure/{comm.group.group_name}"
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set(key, "", message[:4000]).decode(errors="replace")
    return None


def _count(comm: Comm, elements: int, tensor: torch.Tensor) -> None:
    comm.counters.data_elements += elements
    comm.counters.data_bytes += elements * tensor.element_size()


# torch 2.13 deprecates the *_tensor names in favour of *_single; torch 2.11 (the H200) has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(comm: Comm, tensor: torch.Tensor, *, async_op: bool = False) -> dist.Work | None:
    """Sum ``tensor`` over ranks in place (callers divide for an average)."""
    if comm.world_size == 1:
        return None
    _count(comm, 2 * tensor.numel(), tensor)
    with span("zerooffload::all_reduce"):
        return dist.all_reduce(tensor, group=comm.group, async_op=async_op)


def reduce_scatter(comm: Comm, output: torch.Tensor, input: torch.Tensor, *, scratch: torch.Tensor | None = None,
                   async_op: bool = False) -> dist.Work | ExchangeWork | None:
    """``output`` = this rank's slice of the sum over ranks of ``input`` (world_size × output elements).

    ``scratch`` ((world_size − 1) × output elements, the caller's to account) receives the peers'
    parts in a direct exchange; one is allocated when it is not given. Keep ``input`` alive until done.
    """
    if comm.world_size == 1:
        output.copy_(input)
        return None
    _count(comm, input.numel(), input)
    with span("zerooffload::reduce_scatter"):
        return _reduce_scatter(comm, output, input, scratch, async_op)


def _reduce_scatter(comm: Comm, output: torch.Tensor, input: torch.Tensor, scratch: torch.Tensor | None,
                    async_op: bool) -> dist.Work | ExchangeWork | None:
    if not comm.direct_exchange:
        return _reduce_scatter_single(output, input, group=comm.group, async_op=async_op)
    parts, peers = input.view(comm.world_size, -1), comm.peers
    if scratch is None:
        scratch = torch.empty(len(peers) * output.numel(), dtype=input.dtype, device=input.device)
    received = dict(zip(peers, scratch.view(len(peers), -1)))

    def finish() -> None:
        contributions = [parts[comm.rank] if r == comm.rank else received[r] for r in range(comm.world_size)]
        torch.add(contributions[0], contributions[1], out=output)
        for part in contributions[2:]:
            output.add_(part)
    return _exchange(comm, {peer: parts[peer] for peer in peers}, received, finish, async_op)


def all_gather(comm: Comm, output: torch.Tensor, input: torch.Tensor, *,
               async_op: bool = False) -> dist.Work | None:
    """``output`` = every rank's ``input`` concatenated in rank order."""
    if comm.world_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    _count(comm, output.numel(), output)
    with span("zerooffload::all_gather"):
        if not comm.direct_exchange:
            return _all_gather_single(output, input, group=comm.group, async_op=async_op)
        rows = output.view(comm.world_size, -1)
        return _exchange(comm, {peer: input for peer in comm.peers}, {peer: rows[peer] for peer in comm.peers},
                         lambda: rows[comm.rank].copy_(input), async_op)


def broadcast(comm: Comm, tensor: torch.Tensor, src: int = 0) -> None:
    """Make every rank's ``tensor`` equal to ``src``'s (initial weights, as DDP does); not counted per step."""
    if comm.world_size > 1:
        dist.broadcast(tensor, src, group=comm.group)


def barrier(comm: Comm) -> None:
    """Wait until every rank of the engine's group got here (nothing to wait for alone)."""
    if comm.world_size > 1:
        dist.barrier(group=comm.group)


def all_gather_object(comm: Comm, value: Any) -> list:
    """Every rank's picklable ``value``, in rank order (``[value]`` alone); not counted per step."""
    if comm.world_size == 1:
        return [value]
    out: list = [None] * comm.world_size
    dist.all_gather_object(out, value, group=comm.group)
    return out


def control_all_reduce(comm: Comm, values: torch.Tensor) -> torch.Tensor:
    """Sum a small float64 control vector over ranks (norms, flags); counted apart from data."""
    if comm.world_size > 1:
        comm.counters.control_elements += values.numel()
        dist.all_reduce(values, group=comm.group)
    return values
