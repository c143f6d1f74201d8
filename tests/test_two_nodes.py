"""bench/two_nodes.py's link: a nano run at 2 nodes x 2 ranks through two network namespaces, whose veth
counted at least the bytes the engine says its ranks sent across nodes (and not the intra-node ones)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def _netns_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _netns_works(), reason="needs root and ip netns (network namespaces)")
def test_a_two_node_run_crosses_the_veth():
    import two_nodes

    with two_nodes.two_nodes(rate=None) as link, tempfile.TemporaryDirectory() as tmp:
        names = link.names
        before = link.bytes_crossed()
        summary = two_nodes.train(link, ["-m", "zerooffload", "train", "--model", "nano", *two_nodes.BASE], 1,
                                  Path(tmp), timeout=120)
        crossed = link.bytes_crossed() - before
    assert not set(names) & set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    traffic = summary["traffic"]
    inter, intra = traffic["inter_node_bytes"] * 4, traffic["intra_node_bytes"] * 4  # 4 ranks sending alike
    assert summary["world_size"] == 4 and inter > 0 and intra > 0
    # the link carried the step's cross-node bytes plus start-up (rendezvous, the initial broadcast of
    # ~3.4 MB of fp32 weights, headers), never the intra-node ones on top
    assert inter <= crossed < inter + intra
