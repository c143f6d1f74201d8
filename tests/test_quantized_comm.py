"""ZeRO++'s wire code against an independent numpy reference (every native level and the torch fallback),
and the quantized collectives at world 4 as 2 nodes x 2 ranks against the fp32 collectives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zerooffload.comm import quantize as q

LEVELS = [-1, 0, 1, 2] if q.native_level() else [-1]
QMAX = {8: 127, 4: 7}


def _reference(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (int) and scales (float32) of the note's code, in numpy, block by block."""
    qmax, codes, scales = np.float32(QMAX[bits]), np.zeros(x.size, dtype=np.int64), []
    for start in range(0, x.size, q.BLOCK):
        block = x[start:start + q.BLOCK].astype(np.float32)
        amax = np.abs(block).max()
        if not np.isfinite(amax):
            scales.append(np.float32(np.nan))
            continue
        scales.append(amax / qmax if amax >= q.TINY else np.float32(0))
        if amax >= q.TINY:
            codes[start:start + block.size] = np.clip(np.rint(block * (qmax / amax)), -qmax, qmax)
    return codes, np.array(scales, dtype=np.float32)


def _sample(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(4) * 3  # blocks of unlike ranges
    x[q.BLOCK // 2 + 5: q.BLOCK // 2 + 9] = torch.tensor([1e-3, -1e-3, 0.5, -0.5]) * 1e3  # an outlier block
    return x.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_code_matches_numpy_and_its_bound(bits, dtype):
    numel = 3 * q.BLOCK + 1001  # a short last block, odd for the nibbles
    x = _sample(numel, dtype, seed=bits)
    codes, scales = _reference(x.float().numpy(), bits)
    wires = [q.encode(x, torch.empty(q.wire_bytes(numel, bits), dtype=torch.uint8), bits, level=level)
             for level in LEVELS]
    assert all(torch.equal(wire, wires[0]) for wire in wires)  # every level, the same bytes
    torch_wire = torch.zeros_like(wires[0])
    got_codes, got_scales = q._parts(torch_wire, numel, bits)
    q._encode_torch(x, got_codes, got_scales, bits)
    assert torch.equal(torch_wire, wires[0])  # the fallback too
    got_codes, got_scales = q._parts(wires[0], numel, bits)
    np.testing.assert_array_equal(got_scales.numpy(), scales)
    if bits == 4:  # unpack the nibbles by hand: element 2i low, 2i + 1 high, code + 8
        nibbles = np.stack([got_codes.numpy() & 0xF, got_codes.numpy() >> 4], axis=1).reshape(-1)
        assert nibbles[numel:].tolist() in ([], [8])
        np.testing.assert_array_equal(nibbles[:numel].astype(np.int64) - 8, codes)
    else:
        np.testing.assert_array_equal(got_codes.numpy().view(np.int8), codes)
    qmax = QMAX[bits]
    for b, start in enumerate(range(0, numel, q.BLOCK)):  # each block's largest element codes to +-qmax
        block = x.float()[start:start + q.BLOCK].abs()
        assert abs(codes[start + int(block.argmax())]) == qmax
    for out_dtype in (torch.float32, torch.bfloat16):
        for level in LEVELS:
            out = q.decode(wires[0], torch.empty(numel, dtype=out_dtype), bits, level=level)
            exact = torch.from_numpy(codes.astype(np.float32) * np.repeat(scales, q.BLOCK)[:numel])
            assert torch.equal(out, exact.to(out_dtype))
    bound = torch.from_numpy(np.repeat(scales, q.BLOCK)[:numel]) / 2 * (1 + 1e-6) + x.float().abs() * 2e-7
    error = (q.decode(wires[0], torch.empty(numel), bits) - x.float()).abs()
    assert (error <= bound).all() and error.max() > bound.max() / 10  # within the bound, and it is lossy


def test_accumulate_non_finite_and_zero_blocks():
    numel = 2 * q.BLOCK + 10
    x = torch.randn(numel)
    x[q.BLOCK:2 * q.BLOCK] = 0  # a zero block
    x[2 * q.BLOCK + 3] = float("inf")  # the last block is not finite
    for level in LEVELS:
        wire = q.encode(x, torch.empty(q.wire_bytes(numel), dtype=torch.uint8), level=level)
        base = torch.full((numel,), 0.25)
        summed = q.decode(wire, base.clone(), accumulate=True, level=level)
        alone = q.decode(wire, torch.empty(numel), level=level)
        assert torch.equal(summed[:2 * q.BLOCK], base[:2 * q.BLOCK] + alone[:2 * q.BLOCK])
        assert torch.equal(alone[q.BLOCK:2 * q.BLOCK], torch.zeros(q.BLOCK))
        assert alone[2 * q.BLOCK:].isnan().all() and summed[2 * q.BLOCK:].isnan().all()
        assert q.decode(wire, torch.empty(numel, dtype=torch.bfloat16), level=level)[2 * q.BLOCK:].isnan().all()
    with pytest.raises(ValueError, match="adds only to fp32"):
        q.decode(wire, torch.empty(numel, dtype=torch.bfloat16), accumulate=True)
    assert q.wire_bytes(2049, 8) == 2052 + 8 and q.wire_bytes(2049, 4) == 1028 + 8


def _shard(rank: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    return torch.randn(numel, generator=g) * torch.rand(numel, generator=g) * (rank + 1)


def collectives_case(numel: int) -> dict:
    """At 2 nodes x 2 ranks: a quantized all-gather (fp32 and bf16 output), and quantized reduce-scatters
    at 8 and 4 bits, two in flight waited in reverse order; what each gave and what the counters said."""
    from zerooffload.comm import init_comm, quantized_all_gather, quantized_reduce_scatter

    comm = init_comm(local_world_size=2)
    world, rank, out = comm.world_size, comm.rank, {}
    for dtype in (torch.float32, torch.bfloat16):
        gathered = torch.empty(world * numel, dtype=dtype)
        quantized_all_gather(comm, gathered, _shard(rank, numel, 0).to(dtype))
        out["ag", dtype] = gathered
    out["ag_counts"] = (comm.counters.intra_node_bytes, comm.counters.inter_node_bytes, comm.counters.data_bytes)
    comm.counters.reset()
    pending = []
    for bits in (8, 4):
        result = torch.empty(numel)
        pending.append((bits, result, quantized_reduce_scatter(comm, result, _shard(rank, world * numel, bits),
                                                               bits=bits, async_op=True)))
    for bits, result, work in reversed(pending):
        work.wait()
        out["rs", bits] = result
    out["rs_counts"] = (comm.counters.intra_node_bytes, comm.counters.inter_node_bytes, comm.counters.data_elements)
    return out


def _rs_bound(inputs: list[torch.Tensor], rank: int, bits: int, numel: int) -> torch.Tensor:
    """The note's bound for rank ``rank`` at 2 nodes x 2: each coded term's amax/qmax/2 of its block; a
    partial's block amax bounded by its exact one plus its own leg-1 error."""
    qmax, local, nodes = QMAX[bits], rank % 2, 2

    def half_step(values: torch.Tensor) -> torch.Tensor:  # amax/qmax/2 of each block, per element
        blocks = torch.nn.functional.pad(values.abs(), (0, -numel % q.BLOCK)).view(-1, q.BLOCK).amax(dim=1)
        return (blocks / qmax / 2).repeat_interleave(q.BLOCK)[:numel]

    bound = torch.zeros(numel)
    for node in range(nodes):
        dest_part = [x.view(4, -1)[rank] for x in inputs[2 * node: 2 * node + 2]]
        # leg 1 at the node's rank of this local rank: the other local rank's part was coded
        leg1 = half_step(dest_part[1 - local])
        bound += leg1
        if node != rank // 2:  # leg 2: that node's partial was coded
            bound += half_step((dest_part[0] + dest_part[1]).abs() + leg1)
    return bound * (1 + 1e-5) + sum(x.view(4, -1)[rank].abs() for x in inputs) * 1e-6


def test_quantized_collectives_at_two_nodes_of_two(rank_pools):
    numel = q.BLOCK + 1000  # two blocks a part, the second short
    results = rank_pools(4).run(collectives_case, numel)
    row8, row4 = q.wire_bytes(numel, 8), q.wire_bytes(numel, 4)
    shards = [_shard(r, numel, 0) for r in range(4)]
    for rank, r in enumerate(results):
        for dtype in (torch.float32, torch.bfloat16):  # every row, own included, is the code's: equal on all ranks
            coded = [q.decode(q.encode(s.to(dtype), torch.empty(row8, dtype=torch.uint8)), torch.empty(numel,
                                                                                                      dtype=dtype))
                     for s in shards]
            assert torch.equal(r["ag", dtype], torch.cat(coded)), (rank, dtype)
        error = (r["ag", torch.float32] - torch.cat(shards)).abs()
        assert (error <= torch.cat([_rs_half(s) for s in shards]) * (1 + 1e-5)).all() and error.max() > 0
        # the shard to 1 peer in the node, 2 outside, coded; DESIGN's elements in wire bytes: 4 rows
        assert r["ag_counts"] == (2 * row8, 2 * 2 * row8, 2 * 4 * row8)
        for bits in (8, 4):
            inputs = [_shard(s, 4 * numel, bits) for s in range(4)]
            exact = sum(x.view(4, -1)[rank] for x in inputs)
            error = (r["rs", bits] - exact).abs()
            assert (error <= _rs_bound(inputs, rank, bits, numel)).all(), (rank, bits)
            assert error.max() > 0
        # leg 1: 2 coded parts to the node's other rank; leg 2: 1 coded part across; for each of 8 and 4 bits
        assert r["rs_counts"] == (2 * (row8 + row4), row8 + row4, 2 * 4 * numel)


def _rs_half(shard: torch.Tensor) -> torch.Tensor:
    blocks = torch.nn.functional.pad(shard.abs(), (0, -shard.numel() % q.BLOCK)).view(-1, q.BLOCK).amax(dim=1)
    return (blocks / 127 / 2).repeat_interleave(q.BLOCK)[:shard.numel()]


def one_level_case(local_world_size: int | None, numel: int) -> tuple:
    from zerooffload.comm import init_comm, quantized_reduce_scatter

    comm = init_comm(local_world_size=local_world_size)
    result = torch.empty(numel)
    quantized_reduce_scatter(comm, result, _shard(comm.rank, 4 * numel, 8))
    return result, comm.counters.intra_node_bytes, comm.counters.inter_node_bytes


def test_one_level_at_one_node_and_at_one_rank_a_node(rank_pools):
    """One node of 4 (leg 1 alone) and 4 nodes of 1 (leg 2 alone): each peer's part coded once, so the
    error is within the sum of the peers' amax/127/2."""
    numel, row = 3000, q.wire_bytes(3000, 8)
    inputs = [_shard(s, 4 * numel, 8).view(4, -1) for s in range(4)]
    for local, counts in ((None, (3 * row, 0)), (1, (0, 3 * row))):
        for rank, (result, intra, inter) in enumerate(rank_pools(4).run(one_level_case, local, numel)):
            exact = sum(x[rank] for x in inputs)
            bound = sum(_rs_half(inputs[s][rank]) for s in range(4) if s != rank) * (1 + 1e-5) + exact.abs() * 1e-6
            assert ((result - exact).abs() <= bound).all() and (intra, inter) == counts, (local, rank)
