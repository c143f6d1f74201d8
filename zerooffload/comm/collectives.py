"""Collectives as free functions with explicit inputs, counting what they move.

[Note: collective accounting]
Elements per rank per step, DESIGN §3's convention: an all-gather counts its output, a
reduce-scatter its input, an all-reduce twice its size (so DDP moves 2Ψ, stages 1–2 2Ψ, stage 3
3Ψ). *Data* collectives move model states and are what that convention counts; *control*
collectives (one small all-reduce per step of gradient-norm squares, overflow and used-parameter
flags) are counted apart. At world size 1 nothing is sent and nothing is counted. Beside the
convention, each data collective adds the bytes this rank *sends*, split by where they go
(topology's [Note: nodes]): to ranks of its own node (``intra_node_bytes``) or of other nodes
(``inter_node_bytes``, what crosses the link). A direct exchange sends its part once to each peer, so
an all-gather over 2 nodes × 2 ranks sends this rank's shard to 1 peer in its node and 2 outside it.
An all-reduce (stage 0) is counted as a ring in rank order moves it: 2(N−1)/N of its bytes to the next
rank, across the link where that rank is on the next node. The sum of every rank's
``inter_node_bytes`` is the payload the link carries (the link adds its headers).

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
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..trace import span
from .group import Comm

__all__ = ["ExchangeWork", "all_reduce", "reduce_scatter", "all_gather", "control_all_reduce", "broadcast",
           "barrier", "all_gather_object", "members", "count", "exchange"]


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


def exchange(comm: Comm, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor],
             finish: Callable[[], None], async_op: bool, *, group: dist.ProcessGroup | None = None,
             tag: int | None = None) -> ExchangeWork | None:
    """Post every send and receive (peers by global rank) with one tag (the next of the sequence unless
    given); complete now unless ``async_op``."""
    tag = comm.next_tag() if tag is None else tag
    group = comm.group if group is None else group
    handles = [dist.isend(t, peer, group=group, tag=tag) for peer, t in sends.items()]
    handles += [dist.irecv(t, peer, group=group, tag=tag) for peer, t in receives.items()]
    work = ExchangeWork(handles, finish)
    if async_op:
        return work
    work.wait()
    return None


def members(comm: Comm, group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (None: the engine's group), in the group's order."""
    if group is None or group is comm.group:
        return list(range(comm.world_size))
    if group is comm.intra:
        return comm.topology.node_ranks()
    if group is comm.inter:
        return comm.topology.peer_ranks()
    return dist.get_process_group_ranks(group)


def count(comm: Comm, elements: int, nbytes: int, *, ranks: list[int], per_peer: int) -> None:
    """Count a data collective: DESIGN's ``elements`` (``nbytes`` of them) and ``per_peer`` bytes sent to
    each other rank of ``ranks`` ([Note: collective accounting])."""
    counters = comm.counters
    counters.data_elements += elements
    counters.data_bytes += nbytes
    intra, inter = comm.topology.split(ranks)
    counters.intra_node_bytes += intra * per_peer
    counters.inter_node_bytes += inter * per_peer


# torch 2.13 deprecates the *_tensor names in favour of *_single; torch 2.11 (the H200) has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(comm: Comm, tensor: torch.Tensor, *, async_op: bool = False) -> dist.Work | None:
    """Sum ``tensor`` over ranks in place (callers divide for an average)."""
    if comm.world_size == 1:
        return None
    nbytes = tensor.numel() * tensor.element_size()
    ring = [comm.rank, (comm.rank + 1) % comm.world_size]  # counted as a ring in rank order: see the note
    count(comm, 2 * tensor.numel(), 2 * nbytes, ranks=ring, per_peer=2 * (comm.world_size - 1) * nbytes
          // comm.world_size)
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
    count(comm, input.numel(), input.numel() * input.element_size(), ranks=members(comm, None),
          per_peer=output.numel() * input.element_size())
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
    return exchange(comm, {peer: parts[peer] for peer in peers}, received, finish, async_op)


def all_gather(comm: Comm, output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> dist.Work | None:
    """``output`` = every rank's ``input`` concatenated in the order of ``group``'s ranks: the engine's
    whole group by default; ``comm.intra`` gathers within this rank's node (hpZ's secondary shards), its
    bytes counted as intra-node. Pass ``comm.intra`` only where it is not None (one rank a node)."""
    ranks = members(comm, group)
    if len(ranks) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    count(comm, output.numel(), output.numel() * output.element_size(), ranks=ranks,
          per_peer=input.numel() * input.element_size())
    with span("zerooffload::all_gather"):
        if not comm.direct_exchange:
            return _all_gather_single(output, input, group=comm.group if group is None else group, async_op=async_op)
        rows, peers = output.view(len(ranks), -1), [r for r in ranks if r != comm.rank]
        return exchange(comm, {peer: input for peer in peers}, {peer: rows[ranks.index(peer)] for peer in peers},
                        lambda: rows[ranks.index(comm.rank)].copy_(input), async_op, group=group)


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
