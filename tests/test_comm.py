"""Collectives against sums and concatenations computed locally; gloo's direct exchanges in flight together."""
from __future__ import annotations

import torch

from zerooffload.comm import all_gather, init_comm, reduce_scatter


def _input(rank: int, numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + rank))


def collectives_case(rounds: int = 3) -> dict:
    """Several reduce-scatters and all-gathers in flight at once, waited in reverse order; returns what
    each produced, for the test to compare with what it computes itself."""
    comm = init_comm()
    world, rank, shard = comm.world_size, comm.rank, 1000
    assert comm.direct_exchange  # gloo
    pending = []
    for seed in range(rounds):
        rs_out, ag_out = torch.empty(shard), torch.empty(world * shard)
        pending.append(("rs", seed, rs_out, reduce_scatter(comm, rs_out, _input(rank, world * shard, seed),
                                                           async_op=True)))
        pending.append(("ag", seed, ag_out, all_gather(comm, ag_out, _input(rank, shard, seed), async_op=True)))
    outputs = {}
    for kind, seed, out, work in reversed(pending):
        work.wait()
        outputs[kind, seed] = out
    return {"rank": rank, "world": world, "outputs": outputs, "data_elements": comm.counters.data_elements}


def test_direct_exchanges_at_world_2_and_4(rank_pools):
    rounds, shard = 3, 1000
    for world in (2, 4):
        results = rank_pools(world).run(collectives_case, rounds)
        assert [(r["rank"], r["world"]) for r in results] == [(rank, world) for rank in range(world)]
        for rank, result in enumerate(results):
            assert sorted(result["outputs"]) == sorted((kind, seed) for kind in ("ag", "rs") for seed in range(rounds))
            for seed in range(rounds):
                summed = sum(_input(r, world * shard, seed).view(world, -1)[rank] for r in range(world))
                torch.testing.assert_close(result["outputs"]["rs", seed], summed, atol=1e-6, rtol=0)
                gathered = torch.cat([_input(r, shard, seed) for r in range(world)])
                assert torch.equal(result["outputs"]["ag", seed], gathered), (world, rank, seed)
            # DESIGN §3's convention: a reduce-scatter or all-gather of N elements counts N per rank
            assert result["data_elements"] == rounds * 2 * world * shard
