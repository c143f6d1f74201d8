"""Configs that choose where the engine places state, for tests of each placement."""
from __future__ import annotations

from torch import nn

from zerooffload.config import Config
from zerooffload.memory_plan import plan_for_config
from zerooffload.tiers import Kind
from zerooffload.zero.unit_layout import find_units


def grads_waiting_on(tier: str, model: nn.Module, config: dict, world_size: int = 1) -> dict:
    """``config``, whose kept gradient shards of NVMe state wait in host memory, made to keep them on
    ``tier``: "host" leaves it as it is; "nvme" streams them through the fewest host buffers
    (``aio.blocks_in_flight = 2``) and sets a ``memory.host_budget`` that holds those but not the shards
    themselves (memory_plan's [Note: where kept gradients wait])."""
    if tier == "host":
        return config
    config = {**config, "aio": {**config.get("aio", {}), "blocks_in_flight": 2}}
    loaded = Config.load(config)
    layouts = find_units(model, loaded.zero.unit_modules, world_size if loaded.zero.stage >= 1 else 1)
    host_need = {name: sum(plan_for_config(layouts, loaded, world_size, fits)[1]["host"].values())
                 for name, fits in (("host", lambda plan: True),  # the shards in host memory fit,
                                    ("nvme", lambda plan: not plan["host"][Kind.GRAD]))}  # or only on NVMe
    assert host_need["nvme"] < host_need["host"], "the model's shards weigh less than streaming them"
    budget = (host_need["nvme"] + host_need["host"]) // 2
    return {**config, "memory": {**config.get("memory", {}), "host_budget": budget}}
