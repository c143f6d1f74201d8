"""ZeRO++'s quantized collectives: qwZ's weight all-gather and qgZ's hierarchical gradient reduce-scatter.

[Note: qwZ]
``quantized_all_gather`` sends each rank's shard in the wire code (quantize's [Note: the wire code]:
int8 with a scale a 2048-element block, ~1/2 the bytes of bf16 and ~1/4 of fp32) and decodes every row
on arrival into the output's dtype, this rank's own row too: every rank then holds the same gathered
weights (replicas that differed by rank would compute different forwards). Each element is off by at
most amax/127/2 of its block; the shards themselves (the masters' copies) never see the code.

[Note: qgZ]
``quantized_reduce_scatter`` gives rank r the sum over ranks of part r of their inputs, as
``reduce_scatter`` does (input: world_size parts of output's size, rank order), in two legs so that
each node's data crosses the link once and coded:
1. within the node, an all-to-all: this rank sends to the node's rank of local rank j, coded, its
   parts for every node's rank of local rank j (nodes parts); the receiver decodes and sums them in
   fp32 into one *partial* per node (its node's contribution to that node's rank of its local rank);
2. across nodes, an all-to-all among the ranks of this local rank: each partial goes, coded again, to
   the node it is for; the receiver decodes and sums them in fp32 into ``output``.
At one node the second leg is absent; at one rank a node the first is. A rank's own contribution is
never coded (it does not travel), so leg 1 adds exactly what this rank holds. Summation order, fp32:
leg 1 adds local ranks 0, 1, ... in order (the first written, the rest added), leg 2 adds nodes 0, 1,
... in order, the same on every rank. Error per element: the code's amax/qmax/2 for each coded term,
amax of the sender's block in leg 1 and of the partial's in leg 2 (qmax 127 at 8 bits, 7 at 4 bits).
A rank sends (local_world_size − 1) × nodes coded parts within its node and nodes − 1 across: at 2 × 2
and 8 bits, one coded part (~1/4 of its fp32 bytes) leaves the node per rank, against two fp32 parts
for ``reduce_scatter``.

[Note: stages]
Leg 2 cannot be posted before leg 1 has arrived, so an asynchronous ``quantized_reduce_scatter`` posts
leg 1 at once and leg 2 in its handle's ``wait``. Its tags are taken from the ``Comm``'s sequence when it
is issued (so they match on every rank whatever else runs meanwhile), and a wait first completes every
staged collective issued before it (``Comm.staged``): ranks that wait in different orders still post
the second legs in one order, and no two ranks can each wait for the other's later leg.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..trace import span
from .collectives import ExchangeWork, count, exchange, members
from .group import Comm
from .quantize import decode, encode, wire_bytes

__all__ = ["quantized_all_gather", "quantized_reduce_scatter", "StagedWork"]


def _coded(tensors: list[torch.Tensor], bits: int) -> torch.Tensor:
    """One uint8 buffer holding the wire form of each of ``tensors`` (equal sizes), row after row."""
    row = wire_bytes(tensors[0].numel(), bits)
    out = torch.empty(len(tensors) * row, dtype=torch.uint8, device=tensors[0].device)
    for i, tensor in enumerate(tensors):
        encode(tensor.contiguous(), out[i * row:(i + 1) * row], bits)
    return out


def quantized_all_gather(comm: Comm, output: torch.Tensor, input: torch.Tensor, *, group=None,
                         async_op: bool = False) -> ExchangeWork | None:
    """``output`` (bf16 or fp32) = every rank's ``input`` in ``group``'s rank order (the engine's whole
    group by default), each shard sent as int8 blocks and decoded on arrival ([Note: qwZ])."""
    ranks = members(comm, group)
    rows = output.view(len(ranks), -1)
    wire = _coded([input], 8)
    if len(ranks) == 1:  # nothing travels, but the weights are the code's as they would be with peers
        decode(wire, rows[0], 8)
        return None
    row = wire.numel()
    count(comm, output.numel(), len(ranks) * row, ranks=ranks, per_peer=row)
    peers = [r for r in ranks if r != comm.rank]
    received = torch.empty(len(peers) * row, dtype=torch.uint8, device=wire.device)
    inbox = {peer: received[i * row:(i + 1) * row] for i, peer in enumerate(peers)}

    def finish() -> None:
        for rank, rows_index in zip(ranks, range(len(ranks))):
            decode(wire if rank == comm.rank else inbox[rank], rows[rows_index], 8)
    with span("zerooffload::quantized_all_gather"):
        return exchange(comm, {peer: wire for peer in peers}, inbox, finish, async_op, group=group)


class StagedWork:
    """A collective in legs: the first posted when issued, each later one posted by ``wait`` after the one
    before it completed ([Note: stages]); ``wait`` completes older staged collectives of the ``Comm`` first."""

    def __init__(self, comm: Comm, legs: list[Callable[[], ExchangeWork | None]]):
        self._comm, self._legs, self._done = comm, list(legs), False
        comm.staged.append(self)
        self._work = self._legs.pop(0)()

    def wait(self) -> bool:
        if self._done:
            return True
        queue = self._comm.staged
        while queue and queue[0] is not self:
            queue[0].wait()
        while True:
            if self._work is not None:
                self._work.wait()
            if not self._legs:
                break
            self._work = self._legs.pop(0)()
        self._done = True
        queue.popleft()
        return True


def quantized_reduce_scatter(comm: Comm, output: torch.Tensor, input: torch.Tensor, *, bits: int = 8,
                             async_op: bool = False) -> StagedWork | None:
    """``output`` = this rank's part of the sum over ranks of ``input`` (world_size × output elements,
    fp32 or bf16), summed in fp32, each part crossing the wire coded in ``bits`` (8 or 4) per block
    ([Note: qgZ]). The same layout as ``reduce_scatter``: H2's reducer swaps one for the other."""
    if comm.world_size == 1:
        output.copy_(input)
        return None
    t, numel = comm.topology, output.numel()
    parts, row = input.view(comm.world_size, numel), wire_bytes(numel, bits)
    partial = torch.empty(t.nodes, numel, dtype=torch.float32, device=input.device)
    count(comm, input.numel(), comm.world_size * row, ranks=t.node_ranks(), per_peer=t.nodes * row)
    count(comm, 0, 0, ranks=t.peer_ranks(), per_peer=row)
    legs = [_within_node(comm, parts, partial, bits, comm.next_tag()),
            _across_nodes(comm, partial, output, bits, comm.next_tag())]
    with span("zerooffload::quantized_reduce_scatter"):
        work = StagedWork(comm, legs)
        if async_op:
            return work
        work.wait()
        return None


def _within_node(comm: Comm, parts: torch.Tensor, partial: torch.Tensor, bits: int,
                 tag: int) -> Callable[[], ExchangeWork | None]:
    """Leg 1: ``partial[n]`` = the node's sum of the parts for rank (n, this local rank)."""
    t = comm.topology
    mine = [parts[rank] for rank in t.peer_ranks()]  # this rank's parts for its own local rank on every node

    def post() -> ExchangeWork | None:
        if t.local_world_size == 1:
            partial.copy_(torch.stack(mine))
            return None
        peers = [r for r in t.node_ranks() if r != comm.rank]
        row = wire_bytes(partial.shape[1], bits) * t.nodes
        sends = {peer: _coded([parts[r] for r in t.peer_ranks(peer % t.local_world_size)], bits) for peer in peers}
        inbox = {peer: torch.empty(row, dtype=torch.uint8, device=parts.device) for peer in peers}

        def finish() -> None:
            for node in range(t.nodes):
                _sum_in_order(partial[node], [mine[node] if r == comm.rank else _row(inbox[r], node, t.nodes)
                                              for r in t.node_ranks()], bits)
        return exchange(comm, sends, inbox, finish, True, group=comm.intra, tag=tag)
    return post


def _across_nodes(comm: Comm, partial: torch.Tensor, output: torch.Tensor, bits: int,
                  tag: int) -> Callable[[], ExchangeWork | None]:
    """Leg 2: ``output`` = the sum over nodes of their partials for this rank."""
    t = comm.topology

    def post() -> ExchangeWork | None:
        if t.nodes == 1:
            output.copy_(partial[0])
            return None
        peers = [r for r in t.peer_ranks() if r != comm.rank]
        sends = {peer: _coded([partial[t.node_of(peer)]], bits) for peer in peers}
        inbox = {peer: torch.empty_like(sends[peer]) for peer in peers}

        def finish() -> None:
            target = output if output.dtype == torch.float32 else torch.empty_like(output, dtype=torch.float32)
            _sum_in_order(target, [partial[t.node] if r == comm.rank else inbox[r] for r in t.peer_ranks()], bits)
            if target is not output:
                output.copy_(target)
        return exchange(comm, sends, inbox, finish, True, group=comm.inter, tag=tag)
    return post


def _row(buffer: torch.Tensor, index: int, rows: int) -> torch.Tensor:
    size = buffer.numel() // rows
    return buffer[index * size:(index + 1) * size]


def _sum_in_order(out: torch.Tensor, terms: list[torch.Tensor], bits: int) -> None:
    """``out`` (fp32) = the sum of ``terms`` in order: a uint8 term is a wire row to decode, any other a
    tensor of values added as they are."""
    for i, term in enumerate(terms):
        if term.dtype == torch.uint8:
            decode(term, out, bits, accumulate=i > 0)
        elif i == 0:
            out.copy_(term)
        else:
            out.add_(term)
