"""Split masters and bf16 moments (``optim.state_formats``, the native pass's ``master``/``moment_dtype``).

References are independent of the code under test: torch's own ``.to(bfloat16)`` for the weight of a
split, the fp32 master's update (itself checked against torch's fused AdamW in test_cpu_adam.py) for a
split master's update, and plain fp32 arithmetic for the expectation of stochastic rounding.
"""
from __future__ import annotations

import sys

import pytest
import torch

from test_cpu_adam import LEVELS, results_at_level
from zerooffload.optim import cpu_adam, fused_adam_step, fused_adam_steps
from zerooffload.optim import state_formats as formats

HYPER = dict(lr=3e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _hard_values() -> torch.Tensor:
    """Every low half around the ties, on even and odd weights and both signs, plus inf, the largest
    floats, subnormals, zeros and random normals."""
    highs = torch.tensor([0x3F80, 0x3F81, 0x0000, 0x0001, 0x7F7F, 0x4000, 0x3FFF], dtype=torch.int64)
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    patterns = (highs[:, None] << 16 | lows[None, :]).reshape(-1)
    patterns = torch.cat([patterns, patterns | (1 << 31)])
    floats = torch.where(patterns >= 2 ** 31, patterns - 2 ** 32, patterns).to(torch.int32).view(torch.float32)
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, -1e-40])
    return torch.cat([floats, special, torch.randn(10_000, generator=torch.Generator().manual_seed(0))])


@pytest.fixture(params=[formats.CHUNK, 13], ids=["whole", "chunked"])
def chunk(request, monkeypatch):
    """The conversions as they run (whole, for these sizes) and cut into chunks of 13 elements."""
    monkeypatch.setattr(formats, "CHUNK", request.param)


def test_a_split_master_joins_back_bit_for_bit_and_its_weight_is_torchs_cast(chunk):
    master = _hard_values()
    weight, residual, bits = formats.split_master(master)
    assert torch.equal(_bits(formats.join_master(weight, residual, bits)), _bits(master))
    assert torch.equal(weight.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    assert bits.any() and residual.dtype == torch.int16  # the ties that need the 17th value occur here


def test_a_nan_master_stays_a_nan():
    patterns = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, 0x7FFFFFFF, -1, 0x7FC08000], dtype=torch.int32)
    master = patterns.view(torch.float32)
    assert torch.isnan(formats.join_master(*formats.split_master(master))).all()


@pytest.mark.parametrize("bit0, count", [(0, 17), (3, 29), (13, 1), (7, 64)])
def test_bits_are_written_in_place_and_their_neighbours_kept(bit0, count, chunk):
    packed = torch.randint(0, 256, (16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bit0))
    before = formats.read_bits(packed, 0, 128).clone()
    bits = torch.rand(count, generator=torch.Generator().manual_seed(count)) < 0.5
    formats.write_bits(packed, bit0, bits)
    expected = before.clone()
    expected[bit0:bit0 + count] = bits
    assert torch.equal(formats.read_bits(packed, 0, 128), expected)


# ----------------------------------------------------------------- the native pass, at every level


def _inputs(n: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=generator)
    master[::97] = master[::97].to(torch.bfloat16).float().view(torch.int32).add(0x8000).view(torch.float32)  # ties
    return dict(master=master, grads=[torch.randn(n, generator=generator).to(torch.bfloat16) for _ in range(3)])


def _run_split(n: int, seed: int, bit0: int, threads: int, moments: torch.dtype) -> dict:
    """Three updates of a split master (and of its fp32 twin, same moments' format)."""
    data = _inputs(n, seed)
    weight, residual, bits = formats.split_master(data["master"])
    packed = torch.full(((bit0 + n + 7) // 8 + 1,), 0xA5, dtype=torch.uint8)  # neighbours' bits must survive
    formats.write_bits(packed, bit0, bits)
    master, out = data["master"].clone(), torch.empty(n, dtype=torch.bfloat16)
    moments_split = [torch.zeros(n, dtype=moments) for _ in range(2)]
    moments_fp32 = [torch.zeros(n, dtype=moments) for _ in range(2)]
    for step, grad in enumerate(data["grads"], start=1):
        fused_adam_step(None, grad, *moments_split, weight, step=step, threads=threads, residual=residual,
                        residual_bits=packed, residual_bit0=bit0, noise_key=seed, noise_base=bit0, **HYPER)
        fused_adam_step(master, grad, *moments_fp32, out, step=step, threads=threads, noise_key=seed, noise_base=bit0,
                        **HYPER)
    return dict(weight=weight, residual=residual, packed=packed, out=out, master=master, moments_split=moments_split,
                moments_fp32=moments_fp32)


SPLIT_CASES = [(1, 0, 0), (1000, 5, 0), (300_001, 3, 0), (1_000_003, 11, 3)]
"""(n, bit0, threads): tails, a first element inside a byte, blocks of a split over 3 threads whose
edges share bytes of residual bits."""


def run_updates() -> dict:
    """Every case's results at this process's level (read by the child and by the torch fallback)."""
    results = {}
    for n, bit0, threads in SPLIT_CASES:
        for moments in (torch.float32, torch.bfloat16):
            results[(n, bit0, threads, str(moments))] = _run_split(n, bit0 + n % 7, bit0, threads, moments)
    results["adjacent"] = _run_adjacent()
    return results


def _run_adjacent() -> dict:
    """Pieces whose residual bits share bytes, updated in one split (``fused_adam_steps``)."""
    n, cuts = 700_001, (0, 131_075, 262_147, 700_001)
    data = _inputs(n, 7)
    weight, residual, bits = formats.split_master(data["master"])
    packed = torch.zeros((n + 7) // 8, dtype=torch.uint8)
    formats.write_bits(packed, 0, bits)
    moments = [torch.zeros(n) for _ in range(2)]
    for step, grad in enumerate(data["grads"], start=1):
        fused_adam_steps([cpu_adam.AdamUpdate(None, grad[a:b], moments[0][a:b], moments[1][a:b], weight[a:b],
                                              step=step, residual=residual[a:b], residual_bits=packed,
                                              residual_bit0=a, **HYPER)
                          for a, b in zip(cuts, cuts[1:])], threads=4)
    return dict(weight=weight, residual=residual, packed=packed)


def _check_split(result: dict, n: int, bit0: int) -> None:
    assert torch.equal(result["weight"].view(torch.int16), result["out"].view(torch.int16))
    bits = formats.read_bits(result["packed"], bit0, n)
    joined = formats.join_master(result["weight"], result["residual"], bits)
    assert torch.equal(_bits(joined), _bits(result["master"]))
    for split, fp32 in zip(result["moments_split"], result["moments_fp32"]):
        assert torch.equal(split.view(torch.int16 if split.dtype == torch.bfloat16 else torch.int32),
                           fp32.view(torch.int16 if fp32.dtype == torch.bfloat16 else torch.int32))
    every, before = (formats.read_bits(packed, 0, packed.numel() * 8)
                     for packed in (result["packed"], torch.full_like(result["packed"], 0xA5)))
    assert torch.equal(every[:bit0], before[:bit0]) and torch.equal(every[bit0 + n:], before[bit0 + n:])


def _check_all(results: dict) -> None:
    for n, bit0, threads in SPLIT_CASES:
        for moments in (torch.float32, torch.bfloat16):
            _check_split(results[(n, bit0, threads, str(moments))], n, bit0)


@pytest.mark.skipif(cpu_adam.simd_level() == "torch", reason="the native extension zerooffload._cpu_adam is not built")
@pytest.mark.parametrize("level", LEVELS)
def test_a_split_master_updates_bitwise_as_the_fp32_master(level, tmp_path):
    results = results_at_level(level, "test_state_formats", "run_updates", tmp_path)
    _check_all(results)
    adjacent, reference = results["adjacent"], _reference_adjacent()
    assert torch.equal(adjacent["weight"].view(torch.int16), reference["out"].view(torch.int16))
    joined = formats.join_master(adjacent["weight"], adjacent["residual"],
                                 formats.read_bits(adjacent["packed"], 0, reference["master"].numel()))
    assert torch.equal(_bits(joined), _bits(reference["master"]))


def run_noise_sums() -> tuple[int, float]:
    """Sums of the bits of bf16 moments after three steps (run at each level by ``results_at_level``)."""
    n = 100_003
    generator = torch.Generator().manual_seed(0)
    param, grad = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        fused_adam_step(param, grad, m, v, step=step, noise_key=5, noise_base=77, lr=1e-2, betas=(0.9, 0.999),
                        eps=1e-8, weight_decay=0.0)
    return m.view(torch.int16).sum().item(), v.view(torch.int16).double().square().sum().item()


@pytest.mark.skipif(cpu_adam.simd_level() == "torch", reason="the native extension zerooffload._cpu_adam is not built")
@pytest.mark.parametrize("level", LEVELS[:-1])
def test_bf16_moments_round_with_the_same_noise_at_every_level(level, tmp_path):
    """Each vector level hashes the noise itself: their bits must be the scalar level's."""
    assert (results_at_level(level, "test_state_formats", "run_noise_sums", tmp_path)
            == results_at_level("scalar", "test_state_formats", "run_noise_sums", tmp_path))


def _reference_adjacent() -> dict:
    """The fp32 master of ``_run_adjacent``, updated whole."""
    data = _inputs(700_001, 7)
    master, out = data["master"].clone(), torch.empty(700_001, dtype=torch.bfloat16)
    moments = [torch.zeros(700_001) for _ in range(2)]
    for step, grad in enumerate(data["grads"], start=1):
        fused_adam_step(master, grad, *moments, out, step=step, **HYPER)
    return dict(master=master, out=out)


def test_the_torch_fallback_keeps_the_formats_and_the_native_values(monkeypatch):
    """Without the native module, torch's ops give the same formats (a split master bitwise its fp32
    twin's) and the native values within what torch's operation order rounds apart (an ulp or two)."""
    native = run_updates()
    monkeypatch.setattr(cpu_adam, "_cpu_adam", None)
    fallback = run_updates()
    _check_all(fallback)
    for key in (key for key in native if key != "adjacent"):
        ours, theirs = native[key], fallback[key]
        torch.testing.assert_close(theirs["master"], ours["master"], rtol=1e-6, atol=1e-7)
        for mine, other in zip(theirs["moments_split"], ours["moments_split"]):
            torch.testing.assert_close(mine.float(), other.float(), rtol=2 ** -7, atol=1e-12)


def test_bf16_moments_are_rounded_without_bias():
    """v decays by beta2 each step with no gradient: rounded to nearest, bf16 would keep v as it is
    (0.999 v rounds back to v); stochastically rounded, the mean follows fp32 within 0.2%."""
    n, steps = 200_000, 60
    v = torch.full((n,), 1.0, dtype=torch.bfloat16)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v_fp32 = torch.full((n,), 1.0)
    weight, residual, bits = formats.split_master(torch.zeros(n))
    packed = torch.zeros((n + 7) // 8, dtype=torch.uint8)
    formats.write_bits(packed, 0, bits)
    for step in range(1, steps + 1):
        fused_adam_step(None, torch.zeros(n), m, v, weight, step=step, residual=residual, residual_bits=packed,
                        noise_key=1, **{**HYPER, "weight_decay": 0.0})
        v_fp32 *= 0.999
    mean = v.float().mean().item()
    assert abs(mean / v_fp32[0].item() - 1) < 2e-3, (mean, v_fp32[0].item())
    assert 0.999 ** steps < 0.95 and abs(mean - 1) > 0.04  # what round to nearest would have kept


def test_a_split_update_is_refused_with_the_argument_named():
    weight, residual = torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.int16)
    common = dict(step=1, residual=residual, **HYPER)
    with pytest.raises(ValueError, match="residual_bits has 8 bits: 13 needed from residual_bit0 = 3"):
        fused_adam_step(None, torch.zeros(10), torch.zeros(10), torch.zeros(10), weight,
                        residual_bits=torch.zeros(1, dtype=torch.uint8), residual_bit0=3, **common)
    with pytest.raises(ValueError, match="out has dtype float16: expected bfloat16"):
        fused_adam_step(None, torch.zeros(10), torch.zeros(10), torch.zeros(10), weight.half(),
                        residual_bits=torch.zeros(2, dtype=torch.uint8), **common)
    with pytest.raises(ValueError, match="exp_avg_sq has dtype float32: expected bfloat16"):
        fused_adam_step(None, torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10), weight,
                        residual_bits=torch.zeros(2, dtype=torch.uint8), **common)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
