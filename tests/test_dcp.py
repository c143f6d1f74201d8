"""torch.distributed.checkpoint directories both ways, against FSDP2 itself: an FSDP2 run's DCP save loads
into the engine (stage 3, NVMe) and continues as FSDP2 continues; our export of that state loads into
FSDP2 with ``dcp.load`` and continues the same way (checkpoint.dcp's [Note: DCP checkpoints])."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zerooffload as zo
from reference import make_batches, make_model
from zerooffload.checkpoint import CheckpointError, export_dcp
from zerooffload.cli.main import main

GLOBAL_BATCH, SAVED_AT, CONTINUED = 4, 3, 10
LR, WEIGHT_DECAY = 1e-2, 0.1
NVME = {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}}


def _rows() -> slice:
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world
    return slice(rank * micro, (rank + 1) * micro)


def _mean(loss: torch.Tensor) -> float:
    """The global batch's loss: each rank's mean over its equal slice, averaged."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _fsdp2(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=WEIGHT_DECAY)
    return model, optimizer


def _fsdp2_steps(model, optimizer, first: int, last: int) -> list[float]:
    losses = []
    for (idx, targets), in make_batches(SAVED_AT + CONTINUED, 1, GLOBAL_BATCH)[first:last]:
        loss = model(idx[_rows()], targets[_rows()])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean(loss))
    return losses


def fsdp2_run(saved: str) -> list[float]:
    """Every rank: FSDP2 trains SAVED_AT steps, saves with dcp.save, continues CONTINUED steps."""
    torch.set_num_threads(1)
    model, optimizer = _fsdp2()
    _fsdp2_steps(model, optimizer, 0, SAVED_AT)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=saved)
    return _fsdp2_steps(model, optimizer, SAVED_AT, SAVED_AT + CONTINUED)


def fsdp2_resume(saved: str) -> list[float]:
    """Every rank: FSDP2 loads a DCP directory (dcp.load + set_state_dict) and continues."""
    torch.set_num_threads(1)
    model, optimizer = _fsdp2(seed=1)  # other weights: a load that did nothing shows
    _fsdp2_steps(model, optimizer, 0, 1)  # AdamW's state must exist to be loaded into
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=saved)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))  # the unused layer never had AdamW state
    return _fsdp2_steps(model, optimizer, SAVED_AT, SAVED_AT + CONTINUED)


def engine_resume(saved: str, ours: str) -> dict:
    """Every rank: the engine at stage 3 on NVMe loads the FSDP2 save, saves it as ours, continues."""
    config = {"zero": {"stage": 3}, "offload": NVME, "optimizer": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
    with zo.initialize(make_model(seed=1), config) as engine:
        client = engine.load_checkpoint(saved)
        engine.save_checkpoint(ours)
        losses = []
        for (idx, targets), in make_batches(SAVED_AT + CONTINUED, 1, GLOBAL_BATCH)[SAVED_AT:]:
            loss = engine(idx[_rows()], targets[_rows()])
            engine.backward(loss)
            engine.step()
            losses.append(_mean(loss))
        return {"losses": losses, "client": client, "steps": engine.window.global_steps}


def _close(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))


@pytest.fixture(scope="module")
def saved(rank_pools, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    fsdp2 = rank_pools(2).run(fsdp2_run, str(tmp / "fsdp2"))[0]
    return tmp, fsdp2


def test_an_fsdp2_save_continues_in_the_engine_and_our_export_in_fsdp2(saved, rank_pools):
    tmp, fsdp2 = saved
    ours = rank_pools(2).run(engine_resume, str(tmp / "fsdp2"), str(tmp / "ours"))[0]
    assert ours["client"] == {"step": SAVED_AT} and ours["steps"] == SAVED_AT + CONTINUED
    assert _close(ours["losses"], fsdp2) <= 1e-6, (ours["losses"], fsdp2)
    assert main(["checkpoint", "export", str(tmp / "ours"), str(tmp / "exported"), "--format", "dcp"]) == 0
    again = rank_pools(2).run(fsdp2_resume, str(tmp / "exported"))[0]
    assert _close(again, fsdp2) <= 1e-6, (again, fsdp2)
    print(f"relative to FSDP2's own continuation: engine {_close(ours['losses'], fsdp2):.1e}, "
          f"FSDP2 from our export {_close(again, fsdp2):.1e}")
    assert not math.isclose(fsdp2[0], fsdp2[-1])  # it trained


def test_a_dcp_of_another_model_is_refused_by_name(saved, make_engine):
    tmp, _ = saved
    engine = make_engine(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"zero": {"stage": 1}})
    with pytest.raises(CheckpointError, match=r"torch.distributed.checkpoint directory\) does not hold this "
                                              r"model's state: 0.weight not in it"):
        engine.load_checkpoint(tmp / "fsdp2")


def test_another_kind_of_checkpoint_is_named(tmp_path, make_engine):
    (tmp_path / "checkpoint-20").mkdir()
    (tmp_path / "checkpoint-20" / "trainer_state.json").write_text("{}")
    engine = make_engine(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"zero": {"stage": 1}})
    with pytest.raises(CheckpointError, match="a transformers.Trainer checkpoint-N folder, not a zerooffload "
                                              "checkpoint .*zerooffload.hf.Trainer"):
        engine.load_checkpoint(tmp_path / "checkpoint-20")
    with pytest.raises(CheckpointError, match="not empty"):
        export_dcp(tmp_path, tmp_path)
