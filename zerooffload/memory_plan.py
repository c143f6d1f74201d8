"""The bytes a run will need per tier and kind, known before anything is allocated.

The plan is an upper bound the engine's allocations never pass, so ``tiers.check_plan`` can refuse a
config at start and a run that starts does not fail for memory later. Steady-state bytes are exact
(DESIGN §3's formulas plus padding); temporaries (``Kind.BUFFER``) are bounded per phase, backward
and optimizer step, and the larger phase counts. The one assumption: backward finishes the block
units in the reducer's order (``_waiting_grads``); the reducer warns when a model does not.
Activations are not tier allocations: ``activations.measure_activations`` measures them, and the
checks add them to the device tier, but for checkpointed inputs moved to the host tier
(``place_activations``), which are.

[Note: where kept gradients wait]
A reduced gradient shard kept for the step (placement's ``grads_kept``: over an accumulation window, for
an update that waits for the global norm, or for the redo of a tentative update) waits in host memory
when its optimizer block is on NVMe and the run fits with it there. On NVMe it would cost a write of
the shard each step and a read back for the update; a tentative update, which reads the shard as it
arrives and needs it again only to be redone, would pay the write for nothing in every step that the
clip does not bind. When the plan with the shards in memory does not fit the budgets or the RAM (the
engine's own checks: ``plan_for_machine``), they wait on NVMe beside their blocks, and the run needs no
more memory than that placement did. Each rank decides for itself from the RAM it sees: where a rank's
shards wait changes its own reads and writes only, nothing any collective depends on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .activations import ActivationProfile
from .block_stream import GRAD_READS, STREAM_BUFFERS, grad_read_depth, stream_depth
from .comm.topology import local_world_size
from .config import Config, ConfigError, dtype_bytes
from .optim.optimizer import moment_names
from .optim.state import state_bytes
from .tiers import (BudgetError, Kind, MemoryPlan, Tier, check_plan, check_ram, make_tiers, stored_bytes, swap_bytes,
                    swap_free_bytes)
from .zero.placement import STAGING, Placement, UnitPlacement, activations_leave_device, place, shard_count
from .zero.reduction import MAX_BUCKETS_IN_FLIGHT, REDUCE_DTYPE
from .zero.unit_layout import UnitLayout, find_units

__all__ = ["memory_bytes", "plan_for_config", "plan_for_machine", "check_fits", "check_memory", "fitting_layout",
           "place_activations", "local_ranks", "temporaries", "Temporaries", "LAYOUTS_TO_TRY", "save_staging_bytes"]

LAYOUTS_TO_TRY = (
    ("offload.optimizer.tier=host",),
    ("offload.optimizer.tier=nvme",),
    ("zero.stage=3", "offload.optimizer.tier=nvme"),
    ("zero.stage=3", "offload.optimizer.tier=nvme", "offload.param.tier=nvme"),
)
"""Layouts a refusal may suggest, in the order they give up speed for memory."""


def plan_for_config(layouts: list[UnitLayout], config: Config, world_size: int,
                    fits: Callable[[MemoryPlan], bool]) -> tuple[Placement, MemoryPlan]:
    """The placement ``config`` makes of ``layouts`` and its ``memory_bytes``: kept gradient shards of blocks
    on NVMe in host memory when that plan ``fits``, else on NVMe when that one does ([Note: where kept
    gradients wait]; ``place`` decides, asking ``fits``)."""
    placement = place(layouts, config, fits=lambda candidate: fits(_plan(layouts, candidate, config, world_size)))
    return placement, _plan(layouts, placement, config, world_size)


def plan_for_machine(layouts: list[UnitLayout], config: Config, world_size: int, device: torch.device,
                     activations: ActivationProfile | None, *, tiers: dict[str, Tier] | None = None,
                     released: int = 0) -> tuple[Placement, MemoryPlan]:
    """``plan_for_config`` as the engine makes it: fitting the budgets of ``tiers`` (``config``'s when None)
    and this machine's RAM beside ``activations`` (``released``: ``check_ram``'s)."""
    tiers = make_tiers(config.memory, device) if tiers is None else tiers

    def fits(plan: MemoryPlan) -> bool:
        try:
            check_fits(plan, config, tiers, activations, device, world_size, released=released)
        except BudgetError:
            return False
        return True
    return plan_for_config(layouts, config, world_size, fits)


def check_fits(plan: MemoryPlan, config: Config, tiers: dict[str, Tier], activations: ActivationProfile | None,
               device: torch.device, world_size: int, *, released: int = 0,
               suggestion: Callable[[Callable[[MemoryPlan, int], bool]], str | None] = lambda fits: None) -> None:
    """Refuse (``BudgetError``) a ``plan`` that does not fit the budgets of ``tiers`` or this machine's RAM
    beside ``activations`` (placed on a copy: ``plan`` is left as it is), the budgets first: they are
    cheap to check. ``released`` and ``suggestion``: ``check_ram``'s."""
    plan, on_device = _placed(plan, activations, config, device)
    check_plan(plan, tiers, on_device)
    check_swap_cap(plan, config, world_size)
    check_ram(plan, config.memory, device, activations=on_device, released=released,
              local_ranks=local_ranks(world_size), suggestion=suggestion)


def check_swap_cap(plan: MemoryPlan, config: Config, world_size: int) -> None:
    """Refuse (``BudgetError``) swap files past ``nvme.max_bytes`` on this machine."""
    cap, needed = config.nvme.max_bytes, swap_bytes(plan) * local_ranks(world_size)
    if cap and needed > cap:
        fewer = {"fp32": "bf16", "bf16": "int8"}.get(config.optimizer.moments)
        more = f", or in fewer bytes (optimizer.moments = '{fewer}')" if fewer else ""
        raise BudgetError(f"the swap files need {needed:,} bytes on this machine but nvme.max_bytes is {cap:,} "
                          f"({needed - cap:,} short); raise it, or keep more state in RAM (offload.*.tier){more}")


def save_staging_bytes(layouts: list[UnitLayout], config: Config) -> int:
    """Host memory a save in the background copies the state into (checkpoint.async_save's note):
    ``train.save_staging``, at most what this rank's shards of state take in a checkpoint (an fp32
    master and the moments as kept)."""
    moments = len(moment_names(config.optimizer))
    state = sum(state_bytes(u.shard_numel, moments, config.optimizer.moments, "fp32", len(u.slots)) for u in layouts)
    return min(config.train.save_staging, state)


def _plan(layouts: list[UnitLayout], placement: Placement, config: Config, world_size: int) -> MemoryPlan:
    """``memory_bytes`` of ``placement`` with ``config``'s sizes; with ``train.async_save``, the staging of a
    save in the background in host memory too."""
    plan = _state_plan(layouts, placement, config, world_size)
    if config.train.async_save:
        plan.setdefault(placement.staging, {kind: 0 for kind in Kind})[Kind.BUFFER] += save_staging_bytes(layouts,
                                                                                                          config)
    return plan


def _state_plan(layouts: list[UnitLayout], placement: Placement, config: Config, world_size: int) -> MemoryPlan:
    return memory_bytes(layouts, placement,
                       compute_bytes=dtype_bytes(config.train.precision), moments=len(moment_names(config.optimizer)),
                       moment_dtype=config.optimizer.moments, bucket_bytes=config.zero.bucket_size,
                       world_size=world_size,
                       max_live_bytes=config.zero.max_live_size, prefetch_bytes=config.zero.prefetch_size,
                       stream_buffers=stream_depth(config.aio), grad_reads=grad_read_depth(config.aio),
                       swap_stripes=len(config.nvme.paths), updates_in_flight=config.optimizer.updates_in_flight)


def _placed(plan: MemoryPlan, activations: ActivationProfile | None, config: Config, device: torch.device
            ) -> tuple[MemoryPlan, int]:
    """A copy of ``plan`` with its activations placed (``place_activations``), and those on the device."""
    plan = {name: dict(kinds) for name, kinds in plan.items()}
    return plan, place_activations(plan, activations, config, device)


def fitting_layout(module: nn.Module, config: Config, world_size: int, fits: Callable[[MemoryPlan, int], bool],
                   activations: ActivationProfile | None = None, local_ranks: int = 1,
                   device: torch.device = torch.device("cpu")) -> str | None:
    """The first of ``LAYOUTS_TO_TRY`` (as overrides) whose plan ``fits`` beside its activations
    (``fits(plan, activation_bytes)``) and whose swap files fit the free space of ``nvme.path`` (for
    ``local_ranks`` ranks), or None. With measured ``activations`` each layout is tried as configured,
    then with ``train.activation_checkpointing`` (when it is not on already)."""
    checkpointing = ("train.activation_checkpointing=true",)
    variants = ((), checkpointing) if activations and not config.train.activation_checkpointing else ((),)
    for layout in LAYOUTS_TO_TRY:
        for overrides in (layout + extra for extra in variants):
            candidate = _with_overrides(config, overrides)
            if candidate is None:
                continue
            layouts = find_units(module, candidate.zero.unit_modules, shard_count(candidate, world_size))
            def fits_here(plan: MemoryPlan) -> bool:
                return fits(*_placed(plan, activations, candidate, device))
            _, plan = plan_for_config(layouts, candidate, world_size, fits_here)
            on_disk = swap_bytes(plan) * local_ranks
            if fits_here(plan) and (not on_disk or on_disk <= swap_free_bytes(candidate)):
                return " ".join(overrides)
    return None


def check_memory(module: nn.Module, layouts: list[UnitLayout], config: Config, tiers: dict[str, Tier],
                 activations: ActivationProfile | None, world_size: int, device: torch.device
                 ) -> tuple[Placement, MemoryPlan]:
    """The run's placement and plan, refused before anything is allocated when it does not fit its budgets
    or the RAM (the refusal names a layout that would fit: ``fitting_layout``)."""
    released = _storage_bytes(module)
    placement, plan = plan_for_machine(layouts, config, world_size, device, activations, tiers=tiers,
                                       released=released)
    check_fits(plan, config, tiers, activations, device, world_size, released=released,
               suggestion=lambda fits: fitting_layout(module, config, world_size, fits, activations,
                                                      local_ranks(world_size), device))
    return placement, plan


def _storage_bytes(module: nn.Module) -> int:
    """Bytes the module's parameters hold now, each storage once: what flattening them gives back
    (an eager build's weights; a lazy build's placeholders hold next to nothing)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()
                if not p.is_meta and p.device.type == "cpu"}
    return sum(storages.values())


def local_ranks(world_size: int) -> int:
    """Ranks sharing this machine's RAM: a node's (comm.topology reads torchrun's LOCAL_WORLD_SIZE; all of
    them without it)."""
    return local_world_size(world_size)


def place_activations(plan: MemoryPlan, activations: ActivationProfile | None, config: Config, device: torch.device) -> int:
    """The measured activations of the run ``config`` describes that stay on ``device``; 0 when not
    measured (the RAM margin stands in for them). Checkpointed inputs that ``offload.activations.tier``
    moves to the host (activation_offload's note) are counted in ``plan``'s host tier instead."""
    if not activations:
        return 0
    total = activations.bytes(config.train.activation_checkpointing)
    if not activations_leave_device(config, device):
        return total
    plan.setdefault(STAGING, {kind: 0 for kind in Kind})[Kind.ACTIVATION] += activations.checkpoint_inputs
    return total - activations.checkpoint_inputs


def _with_overrides(config: Config, overrides: tuple[str, ...]) -> Config | None:
    """``config`` with ``overrides`` applied, or None when its other keys do not allow them."""
    try:
        return Config.load(config, overrides=overrides)
    except ConfigError:
        return None


@dataclass(frozen=True, slots=True)
class Temporaries:
    """The engine's bounded temporaries (``Kind.BUFFER``) by purpose, bytes per rank: ``memory_bytes``
    adds them up per tier (a bound); a prediction lines them up by phase (an expected peak)."""

    staged_shards: int = 0
    """Host: stage 3's off-device shards read or copied ahead of their gathers (forward and backward)."""
    grad_stream: int = 0
    """Host: kept gradient shards written through host buffers in backward, read back ahead in the step."""
    reduce: int = 0
    """Device: backward's reduction staging, reduce-scatter outputs, and full gradients waiting to reduce."""
    step: int = 0
    """Device: the step's scaled fp32 gradients and all-gather inputs."""
    update_grad: int = 0
    """Host: one offloaded unit's fp32 gradient for its update (in backward or in the step)."""
    block_stream: int = 0
    """Host: the host buffers optimizer blocks stream through (``block_stream``), for whole blocks."""

    @property
    def host(self) -> int:
        return self.staged_shards + self.grad_stream + self.update_grad + self.block_stream

    @property
    def device(self) -> int:
        return max(self.reduce, self.step)


def memory_bytes(layouts: list[UnitLayout], placement: Placement, *, compute_bytes: int, moments: int,
                 moment_dtype: str = "fp32",
                bucket_bytes: int, world_size: int, max_live_bytes: int, prefetch_bytes: int,
                stream_buffers: int = STREAM_BUFFERS, grad_reads: int = GRAD_READS,
                swap_stripes: int = 1, updates_in_flight: int = 0) -> MemoryPlan:
    """Bytes by tier and kind of ``placement`` ([Note: placement]): full parameters on the device but for
    partitioned units (a shard each on its home, plus at most ``max_live_bytes`` gathered on the device, and
    under hpZ a 1/``secondary_parts`` share of each as its secondary shard there, held through a pass);
    optimizer blocks on their tiers (no master for units whose master is the weights; twice for tentative
    updates, stored aside); gradients as placed (full over the window, or a shard that stays, or leaves for
    its grad home when kept for the step);
    an offloaded partitioned unit's shard in its block's master segment takes no space of its own;
    temporaries (``temporaries``) with ``stream_buffers`` host buffers per block stream or writer and
    ``grad_reads`` for gradients read back (``block_stream``) and ``updates_in_flight`` gradients held by
    the update worker, each phase's on the device, all of them on the host; on NVMe each block as the swap
    files over ``swap_stripes`` directories hold it (``tiers.stored_bytes``)."""
    units = list(zip(layouts, placement.units))
    device, staging = placement.compute, placement.staging
    plan: MemoryPlan = {name: {k: 0 for k in Kind} for name in placement.tiers()}
    full = sum(u.padded_numel for u in layouts) * compute_bytes
    partitioned_full = sum(u.padded_numel for u, p in units if p.partitioned) * compute_bytes
    plan[device][Kind.PARAM] = full - partitioned_full
    for u, p in units:
        if p.partitioned and not p.params_in_masters:
            plan[p.param_home][Kind.PARAM] += stored_bytes(p.param_home, u.shard_numel * compute_bytes, swap_stripes)
        versions = 2 if p.updates_tentatively else 1  # a tentative update's block is stored aside until the step
        plan[p.optimizer][Kind.OPTIMIZER] += versions * stored_bytes(
            p.optimizer, state_bytes(u.shard_numel, moments, moment_dtype, p.master_format, len(u.slots)), swap_stripes)
        if p.keep_full_grad:  # accumulated whole over the window
            plan[device][Kind.GRAD] += u.padded_numel * compute_bytes
        elif p.keep_grad_shard and not p.grad_leaves:  # the reduced shard stays on the device
            plan[device][Kind.GRAD] += u.shard_numel * compute_bytes
        elif p.grads_kept:  # a shard that leaves waits on its grad home for the step (offloaded_grads)
            plan[p.grad_home][Kind.GRAD] += stored_bytes(p.grad_home, u.shard_numel * compute_bytes, swap_stripes)
    plan[device][Kind.GATHERED] = min(max_live_bytes, partitioned_full)
    # hpZ: every partitioned unit's share, from its forward gather to the pass's end
    plan[device][Kind.SECONDARY] = sum(u.padded_numel // p.secondary_parts for u, p in units
                                       if p.secondary_parts > 1) * compute_bytes
    buffers = temporaries(layouts, placement, compute_bytes=compute_bytes, moments=moments, moment_dtype=moment_dtype,
                          bucket_bytes=bucket_bytes, world_size=world_size, max_live_bytes=max_live_bytes,
                          prefetch_bytes=prefetch_bytes, stream_buffers=stream_buffers, grad_reads=grad_reads,
                          updates_in_flight=updates_in_flight)
    plan[device][Kind.BUFFER] = buffers.device
    plan[staging][Kind.BUFFER] += buffers.host
    return _drop_empty(plan, device)


def temporaries(layouts: list[UnitLayout], placement: Placement, *, compute_bytes: int, moments: int,
                moment_dtype: str = "fp32",
                bucket_bytes: int, world_size: int, max_live_bytes: int, prefetch_bytes: int,
                stream_buffers: int = STREAM_BUFFERS, grad_reads: int = GRAD_READS,
                updates_in_flight: int = 0) -> Temporaries:
    """The bounds on each purpose's temporaries (``Temporaries``) for ``memory_bytes``'s arguments."""
    units = list(zip(layouts, placement.units))
    full = sum(u.padded_numel for u in layouts) * compute_bytes
    shard = sum(u.shard_numel for u in layouts)
    largest = max(u.padded_numel for u in layouts) * compute_bytes
    partitioned = [u for u, p in units if p.partitioned]
    moved_units = [(u, p) for u, p in units if p.offloaded]
    moved = sum(u.shard_numel for u, _ in moved_units)
    staged_shards = 0
    if partitioned and placement.shards_off_device:  # shards staged in host memory (scheduler's note)
        largest_shard = max(u.shard_numel for u in partitioned) * compute_bytes
        staged = (2 * prefetch_bytes + max_live_bytes) // world_size + largest_shard
        staged_shards = min(staged, sum(u.padded_numel for u in partitioned) * compute_bytes // world_size
                            + largest_shard)
    streamed_grads = [u for u, p in moved_units if p.grads_kept and p.grads_streamed]
    grad_stream = 0
    if streamed_grads:  # written and read through host buffers: the writer's, and the reads ahead, one of
        buffers = stream_buffers + grad_reads - 1  # which the update holds (not both at once)
        grad_stream = buffers * max(u.shard_numel for u in streamed_grads) * compute_bytes
    reduce_bytes = REDUCE_DTYPE.itemsize
    in_flight = (MAX_BUCKETS_IN_FLIGHT + 1) * (bucket_bytes + largest // compute_bytes * reduce_bytes)
    full_reduce = full // compute_bytes * reduce_bytes
    reduce_phase = 0
    if world_size > 1:  # at world size 1 nothing is staged or exchanged (reduction's GradReducer._add)
        reduce_phase = min(in_flight, full_reduce)  # staging copies of buckets, in the reduction dtype
        if placement.reduce_scatters:
            # reduce-scatter outputs, and on gloo the peers' parts received beside them (world − 1 as many);
            # under qgZ comm's coded parts out and in and its fp32 sums per node instead, at most 2 × world
            # outputs' worth (codes are 1/4 or 1/8 of fp32), held by comm outside the tiers: reserved here
            coded = any(p.gradient_bits for p in placement.units)
            reduce_phase += (1 + 2 * world_size if coded else world_size) * min(in_flight, shard * reduce_bytes)
    gathered_after_step = [(u, p) for u, p in units if p.published_by_all_gather] if world_size > 1 else []
    if placement.reduces_every_backward:
        reduce_phase += min(full, _waiting_grads(layouts, compute_bytes, bucket_bytes, world_size))
        # all-gather inputs of the units updated in backward, until it ends
        reduce_phase += sum(u.shard_numel for u, p in gathered_after_step if p.updates_in_backward) * compute_bytes
    reduce_phase += _held_by_updates(units, compute_bytes, world_size, updates_in_flight)
    # stage 1's reduced shards land in the full buffers themselves (partition's add_grad_shard)
    step_fp32 = 0 if compute_bytes == 4 else (shard - moved) * 4  # scaled fp32 gradients of one unit at most
    gather = sum(u.shard_numel for u, _ in gathered_after_step) * compute_bytes  # all-gather inputs, all at once
    largest_moved = max((u.shard_numel for u, _ in moved_units), default=0)
    largest_block = max((state_bytes(u.shard_numel, moments, moment_dtype, p.master_format, len(u.slots))
                         for u, p in moved_units),
                        default=0)
    streams = any(p.streamed for _, p in moved_units)  # blocks stream through host buffers (block_stream)
    return Temporaries(staged_shards=staged_shards, grad_stream=grad_stream, reduce=reduce_phase,
                       step=step_fp32 + gather, update_grad=largest_moved * 4,
                       block_stream=stream_buffers * largest_block if streams else 0)


def _held_by_updates(units: list[tuple[UnitLayout, UnitPlacement]], compute_bytes: int, world_size: int,
                     updates_in_flight: int) -> int:
    """Gradients the update worker holds while backward goes on (backward_updates' [Note: updates off the
    autograd thread]): up to ``updates_in_flight`` units' own full gradients at world size 1, lent; above it
    a copy of each one's reduced shard, at most in the reduction dtype."""
    in_backward = [u for u, p in units if p.updates_in_backward]
    if not in_backward or updates_in_flight == 0:
        return 0
    if world_size == 1:
        return updates_in_flight * max(u.padded_numel for u in in_backward) * compute_bytes
    return updates_in_flight * max(u.shard_numel for u in in_backward) * max(compute_bytes, REDUCE_DTYPE.itemsize)


def _waiting_grads(layouts: list[UnitLayout], compute_bytes: int, bucket_bytes: int, world_size: int) -> int:
    """Full gradients alive at once in a stage 2–3 backward: the root unit's, filled from the head's
    backward (its first) to the embeddings' (its last); the block accumulating; and above world size
    1 the blocks in the buckets filling or in flight, each up to a bucket plus the unit that filled it.
    This holds while backward finishes the blocks in the reducer's order (last to first, as in every
    transformer); the reducer warns when a model breaks it."""
    root = sum(u.padded_numel for u in layouts if not u.name)
    largest_block = max((u.padded_numel for u in layouts if u.name), default=0)
    in_buckets = 0 if world_size == 1 else (
        (MAX_BUCKETS_IN_FLIGHT + 1) * (bucket_bytes // REDUCE_DTYPE.itemsize + largest_block))
    return (root + largest_block + in_buckets) * compute_bytes


def _drop_empty(plan: MemoryPlan, device: str) -> MemoryPlan:
    """Tiers the run does not use at all are left out (so no swap space is reserved for nothing)."""
    return {name: kinds for name, kinds in plan.items() if name == device or any(kinds.values())}
