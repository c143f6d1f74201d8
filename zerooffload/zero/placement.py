"""Where each unit's state lives and where its update runs, decided once from the config.

[Note: placement]
A run's layout of state is data: one ``UnitPlacement`` per unit, made here and nowhere else, read by
the engine, the memory plan and telemetry alike. Tiers are named as the config names them (``device``
runs the compute, ``host`` is RAM, ``nvme`` swap files); only this module, the config and the tier
classes spell those names out: everything above asks a placement which tier, and the tier object
what it can do. The rules:
- parameters: full on the device, except stage 3's *partitioned* units (at least
  ``zero.persist_threshold`` parameters), whose shard lives on ``offload.param.tier``;
- optimizer blocks: on ``offload.optimizer.tier`` for the share of units ``offload.optimizer.fraction``
  sends there (``units_to_offload``), on the device for the rest;
- the update runs in the optimizer block's memory, or in host memory when the block is on NVMe;
- gradients: full buffers over the window at stages 0–1, reduced shards at stages 2–3; a shard whose
  optimizer block is off the device *leaves* it, for that tier until the step (*kept*) or straight
  into an update in backward (``optimizer.update_in_backward``, backward_updates' [Note: updates in backward]);
  with ``train.grad_clip`` that update is *tentative*, for units whose optimizer block is on NVMe only
  (the block as it was is kept there until the step validates the update: [Note: tentative updates]),
  and their shard is kept all the same, for the redo;
- a kept shard waits on its *grad home*: the optimizer's tier, but for a block on NVMe, whose shard waits
  in host memory when the run's memory plan fits it there (``place``'s ``fits``, which the memory plan
  supplies), on NVMe otherwise: a shard in memory costs no write and no read back ([Note: where kept
  gradients wait] in ``memory_plan``);
- fp32 masters are the weights themselves with fp32 weights and optimizer both on the device; a
  partitioned fp32 unit on NVMe with its optimizer block there and no frozen values reads its shard from
  the block's master segment (*params in masters*), which its own digest verifies (``nvme.checksum``);
- ZeRO++'s choices are per unit too: quantized gathers and secondary shards for partitioned units,
  quantized gradient reductions for units reduce-scattered;
- everything that depends on the stage is decided here too (the shard count, all-reduce or
  reduce-scatter, reductions in every backward or once a window, weights published by an all-gather),
  so that the engine, the memory plan and the planner read a placement, never ``zero.stage``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import Config
from .unit_layout import UnitLayout

__all__ = ["Placement", "UnitPlacement", "activations_leave_device", "addressable", "leaves_device", "place",
           "shard_count", "steps_beside_forward", "streams_state", "units_to_offload", "updates_in_backward"]

COMPUTE = "device"
"""The tier the compute runs in."""
STAGING = "host"
"""The tier whose memory stages blocks that are not addressable (NVMe) and runs their updates."""
SWAP = "nvme"
"""The tier of swap files: not addressable, its blocks stream through the staging memory."""
TIER_NAMES = (COMPUTE, STAGING, SWAP)
"""Every tier a placement may name, nearest the compute first (what a plan enumerates)."""
_NOT_ADDRESSABLE = (SWAP,)


@dataclass(frozen=True, slots=True)
class UnitPlacement:
    """One unit's placement (see [Note: placement]); tier names as the config spells them."""

    index: int
    """The unit's position in the model's unit order."""
    trainable: bool
    """Whether any of its parameters trains (a frozen unit has no gradient, no optimizer state)."""
    partitioned: bool
    """Stage 3: only a shard lives between uses, gathered for forward and backward."""
    param_home: str
    """Where the parameters live between uses: the shard's tier when partitioned, else the device."""
    optimizer: str
    """Where the optimizer block (masters and moments) lives."""
    update_on: str
    """Whose memory the update runs in: the optimizer block's, or host memory's for blocks on NVMe."""
    keep_full_grad: bool
    """Stages 0–1: a full gradient buffer accumulates over the window."""
    keep_grad_shard: bool
    """Stages 2–3: a reduced shard accumulates over the window."""
    grad_leaves: bool
    """The reduced shard leaves the device: for the optimizer's tier or into an update in backward."""
    grads_kept: bool
    """A shard that leaves waits on its ``grad_home`` for the step (``offloaded_grads``)."""
    grad_home: str
    """Where a kept shard waits: the optimizer's tier, or host memory for a block on NVMe (see the note)."""
    updates_in_backward: bool
    """Updated in the backward that closes a window, as its last reduced shard arrives."""
    updates_tentatively: bool
    """That update runs before the global norm is known: the step commits it or redoes it clipped."""
    master_is_param: bool
    """The fp32 masters are the weights' own shard: no copy, no bytes."""
    master_split: bool
    """The master is the weights' shard plus a residual in the optimizer block (``optimizer.master =
    "split"``, state_formats' [Note: split masters]): an update reads the weights it rewrites."""
    params_in_masters: bool
    """A partitioned shard on NVMe is read from the optimizer block's master segment (fp32): the unit
    has no frozen values, which the master does not hold."""
    published_by_all_gather: bool
    """Its updated weights reach every rank by an all-gather after the update: trainable units at stages
    1–2, and those stage 3 keeps whole (fewer than ``zero.persist_threshold`` parameters)."""
    quantized_gathers: bool = False
    """qwZ (``zero.quantized_weights``): a partitioned unit's all-gathers send its shard quantized."""
    secondary_parts: int = 1
    """hpZ (``zero.hpz_partition_size``): a partitioned unit keeps a 1/this share of its gathered weights on
    the device through a training pass, which its later gathers in the pass read within the node
    (gathers' [Note: secondary shards]); 1: none."""
    gradient_bits: int = 0
    """qgZ (``zero.quantized_gradients``): bits per element its gradients' reduce-scatter sends (8 or 4);
    0: fp32 (reduction's [Note: quantized reductions (qgZ)])."""

    @property
    def master_format(self) -> str | None:
        """How the optimizer block holds the master: None (the weights are it), "fp32" or "split"."""
        return None if self.master_is_param else "split" if self.master_split else "fp32"

    @property
    def offloaded(self) -> bool:
        """The optimizer block lives off the device."""
        return self.optimizer != COMPUTE

    @property
    def streamed(self) -> bool:
        """The optimizer block is not addressable: it streams through host buffers to be used."""
        return self.optimizer in _NOT_ADDRESSABLE

    @property
    def grads_streamed(self) -> bool:
        """A kept shard waits on a tier that is not addressable: written there, read back for the step."""
        return self.grads_kept and self.grad_home in _NOT_ADDRESSABLE

    @property
    def updated_on_device(self) -> bool:
        """The update writes its new weights in the compute's memory."""
        return self.update_on == COMPUTE

    @property
    def params_off_device(self) -> bool:
        """A partitioned unit whose shard lives off the device: each gather brings it in."""
        return self.partitioned and self.param_home != COMPUTE

    @property
    def params_stream(self) -> bool:
        """A partitioned unit whose shard lives where it is not addressable: read into host memory first."""
        return self.partitioned and self.param_home in _NOT_ADDRESSABLE

    @property
    def weights_cross_link(self) -> bool:
        """The update runs on one side of the host-device link and the weights live on the other: the new
        weights cross it."""
        return self.updated_on_device == self.params_off_device


@dataclass(frozen=True, slots=True)
class Placement:
    """Every unit's placement, and the run-wide facts the engine's parts share."""

    units: tuple[UnitPlacement, ...]
    compute: str = COMPUTE
    staging: str = STAGING
    shards_off_device: bool = False
    """Partitioned shards live off the device: gathers copy them in (``DeviceCopier``)."""
    reduce_scatters: bool = True
    """Stages 1–3: gradients are reduce-scattered to the ranks that own their optimizer shards; stage 0
    all-reduces them whole (every rank keeps the full gradient and updates every weight)."""
    reduces_every_backward: bool = False
    """Stages 2–3: every backward reduces its units, their shards accumulating over the window; stages
    0–1 reduce once, in the backward that closes the window, the full gradients accumulating."""

    def tiers(self) -> set[str]:
        """The tiers this placement puts state on (the device and the staging memory always)."""
        return {self.compute, self.staging, *(u.param_home for u in self.units), *(u.optimizer for u in self.units)}

    @property
    def updates_in_backward(self) -> list[UnitPlacement]:
        """The units updated in backward, in unit order."""
        return [u for u in self.units if u.updates_in_backward]


def shard_count(config: Config, world_size: int) -> int:
    """Shards a unit is split into: one per rank from stage 1 (optimizer states sharded), one at stage 0."""
    return world_size if config.zero.stage >= 1 else 1


def leaves_device(tier: str) -> bool:
    """Whether state on ``tier`` lives off the compute's memory."""
    return tier != COMPUTE


def addressable(tier: str) -> bool:
    """Whether ``tier``'s bytes are memory the compute can address (device, host), not swap files."""
    return tier not in _NOT_ADDRESSABLE


def streams_state(config: Config) -> bool:
    """Whether the config puts parameters or optimizer states on a tier that is not addressable (NVMe)."""
    return any(tier in _NOT_ADDRESSABLE for tier in (config.offload.param.tier, config.offload.optimizer.tier))


def activations_leave_device(config: Config, device: torch.device) -> bool:
    """Whether checkpointed block inputs wait in the host tier (``offload.activations.tier``): with
    checkpointing, off a CPU device (on one they are in host memory already: activation_offload's note)."""
    return (config.offload.activations.tier == STAGING and config.train.activation_checkpointing
            and device.type != "cpu")


def updates_in_backward(config: Config) -> bool:
    """Whether units whose gradients leave the device are updated in the backward that closes a window
    (``optimizer.update_in_backward``; ``auto``: unless an fp16 loss scale may skip the step). With
    ``train.grad_clip`` only units whose optimizer block streams from NVMe are, tentatively (``place``)."""
    mode = config.optimizer.update_in_backward
    if mode == "auto":
        return config.train.precision != "fp16"
    return mode == "on"


def steps_beside_forward(units: list[UnitPlacement]) -> bool:
    """Whether the step's updates of ``units`` can run beside the next forward (step_updates' note), given
    ``optimizer.updates_in_flight`` > 0 and the native CPU pass: every one's state off the device, and no
    shard read from its optimizer block's masters (that block is stored only as the stream moves past it)."""
    return bool(units) and all(u.offloaded and not u.params_in_masters for u in units)

def units_to_offload(layouts: list, fraction: float) -> list[bool]:
    """Which units' optimizer states go to ``offload.optimizer.tier`` for ``offload.optimizer.fraction``:
    units in order while their shards stay within ``fraction`` of all (whole units: the share is at
    most ``fraction``, short of it by less than one unit)."""
    total = sum(layout.shard_numel for layout in layouts)
    chosen, taken = [], 0
    for layout in layouts:
        taken += layout.shard_numel
        chosen.append(taken <= fraction * total + 1e-9 * total)
    return chosen


def place(layouts: list[UnitLayout], config: Config, fits: Callable[[Placement], bool] = lambda placement: True
          ) -> Placement:
    """The placement ``config`` makes of ``layouts`` (see [Note: placement]), decided once. The kept
    gradient shards of blocks on NVMe wait in host memory when that placement ``fits`` (the memory plan's
    budgets and RAM), else on NVMe when that one does; when neither fits, in host memory (whose bytes the
    refusal then names)."""
    in_host = _placement(layouts, config, grads_wait_in_host=True)
    moves = any(p.grads_kept and p.grad_home != p.optimizer for p in in_host.units)
    if not moves or fits(in_host):
        return in_host
    beside = _placement(layouts, config, grads_wait_in_host=False)
    return beside if fits(beside) else in_host


def _placement(layouts: list[UnitLayout], config: Config, *, grads_wait_in_host: bool) -> Placement:
    """The placement with the kept shards of blocks on NVMe in host memory (``grads_wait_in_host``) or
    beside their blocks."""
    stage, offload, zero = config.zero.stage, config.offload, config.zero
    moved = units_to_offload(layouts, offload.optimizer.fraction)
    in_backward, tentative = updates_in_backward(config), config.train.grad_clip > 0
    split = config.optimizer.master == "split"  # its weights, rewritten by a tentative update, could not be undone
    fp32 = config.train.precision == "fp32"
    units = []
    for index, (layout, offloaded) in enumerate(zip(layouts, moved)):
        optimizer = offload.optimizer.tier if offloaded else COMPUTE
        partitioned = stage == 3 and layout.numel >= config.zero.persist_threshold
        param_home = offload.param.tier if partitioned else COMPUTE
        grad_leaves = stage >= 2 and layout.trainable and optimizer != COMPUTE
        early = grad_leaves and in_backward and (optimizer in _NOT_ADDRESSABLE or not tentative) and not (
            split and tentative)
        kept = grad_leaves and (config.train.grad_accum_steps > 1 or not early or tentative)
        grad_home = STAGING if grads_wait_in_host and optimizer in _NOT_ADDRESSABLE else optimizer
        units.append(UnitPlacement(
            index=index, trainable=layout.trainable, partitioned=partitioned, param_home=param_home,
            optimizer=optimizer, update_on=STAGING if optimizer in _NOT_ADDRESSABLE else optimizer,
            keep_full_grad=stage <= 1 and layout.trainable, keep_grad_shard=stage >= 2 and layout.trainable,
            grad_leaves=grad_leaves, grads_kept=kept, grad_home=grad_home, updates_in_backward=early,
            updates_tentatively=early and tentative,
            master_is_param=fp32 and offload.param.tier == COMPUTE and optimizer == COMPUTE,
            master_split=config.optimizer.master == "split" and layout.trainable,
            params_in_masters=(fp32 and partitioned and param_home in _NOT_ADDRESSABLE and optimizer in
                               _NOT_ADDRESSABLE and layout.trainable_numel == layout.padded_numel),
            published_by_all_gather=stage >= 1 and layout.trainable and not partitioned,
            quantized_gathers=partitioned and zero.quantized_weights,
            secondary_parts=zero.hpz_partition_size if partitioned else 1,
            gradient_bits=zero.quantized_gradients_bits if zero.quantized_gradients and stage >= 1 else 0))
    return Placement(tuple(units), shards_off_device=offload.param.tier != COMPUTE, reduce_scatters=stage >= 1,
                     reduces_every_backward=stage >= 2)
