"""The prefetching scheduler alone: random unit sizes, traces and bounds, fake units, no model.

Invariants checked after every call: gathered bytes never exceed max_live_size, a unit is gathered
(and its views attached) whenever a use begins, nothing stays gathered after a pass, every use is
counted once as a hit or a miss, and once a trace is recorded an unchanged order stalls only on the
pass's first unit when the window can hold the next unit; a changed order drops the trace; an
evaluation pass leaves it alone.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerooffload.comm import Comm
from zerooffload.zero.partition import ParamState
from zerooffload.zero.placement import UnitPlacement
from zerooffload.zero.scheduler import ParamScheduler
from zerooffload.tiers import Block, DeviceTier, HostTier, Kind


class _Layout:
    def __init__(self, name: str, numel: int):
        self.name, self.padded_numel = name, numel


class FakeUnit:
    """What the scheduler asks of a unit: an index, a shard block, a full buffer to gather into, views to
    attach; its parameter states move as partition's [Note: unit states] says, or the test fails."""

    compute_dtype = torch.float32
    placement = UnitPlacement(index=0, trainable=True, partitioned=True, param_home="device", optimizer="device",
                              update_on="device", keep_full_grad=False, keep_grad_shard=True, grad_leaves=False,
                              grads_kept=False, grad_home="device", updates_in_backward=False,
                              updates_tentatively=False, master_is_param=True, master_split=False,
                              params_in_masters=False, published_by_all_gather=False)
    """A plain stage 3 unit's: gathered over every rank, unquantized, no secondary shard."""
    secondary = None

    def __init__(self, index: int, name: str, numel: int, tier: DeviceTier):
        self.index = index
        self.layout = _Layout(name, numel)
        self.param_block = Block(tier.empty(Kind.PARAM, numel, torch.float32).fill_(len(name)))
        self.param_state = ParamState.SHARDED
        self._buffer: torch.Tensor | None = None

    @property
    def gathered(self) -> bool:
        """Live: gathered or being gathered (its bytes count)."""
        return self.param_state is not ParamState.SHARDED

    @property
    def attached(self) -> bool:
        return self.param_state is ParamState.GATHERED

    def begin_gather(self, tier: DeviceTier) -> torch.Tensor:
        assert self.param_state is ParamState.SHARDED
        self.param_state = ParamState.GATHERING
        self._buffer = tier.empty(Kind.GATHERED, self.layout.padded_numel, torch.float32)
        return self._buffer

    def finish_gather(self) -> None:
        assert self.param_state is ParamState.GATHERING
        assert torch.equal(self._buffer, self.param_block.data)  # the gather arrived
        self.param_state = ParamState.GATHERED

    def reshard(self, tier: DeviceTier) -> None:
        assert self.param_state is ParamState.GATHERED
        tier.free(Kind.GATHERED, self._buffer)
        self.param_state = ParamState.SHARDED
        self._buffer = None


def _scheduler(sizes: list[int], prefetch: int, max_live: int) -> tuple[ParamScheduler, list[FakeUnit]]:
    device = DeviceTier("device", torch.device("cpu"), None)
    units = [FakeUnit(10 + i, f"u{i}", n, device) for i, n in enumerate(sizes)]  # unit indices: not positions
    comm = Comm(None, 0, 1, torch.device("cpu"))
    return ParamScheduler(comm, units, device, HostTier("host", torch.device("cpu"), None),
                          prefetch_bytes=prefetch, max_live_bytes=max_live), units


def _run_pass(scheduler: ParamScheduler, units: list[FakeUnit], order: list[int], max_live: int) -> None:
    """One training pass: each use acquires then releases its unit, as the hooks do (one unit at a time)."""
    scheduler.begin_pass(training=True)
    for index in order:
        scheduler.acquire(units[index])
        assert units[index].gathered and units[index].attached
        assert scheduler.live_bytes <= max_live
        assert scheduler.live_bytes == sum(u.layout.padded_numel * 4 for u in units if u.gathered)
        scheduler.release(units[index])
        assert scheduler.live_bytes <= max_live
    scheduler.end_pass()
    assert scheduler.live_bytes == 0 and not any(u.gathered for u in units)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 64).map(lambda n: n * 256), min_size=1, max_size=8),
       order_seed=st.lists(st.integers(0, 7), min_size=1, max_size=24),
       prefetch_units=st.integers(0, 4), slack_units=st.integers(0, 4))
def test_bounds_hold_and_a_recorded_trace_only_misses_its_first_unit(sizes, order_seed, prefetch_units, slack_units):
    order = [i % len(sizes) for i in order_seed]
    largest = max(sizes) * 4
    prefetch, max_live = prefetch_units * largest, (1 + prefetch_units + slack_units) * largest
    scheduler, units = _scheduler(sizes, prefetch, max_live)
    for number in range(3):
        scheduler.stats.reset(0)
        _run_pass(scheduler, units, order, max_live)
        stats = scheduler.stats
        assert stats.hits + stats.misses == len(order)
        assert stats.peak_live_bytes <= max_live
        if number == 0:
            assert stats.misses == len(order)  # recording: on demand, every use gathers
        elif prefetch_units >= 1:
            assert stats.misses <= 1  # with the trace, every unit after the first is fetched ahead
    assert scheduler.trace == order


def test_a_changed_order_invalidates_the_trace_and_the_next_pass_records_again():
    scheduler, units = _scheduler([256] * 3, prefetch=4096, max_live=4096)
    _run_pass(scheduler, units, [0, 1, 2], 4096)
    _run_pass(scheduler, units, [2, 1, 0], 4096)
    assert scheduler.trace is None
    _run_pass(scheduler, units, [2, 1, 0], 4096)
    assert scheduler.trace == [2, 1, 0]


def test_an_eval_pass_neither_reads_nor_writes_the_trace():
    scheduler, units = _scheduler([256] * 3, prefetch=4096, max_live=4096)
    _run_pass(scheduler, units, [0, 1, 2], 4096)
    scheduler.begin_pass(training=False)
    for index in (2, 0):
        scheduler.acquire(units[index])
        scheduler.release(units[index])
    scheduler.end_pass()
    assert scheduler.trace == [0, 1, 2]
