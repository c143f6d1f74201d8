"""The bytes a run will need per tier and kind, known before anything is allocated.

The plan is an upper bound the engine's allocations never pass, so ``tiers.check_plan`` can refuse a
config at start and a run that starts does not fail for memory later. Steady-state bytes are exact
(DESIGN §3's formulas plus padding); temporaries (``Kind.BUFFER``) are bounded per phase, backward
and optimizer step, and the larger phase counts. The one assumption: backward finishes the block
units in the reducer's order (``_waiting_grads``); the reducer warns when a model does not.
Activations are not tier allocations: ``activations.measure_activations`` measures them, and the
checks add them to the device tier.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from .activations import ActivationProfile
from .config import Config, ConfigError, TrainConfig, dtype_bytes
from .optim.optimizer import moment_names
from .optim.state import units_to_offload
from .partition import UnitLayout, find_units
from .reduction import MAX_BUCKETS_IN_FLIGHT, REDUCE_DTYPE
from .tiers import STREAM_BUFFERS, Kind, Plan, swap_free_bytes

__all__ = ["plan_memory", "plan_for_config", "fitting_layout", "activation_bytes", "updates_in_backward",
           "grads_kept_for_step",
           "master_is_param", "params_in_masters", "LAYOUTS_TO_TRY"]

LAYOUTS_TO_TRY = (
    ("offload.optimizer.tier=host",),
    ("offload.optimizer.tier=nvme",),
    ("zero.stage=3", "offload.optimizer.tier=nvme"),
    ("zero.stage=3", "offload.optimizer.tier=nvme", "offload.param.tier=nvme"),
)
"""Layouts a refusal may suggest, in the order they give up speed for memory."""


def updates_in_backward(train: TrainConfig) -> bool:
    """Whether units whose gradients leave the device are updated in the backward that closes a window
    (engine's [Note: updates in backward]): only when the update needs nothing global."""
    return train.grad_clip == 0 and train.precision != "fp16"


def grads_kept_for_step(train: TrainConfig) -> bool:
    """Whether reduced shards leaving the device wait on the optimizer's tier for the step."""
    return train.grad_accum_steps > 1 or not updates_in_backward(train)


def master_is_param(config: Config, optimizer_tier: str) -> bool:
    """Whether a unit's fp32 masters are simply views of its compute weights (no copy, no bytes): fp32
    weights on the device, with the unit's optimizer block there too."""
    return (config.train.precision == "fp32" and config.offload.param.tier == "device"
            and optimizer_tier == "device")


def params_in_masters(config: Config, optimizer_tier: str) -> bool:
    """Whether a partitioned unit's fp32 shard on NVMe is read from its optimizer block's master
    segment (no second copy written each step); not with ``nvme.checksum``, which covers whole
    blocks only."""
    return (config.train.precision == "fp32" and config.offload.param.tier == "nvme" and optimizer_tier == "nvme"
            and not config.nvme.checksum)


def plan_for_config(layouts: list[UnitLayout], config: Config, world_size: int) -> Plan:
    """``plan_memory`` for the placement ``config`` makes of ``layouts``."""
    stage, train, offload = config.zero.stage, config.train, config.offload
    moved = units_to_offload(layouts, offload.optimizer.fraction)
    return plan_memory(
        layouts, stage=stage, compute_bytes=dtype_bytes(train.precision), optimizer_tier=offload.optimizer.tier,
        param_tier=offload.param.tier, offloaded=[layout for layout, m in zip(layouts, moved) if m],
        master_is_param=master_is_param(config, "device"),
        params_in_masters=params_in_masters(config, offload.optimizer.tier),
        grads_kept_for_step=grads_kept_for_step(train), updates_in_backward=updates_in_backward(train),
        moments=len(moment_names(config.optimizer)),
        bucket_bytes=config.zero.bucket_size, world_size=world_size,
        partitioned=[layout for layout in layouts if stage == 3 and layout.numel >= config.zero.persist_threshold],
        max_live_bytes=config.zero.max_live_size, prefetch_bytes=config.zero.prefetch_size)


def fitting_layout(module: nn.Module, config: Config, world_size: int, fits: Callable[[Plan, int], bool],
                   activations: ActivationProfile | None = None, local_ranks: int = 1) -> str | None:
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
            shards = world_size if candidate.zero.stage >= 1 else 1
            layouts = find_units(module, candidate.zero.unit_modules, shards)
            plan = plan_for_config(layouts, candidate, world_size)
            on_disk = sum(plan.get("nvme", {}).values()) * local_ranks
            if (fits(plan, activation_bytes(activations, candidate))
                    and (not on_disk or on_disk <= swap_free_bytes(candidate))):
                return " ".join(overrides)
    return None


def activation_bytes(activations: ActivationProfile | None, config: Config) -> int:
    """The measured activations of the run ``config`` describes; 0 when not measured (the RAM margin
    stands in for them)."""
    return activations.bytes(config.train.activation_checkpointing) if activations else 0


def _with_overrides(config: Config, overrides: tuple[str, ...]) -> Config | None:
    """``config`` with ``overrides`` applied, or None when its other keys do not allow them."""
    try:
        return Config.load(config, overrides=overrides)
    except ConfigError:
        return None


def plan_memory(layouts: list[UnitLayout], *, stage: int, compute_bytes: int, optimizer_tier: str, param_tier: str,
                offloaded: list[UnitLayout], master_is_param: bool, moments: int, bucket_bytes: int, world_size: int,
                partitioned: list[UnitLayout], max_live_bytes: int, prefetch_bytes: int,
                params_in_masters: bool = False, grads_kept_for_step: bool = True, updates_in_backward: bool = False
                ) -> Plan:
    """Bytes by tier and kind: parameters full on the device, except the ``partitioned`` units of stage
    3 (a shard each on ``param_tier``, plus at most ``max_live_bytes`` gathered on the device);
    optimizer states of the ``offloaded`` units on ``optimizer_tier``, the others' on the device (whose
    fp32 masters are the weights themselves when ``master_is_param``); gradients by stage. With
    ``params_in_masters`` an offloaded partitioned unit's shard is its optimizer block's master segment
    and takes no space of its own; without ``grads_kept_for_step`` offloaded units are updated as
    their gradients are reduced, which are then kept nowhere; with ``updates_in_backward`` the new
    weights of those updates wait for their all-gather beside the reduction's buffers."""
    full = sum(u.padded_numel for u in layouts) * compute_bytes
    shard = sum(u.shard_numel for u in layouts)
    largest = max(u.padded_numel for u in layouts) * compute_bytes
    partitioned_full = sum(u.padded_numel for u in partitioned) * compute_bytes
    moved_ids = {id(u) for u in offloaded} if optimizer_tier != "device" else set()
    moved = sum(u.shard_numel for u in layouts if id(u) in moved_ids)
    plan: Plan = {"device": {k: 0 for k in Kind}}
    for tier in (optimizer_tier, param_tier, "host"):
        plan.setdefault(tier, {k: 0 for k in Kind})
    device = plan["device"]
    device[Kind.PARAM] = full - partitioned_full
    in_masters = {id(u) for u in partitioned if params_in_masters and id(u) in moved_ids
                  and u.trainable_numel == u.padded_numel}  # a master holds no frozen values
    own_shards = [u for u in partitioned if id(u) not in in_masters]
    plan[param_tier][Kind.PARAM] += sum(u.shard_numel for u in own_shards) * compute_bytes
    device[Kind.GATHERED] = min(max_live_bytes, partitioned_full)
    if partitioned and param_tier != "device":  # shards staged in host memory (scheduler's note)
        largest_shard = max(u.shard_numel for u in partitioned) * compute_bytes
        staged = (2 * prefetch_bytes + max_live_bytes) // world_size + largest_shard
        plan["host"][Kind.BUFFER] += min(staged, partitioned_full // world_size + largest_shard)
    device[Kind.GRAD] = (shard - moved) * compute_bytes if stage >= 2 else full
    if stage >= 2 and moved and grads_kept_for_step:  # reduced shards go to the optimizer's tier (offloaded_grads)
        plan[optimizer_tier][Kind.GRAD] += moved * compute_bytes  # written and read through host buffers
        largest_moved_grad = max(u.shard_numel for u in layouts if id(u) in moved_ids) * compute_bytes
        plan["host"][Kind.BUFFER] += (STREAM_BUFFERS + 1) * largest_moved_grad
    device[Kind.OPTIMIZER] += (shard - moved) * 4 * (moments + (0 if master_is_param else 1))
    plan[optimizer_tier][Kind.OPTIMIZER] += moved * 4 * (moments + 1)
    reduce_bytes = REDUCE_DTYPE.itemsize
    in_flight = (MAX_BUCKETS_IN_FLIGHT + 1) * (bucket_bytes + largest // compute_bytes * reduce_bytes)
    full_reduce = full // compute_bytes * reduce_bytes
    reduce_phase = 0
    if world_size > 1:  # at world size 1 nothing is staged or exchanged (reduction's GradReducer._add)
        reduce_phase = min(in_flight, full_reduce)  # staging copies of buckets, in the reduction dtype
        if stage >= 1:
            # reduce-scatter outputs, and on gloo the peers' parts received beside them (world − 1 as many)
            reduce_phase += world_size * min(in_flight, shard * reduce_bytes)
    kept = {id(u) for u in partitioned}
    gathered_after_step = [u for u in layouts if id(u) not in kept] if stage >= 1 and world_size > 1 else []
    if stage >= 2:
        reduce_phase += min(full, _waiting_grads(layouts, compute_bytes, bucket_bytes, world_size))
        if updates_in_backward:  # all-gather inputs of the units updated in backward, until it ends
            reduce_phase += sum(u.shard_numel for u in gathered_after_step if id(u) in moved_ids) * compute_bytes
    if stage == 1:
        reduce_phase += shard * compute_bytes  # the reduced shards, held until the step
    step_device = shard * compute_bytes if stage == 1 else 0
    step_fp32 = 0 if compute_bytes == 4 else (shard - moved) * 4  # scaled fp32 gradients of one unit at most
    gather = sum(u.shard_numel for u in gathered_after_step) * compute_bytes  # all-gather inputs, all at once
    device[Kind.BUFFER] = max(reduce_phase, step_device + step_fp32 + gather)
    if moved:
        largest_moved = max(u.shard_numel for u in layouts if id(u) in moved_ids)
        plan["host"][Kind.BUFFER] += largest_moved * 4  # one offloaded unit's fp32 gradient for its update
        if optimizer_tier == "nvme":  # blocks stream through host buffers (tiers.stream_blocks)
            plan["host"][Kind.BUFFER] += STREAM_BUFFERS * largest_moved * 4 * (moments + 1)
    return _drop_empty(plan)


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


def _drop_empty(plan: Plan) -> Plan:
    """Tiers the run does not use at all are left out (so no swap space is reserved for nothing)."""
    return {name: kinds for name, kinds in plan.items() if name == "device" or any(kinds.values())}
