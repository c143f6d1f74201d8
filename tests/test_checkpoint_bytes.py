"""Checkpoint bytes are what the state costs (issue 45): each format's files within 1% of its state's bytes
per trainable parameter — ours with fp32 moments 12 B (fp32 master + two moments), bf16 moments 8 B, int8
moments 4 + 2 x (1 + 4 / INT8_BLOCK) ~ 6.03 B (codes and one fp32 scale a block), a DCP export 12 B, and the
Trainer's layout our Trainer saves (model.safetensors and optimizer.pt: fp32 weights and AdamW moments) 12 B —
on a model whose units are large enough that 4 KiB alignment is noise (4.2M parameters; the manifest, RNG states and 4 KiB padding weigh ~80 kB)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from zerooffload.checkpoint import export_dcp
from zerooffload.hf.trainer_files import save_trainer_files
from zerooffload.optim.state_formats import INT8_BLOCK

PER_PARAMETER = {"fp32": 12.0, "bf16": 8.0, "int8": 4.0 + 2 * (1 + 4 / INT8_BLOCK)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)))


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _saved(make_engine, tmp_path: Path, moments: str) -> tuple[Path, int]:
    model = _model()
    engine = make_engine(model, {"zero": {"stage": 1}, "optimizer": {"moments": moments}})
    engine.backward(engine(torch.randn(2, 1024)).square().mean())
    engine.step()
    return engine.save_checkpoint(tmp_path / "ckpt"), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("moments", sorted(PER_PARAMETER))
def test_our_files_hold_what_the_state_costs(make_engine, tmp_path, moments):
    tag, params = _saved(make_engine, tmp_path, moments)
    assert _bytes(tag) / params == pytest.approx(PER_PARAMETER[moments], rel=0.01)
    assert PER_PARAMETER["int8"] == pytest.approx(6.03, abs=0.005)


def test_a_dcp_export_holds_fp32_weights_and_moments(make_engine, tmp_path):
    tag, params = _saved(make_engine, tmp_path, "fp32")
    exported = export_dcp(tag.parent, tmp_path / "dcp")
    assert _bytes(exported) / params == pytest.approx(12.0, rel=0.01)


def test_the_trainer_layout_holds_fp32_weights_and_moments_once(make_engine, tmp_path):
    model = _model()
    engine = make_engine(model, {"zero": {"stage": 1}})
    engine.backward(engine(torch.randn(2, 1024)).square().mean())
    engine.step()
    names = [name for name, _ in model.named_parameters()]
    groups = [[n for n in names if n.endswith("weight")], [n for n in names if n.endswith("bias")]]
    settings = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": decay} for decay in (0.1, 0.0)]
    save_trainer_files(engine, tmp_path, groups, settings, {})
    params = sum(p.numel() for p in model.parameters())
    assert _bytes(tmp_path) / params == pytest.approx(12.0, rel=0.01)
