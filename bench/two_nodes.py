"""Two nodes on one machine: a training run at 2 nodes x 2 ranks over a real link, its bytes counted by the link.

Two network namespaces joined by a veth pair (MTU 9000; ``tc`` tbf on both ends when ``--rate`` is given,
e.g. 200mbit), loopback up in each, and ``torchrun --nnodes 2 --nproc-per-node 2`` in each with gloo bound
to its end of the veth (GLOO_SOCKET_IFNAME): ranks of one node talk over loopback, ranks of two nodes
across the veth, whose own counters (/sys/class/net/<end>/statistics/{tx,rx}_bytes, read inside node A's
namespace: both directions) say what crossed. Each measurement trains twice, ``--warmup`` steps and
``--warmup + --steps`` steps, and takes the difference of the link's bytes, so start-up traffic
(rendezvous, the initial broadcast, the first step's trace) cancels: bytes per timed step. Beside it: the
step time (the longer run's summary.json median) and the engine's own count (rank 0's inter-node bytes a
step, times the world size: every rank sends alike in these runs).

    sudo python bench/two_nodes.py [--rate 200mbit] [--steps 4] [key=value ...]     one configuration
    sudo python bench/two_nodes.py --pair "" "zero.hpz_partition_size=2" --pairs 5   interleaved pairs

It needs root (namespaces, tc); without it one line says so and it exits with status 2. The namespaces
are deleted on every exit (finally, also on Ctrl-C and SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pairs import interleaved_pairs, record, report_pairs  # noqa: E402

BASE = ["zero.stage=3", "zero.prefetch_size=4MiB", "zero.max_live_size=16MiB"]
"""Every run's keys: stage 3 with a window small enough that backward gathers again (issue 44)."""
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PORT = 29533


@dataclass(frozen=True)
class Link:
    """The two namespaces and their veth ends."""

    names: tuple[str, str]
    ends: tuple[str, str]

    def run(self, node: int, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[node], *command], check=True, **kwargs)

    def bytes_crossed(self) -> int:
        """Bytes through node A's end, both directions (what the link carried)."""
        stats = f"/sys/class/net/{self.ends[0]}/statistics"
        out = self.run(0, ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"], capture_output=True, text=True).stdout
        return sum(int(v) for v in out.split())


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


@contextlib.contextmanager
def two_nodes(rate: str | None):
    """The link, deleted on every exit."""
    tag = os.getpid() % 100000
    link = Link((f"zo-a-{tag}", f"zo-b-{tag}"), (f"zoa{tag}", f"zob{tag}"))
    try:
        for name in link.names:
            _ip("netns", "add", name)
        _ip("link", "add", link.ends[0], "mtu", "9000", "type", "veth", "peer", "name", link.ends[1], "mtu", "9000")
        for node in (0, 1):
            _ip("link", "set", link.ends[node], "netns", link.names[node])
            _ip("-n", link.names[node], "addr", "add", f"{ADDRESSES[node]}/24", "dev", link.ends[node])
            _ip("-n", link.names[node], "link", "set", link.ends[node], "up")
            _ip("-n", link.names[node], "link", "set", "lo", "up")
            if rate:
                link.run(node, ["tc", "qdisc", "add", "dev", link.ends[node], "root", "tbf", "rate", rate,
                                "burst", "128kb", "latency", "200ms"])
        yield link
    finally:
        for name in link.names:
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)


def train(link: Link, command: list[str], steps: int, out: Path, timeout: float) -> dict:
    """One run of ``command`` (``--steps`` and ``--out`` added) on both nodes; its summary.json."""
    procs = []
    try:
        for node in (0, 1):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link.ends[node], "OMP_NUM_THREADS": "1"}
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                        "--nproc-per-node", "2", "--master-addr", ADDRESSES[0], "--master-port", str(PORT)]
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", link.names[node], "env", *(f"{k}={v}" for k, v in env.items()
                                                                   if k in ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")),
                 *torchrun, *command, "--steps", str(steps), "--out", str(out), "--overwrite"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError("a node failed:\n" + "\n".join(o[-3000:] for o in outputs))
    return json.loads((out / "summary.json").read_text())


def measure(link: Link, command: list[str], warmup: int, steps: int, timeout: float) -> dict:
    """Bytes a timed step moved across the link, its time, and the engine's count (see the module's note)."""
    with tempfile.TemporaryDirectory(prefix="zo-two-nodes-") as tmp:
        before = link.bytes_crossed()
        train(link, command, warmup, Path(tmp), timeout)
        middle = link.bytes_crossed()
        summary = train(link, command, warmup + steps, Path(tmp), timeout)
        after = link.bytes_crossed()
    link_bytes = ((after - middle) - (middle - before)) / steps
    engine = summary["traffic"]["inter_node_bytes"] * summary["world_size"]
    return {"step_seconds": summary["traffic"]["step_seconds"], "link_bytes_per_step": link_bytes,
            "engine_inter_node_bytes_per_step": engine, "losses": summary["losses"][-3:]}


def _command(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    return ["-m", "zerooffload", "train", "--model", args.model, *BASE, *args.overrides, *overrides]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rate", default=None, help="shape the link with tc tbf (e.g. 200mbit); unshaped without")
    parser.add_argument("--warmup", type=int, default=2, help="steps of the first run (subtracted)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps: the second run trains warmup + steps")
    parser.add_argument("--pair", nargs=2, metavar=("OURS", "THEIRS"), help="two sets of keys to compare in pairs")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--target", type=float, default=1.0, help="the pairs' ratio target (ours / theirs)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("overrides", nargs="*", help="keys passed to every run (key.path=value)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or not shutil.which("ip") or (args.rate and not shutil.which("tc")):
        print("two_nodes: needs root and iproute2 (ip, tc) to make network namespaces; run it as root", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # finally runs
    with two_nodes(args.rate) as link:
        if not args.pair:
            result = measure(link, _command(args, []), args.warmup, args.steps, args.timeout)
            print(json.dumps(result))
            record("two_nodes", rate=args.rate, model=args.model, overrides=args.overrides, **result)
            return 0
        sides = [shlex.split(keys) for keys in args.pair]
        seen: dict[str, list[dict]] = {keys: [] for keys in args.pair}

        def side(keys: str, overrides: list[str]):
            def once() -> float:
                seen[keys].append(measure(link, _command(args, overrides), args.warmup, args.steps, args.timeout))
                return seen[keys][-1]["step_seconds"]
            return (keys or "plain", once)
        results = interleaved_pairs(args.pairs, side(args.pair[0], sides[0]), side(args.pair[1], sides[1]))
        names = (args.pair[0] or "plain", args.pair[1] or "plain")
        report_pairs(f"two nodes x 2 ranks, {args.model}, link {args.rate or 'unshaped'}", names, results,
                     args.target)
        for keys, runs in seen.items():
            print(f"{keys or 'plain'}: link bytes a step median {statistics.median(r['link_bytes_per_step'] for r in runs):,.0f}, "
                  f"engine's {statistics.median(r['engine_inter_node_bytes_per_step'] for r in runs):,.0f}")
            record("two_nodes", rate=args.rate, model=args.model, overrides=[*args.overrides, *shlex.split(keys)],
                   runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
