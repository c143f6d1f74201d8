"""The bytes stage 3's collectives send per rank and step, within the node and across nodes, with and
without ZeRO++ (``estimate``'s table, ``predict``'s collectives, ``plan``'s proposal).

[Note: volumes]
Bytes a rank *sends* as the engine's exchanges send them (each part straight to the rank that needs it:
comm's counters, ``intra_node_bytes`` and ``inter_node_bytes``), for Ψ elements of gathered units in a
compute dtype of c bytes, N ranks, L a node, M = N / L nodes, per micro-batch:
- a weight all-gather sends this rank's shard, Ψc / N, to each other rank: (L − 1) Ψc / N within the node,
  (N − L) Ψc / N across; under qwZ a shard crosses as the wire code (comm.quantize: a byte an element and
  an fp32 scale a 2048-element block), so c becomes q = 1 + 4/2048;
- forward gathers every unit; backward gathers again the share ``regathered`` that ``zero.max_live_size``
  could not keep; under hpZ from the secondary shards, within the node only: (L − 1) Ψc / L;
- the gradient reduce-scatter sends every other rank its part of the fp32 sums: (L − 1) 4Ψ / N within,
  (N − L) 4Ψ / N across; under qgZ with b bits (q_b = b/8 + 4/2048 bytes an element) first the node's
  all-to-all, (L − 1) Ψ q_b / L within, then across nodes each rank's node sum of Ψ / L: (M − 1) Ψ q_b / N.
Across a 2 × 2 job in fp32 that is 6Ψ bytes plain (2 + 2 + 2), 4Ψ with hpZ (0.67), 0.75Ψ with all three
(0.125) and 0.63Ψ with 4-bit gradients (0.104).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..comm.quantize import BLOCK

__all__ = ["SLOW_LINK", "Volume", "gather_volume", "proposes_zero_pp", "reduce_volume", "step_volume",
           "wire_element_bytes"]

REDUCE_BYTES = 4
"""Gradients are summed in fp32 (reduction's REDUCE_DTYPE)."""


def wire_element_bytes(bits: int) -> float:
    """Bytes an element takes in the wire code of ``bits`` bits: its code and its share of its block's scale."""
    return bits / 8 + 4 / BLOCK


@dataclass(frozen=True, slots=True)
class Volume:
    """Bytes a rank sends: to ranks of its node, and to ranks of other nodes (over the link)."""

    intra: float = 0.0
    inter: float = 0.0

    def __add__(self, other: "Volume") -> "Volume":
        return Volume(self.intra + other.intra, self.inter + other.inter)

    def __mul__(self, factor: float) -> "Volume":
        return Volume(self.intra * factor, self.inter * factor)


SLOW_LINK = 4.0
"""``plan`` proposes ZeRO++ when the link between nodes carries bytes this many times slower than the
ranks of a node exchange them (``proposes_zero_pp``): there, stage 3's across-node bytes (6Ψ of its 9Ψ a
rank sends at 2 × 2 in fp32) take most of the collectives' time, and ZeRO++ cuts them 5-8x."""


def gather_volume(numel: float, world: int, local: int, element_bytes: float) -> Volume:
    """A weight all-gather of ``numel`` elements of ``element_bytes`` over every rank (see the note)."""
    shard = numel * element_bytes / world
    return Volume((local - 1) * shard, (world - local) * shard)


def reduce_volume(numel: float, world: int, local: int, bits: int) -> Volume:
    """A gradient reduce-scatter of ``numel`` elements, in fp32 (``bits`` 0) or under qgZ (see the note)."""
    if not bits:
        return gather_volume(numel, world, local, REDUCE_BYTES)
    element = wire_element_bytes(bits)
    return Volume((local - 1) * numel * element / local, (world // local - 1) * numel * element / world)


def step_volume(numel: float, world: int, local: int, compute_bytes: int, *, quantized_weights: bool = False,
                hpz: bool = False, gradient_bits: int = 0, regathered: float = 1.0, micro_batches: int = 1) -> Volume:
    """Bytes a rank sends in one step of ``micro_batches`` forwards and backwards of stage 3 over ``numel``
    gathered elements (see [Note: volumes]); nothing at one rank."""
    if world == 1:
        return Volume()
    gathered = compute_bytes if not quantized_weights else wire_element_bytes(8)
    forward = gather_volume(numel, world, local, gathered)
    backward = (Volume((local - 1) * numel * compute_bytes / local, 0.0) if hpz else forward) * regathered
    return (forward + backward + reduce_volume(numel, world, local, gradient_bits)) * micro_batches


def proposes_zero_pp(intra_gbps: float | None, inter_gbps: float | None, nodes: int) -> bool:
    """Whether ``plan`` tries ZeRO++'s three settings: over several nodes whose link is ``SLOW_LINK`` times
    slower than a node's own exchanges (``intra_gbps``, the probe's collective rate); never without a
    measured or given link rate (a probe on one machine has none: ``plan --inter-node-rate``)."""
    return nodes > 1 and bool(intra_gbps) and inter_gbps is not None and inter_gbps * SLOW_LINK <= intra_gbps
