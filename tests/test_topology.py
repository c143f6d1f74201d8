"""Nodes from a given local world size at world 4 (2 nodes x 2 ranks) in the rank pool: the groups
init_comm makes, the bytes counted within and across nodes, and the one-line refusal when nodes disagree."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerooffload.comm import all_gather, all_reduce, init_comm, read_topology, reduce_scatter
from zerooffload.config import ConfigError


def groups_case(local_world_size: int) -> dict:
    """This rank's topology, its groups' members as gathered over them, and what the counters say
    after one all-gather over the world, one within the node and one reduce-scatter."""
    comm = init_comm(local_world_size=local_world_size)
    t = comm.topology
    seen = {}
    for name, group in (("intra", comm.intra), ("inter", comm.inter)):
        if group is not None:
            out = [None] * dist.get_world_size(group)
            dist.all_gather_object(out, comm.rank, group=group)
            seen[name] = out
    shard = 1000
    world = torch.empty(comm.world_size * shard)
    all_gather(comm, world, torch.full((shard,), float(comm.rank)))
    node = torch.empty(t.local_world_size * shard)
    all_gather(comm, node, torch.full((shard,), float(comm.rank)), group=comm.intra)
    counters_after_gathers = (comm.counters.intra_node_bytes, comm.counters.inter_node_bytes)
    reduce_scatter(comm, torch.empty(shard), torch.ones(comm.world_size * shard))
    return {"topology": (t.world_size, t.rank, t.local_world_size, t.local_rank, t.node, t.nodes), "seen": seen,
            "world": world.view(comm.world_size, -1)[:, 0].tolist(), "node": node.view(-1, shard)[:, 0].tolist(),
            "after_gathers": counters_after_gathers,
            "counters": (comm.counters.intra_node_bytes, comm.counters.inter_node_bytes,
                         comm.counters.data_elements, comm.counters.data_bytes)}


def test_two_nodes_of_two_ranks(rank_pools):
    results = rank_pools(4).run(groups_case, 2)
    shard_bytes = 1000 * 4
    for rank, r in enumerate(results):
        node = rank // 2
        assert r["topology"] == (4, rank, 2, rank % 2, node, 2)
        assert r["seen"] == {"intra": [2 * node, 2 * node + 1], "inter": [rank % 2, rank % 2 + 2]}
        assert r["world"] == [0.0, 1.0, 2.0, 3.0]
        assert r["node"] == [float(2 * node), float(2 * node + 1)]
        # world all-gather: the shard to 1 peer in the node and 2 outside; the node's: 1 peer inside
        assert r["after_gathers"] == (2 * shard_bytes, 2 * shard_bytes)
        # reduce-scatter: a 1000-element part to each of 3 peers, 1 inside, 2 outside
        assert r["counters"][:2] == (3 * shard_bytes, 4 * shard_bytes)
        assert r["counters"][2] == 4000 + 2000 + 4000  # DESIGN's elements: outputs of gathers, input of the RS


def one_node_case(local_world_size: int | None) -> tuple:
    comm = init_comm(local_world_size=local_world_size)
    all_reduce(comm, torch.ones(1000))
    return (comm.intra is comm.group, comm.inter is None, comm.topology.nodes,
            comm.counters.intra_node_bytes, comm.counters.inter_node_bytes)


def test_one_node_and_one_rank_a_node(rank_pools):
    """One node (no LOCAL_WORLD_SIZE): the node's group is the engine's, no cross-node group, nothing counted
    across; four nodes of one rank: no node group, and a ring's all-reduce crosses the link from every rank."""
    ring = 2 * 3 * 4000 // 4
    assert rank_pools(4).run(one_node_case, None) == [(True, True, 1, ring, 0)] * 4
    results = rank_pools(4).run(one_node_case, 1)
    assert [r[1:] for r in results] == [(False, 4, 0, ring)] * 4


def disagreeing_case() -> str:
    """Ranks 0-1 say 2 ranks a node, ranks 2-3 one: every rank must refuse alike, none left waiting."""
    try:
        init_comm(local_world_size=2 if dist.get_rank() < 2 else 1)
    except ConfigError as error:
        return str(error)
    return "accepted"


def test_nodes_that_disagree_are_refused_on_every_rank(rank_pools):
    messages = rank_pools(4).run(disagreeing_case)
    assert len(set(messages)) == 1 and "\n" not in messages[0]
    assert messages[0].startswith("LOCAL_WORLD_SIZE differs between nodes (1 on node 2, 2 on node 0)")


def test_topology_from_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert read_topology(4, 3).node == 1
    monkeypatch.setenv("GROUP_RANK", "0")
    with pytest.raises(ConfigError, match="node-major"):
        read_topology(4, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=3 does not divide the world size 4"):
        read_topology(4, 0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert read_topology(4, 3).nodes == 1


def test_memory_plan_asks_the_topology(monkeypatch):
    from zerooffload.memory_plan import local_ranks

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_ranks(8) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_ranks(8) == 8
