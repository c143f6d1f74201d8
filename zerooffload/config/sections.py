"""The sections of a config, one frozen dataclass per component ([Note: config vocabulary] in ``fields``).

Every field's doc is its key's entry in docs/configuration-reference.md (``python docs/generate.py``
writes the page from these docs; tests/test_docs.py fails while it is stale), and errors quote it.
"""
from __future__ import annotations

import tempfile
from dataclasses import field
from typing import Literal, Union

from .fields import ALIGNMENT, Section, option, section
from .values import ConfigError

__all__ = ["AioConfig", "MemoryConfig", "NvmeConfig", "OffloadActivationsConfig", "OffloadConfig",
           "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig", "TrainConfig",
           "ZeroConfig"]


@section
class TrainConfig(Section):
    PATH = "train"
    micro_batch_size: int = option(1, "samples per rank per forward", min=1)
    grad_accum_steps: int = option(1, "micro-batches accumulated per optimizer step", min=1)
    precision: Literal["fp32", "bf16", "fp16"] = option("fp32", "compute dtype; master weights stay fp32")
    grad_clip: float = option(0.0, "clip the global gradient norm to this; 0 = off", min=0)
    seed: int = option(0, "seed of parameter init and data order", min=0)
    activation_checkpointing: bool = option(False, "recompute each unit's activations in backward")
    threads: int = option(0, "torch's CPU threads; 0: torch's default (one per core)", min=0)
    skip_nonfinite: bool = option(True, "skip a window whose loss or gradient norm is inf/NaN on any rank, as fp16 "
                                      "skips overflows (counted in stats.skipped_steps); false: update anyway, "
                                      "as plain PyTorch does")
    max_skip_streak: int = option(8, "stop (SkipStreakError) after this many windows in a row skipped for inf/NaN "
                                   "losses or gradients (fp16 overflows do not count); 0: never", min=0)
    loss_scale: float = option(0.0, "fp16 static loss scale; 0 = dynamic", min=0)
    initial_scale_power: int = option(16, "fp16 dynamic scale starts at 2**this", min=0, max=64)
    loss_scale_window: int = option(2000, "fp16: steps without overflow before the scale doubles", min=1)
    hysteresis: int = option(2, "fp16: overflows tolerated before the scale halves", min=1)
    min_loss_scale: float = option(1.0, "fp16: the dynamic scale never drops below this", above=0)
    async_save: bool = option(True, "zerooffload train --save-every saves without stopping the loop: the state is "
                                    "copied at the step boundary and its files written while training goes on "
                                    "(engine.save_checkpoint(..., blocking=False)); false: each save returns once "
                                    "its checkpoint is published")
    save_staging: int = option("1GiB", "host memory a non-blocking save copies the state into while its writes "
                                       "land (at most this rank's checkpoint data file; the memory plan counts it, but "
                                       "not for a train run without --save-every, which never saves); "
                                       "past it the save waits for its oldest writes before it returns",
                               size=True, min=4096)


@section
class OptimizerConfig(Section):
    PATH = "optimizer"
    type: Literal["adamw", "adam", "sgd"] = option("adamw", "update rule (adam: L2 decay; adamw: decoupled)")
    lr: float = option(1e-3, "learning rate (the peak, with a warmup schedule)", min=0)
    betas: tuple[float, float] = option((0.9, 0.999), "Adam moment decay rates, each in [0, 1)")
    eps: float = option(1e-8, "Adam denominator term", above=0)
    weight_decay: float = option(0.01, "weight decay", min=0)
    momentum: float = option(0.0, "SGD momentum", min=0, below=1)
    master: Literal["fp32", "split"] = option(
        "fp32", "how the fp32 master is held: split keeps it as the bf16 weight plus a 16-bit residual and a bit, "
        "bitwise the fp32 master's updates in 2.125 bytes instead of 4 (bf16 precision; native CPU Adam pass)")
    moments: Literal["fp32", "bf16", "int8"] = option(
        "fp32", "format of Adam's moments (exp_avg, exp_avg_sq): bf16 halves their bytes, int8 quarters them (a "
        "scale per 256 elements and an 8-bit float code each); both rounded stochastically (unbiased); needs the "
        "native CPU Adam pass")
    update_in_backward: Literal["auto", "on", "off"] = option(
        "auto", "update units whose gradients leave the device in the backward that closes a window (auto: "
        "unless fp16; with train.grad_clip only units whose optimizer state is on nvme, tentatively: the step "
        "commits the update, or redoes it clipped when the global norm exceeds the clip)")
    updates_in_flight: int = option(
        1, "updates in backward handed to the update worker at once, which runs them beside the rest of backward "
        "(the device works on while the CPU updates); each holds its unit's reduced gradient until it is done, "
        "so this bounds that memory. Above 0 the updates step() runs on the CPU also go beside the next forward "
        "(step() returns once the clip is decided; each unit's forward waits for its own update; bitwise the "
        "same result); 0: every update runs where it is due, and backward and step() wait for it", min=0, max=8)

    def check(self) -> None:
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ConfigError(f"optimizer.betas[{i}] = {beta!r}: must be in [0, 1)")
        if self.moments != "fp32" and self.type == "sgd":
            raise ConfigError(f"optimizer.moments = {self.moments!r} is for Adam's moments: optimizer.type = 'sgd' "
                              "keeps its momentum in fp32; set optimizer.moments = 'fp32' or type 'adamw'")


@section
class SchedulerConfig(Section):
    PATH = "scheduler"
    type: Literal["constant", "warmup_cosine", "warmup_linear"] = option(
        "constant", "learning-rate schedule: linear warmup from min_lr to lr, then constant or a decay to min_lr")
    warmup_steps: int = option(0, "optimizer steps of linear warmup", min=0)
    total_steps: int = option(0, "optimizer step at which a decay reaches min_lr (decays need it > warmup_steps)",
                            min=0)
    min_lr: float = option(0.0, "where warmup starts and decay ends", min=0)

    def check(self) -> None:
        if self.type != "constant" and self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"scheduler.total_steps = {self.total_steps}: scheduler.type = {self.type!r} decays after "
                f"warmup, so total_steps must be > warmup_steps ({self.warmup_steps})")


@section
class ZeroConfig(Section):
    PATH = "zero"
    stage: int = option(2, "ZeRO stage: 0 DDP, 1 optimizer states, 2 + gradients, 3 + parameters", min=0, max=3)
    unit_modules: list[str] = option([], "class names of the modules that form units; [] = each child of a "
                                       "ModuleList/Sequential")
    bucket_size: int = option("32MiB", "bytes per reduce-scatter/all-reduce bucket", size=True, above=0)
    prefetch_size: int = option("64MiB", "stage 3: bytes of gathered parameters fetched ahead", size=True, min=0)
    max_live_size: int = option("1GiB", "stage 3: most bytes of gathered parameters held at once", size=True,
                              above=0)
    persist_threshold: int = option(0, "stage 3: units with fewer parameters stay gathered", min=0)
    overlap_comm: bool = option(True, "overlap gradient reduction with backward")
    quantized_weights: bool = option(
        False, "stage 3 (qwZ, ZeRO++): each unit's weight all-gathers cross the wire as int8 per block with an fp32 "
        "scale per block, dequantized into the compute dtype on arrival; the fp32 masters and optimizer states never "
        "see the quantization (docs/zero-plus-plus.md)")
    hpz_partition_size: int = option(
        1, "stage 3 (hpZ, ZeRO++): after a unit's forward gather each rank keeps a 1/N share of it in device memory "
        "and backward gathers it from those N ranks of its node; 1 = off; N is the ranks per node (torchrun's "
        "LOCAL_WORLD_SIZE) or a divisor of it; lossless", min=1)
    quantized_gradients: bool = option(
        False, "stages 1-3 (qgZ, ZeRO++): each gradient reduce-scatter runs as quantize, all-to-all within the node, "
        "sum in fp32, quantize, all-to-all across nodes, sum in fp32: each node's data crosses the link once")
    quantized_gradients_bits: Literal[8, 4] = option(8, "bits per gradient element on the wire with "
                                                        "zero.quantized_gradients")

    def check(self) -> None:
        if self.prefetch_size > self.max_live_size:
            raise ConfigError(f"zero.prefetch_size = {self.prefetch_size}: must be <= zero.max_live_size "
                              f"({self.max_live_size}): prefetched units are live")
        stage3_only = (("quantized_weights", "true", self.quantized_weights),
                       ("hpz_partition_size", self.hpz_partition_size, self.hpz_partition_size > 1))
        for key, value, on in stage3_only:
            if on and self.stage != 3:
                raise ConfigError(f"zero.{key} = {value}: it changes stage 3's parameter gathers, and "
                                  f"zero.stage = {self.stage}; set zero.stage = 3")
        if self.quantized_gradients and self.stage == 0:
            raise ConfigError("zero.quantized_gradients = true: it quantizes a reduce-scatter, and zero.stage = 0 "
                              "all-reduces; set zero.stage to 1, 2 or 3")


_TIERS = Literal["device", "host", "nvme"]


@section
class OffloadParamConfig(Section):
    PATH = "offload.param"
    tier: _TIERS = option("device", "home of stage-3 parameter shards")
    path: str | None = option(None, "swap directory for this state (overrides nvme.path)")


@section
class OffloadOptimizerConfig(Section):
    PATH = "offload.optimizer"
    tier: _TIERS = option("device", "home of fp32 master weights and optimizer moments")
    path: str | None = option(None, "swap directory for this state (overrides nvme.path)")
    fraction: float = option(1.0, "share of optimizer state offloaded to the tier; the rest stays on device",
                           min=0, max=1)


@section
class OffloadActivationsConfig(Section):
    PATH = "offload.activations"
    tier: Literal["device", "host"] = option(
        "device", "where checkpointed activations (the block inputs train.activation_checkpointing keeps) wait "
        "for backward; host: copied off a CUDA device after each block's forward, prefetched back in backward "
        "order (on a CPU device they are in host memory already: nothing moves)")


@section
class OffloadConfig(Section):
    PATH = "offload"
    param: OffloadParamConfig = field(default_factory=OffloadParamConfig, metadata={"doc": "parameters"})
    optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig,
                                              metadata={"doc": "optimizer states"})
    activations: OffloadActivationsConfig = field(default_factory=OffloadActivationsConfig,
                                                  metadata={"doc": "checkpointed activations"})


_BUDGET = Union[int, Literal["auto"]]


@section
class MemoryConfig(Section):
    PATH = "memory"
    device_budget: _BUDGET = option("auto", 'bytes the engine may hold on the device; "auto": 90% of free CUDA '
                                          "memory; on CPU the RAM available, shared with the host tier", size=True,
                                  min=1)
    host_budget: _BUDGET = option("auto", 'bytes the engine may hold in host RAM; "auto": the RAM available (less a '
                                        "margin for activations, the allocator and torch)", size=True, min=1)
    release_freed: Literal["auto", "on", "off"] = option(
        "auto", "give freed host buffers of 1 MiB and more back to the OS at once (glibc's mmap threshold fixed), so "
        "RSS follows what the engine holds, at the cost of page faults on fresh buffers (CPU activations too); auto: "
        "on when parameters or optimizer states live on NVMe")


@section
class NvmeConfig(Section):
    PATH = "nvme"
    path: Union[str, list[str]] = option(tempfile.gettempdir(),
                                       "an existing swap directory (never created; files go in its zerooffload-swap/), "
                                       "or a list to stripe over")
    checksum: bool = option(True, "verify every swapped-in block against the CRC32C taken when it was written "
                                "(off: saves about one more read of the bytes a step moves, ~6% of a ZeRO-3 NVMe "
                                "step on 2 cores, and a damaged swap file is trained on)")
    max_bytes: int = option(0, "cap on the swap files' bytes on this machine (all its ranks, each an even share), "
                               "preallocated space included: refused at start, plan keeps under it, and a write that "
                               "would grow the files past it is refused before it is made; 0: the free space",
                            size=True, min=0)

    def check(self) -> None:
        if not self.path or (isinstance(self.path, list) and not all(self.path)):
            raise ConfigError(f"nvme.path = {self.path!r}: needs at least one non-empty directory")

    @property
    def paths(self) -> list[str]:
        """The swap directories as a list, whichever way they were given."""
        return [self.path] if isinstance(self.path, str) else list(self.path)


@section
class AioConfig(Section):
    PATH = "aio"
    backend: Literal["auto", "uring", "pool", "python", "aiofiles"] = option(
        "auto", "I/O engine; auto = uring, else pool, else python")
    block_size: int = option("1MiB", "bytes per I/O request piece", size=True, min=ALIGNMENT, multiple_of=ALIGNMENT)
    queue_depth: int = option(32, "I/O request pieces in flight per engine", min=1, max=4096)
    threads: int = option(4, "worker threads of the pool/python/aiofiles backends", min=1, max=256)
    direct: bool = option(True, "O_DIRECT: bypass the page cache")
    blocks_in_flight: int = option(
        0, "host buffers each block pipeline holds at most (the optimizer/parameter block stream, the "
        "background block writer, offloaded-gradient reads, the checkpoint writer's writes in flight); 0 = "
        "each its own default (3, 3, 2, 3); else at least 2", min=0, max=64)

    def check(self) -> None:
        if self.blocks_in_flight == 1:
            raise ConfigError("aio.blocks_in_flight = 1: must be 0 (each pipeline's default) or at least 2 (a "
                              "block stream holds the block being worked on while it reads the next)")
