"""Collectives against sums and concatenations computed locally; gloo's direct exchanges in flight together."""
from __future__ import annotations

import torch
import torch.distributed as dist

from zerooffload.comm import all_gather, init_comm, reduce_scatter


def _input(rank: int, numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + rank))


def collectives_case(rounds: int = 3) -> bool:
    """Several reduce-scatters and all-gathers in flight at once, waited in reverse order."""
    comm = init_comm()
    world, rank, shard = comm.world_size, comm.rank, 1000
    assert comm.direct_exchange  # gloo
    pending = []
    for seed in range(rounds):
        rs_out, ag_out = torch.empty(shard), torch.empty(world * shard)
        pending.append(("rs", seed, rs_out, reduce_scatter(comm, rs_out, _input(rank, world * shard, seed),
                                                           async_op=True)))
        pending.append(("ag", seed, ag_out, all_gather(comm, ag_out, _input(rank, shard, seed), async_op=True)))
    for kind, seed, out, work in reversed(pending):
        work.wait()
        if kind == "rs":
            expected = sum(_input(r, world * shard, seed).view(world, -1)[rank] for r in range(world))
            assert torch.allclose(out, expected, atol=1e-6), (kind, seed)
        else:
            assert torch.equal(out, torch.cat([_input(r, shard, seed) for r in range(world)])), (kind, seed)
    assert comm.counters.data_elements == rounds * 2 * world * shard
    return dist.get_world_size() == world


def test_direct_exchanges_at_world_2_and_4(rank_pools):
    for world in (2, 4):
        assert rank_pools(world).run(collectives_case) == [True] * world
