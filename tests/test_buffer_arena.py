"""The tiers' buffer arena (buffer_arena's [Note: buffer arena]) through the Tier API the engine uses."""
from __future__ import annotations

import pytest
import torch

from zerooffload.tiers import BudgetError, DeviceTier, HostTier, Kind, release_idle


@pytest.fixture(params=["device", "host"])
def tier(request):
    cls = DeviceTier if request.param == "device" else HostTier
    return cls(request.param, torch.device("cpu"), budget=64 << 20)


def test_a_freed_buffer_serves_the_next_request_of_its_size_only(tier):
    first = tier.empty(Kind.BUFFER, 1 << 20, torch.float32)
    address = first.data_ptr()
    tier.free(Kind.BUFFER, first)
    del first
    other_size = tier.empty(Kind.BUFFER, 1 << 19, torch.float32)
    other_dtype = tier.empty(Kind.BUFFER, 1 << 20, torch.bfloat16)
    assert address not in (other_size.data_ptr(), other_dtype.data_ptr())
    again = tier.empty(Kind.BUFFER, 1 << 20, torch.float32)
    assert again.data_ptr() == address and again.numel() == 1 << 20
    assert tier.empty(Kind.BUFFER, 1 << 20, torch.float32).data_ptr() != address  # lent once at a time


def test_idle_buffers_count_in_the_peak_and_go_at_the_end_of_a_phase(tier):
    buffer = tier.empty(Kind.BUFFER, 1 << 20, torch.float32)
    tier.free(Kind.BUFFER, buffer)
    assert tier.used == 0 and tier.idle == 4 << 20 and tier.peak == 4 << 20
    tier.empty(Kind.BUFFER, 1 << 20, torch.float32)  # reused: the memory held does not grow
    assert tier.used == 4 << 20 and tier.idle == 0 and tier.peak == 4 << 20
    tier.free(Kind.BUFFER, tier.empty(Kind.BUFFER, 1 << 18, torch.float32))
    release_idle({"t": tier})
    assert tier.idle == 0
    assert tier.empty(Kind.BUFFER, 1 << 18, torch.float32).data_ptr() != 0


def test_what_the_arena_keeps_yields_to_a_request_under_the_budget(tier):
    for _ in range(2):
        tier.free(Kind.BUFFER, tier.empty(Kind.BUFFER, 6 << 20, torch.float32))  # 24 MiB idle after the first
    assert tier.idle == 24 << 20
    tier.empty(Kind.PARAM, 11 << 20, torch.float32)  # 44 MiB of 64: fits only if the 24 idle go
    assert tier.idle == 0 and tier.used == 44 << 20
    with pytest.raises(BudgetError, match=r"memory\.(device|host)_budget"):
        tier.empty(Kind.BUFFER, 7 << 20, torch.float32)


def test_only_engine_buffers_it_lent_are_kept(tier):
    grad = tier.empty(Kind.GRAD, 1 << 20, torch.float32)
    tier.free(Kind.GRAD, grad)
    stranger = torch.empty(1 << 20)
    tier.usage[Kind.BUFFER] += stranger.numel() * 4  # as if counted, but never lent by this tier
    tier.free(Kind.BUFFER, stranger)
    assert tier.idle == 0
