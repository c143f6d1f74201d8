"""DeepSpeed JSON configs map to the values DESIGN §2's table gives, and real published ones load and train."""
from __future__ import annotations

import json
import os
import warnings
from functools import reduce
from pathlib import Path

import pytest
import torch

import zerooffload as zo
from reference import make_batches, make_model
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
    assert (config.offload.param.tier, config.nvme.path) == ("nvme", "/local_nvme")  # one directory: nvme.path
    assert config.offload.param.path is None and config.offload.optimizer.path is None
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
    assert config.optimizer.weight_decay == 0.0  # DeepSpeed's AdamW has none by default
    assert '"auto" (no Hugging Face Trainer fills it in: the default applies) (5)' in warning
    for resolved in ("optimizer.params.lr -> optimizer.lr = 0.001", "optimizer.params.weight_decay -> "
                     "optimizer.weight_decay = 0.0", "zero_optimization.reduce_bucket_size -> zero.bucket_size = 32MiB",
                     "train_batch_size, train_micro_batch_size_per_gpu -> train.micro_batch_size = 1"):
        assert resolved in warning


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


# ----------------------------------------------------------------------------------------------
# Zeros, defaults and second spellings, as DeepSpeed reads them

def test_zeros_mean_what_they_mean_to_deepspeed():
    config, warning = _load({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 0, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0, "sub_group_size": 0, "stage3_prefetch_bucket_size": 5e7}})
    assert config.zero.bucket_size == 1  # each unit reduced alone, as DeepSpeed reduces each gradient alone
    assert config.zero.prefetch_size == 0  # max live 0: DeepSpeed gathers only what is in use
    assert config.zero.max_live_size == zo.Config().zero.max_live_size and config.zero.persist_threshold == 0
    assert "zero_optimization.stage3_max_live_parameters = 0 (DeepSpeed then gathers only" in warning
    assert "zero_optimization.reduce_bucket_size = 0 (DeepSpeed reduces each gradient alone" in warning


def test_live_bound_caps_prefetch_as_deepspeed_does():
    config, warning = _load({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "stage3_max_live_parameters": 1e6, "stage3_prefetch_bucket_size": 5e8}})
    assert config.zero.max_live_size == 2 * 10**6 and config.zero.prefetch_size == 2 * 10**6
    assert "zero_optimization.stage3_max_live_parameters = 1000000 (zero.max_live_size = 2MB" in warning


def test_deepspeed_defaults_where_they_change_training():
    config, _ = _load({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-4}}})
    assert config.train.grad_clip == 1.0  # DeepSpeed >= 0.19.3 clips at 1.0 unless told otherwise
    assert config.train.loss_scale_window == 1000 and config.optimizer.weight_decay == 0.0
    assert config.scheduler.warmup_steps == 1000
    off, _ = _load({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0})
    assert off.train.grad_clip == 0.0
    torch_adamw, _ = _load({"train_micro_batch_size_per_gpu": 2,
                            "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    assert torch_adamw.optimizer.weight_decay == 0.01  # torch.optim.AdamW's default


def test_what_a_config_switches_off_is_not_reported_as_ignored():
    """DeepSpeed-Chat's training config (its ``get_train_ds_config``) turns sections off with ``enabled``
    false and leaves switches at DeepSpeed's false: nothing is lost, so nothing is listed as ignored. The
    same keys switched on are ignored, and say zerooffload's own way where it has one."""
    chat = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "none"}},
            "prescale_gradients": False, "wall_clock_breakdown": False,
            "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1},
            "tensorboard": {"enabled": False, "output_path": "step3_tensorboard/", "job_name": "actor"},
            "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                         "number_checkpoints": None}}
    _, warning = _load(chat)
    assert "not supported" not in warning, warning
    assert "hybrid_engine (enabled: false)" in warning and "tensorboard (enabled: false)" in warning
    assert "prescale_gradients" in warning and "activation_checkpointing.cpu_checkpointing" in warning
    on = {**chat, "prescale_gradients": True, "tensorboard": {**chat["tensorboard"], "enabled": True},
          "activation_checkpointing": {"cpu_checkpointing": True}}
    _, warning = _load(on)
    ignored = warning.split("; ")[0]
    assert ignored.startswith("DeepSpeed config keys not supported, ignored (5): ")
    assert "prescale_gradients" in ignored and "tensorboard.job_name" in ignored
    assert ("activation_checkpointing.cpu_checkpointing (zerooffload checkpoints every unit with "
            "train.activation_checkpointing and keeps the checkpoints on the host with offload.activations.tier = "
            "host)") in ignored
    assert "hybrid_engine (enabled: false)" in warning


def test_second_spellings_deepspeed_also_reads():
    config, warning = _load({
        "bfloat16": {"enabled": True},
        "zero_optimization": {"stage": 3, "max_live_parameters": 1e8, "prefetch_bucket_size": 1e7,
                              "param_persistence_threshold": 10, "aio": {"queue_depth": 8, "thread_count": 3}}})
    assert config.train.precision == "bf16" and config.zero.max_live_size == 2 * 10**8
    assert config.zero.prefetch_size == 2 * 10**7 and config.zero.persist_threshold == 10
    assert (config.aio.queue_depth, config.aio.threads) == (8, 3)
    assert "zero_optimization.aio (DeepSpeed reads aio at the top level only" in warning
    assert "zero_optimization.max_live_parameters = 100000000" in warning  # named as written


def test_decay_without_total_steps_is_warmup_then_constant():
    config, warning = _load({"train_micro_batch_size_per_gpu": 1, "scheduler": {
        "type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 10}}})
    assert (config.scheduler.type, config.scheduler.warmup_steps, config.optimizer.lr) == ("constant", 10, 0.001)
    assert "without scheduler.params.total_num_steps" in warning


@pytest.mark.parametrize("ds, message", [
    ({"train_micro_batch_size_per_gpu": 0},
     r"^train_micro_batch_size_per_gpu = 0: train\.micro_batch_size = 0: must be >= 1"),
    ({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": -1},
     r"^gradient_clipping = -1: train\.grad_clip = -1\.0: must be >= 0"),
    ({"zero_optimization": {"stage": 4}}, r"^zero_optimization\.stage = 4: zero\.stage = 4: must be <= 3"),
    ({"zero_optimization": {"stage": 3, "max_live_parameters": -1}},
     r"^zero_optimization\.max_live_parameters = -1: expected a whole number"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "max_live_parameters": 0}},
     r"zero_optimization\.stage3_max_live_parameters and zero_optimization\.max_live_parameters are the same"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": 5}}},
     r"^zero_optimization\.offload_param\.nvme_path = 5: expected a directory"),
    ({"zero_optimization": {"stage": 2, "aio": {"queue_depth": 0}}},
     r"^zero_optimization\.aio\.queue_depth = 0: aio\.queue_depth = 0: must be >= 1"),
    ({"train_micro_batch_size_per_gpu": 1, "aio": {"block_size": 1000}}, r"^aio\.block_size = 1000: must be >= 4096"),
    ({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": "yes"}}, r"^fp16\.enabled = 'yes': expected true"),
    ({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}},
     r"^optimizer\.params\.betas = \[0\.9, 1\.5\]: optimizer\.betas\[1\] = 1\.5: must be in \[0, 1\)"),
    ({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}},
     r"^scheduler\.params\.total_num_steps = 500: .* \(DeepSpeed's default scheduler\.params\.warmup_num_steps = "
     r"1000 applies\)"),
    ({"train_batch_size": 32.5, "train_micro_batch_size_per_gpu": 1}, r"^train_batch_size = 32\.5: expected a whole"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     r"^zero_optimization\.offload_optimizer\.device = 'cpu': offload\.optimizer\.tier = 'host' needs zero\.stage"),
])
def test_bad_values_name_the_deepspeed_key_path(ds, message):
    with pytest.raises(ConfigError, match=message):
        zo.Config.load(ds)


# ----------------------------------------------------------------------------------------------
# Real configs, vendored byte for byte (tests/data/deepspeed/SOURCES.md): they load, map to what
# DeepSpeed would use, and train

DATA = Path(__file__).parent / "data" / "deepspeed"
GB = 10**9
VENDORED = {  # file: {our key path: value DeepSpeed would use}
    "transformers_ds_config_zero2.json": {
        "zero.stage": 2, "offload.optimizer.tier": "host", "offload.param.tier": "device", "train.precision": "fp32",
        "zero.bucket_size": 2 * 10**8 * 4, "train.grad_clip": 1.0, "optimizer.weight_decay": 0.0,
        "scheduler.type": "constant", "scheduler.warmup_steps": 1000},
    "transformers_ds_config_zero3.json": {
        "zero.stage": 3, "offload.optimizer.tier": "host", "offload.param.tier": "host", "train.precision": "fp16",
        "zero.bucket_size": 1, "zero.prefetch_size": 0, "zero.persist_threshold": 0, "zero.max_live_size": 2 * GB,
        "optimizer.lr": 3e-5, "optimizer.betas": (0.8, 0.999), "optimizer.weight_decay": 3e-7,
        "scheduler.warmup_steps": 500, "train.loss_scale_window": 1000},
    "accelerate_zero_stage2_offload_config.json": {
        "zero.stage": 2, "offload.optimizer.tier": "host", "train.precision": "fp16",
        "zero.bucket_size": 2 * 10**8 * 2, "optimizer.weight_decay": 0.01, "scheduler.type": "constant",
        "optimizer.lr": 0.001, "train.grad_clip": 1.0},
    "axolotl_zero3_bf16_cpuoffload_all.json": {
        "zero.stage": 3, "offload.optimizer.tier": "host", "offload.param.tier": "host", "train.precision": "bf16",
        "zero.prefetch_size": 0, "zero.max_live_size": 2**30, "zero.bucket_size": 32 * MiB, "train.grad_clip": 1.0},
    "axolotl_zero2.json": {
        "zero.stage": 2, "offload.optimizer.tier": "host", "train.precision": "fp32", "train.initial_scale_power": 32},
    "llamafactory_ds_z3_offload_config.json": {
        "zero.stage": 3, "offload.optimizer.tier": "host", "offload.param.tier": "host", "train.precision": "fp32",
        "zero.overlap_comm": False, "zero.max_live_size": 4 * GB, "zero.prefetch_size": 64 * MiB},
    "llamafactory_ds_z2_config.json": {
        "zero.stage": 2, "offload.optimizer.tier": "device", "train.precision": "fp32", "zero.bucket_size": 2 * GB,
        "zero.overlap_comm": False},
    "deepspeedexamples_ds_zero_stage_infinity_config.json": {
        "zero.stage": 3, "offload.optimizer.tier": "nvme", "offload.param.tier": "nvme", "train.precision": "fp16",
        "zero.bucket_size": 9 * 10**7 * 2, "zero.prefetch_size": 5 * 10**7 * 2, "zero.max_live_size": 2 * GB,
        "aio.queue_depth": 16, "aio.threads": 2, "aio.block_size": MiB, "train.micro_batch_size": 4,
        "train.grad_clip": 1.0},
}


def _vendored(name: str, tmp_path) -> tuple[zo.Config, str]:
    """Load a vendored file; an nvme_path naming a directory this machine lacks moves to tmp_path."""
    path = DATA / name
    leaves = json.loads(path.read_text()).get("zero_optimization", {})
    missing = [o["nvme_path"] for o in (leaves.get("offload_param"), leaves.get("offload_optimizer"))
               if o and o.get("device") == "nvme" and not os.path.isdir(o.get("nvme_path", "/"))]
    overrides = [f"nvme.path={json.dumps(str(tmp_path))}"] if missing else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = zo.Config.load(path, overrides=overrides)
    ours = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(ours) == 1, "every vendored config has keys to report, in one warning"
    return config, str(ours[0].message)


def test_every_vendored_config_has_its_source_recorded():
    sources = (DATA / "SOURCES.md").read_text()
    files = sorted(p.name for p in DATA.glob("*.json"))
    assert files == sorted(VENDORED) and all(f"`{name}`" in sources for name in files)


@pytest.fixture
def one_thread():
    """The model is tiny: more intra-op threads only contend for CI's two cores (DESIGN §4)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(VENDORED))
def test_vendored_config_loads_maps_and_trains(name, tmp_path, one_thread, make_engine):
    config, warning = _vendored(name, tmp_path)
    mapped = {key: reduce(getattr, key.split("."), config) for key in VENDORED[name]}
    assert mapped == VENDORED[name]
    if config.offload.param.tier == "nvme":
        assert config.nvme.path == str(tmp_path)  # the file's one nvme_path became nvme.path, moved here
    torch.manual_seed(0)
    engine = make_engine(make_model(), config)
    updates = 0
    for window in make_batches(3, config.train.grad_accum_steps, config.train.micro_batch_size):
        for idx, targets in window:
            loss = engine(idx, targets)
            assert torch.isfinite(loss)
            engine.backward(loss)
            updates += engine.step()
    stats = engine.stats
    assert updates + stats.skipped_steps == 3  # fp16 skips overflowing steps as DeepSpeed's loss scaler does
    if config.train.precision != "fp16":
        assert updates == 3
    else:  # hysteresis 2: the first overflow keeps the scale, each later one halves it
        assert stats.loss_scale == 2.0 ** config.train.initial_scale_power / 2 ** max(stats.skipped_steps - 1, 0)


def test_vendored_warnings_name_what_differs(tmp_path):
    _, infinity = _vendored("deepspeedexamples_ds_zero_stage_infinity_config.json", tmp_path)
    assert ("zero_optimization.stage3_param_persitence_threshold (did you mean "
            "zero_optimization.stage3_param_persistence_threshold?)") in infinity  # a typo in the published file
    _, axolotl = _vendored("axolotl_zero3_bf16_cpuoffload_all.json", tmp_path)
    assert "zero_optimization.max_live_parameters = 0" in axolotl and "zero_optimization.sub_group_size" in axolotl
    assert "optimizer (absent: DeepSpeed trains with the optimizer the script passes" in axolotl
    _, hf = _vendored("transformers_ds_config_zero2.json", tmp_path)
    assert "bf16.enabled, fp16.enabled -> train.precision = 'fp32'" in hf
    assert "gradient_clipping -> train.grad_clip = 1.0" in hf
