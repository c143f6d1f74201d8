"""int8 moments (``state_formats``' [Note: int8 moments], native/int8_moments.h).

References independent of the code under test: the code map written out from its definition with
Python floats; and for the native pass, its own fp32-moment pass (itself checked against torch's fused
AdamW in test_cpu_adam.py) between a decode and an encode, since an int8 update must be exactly
"decode, update in fp32, encode".
"""
from __future__ import annotations

import pytest
import torch

from test_cpu_adam import LEVELS, results_at_level
from zerooffload.optim import cpu_adam, fused_adam_step
from zerooffload.optim import state_formats as formats

HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BIAS = {True: 15, False: 31}


def _code_values(signed: bool) -> list[float]:
    """Every code's magnitude as the note defines it: 3 mantissa bits, q = 1 at the top exponent, linear
    below the lowest."""
    bias, codes = BIAS[signed], range(128 if signed else 256)
    return [c * 2.0 ** (-bias - 2) if c < 8 else 2.0 ** (c // 8 - bias) * (1 + (c % 8) / 8) for c in codes]


@pytest.mark.parametrize("signed", [True, False])
def test_codes_decode_to_the_map_and_encode_back_to_nearest(signed):
    values = _code_values(signed)
    top = next(c for c in range(len(values)) if values[c] == 1.0)  # q = 1: the block's largest
    codes = torch.arange(top + 1, dtype=torch.uint8)
    scales = torch.ones(formats.int8_blocks(codes.numel()))
    decoded = formats.decode_int8(codes, scales, signed)
    assert decoded.tolist() == values[:top + 1]
    assert all(a < b for a, b in zip(values[:top], values[1:top + 1]))  # monotone, no code wasted below 1
    nearest = torch.full((top + 1,), 0x8000)
    again, _ = formats.encode_int8(decoded, nearest, signed)
    assert torch.equal(again, codes)
    if signed:  # the sign bit, on every magnitude
        negative, _ = formats.encode_int8(-decoded, nearest, signed)
        assert torch.equal(negative[1:], codes[1:] | 0x80)


def test_a_block_is_scaled_by_its_largest_which_reads_back_exactly():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=generator) * torch.logspace(-6, 2, 1000)
    codes, scales = formats.encode_int8(x, torch.randint(0, 1 << 16, (1000,), generator=generator), True)
    blocks = x.split(formats.INT8_BLOCK)
    assert torch.equal(scales, torch.stack([b.abs().max() for b in blocks]))
    decoded = formats.decode_int8(codes, scales, True)
    for block, back in zip(blocks, decoded.split(formats.INT8_BLOCK)):
        largest = block.abs().argmax()
        assert back[largest] == block[largest]
        assert torch.all((back - block).abs() <= block.abs() / 8 + block.abs().max() * 2.0 ** -17)  # a code apart


TOP = {True: 120, False: 248}
"""The code of q = 1 (the block's largest): exponent field 15 (m) or 31 (v), mantissa 0, by the map."""


def _below_one_after_reciprocal(count: int) -> torch.Tensor:
    """fp32 values s whose ``s * (1 / s)`` rounds to 0.99999994 (~12% of floats): coded by the product
    alone, with noise 0, a block's largest would take the code below the top."""
    candidates = torch.rand(20 * count, generator=torch.Generator().manual_seed(5)) * 10 + 1e-3
    below = candidates * (torch.ones_like(candidates) / candidates) < 1
    return candidates[below][:count]


@pytest.mark.parametrize("signed", [True, False])
def test_a_blocks_largest_takes_the_top_code_whatever_its_reciprocal_rounds_to(signed):
    largest = _below_one_after_reciprocal(50)
    x = torch.rand(50, formats.INT8_BLOCK, generator=torch.Generator().manual_seed(6)) * largest[:, None] * 0.9
    x[:, 7] = largest
    codes, scales = formats.encode_int8(x.reshape(-1), torch.zeros(x.numel(), dtype=torch.int64), signed)
    assert torch.equal(scales, largest)
    assert (codes.view(50, -1)[:, 7] == TOP[signed]).all()
    decoded = formats.decode_int8(codes, scales, signed)
    assert torch.equal(decoded.view(50, -1)[:, 7], largest)
    again, again_scales = formats.encode_int8(decoded, torch.full((x.numel(),), 0x8000), signed)  # a save and load
    assert torch.equal(again, codes) and torch.equal(again_scales, scales)


def test_a_non_finite_moment_is_isolated_in_its_block():
    """It codes as its block's largest finite magnitude, its sign kept; every other value of the block
    keeps the code and scale it has without it (fp32 moments keep one bad value too, not 256)."""
    x = torch.zeros(3 * formats.INT8_BLOCK)
    x[formats.INT8_BLOCK:] = torch.linspace(-1, 0.5, 2 * formats.INT8_BLOCK)
    noise = torch.randint(0, 1 << 16, (x.numel(),), generator=torch.Generator().manual_seed(2))
    clean, clean_scales = formats.encode_int8(x, noise, True)
    bad = x.clone()
    bad[5], bad[formats.INT8_BLOCK + 3], bad[2 * formats.INT8_BLOCK + 9] = float("nan"), float("-inf"), float("inf")
    codes, scales = formats.encode_int8(bad, noise, True)
    assert torch.equal(scales, clean_scales)  # the largest finite magnitudes: 0, 1, 0.5
    others = torch.ones(x.numel(), dtype=torch.bool)
    others[[5, formats.INT8_BLOCK + 3, 2 * formats.INT8_BLOCK + 9]] = False
    assert torch.equal(codes[others], clean[others])
    decoded = formats.decode_int8(codes, scales, True)
    assert decoded.isfinite().all()
    assert decoded[formats.INT8_BLOCK + 3] == -1.0 and decoded[2 * formats.INT8_BLOCK + 9] == 0.5
    assert decoded[5].abs() == 0.0  # a block of zeros: its scale is 0, whatever codes it holds


def _step_pair(n: int, step: int, grad: torch.Tensor, state: dict, split: bool) -> tuple[dict, dict]:
    """One int8 update of ``state``, and its reference: the fp32-moment pass on the decoded moments."""
    out = {k: v.clone() for k, v in state.items()}
    ref = {k: v.clone() for k, v in state.items()}
    common = dict(step=step, noise_key=11, noise_base=300, **HYPER)
    master = dict(residual=out["residual"], residual_bits=out["bits"]) if split else {}
    fused_adam_step(None if split else out["param"], grad, out["m"], out["v"], out["weight"],
                    exp_avg_scale=out["m_scale"], exp_avg_sq_scale=out["v_scale"], threads=3, **master, **common)
    m = formats.decode_int8(ref["m"], ref["m_scale"], True)
    v = formats.decode_int8(ref["v"], ref["v_scale"], False)
    master = dict(residual=ref["residual"], residual_bits=ref["bits"]) if split else {}
    fused_adam_step(None if split else ref["param"], grad, m, v, ref["weight"], **master, **common)
    noise = formats.rounding_noise(11, step, 300, n)
    ref["m"], ref["m_scale"] = formats.encode_int8(m, noise & 0xFFFF, True)
    ref["v"], ref["v_scale"] = formats.encode_int8(v, noise >> 16, False)
    return out, ref


def run_int8_chain() -> dict:
    """Three updates of int8 moments beside their references, with an fp32 and a split master; the last
    update of the first run has a NaN gradient (its block's codes are the same at every level too)."""
    results = {}
    for n, split in ((1000, False), (700_001, True), (300_013, False)):
        generator = torch.Generator().manual_seed(n)
        param = torch.randn(n, generator=generator)
        weight, residual, bits = formats.split_master(param)
        packed = torch.zeros((n + 7) // 8, dtype=torch.uint8)
        formats.write_bits(packed, 0, bits)
        blocks = formats.int8_blocks(n)
        state = dict(param=param, weight=weight if split else torch.empty(n, dtype=torch.bfloat16), residual=residual,
                     bits=packed, m=torch.zeros(n, dtype=torch.uint8), v=torch.zeros(n, dtype=torch.uint8),
                     m_scale=torch.zeros(blocks), v_scale=torch.zeros(blocks))
        for step in (1, 2, 3):
            grad = (torch.randn(n, generator=generator) * torch.logspace(-5, 0, n)).bfloat16()
            if n == 1000 and step == 3:
                grad[517] = float("nan")
            out, ref = _step_pair(n, step, grad, state, split)
            results[(n, split, step)] = (out, ref)
            state = out
    return results


def _noise_base_with_zero(high: bool) -> int:
    """An element number whose rounding noise for m (low 16 bits) or v (high 16) is 0 at step 1, key 11."""
    noise = formats.rounding_noise(11, 1, 0, 1 << 22)
    return int(torch.nonzero(((noise >> 16) if high else (noise & 0xFFFF)) == 0)[0])


def run_top_code_updates() -> dict:
    """A first update of int8 moments whose block's largest new moment (m, then v) has a reciprocal that
    rounds its q below 1 and the rounding noise 0 there: the case that coded once in 65,536 blocks below
    the top code. Returns, for "m" and "v", whether the precondition held, the codes and scales."""
    results = {}
    for moment in ("m", "v"):
        base = _noise_base_with_zero(high=moment == "v")
        for gradient in torch.linspace(1.0, 3.0, 400).tolist():
            grad = torch.rand(formats.INT8_BLOCK, generator=torch.Generator().manual_seed(4)) * 0.5
            grad[0] = gradient  # element 0, numbered ``base``: the block's largest
            m, v = torch.zeros(formats.INT8_BLOCK, dtype=torch.uint8), torch.zeros(formats.INT8_BLOCK, dtype=torch.uint8)
            scales = {"m": torch.zeros(1), "v": torch.zeros(1)}
            fused_adam_step(torch.zeros(formats.INT8_BLOCK), grad, m, v, step=1, noise_key=11, noise_base=base,
                            exp_avg_scale=scales["m"], exp_avg_sq_scale=scales["v"], **HYPER)
            scale = scales[moment]
            if scale * (torch.ones(1) / scale) < 1:
                results[moment] = {"codes": m if moment == "m" else v, "scale": scale}
                break
    return results


@pytest.mark.skipif(cpu_adam.simd_level() == "torch", reason="the native extension zerooffload._cpu_adam is not built")
@pytest.mark.parametrize("level", LEVELS)
def test_the_native_pass_codes_a_blocks_largest_at_the_top_at_every_level(level, tmp_path):
    results = results_at_level(level, "test_int8_moments", "run_top_code_updates", tmp_path)
    for moment, signed in (("m", True), ("v", False)):
        assert moment in results, f"no gradient gave {moment} the constructed case: the test cannot judge"
        codes, scale = results[moment]["codes"], results[moment]["scale"]
        assert codes[0] & 0x7F == TOP[signed] if signed else codes[0] == TOP[signed]
        assert formats.decode_int8(codes, scale, signed)[0].abs() == scale[0]


@pytest.mark.skipif(cpu_adam.simd_level() == "torch", reason="the native extension zerooffload._cpu_adam is not built")
@pytest.mark.parametrize("level", LEVELS)
def test_an_int8_update_is_decode_fp32_update_encode_at_every_level(level, tmp_path):
    for key, (out, ref) in results_at_level(level, "test_int8_moments", "run_int8_chain", tmp_path).items():
        for name in out:
            assert torch.equal(out[name].view(torch.uint8), ref[name].view(torch.uint8)), (key, name)


def test_the_torch_fallback_stores_the_native_codes(monkeypatch):
    native = run_int8_chain()
    monkeypatch.setattr(cpu_adam, "_cpu_adam", None)
    fallback = run_int8_chain()
    for key in native:
        ours, theirs = native[key][0], fallback[key][0]
        torch.testing.assert_close(theirs["param"], ours["param"], rtol=1e-6, atol=1e-7, equal_nan=True)
        agree = (theirs["v"] == ours["v"]).float().mean()  # an ulp of torch's op order moves a code rarely
        assert agree > 0.999, (key, agree)


def test_int8_moments_are_rounded_without_bias():
    """v decays by beta2 each step with no gradient: codes lie 12.5% apart, so round to nearest would
    keep v as it is; stochastically rounded, the mean follows fp32 within 0.5%."""
    n, steps = 200_000, 60
    v_values = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5
    v, v_scale = formats.encode_int8(v_values, torch.full((n,), 0x8000), False)
    m, m_scale = torch.zeros(n, dtype=torch.uint8), torch.zeros(formats.int8_blocks(n))
    start = formats.decode_int8(v, v_scale, False)
    param = torch.zeros(n)
    for step in range(1, steps + 1):
        fused_adam_step(param, torch.zeros(n), m, v, step=step, exp_avg_scale=m_scale, exp_avg_sq_scale=v_scale,
                        noise_key=1, **{**HYPER, "weight_decay": 0.0})
    mean, expected = formats.decode_int8(v, v_scale, False).mean().item(), start.mean().item() * 0.999 ** steps
    assert abs(mean / expected - 1) < 5e-3, (mean, expected)


def test_int8_scales_are_checked_by_name():
    codes = torch.zeros(600, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"exp_avg_scale has 2 elements: 3 needed, a scale per 256 elements of 600"):
        fused_adam_step(torch.zeros(600), torch.zeros(600), codes, codes.clone(), step=1,
                        exp_avg_scale=torch.zeros(2), exp_avg_sq_scale=torch.zeros(3), **HYPER)
