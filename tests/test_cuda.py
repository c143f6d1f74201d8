"""The CUDA path (skipped without a GPU; bench/gpu_check.sh runs it on a lent machine): the engine on
the GPU against plain PyTorch on the CPU, with every offload tier, and pinned host buffers."""
from __future__ import annotations

import pytest
import torch

import zerooffload as zo
from reference import make_batches, make_model, reference_train, update_errors

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OFFLOADS = {"device": {}, "host optimizer": {"optimizer": {"tier": "host"}},
            "half the optimizer on the host": {"optimizer": {"tier": "host", "fraction": 0.5}},
            "nvme everything": {"optimizer": {"tier": "nvme"}, "param": {"tier": "nvme"}}}
WINDOWS = {"accumulation and clipping": (2, 0.05), "updates in backward": (1, 0.0),
           "accumulation, updates in backward": (2, 0.0)}


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 rounds inputs to 10 bits: not an fp32 reference
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("offload", list(OFFLOADS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_on_cuda_matches_plain_pytorch_on_the_cpu(make_engine, stage, offload, window):
    if stage < 3 and "param" in OFFLOADS[offload] or stage == 0 and OFFLOADS[offload]:
        pytest.skip("parameter offload needs stage 3, optimizer offload stage >= 1")
    accum, clip = WINDOWS[window]
    batches = make_batches(3, accum, 2)
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = make_engine(model, {"zero": {"stage": stage}, "offload": OFFLOADS[offload],
                                 "train": {"grad_accum_steps": accum, "grad_clip": clip},
                                 "optimizer": {"lr": 1e-2, "weight_decay": 0.1}})
    with engine.gathered() as module:
        assert {p.device.type for p in module.parameters()} == {"cuda"}
    for window in batches:
        for idx, targets in window:
            loss = engine(idx.cuda(), targets.cuda())
            assert loss.device.type == "cuda"
            engine.backward(loss)
            engine.step()
    full = engine.full_state_dict()
    errors = update_errors(initial, full, reference_train(make_model(), batches, clip=clip))
    assert max(errors.values()) < 1e-4, max(errors.items(), key=lambda kv: kv[1])


def test_host_tier_buffers_are_pinned(make_engine):
    engine = make_engine(make_model(), {"zero": {"stage": 2}, "offload": {"optimizer": {"tier": "host"}}})
    assert all(state.block.data.is_pinned() for state in engine.opt_states)  # private: no public accessor


def test_side_stream_copies_arrive_before_their_use_and_free_the_host_buffer_after():
    """DeviceCopier: the copy runs on its own stream; the current stream sees the whole tensor; once
    released, the pinned host buffer can be overwritten without touching what the device used."""
    from zerooffload.tiers import DeviceCopier, LinkStats, make_tiers
    from zerooffload.tiers.streams import SideStreams

    tiers = make_tiers(zo.Config().memory, torch.device("cuda"))
    link = LinkStats()
    copier = DeviceCopier(tiers["device"], link, SideStreams(tiers["device"].device))
    host = torch.randn(1 << 24).pin_memory()
    expected = host.clone()
    on_device, release = copier.to_device(host)
    assert copier.stream != torch.cuda.current_stream()
    total = on_device.sum()  # queued on the current stream, after the copy's event
    release()
    host.fill_(0)  # the host buffer is free once released
    assert torch.allclose(total.cpu(), expected.sum(), rtol=1e-4)
    assert link.host_to_device_bytes == host.numel() * 4


def test_checkpointed_inputs_offloaded_to_the_host_train_bitwise_as_on_the_device(make_engine):
    """offload.activations.tier = host (activation_offload's note): block inputs wait in pinned host
    buffers between forward and backward, counted in the host tier, back on the device in time."""
    batches = make_batches(2, 1, 2)
    results = {}
    for tier in ("device", "host"):
        engine = make_engine(make_model(), {"zero": {"stage": 2}, "train": {"activation_checkpointing": True},
                                            "offload": {"activations": {"tier": tier}}})
        held = []
        for (idx, targets), in batches:
            loss = engine(idx.cuda(), targets.cuda())
            held.append(engine.memory_report().bytes("host", "activation"))
            engine.backward(loss)
            engine.step()
            assert engine.memory_report().bytes("host", "activation") == 0
        results[tier] = (engine.full_state_dict(), held)
    assert results["device"][1] == [0, 0] and all(h > 0 for h in results["host"][1])
    device, host = results["device"][0], results["host"][0]
    assert all(torch.equal(device[k], host[k]) for k in device)


@pytest.mark.parametrize("stage, offload", [(1, {"optimizer": {"tier": "host"}}), (3, OFFLOADS["nvme everything"])],
                         ids=["stage1-host", "stage3-nvme"])
def test_compact_states_on_cuda_a_split_master_bitwise_and_int8_moments_close(make_engine, tmp_path, stage, offload):
    """Compact states on the GPU: bf16 weights on the device, the update on the host's native pass. A split
    master trains bitwise as the fp32 master; int8 moments follow fp32 ones (test_compact_states' bound)."""
    finals = {}
    for master, moments in (("fp32", "fp32"), ("split", "fp32"), ("split", "int8")):
        engine = make_engine(make_model(0), {
            "zero": {"stage": stage}, "offload": offload, "train": {"precision": "bf16"},
            "nvme": {"path": str(tmp_path)},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "master": master, "moments": moments}})
        initial = engine.full_state_dict()
        for (idx, targets), in make_batches(5, 1, 4):
            engine.backward(engine(idx.cuda(), targets.cuda()))
            engine.step()
        finals[master, moments] = engine.full_state_dict()
        engine.close()
    fp32, split = finals["fp32", "fp32"], finals["split", "fp32"]
    assert all(torch.equal(split[k], fp32[k]) for k in fp32)
    errors = update_errors(initial, finals["split", "int8"], fp32)
    assert 0 < max(errors.values()) < 5e-2, errors
