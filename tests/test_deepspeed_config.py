"""DeepSpeed JSON configs of the usual shapes map to the values DESIGN §2's table gives."""
from __future__ import annotations

import json
import warnings

import pytest

import zerooffload as zo
from zerooffload import DeepSpeedConfigWarning
from zerooffload.config import ConfigError

MiB = 2**20


def _load(ds: dict, tmp_path=None, world_size=1) -> tuple[zo.Config, str]:
    """Load through a real JSON file; return the config and the one warning's text ('' if none)."""
    source = ds
    if tmp_path is not None:
        source = tmp_path / "ds_config.json"
        source.write_text(json.dumps(ds))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = zo.Config.load(source, world_size=world_size)
    ours = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(ours) <= 1, "unmapped keys must be reported in one warning"
    return config, str(ours[0].message) if ours else ""


def test_stage2_with_cpu_optimizer_offload(tmp_path):
    config, warning = _load({
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True},
        "steps_per_print": 10, "wall_clock_breakdown": False,
    }, tmp_path, world_size=4)
    assert config.train.grad_accum_steps == 4 and config.train.micro_batch_size == 4  # 64 = 4 × 4 × 4
    assert config.train.grad_clip == 1.0 and config.train.precision == "fp32"
    assert (config.optimizer.type, config.optimizer.lr, config.optimizer.betas) == ("adamw", 3e-4, (0.9, 0.95))
    assert config.optimizer.weight_decay == 0.1
    assert config.zero.stage == 2 and config.zero.overlap_comm is True
    assert config.zero.bucket_size == 500_000_000 * 4  # reduce_bucket_size elements × fp32 bytes
    assert config.offload.optimizer.tier == "host" and config.offload.param.tier == "device"
    for key in ("zero_optimization.offload_optimizer.pin_memory", "zero_optimization.contiguous_gradients",
                "zero_optimization.reduce_scatter", "steps_per_print", "wall_clock_breakdown"):
        assert key in warning


def test_stage3_nvme_params_and_optimizer_with_aio(tmp_path):
    config, warning = _load({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8, "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3, "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9,
            "stage3_param_persistence_threshold": 1e5, "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e9,
            "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5, "buffer_size": 1e8,
                              "max_in_cpu": 1e9, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4,
                                  "pipeline_read": False, "pipeline_write": False, "fast_init": False,
                                  "pin_memory": True, "ratio": 0.3}},
        "aio": {"block_size": 1048576, "queue_depth": 16, "thread_count": 2, "single_submit": False,
                "overlap_events": True},
    }, tmp_path)
    assert config.train.precision == "bf16" and config.train.grad_accum_steps == 8
    assert config.zero.stage == 3 and config.zero.persist_threshold == 100_000
    assert config.zero.prefetch_size == 50_000_000 * 2 and config.zero.max_live_size == 10**9 * 2
    assert (config.offload.param.tier, config.offload.param.path) == ("nvme", "/local_nvme")
    assert (config.offload.optimizer.tier, config.offload.optimizer.fraction) == ("nvme", 0.3)
    assert (config.aio.block_size, config.aio.queue_depth, config.aio.threads) == (MiB, 16, 2)
    for key in ("buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "fast_init", "sub_group_size",
                "stage3_max_reuse_distance", "aio.single_submit", "aio.overlap_events"):
        assert key in warning
    assert "not supported" not in warning


def test_bf16_with_auto_values():
    config, warning = _load({
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    })
    assert config.train.precision == "bf16" and config.train.micro_batch_size == 1
    assert config.optimizer.lr == zo.Config().optimizer.lr and config.zero.bucket_size == zo.Config().zero.bucket_size
    assert warning == ""


def test_fp16_with_loss_scale_keys():
    config, warning = _load({
        "train_micro_batch_size_per_gpu": 8,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 1000,
                 "hysteresis": 3, "min_loss_scale": 1, "consecutive_hysteresis": False},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0, "adam_w_mode": False}},
        "zero_optimization": {"stage": 1},
    })
    t = config.train
    assert (t.precision, t.loss_scale, t.initial_scale_power, t.loss_scale_window, t.hysteresis,
            t.min_loss_scale) == ("fp16", 0.0, 12, 1000, 3, 1.0)
    assert config.optimizer.type == "adam"  # adam_w_mode false: L2 decay, not decoupled
    assert "not supported, ignored (1): fp16.consecutive_hysteresis" in warning


def test_warmup_lr_and_deepspeed_adam_is_adamw():
    config, warning = _load({
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 0.002,
                                                     "warmup_num_steps": 100}},
        "tensorboard": {"enabled": True, "output_path": "runs"},
    })
    assert config.optimizer.type == "adamw"  # DeepSpeed's Adam decouples weight decay by default
    assert (config.scheduler.type, config.scheduler.warmup_steps, config.scheduler.min_lr) == ("constant", 100, 1e-5)
    assert config.optimizer.lr == 0.002  # warmup_max_lr is the peak
    assert "warmup_type = 'log'" in warning and "tensorboard.enabled" in warning and "tensorboard.output_path" in warning


def test_warmup_cosine_and_decay():
    cosine, _ = _load({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                       "scheduler": {"type": "WarmupCosineLR", "params": {
                           "total_num_steps": 1000, "warmup_num_steps": 10, "cos_min_ratio": 0.1,
                           "warmup_min_ratio": 0.1, "warmup_type": "linear"}}})
    assert (cosine.scheduler.type, cosine.scheduler.total_steps, cosine.scheduler.min_lr) == (
        "warmup_cosine", 1000, pytest.approx(0.001))
    decay, _ = _load({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 50, "warmup_num_steps": 5, "warmup_max_lr": 0.1, "warmup_type": "linear"}}})
    assert (decay.scheduler.type, decay.scheduler.total_steps, decay.optimizer.lr) == ("warmup_linear", 50, 0.1)


@pytest.mark.parametrize("ds, message", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     r"train_batch_size = 30: must equal train_micro_batch_size_per_gpu \(4\) × gradient_accumulation_steps \(2\)"),
    ({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lamb"}}, r"optimizer\.type = 'Lamb'"),
    ({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "OneCycle"}}, r"scheduler\.type = 'OneCycle'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
     r"zero_optimization\.offload_param\.device = 'gpu'"),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, r"zero_optimization\.reduce_bucket_size = -5"),
    ({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "both true"),
])
def test_bad_deepspeed_configs_name_the_deepspeed_key(ds, message):
    with pytest.raises(ConfigError, match=message):
        zo.Config.load(ds)


def test_offload_param_below_stage3_is_reported_not_applied():
    config, warning = _load({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert config.offload.param.tier == "device"
    assert "offload_param.device = 'cpu' (parameters are offloaded only at stage 3)" in warning
