"""A run's step time and peak memory per tier, predicted from its placement, its model and the probe.

[Note: the step model]
Memory is the engine's own plan (``memory_plan.plan_for_config``: exact steady-state bytes, bounded
temporaries) plus the activations measured on the meta device, with one unit's worth of backward
temporaries where the memory check counts three (a peak to expect, not a bound to refuse by). Each
tier's peak comes in a phase of its own, so on a CPU device, whose device and host tiers are one RAM,
their peak together is lined up by phase (``ram_peak_bytes``): the steady state, plus the larger of
the start of backward (the activations, the gathered units, hpZ's secondary shards and the staged
shards, and where units update in backward the whole block stream with one fp32 gradient: its blocks
are read ahead before backward's first gradients and flow while most activations still wait, a
stage 3 NVMe bf16 run measuring 0.71-0.73 of its peak RSS when one block was counted) and the step (its
temporaries and the host buffers optimizer blocks stream through, and where the step's updates run beside
the next forward, that forward's unit in hand and its staged shard: a stage 3 NVMe 1b run measured 6%
above the step's alone).
Time follows the engine's schedule, phase by phase ([Note: phases] in telemetry), per rank and optimizer step:
- *forward*, per micro-batch: the measured compute ([Note: measured compute]); stage 3's partitioned
  shards read from NVMe (fp32 from the masters where they live there) and copied in from off the device
  (a CPU device uses them in place); backward gathers again only what ``zero.max_live_size`` could not
  keep from forward;
- *backward*, per micro-batch: compute (and the recompute under activation checkpointing), the
  gradients added into their flat buffers, the shards gathered again, reduced gradients leaving the
  device (written to NVMe where they are kept there), and the updates that run in backward with
  their optimizer blocks streamed;
- *step*: the norm over the gradients, the updates left for the step (the fused CPU pass, or on a
  CUDA device a pass bound by its memory bandwidth), their blocks streamed in and out, new weights
  published to the device (where the weights live there). A tentative update that a binding
  ``train.grad_clip`` undoes is redone in the step: its block read, updated and written again, its
  kept gradient read back. Whether the clip binds is the run's to say (``StepStats.undone_updates``),
  so the step is predicted both ways: as the clip leaves it, and redone (``Prediction.redone``).
On a CPU device, host memory mapped afresh costs its page faults (the probe's first-touch rate):
stage 3's gathered buffers each micro-batch, and with ``memory.release_freed`` (every large buffer its
own mapping) the activations and the host buffers stage 3's shards are read into from NVMe as well
(an O_DIRECT read into fresh pages faults them in first: such a read measured the disk's time plus
the first-touch time). Within a phase the engine overlaps what runs on different resources: on a
CUDA device the device computes while the CPU updates and copies run, and NVMe transfers (reads and
writes share one disk: their seconds add) run beside the rest, ahead of need, so a phase takes its
busiest resource's seconds plus what nothing overlaps (the first unit read before forward, the first
block read and the last written in a streamed step; with ``zero.prefetch_size = 0``, every transfer).
On a CPU device every second adds: the same cores compute, update, copy, run gloo and submit,
complete and copy the transfers, and on this project's 2-core machine a stage 3 NVMe step measured
close to the sum, far from the overlap (``bench/plan_check.py``). Collectives (world size > 1) take
their bytes (as ``comm`` counts them) at the probe's rate for the engine's own reduce-scatter and
all-gather on this machine's ranks; they run on the CPU over gloo and beside the compute over NCCL.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ..activations import ActivationProfile
from ..config import Config, dtype_bytes
from ..block_stream import grad_read_depth, stream_depth
from ..kinds import Kind
from ..memory_plan import place_activations, plan_for_machine, temporaries
from ..optim.optimizer import moment_names
from ..optim.state import state_bytes
from ..telemetry import Prediction
from ..tiers import MemoryPlan
from ..zero.placement import (TIER_NAMES, Placement, UnitPlacement, activations_leave_device, steps_beside_forward,
                              streams_state)
from ..zero.reduction import REDUCE_DTYPE
from ..zero.unit_layout import UnitLayout
from .model_spec import BlockTimes
from .probe import Probe
from .volumes import gather_volume, reduce_volume, wire_element_bytes

__all__ = ["predict", "WORK"]

WORK = ("compute", "fresh_memory", "optimizer", "nvme_read", "nvme_write", "host_device", "collectives")
"""The resources whose seconds ``Prediction.work`` holds, before overlap."""
_GB = 1e9


@dataclass
class _Phase:
    """The work of one phase: seconds per resource, bytes per transfer direction."""

    device: float = 0.0
    """Seconds of measured compute."""
    copy: float = 0.0
    """Bytes copied within the device's memory."""
    fresh: float = 0.0
    """Bytes written into host memory just mapped (see the note)."""
    shard_reads: float = 0.0
    """Of ``read``: stage 3 parameter shards, each read into a host buffer of its own."""
    optimizer_elements: int = 0
    device_updates: int = 0
    """Of ``optimizer_elements``: those a CUDA device updates itself."""
    read: float = 0.0
    write: float = 0.0
    link: float = 0.0
    """Bytes copied between host memory and the device."""
    gathered: float = 0.0
    """Bytes of off-device shards brought to the device for a gather (a CPU device uses them in place)."""
    collective: float = 0.0
    inter: float = 0.0
    """Of the collectives' work, bytes this rank sends across nodes (volumes' note), at the link's rate."""
    exposed: float = 0.0
    """Transfer seconds nothing overlaps (see the note)."""
    work: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WORK, 0.0))


def predict(config: Config, layouts: list[UnitLayout], probe: Probe, times: BlockTimes,
            activations: ActivationProfile | None, world_size: int) -> Prediction:
    """The ``Prediction`` of one optimizer step of ``config`` (see [Note: the step model])."""
    device = torch.device(probe.device)
    placement, plan = plan_for_machine(layouts, config, world_size, device, activations)
    peaks = _peaks(plan, placement, config, activations, device)
    ram_peak = _ram_peak(plan, config, layouts, placement, activations, world_size) if device.type == "cpu" else None

    def predicted(redone: bool) -> Prediction:
        phases = _phases(config, layouts, placement, probe, times, world_size, redone)
        if probe.device == "cpu":
            _fresh_memory(config, layouts, placement, activations, phases)
        _activation_copies(config, activations, probe, phases)
        seconds = {name: _seconds(phase, probe, config) for name, phase in phases.items()}
        work = {k: sum(p.work[k] for p in phases.values()) for k in WORK}
        moved = {"nvme_read": sum(p.read for p in phases.values()), "nvme_write": sum(p.write for p in phases.values()),
                 "host_device": sum(p.link + p.gathered for p in phases.values())}
        return Prediction(step_seconds=sum(seconds.values()), phases=MappingProxyType(seconds),
                          work=MappingProxyType(work), peak_bytes=MappingProxyType(peaks),
                          moved_bytes=MappingProxyType({k: int(v) for k, v in moved.items()}),
                          bottleneck=_bottleneck(phases, work, probe, config), ram_peak_bytes=ram_peak)

    tentative = any(p.updates_tentatively for p in placement.units)  # only trainable units update at all
    return dataclasses.replace(predicted(redone=False), redone=predicted(redone=True) if tentative else None)


def _peaks(plan: MemoryPlan, placement: Placement, config: Config, activations: ActivationProfile | None,
           device: torch.device) -> dict[str, int]:
    on_device = place_activations(plan, activations, config, device)
    if activations:  # the expected peak, not the check's bound (ActivationProfile.bound_excess)
        on_device -= activations.bound_excess
    peaks = {name: sum(kinds.values()) for name, kinds in plan.items()}
    peaks[placement.compute] = peaks.get(placement.compute, 0) + on_device
    return {tier: peaks.get(tier, 0) for tier in TIER_NAMES}


def _ram_peak(plan: MemoryPlan, config: Config, layouts: list[UnitLayout], placement: Placement,
              activations: ActivationProfile | None, world_size: int) -> int:
    """The device and host tiers' expected peak together on a CPU device (see the note)."""
    tiers = [tier for tier in (placement.compute, placement.staging) if tier in plan]
    passing = (Kind.BUFFER, Kind.GATHERED, Kind.SECONDARY)  # held through a pass or a phase, not the step
    steady = sum(n for tier in tiers for kind, n in plan[tier].items() if kind not in passing)
    buffers = temporaries(layouts, placement, compute_bytes=dtype_bytes(config.train.precision),
                          moments=len(moment_names(config.optimizer)), moment_dtype=config.optimizer.moments,
                          bucket_bytes=config.zero.bucket_size,
                          world_size=world_size, max_live_bytes=config.zero.max_live_size,
                          prefetch_bytes=config.zero.prefetch_size, stream_buffers=stream_depth(config.aio),
                          grad_reads=grad_read_depth(config.aio),
                          updates_in_flight=config.optimizer.updates_in_flight)
    saved = activations.bytes(config.train.activation_checkpointing) - activations.bound_excess if activations else 0
    # the stream's blocks (read ahead, updating, written back) and one fp32 gradient: held in the step, and
    # from backward's start where units update in backward (see the note)
    updates = buffers.block_stream + buffers.update_grad
    compute = plan[placement.compute]
    backward_start = saved + compute[Kind.GATHERED] + compute[Kind.SECONDARY] + buffers.staged_shards + (
        updates if placement.updates_in_backward else 0)
    step = buffers.step + buffers.grad_stream + updates
    if _updates_beside_forward(config, placement):
        step += _forward_gathers(config, layouts, placement, world_size)
    return steady + max(backward_start, step)


def _forward_gathers(config: Config, layouts: list[UnitLayout], placement: Placement, world_size: int) -> int:
    """What the next forward holds of stage 3's gathers while the step's updates run beside it: the unit it
    computes, what it prefetches, and their shards staged in host memory (each gather waits for its unit's
    update, so the forward trails them one unit at a time: a stage 3 NVMe 1b trace)."""
    partitioned = [u for u, p in zip(layouts, placement.units) if p.partitioned]
    if not partitioned:
        return 0
    largest = max(u.padded_numel for u in partitioned) * dtype_bytes(config.train.precision)
    gathered = largest + config.zero.prefetch_size
    return gathered + (gathered // world_size if placement.shards_off_device else 0)


def _updates_beside_forward(config: Config, placement: Placement) -> bool:
    """Whether the step's updates run beside the next forward (step_updates' note): the native CPU pass
    over state off the device, ``optimizer.updates_in_flight`` > 0, no shard read from its block's masters."""
    stepped = [p for p in placement.units if p.trainable and not p.updates_in_backward]
    native = config.optimizer.type in ("adam", "adamw")
    return config.optimizer.updates_in_flight > 0 and native and steps_beside_forward(stepped)


def _phases(config: Config, layouts: list[UnitLayout], placement: Placement, probe: Probe, times: BlockTimes,
            world_size: int, redone: bool) -> dict[str, _Phase]:
    """Each phase's work for one optimizer step (``grad_accum_steps`` forwards and backwards), with the
    tentative updates ``redone`` in the step or not."""
    cb = dtype_bytes(config.train.precision)
    moments = len(moment_names(config.optimizer))
    accum = config.train.grad_accum_steps
    forward, backward, step = _Phase(), _Phase(), _Phase()
    forward.device, backward.device = times.forward * accum, times.backward * accum
    if config.train.activation_checkpointing:
        backward.device += times.recompute * accum
    trainable = sum(u.trainable_numel for u in layouts)
    backward.copy = trainable * cb * accum  # gradients added into their flat buffers
    regathered = _regathered_share(config, layouts, placement)
    for layout, p in zip(layouts, placement.units):
        shard = layout.shard_numel
        block = state_bytes(shard, moments, config.optimizer.moments, p.master_format, len(layout.slots))
        if p.params_off_device:  # gathered for forward, again in backward past max_live (under hpZ from the
            for phase, share in ((forward, 1.0), (backward, 0.0 if p.secondary_parts > 1 else regathered)):  # device)
                phase.gathered += shard * cb * accum * share
                if p.params_stream:
                    nbytes = shard * (4 if p.params_in_masters else cb) * accum * share
                    phase.read += nbytes
                    phase.shard_reads += nbytes
        if not p.trainable:
            continue
        if p.grad_leaves:
            backward.link += shard * cb * accum
            if p.grads_streamed:  # written home each micro-batch, read back by the step's update (by a
                backward.write += shard * cb * accum  # tentative update's only when redone)
                step.read += shard * cb if redone or not p.updates_tentatively else 0
        _add_update(backward if p.updates_in_backward else step, layout, p, block, cb, probe)
        if redone and p.updates_tentatively:  # undone by the clip, done again in the step
            _add_update(step, layout, p, block, cb, probe)
    _collectives(config, layouts, placement, world_size, forward, backward, step, probe.ranks_per_node)
    step.copy = sum(u.shard_numel for u in layouts) * cb  # the norm reads every gradient once
    _fills(config, layouts, placement, cb, moments, probe, forward, step, redone)
    return {"forward": forward, "backward": backward, "step": step}


def _add_update(phase: _Phase, layout: UnitLayout, p: UnitPlacement, block: int, cb: int, probe: Probe) -> None:
    """One unit's update in ``phase`` (``p`` its placement): its elements, its optimizer ``block``
    streamed in and out, a full gradient kept on the device read across the link, its new weights written
    where they are read from and sent where they live."""
    phase.optimizer_elements += layout.trainable_in_shard(0)
    if p.updated_on_device and probe.device != "cpu":
        phase.device_updates += layout.trainable_in_shard(0)
    if p.streamed:
        phase.read += block
        phase.write += block
    if p.params_stream and not p.params_in_masters:
        phase.write += layout.shard_numel * cb  # the new weights' shard, written where they are read from
    if p.keep_full_grad and not p.updated_on_device:  # stages 0–1: the update reads the device's gradient
        phase.link += layout.trainable_in_shard(0) * cb
    if p.weights_cross_link:
        phase.link += layout.shard_numel * cb  # the new weights, from where the update ran to where they live


def _partitioned_bytes(config: Config, layouts: list[UnitLayout], placement: Placement) -> int:
    """Stage 3's partitioned units, gathered whole in the compute dtype."""
    partitioned = sum(u.padded_numel for u, p in zip(layouts, placement.units) if p.partitioned)
    return partitioned * dtype_bytes(config.train.precision)


def _regathered_share(config: Config, layouts: list[UnitLayout], placement: Placement) -> float:
    """The share of the partitioned units backward gathers again: what ``zero.max_live_size`` could not
    keep from forward."""
    full = _partitioned_bytes(config, layouts, placement)
    return max(0.0, 1.0 - config.zero.max_live_size / full) if full else 0.0


def _activation_copies(config: Config, activations: ActivationProfile | None, probe: Probe,
                       phases: dict[str, _Phase]) -> None:
    """``offload.activations.tier = host`` on a CUDA device: each checkpointed input to the host in forward
    and back in backward, over the link (activation_offload's note); on a CPU device nothing moves."""
    if activations and activations_leave_device(config, torch.device(probe.device)):
        for phase in (phases["forward"], phases["backward"]):
            phase.link += activations.checkpoint_inputs * config.train.grad_accum_steps


def _fresh_memory(config: Config, layouts: list[UnitLayout], placement: Placement,
                  activations: ActivationProfile | None, phases: dict[str, _Phase]) -> None:
    """Host memory a CPU device's micro-batch maps afresh (see the note): stage 3's gathered units,
    whose buffers go back at the end of each backward; and where ``memory.release_freed`` makes every
    large buffer its own mapping, the activations too."""
    accum = config.train.grad_accum_steps
    gathered = _partitioned_bytes(config, layouts, placement) * accum
    phases["forward"].fresh += gathered  # every gather: forward's, and backward's past max_live_size
    phases["backward"].fresh += gathered * _regathered_share(config, layouts, placement)
    release = config.memory.release_freed
    if not (release == "on" or (release == "auto" and streams_state(config))):
        return
    if activations:
        saved = activations.bytes(config.train.activation_checkpointing) - activations.backward_temporaries
        phases["forward"].fresh += saved * accum
        phases["backward"].fresh += (activations.backward_temporaries - activations.bound_excess) * accum
    for phase in (phases["forward"], phases["backward"]):  # the host buffers NVMe shards are read into
        phase.fresh += phase.shard_reads


def _collectives(config: Config, layouts: list[UnitLayout], placement: Placement, world_size: int,
                 forward: _Phase, backward: _Phase, step: _Phase, ranks_per_node: int | None = None) -> None:
    """DESIGN §3's elements per rank: all-gathers of partitioned units (forward and backward) and of the
    units published by an all-gather (after their update), reduce-scatters or all-reduces (twice the
    elements) of the gradients, once a window or in every backward as placed; under ZeRO++ in the bytes
    of its wire code (qwZ, qgZ). Across ``ranks_per_node`` nodes, the bytes that cross the link too
    (volumes' note; hpZ keeps backward's gathers in the node)."""
    if world_size == 1:
        return
    cb = dtype_bytes(config.train.precision)
    accum = config.train.grad_accum_steps
    full = sum(u.padded_numel for u in layouts)
    partitioned = sum(u.padded_numel for u, p in zip(layouts, placement.units) if p.partitioned)
    reductions = accum if placement.reduces_every_backward else 1
    bits = max(p.gradient_bits for p in placement.units)
    hpz = any(p.secondary_parts > 1 for p in placement.units)
    gathered = wire_element_bytes(8) if any(p.quantized_gathers for p in placement.units) else cb
    reduce = full * (wire_element_bytes(bits) if bits else REDUCE_DTYPE.itemsize) * reductions
    backward.collective += reduce * (1 if placement.reduce_scatters else 2) + partitioned * (
        cb if hpz else gathered) * accum
    forward.collective += partitioned * gathered * accum
    step.collective += sum(u.padded_numel for u, p in zip(layouts, placement.units) if p.published_by_all_gather) * cb
    local = ranks_per_node or world_size
    if local < world_size:
        gathers = gather_volume(partitioned, world_size, local, gathered).inter * accum
        forward.inter += gathers
        backward.inter += (0.0 if hpz else gathers * _regathered_share(config, layouts, placement)) + reduce_volume(
            full, world_size, local, bits).inter * reductions


def _fills(config: Config, layouts: list[UnitLayout], placement: Placement, cb: int, moments: int, probe: Probe,
           forward: _Phase, step: _Phase, redone: bool) -> None:
    """The transfers nothing overlaps (see the note): with tentative updates ``redone``, theirs in the step too."""
    read, write = _disk_rates(probe, config)
    streamed_params = [u.shard_numel * cb for u, p in zip(layouts, placement.units) if p.params_stream]
    if streamed_params:
        forward.exposed += max(streamed_params) / read
    blocks = [state_bytes(u.shard_numel, moments, config.optimizer.moments, p.master_format, len(u.slots))
              for u, p in zip(layouts, placement.units)
              if p.streamed and p.trainable and (not p.updates_in_backward or redone and p.updates_tentatively)]
    if blocks:
        step.exposed += max(blocks) / read + max(blocks) / write


def _disk_rates(probe: Probe, config: Config) -> tuple[float, float]:
    """Bytes per second of reads and of writes over the swap directories (striped: their sum)."""
    disks = [probe.disk(path) for path in config.nvme.paths]
    return sum(d.read_gbps for d in disks) * _GB, sum(d.write_gbps for d in disks) * _GB


def _seconds(phase: _Phase, probe: Probe, config: Config) -> float:
    """The phase's wall time (see the note), its work per resource filled into ``phase.work``."""
    read_bw, write_bw = _disk_rates(probe, config) if (phase.read or phase.write) else (1.0, 1.0)
    optimizer = (phase.optimizer_elements - phase.device_updates) / probe.adam_rate(config)
    optimizer += phase.device_updates * 32 / (probe.device_copy_gbps * _GB)  # a CUDA device's: memory-bound
    copies = phase.copy / (probe.device_copy_gbps * _GB)
    fresh = phase.fresh / (probe.first_touch_gbps * _GB)
    link = (phase.link + (phase.gathered if probe.device != "cpu" else 0.0)) / (probe.link_gbps * _GB)
    collective = phase.collective / (probe.collective_gbps * _GB) if phase.collective else 0.0
    if phase.inter and probe.inter_node_gbps:  # the link between nodes, beside the node's own exchanges
        collective += phase.inter / (probe.inter_node_gbps * _GB)
    disk = phase.read / read_bw + phase.write / write_bw
    phase.work.update(compute=phase.device + copies, fresh_memory=fresh, optimizer=optimizer,
                      nvme_read=phase.read / read_bw, nvme_write=phase.write / write_bw, host_device=link,
                      collectives=collective)
    if probe.device == "cpu":  # one set of cores computes, updates, copies, runs gloo and serves the disk
        return phase.device + copies + fresh + optimizer + link + collective + disk + phase.exposed
    busy = max(phase.device + copies, optimizer, link, collective)
    if config.zero.prefetch_size == 0:
        return busy + disk + phase.exposed
    return max(busy, disk) + phase.exposed


def _bottleneck(phases: dict[str, _Phase], work: dict[str, float], probe: Probe, config: Config) -> str:
    """One line naming the resource with the most seconds, with its bytes or elements and rate."""
    reads = sum(p.read for p in phases.values())
    writes = sum(p.write for p in phases.values())
    disk = work["nvme_read"] + work["nvme_write"]
    candidates = {"compute": work["compute"], "optimizer": work["optimizer"], "disk": disk,
                  "host_device": work["host_device"], "collectives": work["collectives"]}
    name = max(candidates, key=candidates.get)
    if name == "disk":
        read_bw, write_bw = _disk_rates(probe, config)
        return (f"disk-bound: {reads / _GB:.2f} GB read at {read_bw / _GB:.2f} GB/s and {writes / _GB:.2f} GB "
                f"written at {write_bw / _GB:.2f} GB/s per step ({disk:.2f} s)")
    if name == "optimizer":
        elements = sum(p.optimizer_elements for p in phases.values())
        return (f"optimizer-bound: {elements / 1e6:.1f}M elements at "
                f"{probe.adam_rate(config) / 1e9:.2f} G/s ({work['optimizer']:.2f} s)")
    if name == "host_device":
        moved = sum(p.link + p.gathered for p in phases.values())
        return f"link-bound: {moved / _GB:.2f} GB host<->device at {probe.link_gbps:.1f} GB/s ({work[name]:.2f} s)"
    if name == "collectives":
        return f"collective-bound: {work[name]:.2f} s of collectives per step"
    return f"compute-bound: {work['compute']:.2f} s of forward and backward per step"

