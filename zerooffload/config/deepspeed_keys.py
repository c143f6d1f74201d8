"""DeepSpeed's config keys and ours: the tables the DeepSpeed reader (``deepspeed``) translates by.

Canonical DeepSpeed keys (dotted, lower case, aliases resolved) to our key paths: mapped directly, from
elements to bytes, by value, or accepted as not needed; DeepSpeed's own defaults where it has them.
"""
from __future__ import annotations

__all__ = ["ALIASES", "DEEPSPEED_DEFAULTS", "DIRECT", "ELEMENTS", "INSTEAD", "NOT_NEEDED", "OFF_BY_DEFAULT",
           "OFFLOAD_DEVICES", "OPTIMIZERS", "PREFIX_ALIASES", "SCHEDULERS", "SIZES", "SPECIAL", "TARGETS", "Z",
           "ZERO_PP"]

Z = "zero_optimization."
DIRECT = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "gradient_clipping": "train.grad_clip",
    "fp16.loss_scale": "train.loss_scale",
    "fp16.initial_scale_power": "train.initial_scale_power",
    "fp16.loss_scale_window": "train.loss_scale_window",
    "fp16.hysteresis": "train.hysteresis",
    "fp16.min_loss_scale": "train.min_loss_scale",
    "bf16.check_grad_overflow": "train.skip_nonfinite",
    "optimizer.params.lr": "optimizer.lr",
    "optimizer.params.betas": "optimizer.betas",
    "optimizer.params.eps": "optimizer.eps",
    "optimizer.params.weight_decay": "optimizer.weight_decay",
    "optimizer.params.momentum": "optimizer.momentum",
    "scheduler.params.warmup_num_steps": "scheduler.warmup_steps",
    "scheduler.params.total_num_steps": "scheduler.total_steps",
    "scheduler.params.warmup_min_lr": "scheduler.min_lr",
    "scheduler.params.warmup_max_lr": "optimizer.lr",
    Z + "stage": "zero.stage",
    Z + "overlap_comm": "zero.overlap_comm",
    Z + "stage3_param_persistence_threshold": "zero.persist_threshold",
    Z + "offload_optimizer.ratio": "offload.optimizer.fraction",
    "aio.block_size": "aio.block_size",
    "aio.queue_depth": "aio.queue_depth",
    "aio.intra_op_parallelism": "aio.threads",
}
ELEMENTS = {
    Z + "reduce_bucket_size": "zero.bucket_size",
    Z + "allgather_bucket_size": "zero.bucket_size",
    Z + "stage3_prefetch_bucket_size": "zero.prefetch_size",
    Z + "stage3_max_live_parameters": "zero.max_live_size",
}
ALIASES = {
    **{Z + name: Z + "stage3_" + name for name in (
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")},
    "aio.thread_count": "aio.intra_op_parallelism",  # its name before DeepSpeed 0.16.4 (#7056)
}
"""Second spellings DeepSpeed reads: pydantic field names beside their ``stage3_`` aliases, old names."""
PREFIX_ALIASES = {"bfloat16.": "bf16.", Z + "aio.": "aio."}
NOT_NEEDED = {
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "fp16.auto_cast", "bf16.immediate_grad_update", "aio.single_submit",
    "aio.overlap_events", "aio.use_gds", "scheduler.params.last_batch_iteration",
    *(Z + k for k in (
        "contiguous_gradients", "sub_group_size", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
        "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "elastic_checkpoint",
        "load_from_fp32_weights", "ignore_unused_parameters", "use_multi_rank_bucket_allreduce",
        "memory_efficient_linear", "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
        "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory")),
    *(f"{Z}offload_{s}.{k}" for s in ("param", "optimizer") for k in (
        "buffer_count", "buffer_size", "max_in_cpu", "pin_memory", "pipeline", "pipeline_read", "pipeline_write",
        "fast_init", "super_offload", "cpuadam_cores_perc")),
}
_ACTIVATIONS = "activation_checkpointing."
OFF_BY_DEFAULT = {"prescale_gradients", "sparse_gradients", *(_ACTIVATIONS + k for k in (
    "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
    "profile"))}
"""DeepSpeed switches that are off unless asked for: set to false, they ask for nothing zerooffload lacks."""
INSTEAD = {_ACTIVATIONS: "zerooffload checkpoints every unit with train.activation_checkpointing and keeps the "
                         "checkpoints on the host with offload.activations.tier = host"}
"""Key prefixes of DeepSpeed features zerooffload does its own way: said beside such a key when it is ignored."""
ZERO_PP = {
    Z + "zero_quantized_weights": "zero.quantized_weights",
    Z + "zero_hpz_partition_size": "zero.hpz_partition_size",
    Z + "zero_quantized_gradients": "zero.quantized_gradients",
}
"""ZeRO++'s keys: mapped directly at stage 3; below it DeepSpeed ignores them (its stage-3 optimizer reads them)."""
OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd"}
SCHEDULERS = {"warmuplr": "constant", "warmupdecaylr": "warmup_linear", "warmupcosinelr": "warmup_cosine"}
OFFLOAD_DEVICES = {"none": "device", "cpu": "host", "nvme": "nvme"}
SPECIAL = {"train_batch_size", "bf16.enabled", "fp16.enabled", "optimizer.type", "optimizer.params.adam_w_mode",
            "optimizer.params.torch_adam", "scheduler.type", "scheduler.params.warmup_type",
            "scheduler.params.cos_min_ratio", "scheduler.params.warmup_min_ratio",
            *(f"{Z}offload_{s}.{k}" for s in ("param", "optimizer") for k in ("device", "nvme_path")), *ZERO_PP}
TARGETS = {**DIRECT, **ZERO_PP, **ELEMENTS, "train_batch_size": "train.micro_batch_size", "bf16.enabled": "train.precision",
            "fp16.enabled": "train.precision", "optimizer.type": "optimizer.type",
            Z + "offload_param.device": "offload.param.tier",
            Z + "offload_optimizer.device": "offload.optimizer.tier"}
"""The key of ours each DeepSpeed key sets: where an ``"auto"`` is reported as resolved."""
DEEPSPEED_DEFAULTS = {
    "gradient_clipping": 1.0,  # DeepSpeed >= 0.19.3 (#8068); 0 (off) before
    "fp16.loss_scale_window": 1000,
    "optimizer.params.weight_decay": 0.0,  # FusedAdam, DeepSpeedCPUAdam, torch Adam and SGD; not torch AdamW
    "scheduler.params.warmup_num_steps": 1000,
    "scheduler.params.warmup_max_lr": 0.001,  # WarmupDecayLR's; WarmupLR's is the optimizer's lr
}
"""DeepSpeed's defaults that change what training computes where ours differ ([Note: "auto" and absent keys])."""
SIZES = {"zero.bucket_size", "zero.prefetch_size", "zero.max_live_size"}
