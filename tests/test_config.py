"""Config: every DESIGN §2 key round-trips; bad input fails with the key path, the value and what is allowed."""
from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest
from hypothesis import given, settings, strategies as st

import zerooffload as zo
from zerooffload.config import ConfigError, apply_override, format_size, parse_size

# DESIGN §2, written out by hand: the contract the config must match key for key.
DESIGN_KEYS = {
    "train": {"micro_batch_size", "grad_accum_steps", "precision", "grad_clip", "seed", "activation_checkpointing",
              "skip_nonfinite", "max_skip_streak", "threads", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
              "async_save", "save_staging"},
    "optimizer": {"type", "lr", "betas", "eps", "weight_decay", "momentum", "master", "moments",
                  "update_in_backward", "updates_in_flight"},
    "scheduler": {"type", "warmup_steps", "total_steps", "min_lr"},
    "zero": {"stage", "unit_modules", "bucket_size", "prefetch_size", "max_live_size", "persist_threshold",
             "overlap_comm", "quantized_weights", "hpz_partition_size", "quantized_gradients",
             "quantized_gradients_bits"},
    "offload.param": {"tier", "path"},
    "offload.optimizer": {"tier", "path", "fraction"},
    "offload.activations": {"tier"},
    "memory": {"device_budget", "host_budget", "release_freed"},
    "nvme": {"path", "checksum", "max_bytes"},
    "aio": {"backend", "block_size", "queue_depth", "threads", "direct", "blocks_in_flight"},
}

# A value for every key that differs from its default, as a user would write it.
EVERY_KEY_TOML = """
[train]
micro_batch_size = 3
grad_accum_steps = 2
precision = "bf16"
grad_clip = 1.5
seed = 7
activation_checkpointing = true
skip_nonfinite = false
max_skip_streak = 3
threads = 1
loss_scale = 128.0
initial_scale_power = 12
loss_scale_window = 500
hysteresis = 4
min_loss_scale = 0.5
async_save = false
save_staging = "256MiB"

[optimizer]
type = "adam"
lr = 0.25
betas = [0.8, 0.95]
eps = 1e-6
weight_decay = 0.1
momentum = 0.9
master = "split"
moments = "bf16"
update_in_backward = "off"
updates_in_flight = 3

[scheduler]
type = "warmup_cosine"
warmup_steps = 10
total_steps = 100
min_lr = 1e-5

[zero]
stage = 3
unit_modules = ["Block", "Embedding"]
bucket_size = "8MiB"
prefetch_size = "16MB"
max_live_size = "1.5GiB"
persist_threshold = 1000
overlap_comm = false
quantized_weights = true
hpz_partition_size = 2
quantized_gradients = true
quantized_gradients_bits = 4

[offload.param]
tier = "nvme"
path = "/mnt/params"

[offload.optimizer]
tier = "host"
path = "/mnt/optim"
fraction = 0.5

[offload.activations]
tier = "host"

[memory]
device_budget = "20GiB"
host_budget = 123456789
release_freed = "off"

[nvme]
path = ["/mnt/a", "/mnt/b"]
checksum = false
max_bytes = "60GB"

[aio]
backend = "pool"
block_size = "4MiB"
queue_depth = 8
threads = 2
direct = false
blocks_in_flight = 4
"""


@pytest.fixture
def every_key(tmp_path):
    path = tmp_path / "every.toml"
    path.write_text(EVERY_KEY_TOML)
    return zo.Config.load(path)


def _sections(config) -> dict:
    return {"train": config.train, "optimizer": config.optimizer, "scheduler": config.scheduler,
            "zero": config.zero, "offload.param": config.offload.param,
            "offload.optimizer": config.offload.optimizer, "offload.activations": config.offload.activations,
            "memory": config.memory, "nvme": config.nvme,
            "aio": config.aio}


def test_fields_are_exactly_the_design_keys():
    sections = _sections(zo.Config())
    assert {name: {f.name for f in dataclasses.fields(s)} for name, s in sections.items()} == DESIGN_KEYS


def test_every_key_is_read_with_its_value(every_key):
    c = every_key
    assert (c.train.micro_batch_size, c.train.precision, c.train.activation_checkpointing) == (3, "bf16", True)
    assert c.optimizer.betas == (0.8, 0.95) and c.optimizer.eps == 1e-6
    assert c.zero.bucket_size == 8 * 2**20 and c.zero.prefetch_size == 16 * 10**6
    assert c.zero.max_live_size == 3 * 2**29 and c.memory.device_budget == 20 * 2**30
    assert (c.zero.quantized_weights, c.zero.hpz_partition_size, c.zero.quantized_gradients,
            c.zero.quantized_gradients_bits) == (True, 2, True, 4)
    assert c.nvme.paths == ["/mnt/a", "/mnt/b"] and c.aio.block_size == 4 * 2**20
    default = _sections(zo.Config())
    for name, section in _sections(c).items():
        for f in dataclasses.fields(section):
            assert getattr(section, f.name) != getattr(default[name], f.name), f"{name}.{f.name} kept its default"


def test_round_trip_through_toml(every_key, tmp_path):
    path = tmp_path / "again.toml"
    path.write_text(every_key.to_toml())
    assert zo.Config.load(path) == every_key
    assert zo.Config.load(tomllib.loads(zo.Config().to_toml())) == zo.Config()


def test_round_trip_through_json(every_key, tmp_path):
    path = tmp_path / "again.json"
    path.write_text(json.dumps(every_key.to_dict()))
    assert zo.Config.load(path) == every_key
    assert zo.Config.load(json.loads(path.read_text())) == every_key


def test_sections_are_immutable_and_validated_when_built_in_python():
    config = zo.Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.zero.stage = 3
    with pytest.raises(ConfigError, match=r"zero\.bucket_size = 'lots'"):
        zo.config.ZeroConfig(bucket_size="lots")


@pytest.mark.parametrize("data, message", [
    ({"train": {"micro_batch_sise": 2}}, r"unknown key 'train\.micro_batch_sise'; did you mean 'train\.micro_batch_size'"),
    ({"zeros": {}}, r"unknown key 'zeros'; did you mean 'zero'"),
    ({"offload": {"optimiser": {}}}, r"unknown key 'offload\.optimiser'; did you mean 'offload\.optimizer'"),
    ({"offload": {"param": {"teir": "host"}}}, r"'offload\.param\.teir'; did you mean 'offload\.param\.tier'"),
    ({"train": {"micro_batch_size": 0}}, r"train\.micro_batch_size = 0: must be >= 1"),
    ({"train": {"micro_batch_size": "4"}}, r"train\.micro_batch_size = '4': expected an integer"),
    ({"train": {"micro_batch_size": 2.5}}, r"train\.micro_batch_size = 2\.5: expected an integer"),
    ({"train": {"precision": "bf32"}}, r"train\.precision = 'bf32': expected one of 'fp32', 'bf16', 'fp16'"),
    ({"train": {"activation_checkpointing": "yes"}}, r"train\.activation_checkpointing = 'yes': expected true or false"),
    ({"train": {"grad_clip": -1}}, r"train\.grad_clip = -1\.0: must be >= 0"),
    ({"train": {"min_loss_scale": 0}}, r"train\.min_loss_scale = 0\.0: must be > 0"),
    ({"train": {"seed": True}}, r"train\.seed = True: expected an integer"),
    ({"optimizer": {"type": "lamb"}}, r"optimizer\.type = 'lamb': expected one of 'adamw', 'adam', 'sgd'"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, r"optimizer\.betas\[1\] = 1\.0: must be in \[0, 1\)"),
    ({"optimizer": {"betas": [0.9]}}, r"optimizer\.betas = \[0\.9\]: expected a list of 2 items"),
    ({"optimizer": {"lr": float("nan")}}, r"optimizer\.lr = nan: expected a number"),
    ({"optimizer": {"eps": 0}}, r"optimizer\.eps = 0\.0: must be > 0"),
    ({"optimizer": {"momentum": 1}}, r"optimizer\.momentum = 1\.0: must be < 1"),
    ({"scheduler": {"type": "warmup_cosine", "warmup_steps": 10}}, r"scheduler\.total_steps = 0: .* > warmup_steps"),
    ({"zero": {"stage": 4}}, r"zero\.stage = 4: must be <= 3"),
    ({"zero": {"bucket_size": "12QB"}}, r"zero\.bucket_size = '12QB': expected a byte count"),
    ({"zero": {"bucket_size": "0.5B"}}, r"zero\.bucket_size = '0\.5B': is not a whole number of bytes"),
    ({"zero": {"bucket_size": 0}}, r"zero\.bucket_size = 0: must be > 0"),
    ({"zero": {"unit_modules": "Block"}}, r"zero\.unit_modules = 'Block': expected a list of items"),
    ({"zero": {"prefetch_size": "2GiB", "max_live_size": "1GiB"}}, r"zero\.prefetch_size = 2147483648: must be <= zero\.max_live_size"),
    ({"offload": {"param": {"tier": "nvme"}}}, r"offload\.param\.tier = 'nvme' needs zero\.stage = 3"),
    ({"offload": {"optimizer": {"tier": "host"}}, "zero": {"stage": 0}}, r"offload\.optimizer\.tier = 'host' needs zero\.stage >= 1"),
    ({"offload": {"optimizer": {"fraction": 1.5}}}, r"offload\.optimizer\.fraction = 1\.5: must be <= 1"),
    ({"offload": {"param": {"tier": "disk"}}}, r"offload\.param\.tier = 'disk': expected one of 'device', 'host', 'nvme'"),
    ({"memory": {"device_budget": "lots"}}, r"memory\.device_budget = 'lots': expected a byte count"),
    ({"memory": {"host_budget": 0}}, r"memory\.host_budget = 0: must be >= 1"),
    ({"nvme": {"path": []}}, r"nvme\.path = \[\]: needs at least one"),
    ({"nvme": {"path": 3}}, r"nvme\.path = 3: expected a string or a list of items, each a string"),
    ({"aio": {"block_size": 1000}}, r"aio\.block_size = 1000: must be >= 4096"),
    ({"aio": {"block_size": "6KiB"}}, r"aio\.block_size = 6144: must be a multiple of 4096"),
    ({"aio": {"queue_depth": 0}}, r"aio\.queue_depth = 0: must be >= 1"),
    ({"aio": {"backend": "libaio"}}, r"aio\.backend = 'libaio': expected one of 'auto', 'uring'"),
    ({"train": 3}, r"train = 3: expected a table of keys"),
])
def test_bad_values_name_the_key_and_what_is_allowed(data, message):
    with pytest.raises(ConfigError, match=message):
        zo.Config.load(data)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@settings(max_examples=60, deadline=None)
@given(section=st.sampled_from(sorted(DESIGN_KEYS)), data=st.data())
def test_any_misspelt_key_is_refused_with_its_path(section, data):
    key = data.draw(st.sampled_from(sorted(DESIGN_KEYS[section])))
    typo = data.draw(st.sampled_from([key + "s", key[:-1], key.upper(), "_" + key]))
    *parents, leaf = section.split(".")
    tree: dict = {}
    node = tree
    for part in parents + [leaf]:
        node = node.setdefault(part, {})
    node[typo] = 1
    with pytest.raises(ConfigError, match=f"unknown key '{section}.{typo}'"):
        zo.Config.load(tree)


def _not_a_size(text: str) -> bool:
    """Strings like "0" or "4KiB" are valid values of size keys, so they are not wrong types."""
    try:
        parse_size(text)
    except ConfigError:
        return text != "auto"
    return False


_WRONG = st.one_of(st.text(min_size=1).filter(_not_a_size), st.lists(st.integers(), min_size=3),
                   st.dictionaries(st.text(min_size=1), st.integers(), min_size=1))


@settings(max_examples=80, deadline=None)
@given(section=st.sampled_from(["train", "optimizer", "zero", "aio"]), data=st.data())
def test_wrong_types_are_refused_with_the_key_path(section, data):
    numeric = sorted(k for k in DESIGN_KEYS[section] if k not in {"precision", "type", "backend", "unit_modules", "update_in_backward", "release_freed"})
    key = data.draw(st.sampled_from(numeric))
    value = data.draw(_WRONG)
    with pytest.raises(ConfigError, match=f"^{section}.{key}"):
        zo.Config.load({section: {key: value}})


@pytest.mark.parametrize("text, expected", [
    (4096, 4096), ("4096", 4096), ("64MiB", 64 * 2**20), ("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29),
    ("512 kb", 512_000), (5e8, 500_000_000), ("1TiB", 2**40),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_sizes_are_written_back_exactly():
    for nbytes in (1, 4096, 3 * 2**29, 64 * 2**20, 10**9, 12345):
        assert parse_size(format_size(nbytes)) == nbytes


def test_overrides_are_typed_and_do_not_touch_the_input():
    data = {"zero": {"stage": 1}}
    out = apply_override(apply_override(data, "zero.stage=3"), "train.precision=bf16")
    assert out == {"zero": {"stage": 3}, "train": {"precision": "bf16"}} and data == {"zero": {"stage": 1}}
    assert zo.Config.load({}, overrides=["aio.direct=false", "nvme.path=['/a','/b']"]).nvme.paths == ["/a", "/b"]
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_override({}, "zero.stage")


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*missing.toml"):
        zo.Config.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[zero\nstage = 3")
    with pytest.raises(ConfigError, match="bad.toml is not valid"):
        zo.Config.load(bad)


def test_the_io_layer_defaults_are_the_aio_sections():
    """The I/O layer takes plain settings (it imports nothing above it): they must agree with [aio]."""
    import dataclasses

    from zerooffload.config import ALIGNMENT, AioConfig
    from zerooffload.io import buffers
    from zerooffload.io.settings import IOSettings

    ours = {f.name: getattr(AioConfig(), f.name) for f in dataclasses.fields(AioConfig)}
    above = {"blocks_in_flight"}  # read by the block pipelines (block_stream), not by the I/O layer
    assert dataclasses.asdict(IOSettings()) == {k: v for k, v in ours.items() if k not in above}
    assert above <= set(ours)
    assert buffers.ALIGNMENT == ALIGNMENT


_OFFLOADED = {"zero": {"stage": 2}, "offload": {"optimizer": {"tier": "host"}}}


@pytest.mark.parametrize("extra, needs", [
    ({"train": {"grad_clip": 1.0}}, r"offload\.optimizer\.tier = 'nvme' with train\.grad_clip = 1\.0"),
    ({"train": {"precision": "fp16"}}, r"train\.precision other than fp16"),
    ({"zero": {"stage": 1}}, r"zero\.stage >= 2 with offload\.optimizer\.tier"),
    ({"offload": {"optimizer": {"tier": "device"}}}, r"zero\.stage >= 2 with offload\.optimizer\.tier"),
])
def test_update_in_backward_on_is_refused_where_it_cannot_apply(extra, needs):
    data = {**_OFFLOADED, "optimizer": {"update_in_backward": "on"}}
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError, match=r"^optimizer\.update_in_backward = 'on' needs .*" + needs):
        zo.Config.load(data)


def test_update_in_backward_on_where_it_applies_and_off_anywhere():
    assert zo.Config.load({**_OFFLOADED, "optimizer": {"update_in_backward": "on"}}).optimizer.update_in_backward == "on"
    clipped = {"zero": {"stage": 3}, "train": {"grad_clip": 1.0}, "offload": {"optimizer": {"tier": "nvme"}},
               "optimizer": {"update_in_backward": "on"}}  # tentatively: backward_updates' note
    assert zo.Config.load(clipped).optimizer.update_in_backward == "on"
    off = {"train": {"grad_clip": 1.0, "precision": "fp16"}, "optimizer": {"update_in_backward": "off"}}
    assert zo.Config.load(off).optimizer.update_in_backward == "off"
    with pytest.raises(ConfigError, match=r"optimizer\.update_in_backward"):
        zo.Config.load({"optimizer": {"update_in_backward": "sometimes"}})
