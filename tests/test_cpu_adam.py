"""``fused_adam_step`` against independent references, at every SIMD level this machine has.

References: ``torch.optim.AdamW/Adam(fused=True)`` for param, exp_avg and exp_avg_sq (stepped with
``grad.float() * grad_scale``), and torch's own ``.to(dtype)`` of the new param for ``out``. Each level
runs in a child interpreter with ZO_ADAM_SIMD set (the native module reads it once per process); the
child returns our results and the parent computes the references, so no level is judged by itself.
A child costs ~2 s (importing torch), hence one child per level running every case.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from zerooffload.optim import AdamUpdate, cpu_adam, fused_adam_step, fused_adam_steps, simd_level

TESTS = Path(__file__).resolve().parent
LEVELS = ("avx512", "avx2", "scalar")
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
BITWISE_BUILD = torch.__version__.startswith("2.13.")
"""The torch build whose kernel's rounding native/cpu_adam.c reproduces bit for bit (all but the last
numel % 16 elements); elsewhere only the tolerance below is promised."""


@dataclass(frozen=True, slots=True)
class Case:
    """One run of ``steps`` updates from seeded inputs; ``lr=0`` keeps param as it is, to test casts of
    chosen values (``special``: ties, overflow, NaN, inf, subnormals)."""

    name: str
    n: int  # elements; a special case has special_values()'s
    adamw: bool = True
    grad_dtype: torch.dtype = torch.float32
    out_dtype: torch.dtype | None = torch.bfloat16
    grad_scale: float = 1.0
    threads: int = 0
    steps: int = 3
    lr: float = LR
    special: bool = False


CASES = [
    *(Case(f"adamw-{n}", n) for n in (1, 15, 1000, 300_001)),
    *(Case(f"adam-{n}", n, adamw=False, out_dtype=torch.float16) for n in (1, 15, 1000, 300_001)),
    Case("adamw-3-threads", 1_000_003, threads=3, out_dtype=torch.float16),
    Case("bf16-grad", 1000, grad_dtype=torch.bfloat16),
    Case("fp16-grad", 1000, adamw=False, grad_dtype=torch.float16, out_dtype=torch.float32),
    Case("fp16-grad-and-out", 1000, grad_dtype=torch.float16, out_dtype=torch.float16),  # fp16 training's pass
    Case("grad-scale", 1000, grad_scale=0.37, out_dtype=None),
    Case("bf16-grad-scale", 1000, adamw=False, grad_dtype=torch.bfloat16, grad_scale=3.5),
    Case("cast-bf16", 0, lr=0.0, steps=1, special=True),
    Case("cast-fp16", 0, lr=0.0, steps=1, special=True, out_dtype=torch.float16),
]


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def special_values() -> torch.Tensor:
    """Values whose casts are easy to get wrong, then random bit patterns; 4121 in all, so the vector
    levels convert most of them in their vector code and the last few in their scalar tail."""
    chosen = _from_bits([
        0x3F808000, 0x3F818000, 0xBF808000,  # bf16 ties: to even (down), to even (up), negative
        0x3F801000, 0x3F803000,              # fp16 ties around 1.0: down, up
        0x477FE000, 0x477FEFFF, 0x477FF000,  # 65504, just under 65520 (-> 65504), 65520 (-> inf)
        0x49742400, 0xC9742400, 0x7F7FFFFF,  # +-1e6 (fp16 inf), float max (bf16 inf)
        0x7FC00000, 0xFFC00000, 0x7F812345,  # NaN, -NaN, NaN with a payload
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000,  # +-inf, +-0
        0x35800000, 0x33800000, 0x33000000, 0x33400000, 0x33C00000,  # fp16 subnormals: 2^-20, 2^-24,
        0x387FE000, 0x387FF000, 0x387FFFFF,  # 2^-25 (tie -> 0), 1.5 x 2^-25, 1.5 x 2^-24 (tie -> 2);
        0x00000001, 0x80000001, 0x007FFFFF,  # just under 2^-14 (-> normal); fp32 subnormals
    ])
    random_bits = torch.randint(-(1 << 31), 1 << 31, (4096,), generator=torch.Generator().manual_seed(7),
                                dtype=torch.int32).view(torch.float32)
    return torch.cat([chosen, random_bits])


def inputs(case: Case) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Initial param and one gradient per step, the same in every process."""
    gen = torch.Generator().manual_seed(case.n * 31 + case.steps)
    if case.special:
        param = special_values()
        return param, [torch.zeros_like(param).to(case.grad_dtype)]
    param = torch.randn(case.n, generator=gen)
    return param, [torch.randn(case.n, generator=gen).to(case.grad_dtype) for _ in range(case.steps)]


def ours(case: Case) -> dict:
    """Our updates of the case: final param, moments, and each step's param and out."""
    param, grads = inputs(case)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    params, outs = [], []
    for step, grad in enumerate(grads, 1):
        out = None if case.out_dtype is None else torch.empty(param.shape, dtype=case.out_dtype)
        fused_adam_step(param, grad, exp_avg, exp_avg_sq, out, lr=case.lr, betas=BETAS, eps=EPS,
                        weight_decay=0.0 if case.special else WEIGHT_DECAY, step=step, adamw=case.adamw,
                        grad_scale=case.grad_scale, threads=case.threads)
        params.append(param.clone())
        outs.append(out)
    return {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "params": params, "outs": outs}


def run_all_cases() -> dict:
    """What a child interpreter sends back: ``ours`` of every case."""
    return {case.name: ours(case) for case in CASES}


def reference(case: Case) -> dict[str, torch.Tensor]:
    """torch's fused optimizer over the same inputs, stepping with grad.float() * grad_scale."""
    initial, grads = inputs(case)
    param = initial.clone().requires_grad_()
    kind = torch.optim.AdamW if case.adamw else torch.optim.Adam
    optimizer = kind([param], lr=case.lr, betas=BETAS, eps=EPS,
                     weight_decay=0.0 if case.special else WEIGHT_DECAY, fused=True)
    for grad in grads:
        param.grad = grad.float() * case.grad_scale
        optimizer.step()
    state = optimizer.state[param]
    return {"param": param.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit patterns (NaN payloads and the sign of zero included)."""
    ints = {4: torch.int32, 2: torch.int16}[actual.element_size()]
    actual, expected = actual.view(ints), expected.view(ints)
    differ = (actual != expected).nonzero().flatten()
    if differ.numel():
        first, mask = int(differ[0]), (1 << 8 * actual.element_size()) - 1
        raise AssertionError(f"{what}: {differ.numel()} elements differ, first at {first}: bits "
                             f"{int(actual[first]) & mask:#x} vs {int(expected[first]) & mask:#x}")


def check_case(case: Case, got: dict) -> None:
    """Our results against torch's optimizer and torch's casts."""
    want = reference(case)
    body = len(want["param"]) - len(want["param"]) % 16  # where torch runs its vector code
    for key in ("param", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, equal_nan=True, msg=f"{case.name} {key}")
        if BITWISE_BUILD:
            assert_bits_equal(got[key][:body], want[key][:body], f"{case.name} {key}")
    for step, (param, out) in enumerate(zip(got["params"], got["outs"]), 1):
        if out is not None:
            assert_bits_equal(out, param.to(case.out_dtype), f"{case.name} out at step {step}")


# ------------------------------------------------------------------------------------------------
# Every level against torch


def run_child(level: str, script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter with ZO_ADAM_SIMD=level that can import this file."""
    env = dict(os.environ, ZO_ADAM_SIMD=level, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=300)


LEVEL_RUNS = (("test_cpu_adam", "run_all_cases"), ("test_state_formats", "run_updates"),
              ("test_state_formats", "run_noise_sums"), ("test_int8_moments", "run_int8_chain"),
              ("test_int8_moments", "run_top_code_updates"))
"""Every ``module.function`` whose results a test checks at each level: one interpreter per level runs
them all (the level is chosen once per process; a process each would spend most of the time starting)."""

_LEVEL_RESULTS: dict[str, dict] = {}
"""By level: what that level's interpreter sent back, kept for the session."""


def results_at_level(level: str, module: str, function: str, directory: Path):
    """``module.function()`` as run at ``level`` in a fresh interpreter (with the rest of ``LEVEL_RUNS``),
    its results (skipped where this CPU has no such level: the pass then runs a lower one)."""
    if level not in _LEVEL_RESULTS:
        path = directory / f"level-{level}.pt"
        imports = "; ".join(f"import {name}" for name in sorted({name for name, _ in LEVEL_RUNS}))
        calls = ", ".join(f"({m!r}, {f!r}): {m}.{f}()" for m, f in LEVEL_RUNS)
        script = (f"import sys, torch; from zerooffload.optim import simd_level; {imports}; "
                  f"torch.save({{'level': simd_level(), 'results': {{{calls}}}}}, sys.argv[1])")
        done = run_child(level, script, str(path))
        assert done.returncode == 0, done.stderr[-3000:]
        _LEVEL_RESULTS[level] = torch.load(path, weights_only=False)
    ran = _LEVEL_RESULTS[level]
    if ran["level"] != level:
        pytest.skip(f"this CPU has no {level} (ran {ran['level']})")
    return ran["results"][(module, function)]


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags as /proc/cpuinfo lists them (None where it cannot be read)."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None


@pytest.mark.skipif(simd_level() == "torch", reason="the native extension zerooffload._cpu_adam is not built")
@pytest.mark.parametrize("level", LEVELS)
def test_level_matches_torch(level, tmp_path):
    flag = {"avx512": "avx512f", "avx2": "avx2"}.get(level)
    flags = _cpu_flags()
    if flag and flags is not None and "flags" in flags and flag not in flags:
        pytest.skip(f"this CPU has no {level} ({flag} not in /proc/cpuinfo)")  # the child would fall back
    got = results_at_level(level, "test_cpu_adam", "run_all_cases", tmp_path)
    for case in CASES:
        check_case(case, got[case.name])


@pytest.mark.skipif(simd_level() == "torch", reason="the native extension zerooffload._cpu_adam is not built")
def test_unknown_level_is_refused():
    done = run_child("avx9000", "from zerooffload.optim import simd_level; simd_level()")
    assert done.returncode != 0 and "ValueError: ZO_ADAM_SIMD='avx9000' names no level" in done.stderr


def test_torch_fallback_matches_torch(monkeypatch):
    monkeypatch.setattr(cpu_adam, "_cpu_adam", None)
    assert simd_level() == "torch"
    for case in CASES:
        if case.n <= 1000:
            got = ours(case)
            want = reference(case)
            for key in ("param", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-fallback"])
def test_empty_tensors(monkeypatch, native):
    """A zero-element step is accepted and touches nothing: each tensor is an empty view in the middle of a
    larger buffer, whose every element (a vector kernel's width on either side included) keeps its bits."""
    if not native:
        monkeypatch.setattr(cpu_adam, "_cpu_adam", None)
    elif simd_level() == "torch":
        pytest.skip("the native extension zerooffload._cpu_adam is not built")
    buffers = {name: torch.randn(64, generator=torch.Generator().manual_seed(i)) for i, name in
               enumerate(("param", "grad", "exp_avg", "exp_avg_sq"))}
    buffers["out"] = torch.randn(64).to(torch.bfloat16)
    before = {name: buffer.clone() for name, buffer in buffers.items()}
    views = {name: buffer[32:32] for name, buffer in buffers.items()}
    assert all(view.numel() == 0 and view.is_contiguous() for view in views.values())
    returned = fused_adam_step(views["param"], views["grad"], views["exp_avg"], views["exp_avg_sq"], views["out"],
                               lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, step=1)
    assert returned is None
    for name, buffer in buffers.items():
        assert_bits_equal(buffer, before[name], name)
        assert views[name].shape == (0,) and views[name].dtype == before[name].dtype


def test_any_shape_of_equal_numel():
    param = torch.randn(6, 5)
    want = param.clone().flatten()
    grad, moments = torch.randn(30), [torch.zeros(3, 10), torch.zeros(30)]
    fused_adam_step(param, grad, *moments, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, step=1)
    fused_adam_step(want, grad, torch.zeros(30), torch.zeros(30), lr=LR, betas=BETAS, eps=EPS,
                    weight_decay=WEIGHT_DECAY, step=1)
    assert torch.equal(param.flatten(), want)


# ------------------------------------------------------------------------------------------------
# Refusals


def _arguments(n: int = 64) -> dict:
    return {"param": torch.zeros(n), "grad": torch.zeros(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n),
            "out": torch.empty(n, dtype=torch.bfloat16), "lr": LR, "betas": BETAS, "eps": EPS,
            "weight_decay": WEIGHT_DECAY, "step": 1}


BAD = {
    "param": {"param": torch.zeros(64, dtype=torch.float64)},
    "grad": {"grad": torch.zeros(64, dtype=torch.int32)},
    "exp_avg": {"exp_avg": torch.zeros(128)[::2]},
    "exp_avg_sq": {"exp_avg_sq": torch.zeros(63)},
    "out": {"out": torch.empty(64, dtype=torch.float64)},
    "lr": {"lr": -1.0},
    "betas": {"betas": (1.0, 0.999)},
    "eps": {"eps": -1e-8},
    "weight_decay": {"weight_decay": -0.1},
    "step": {"step": 0},
    "threads": {"threads": -1},
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_argument_is_named(name):
    arguments = {**_arguments(), **BAD[name]}
    before = arguments["param"].clone()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        fused_adam_step(**arguments)
    if arguments["param"].dtype == torch.float32:
        assert torch.equal(arguments["param"], before)  # refused before touching anything


def test_tensor_on_another_device_is_named():
    with pytest.raises(ValueError, match=r"^grad is on meta"):
        fused_adam_step(**{**_arguments(), "grad": torch.empty(64, device="meta")})


# ------------------------------------------------------------------------------------------------
# Sums of squares: the gradient norm, alone (sum_squares) or summed by the update (grad_sumsq)

SUMSQ_SIZES = (1, 15, 4097, 300_001)  # tails, a block and a bit, and enough to split over threads


def _float64_sumsq(tensor: torch.Tensor) -> float:
    return float(tensor.double().square().sum())


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_squares_matches_a_float64_reference(monkeypatch, native, dtype):
    if not native:
        monkeypatch.setattr(cpu_adam, "_cpu_adam", None)
    for n in SUMSQ_SIZES:
        tensor = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        got = cpu_adam.sum_squares(tensor)
        assert got.dtype == torch.float64 and got.shape == ()
        assert got.item() == pytest.approx(_float64_sumsq(tensor), rel=1e-5), (n, dtype)
    assert cpu_adam.sum_squares(torch.empty(0, dtype=dtype)).item() == 0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_sum_squares_is_finite_exactly_when_every_element_is(bad):
    """What the engine's non-finite checks rest on: one bad element anywhere (a vector body or a tail)
    makes the sum non-finite, while the largest finite bf16 values (whose squares overflow fp32) do not."""
    for n, where in ((300_001, 0), (300_001, 150_000), (300_001, 300_000), (7, 3)):
        tensor = torch.randn(n, generator=torch.Generator().manual_seed(where)).to(torch.bfloat16)
        tensor[where] = bad
        assert not math.isfinite(cpu_adam.sum_squares(tensor).item()), (n, where)
    huge = torch.full((300_001,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    assert math.isfinite(cpu_adam.sum_squares(huge).item())


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-fallback"])
def test_the_update_sums_the_squares_of_the_gradient_as_given_without_changing_its_result(monkeypatch, native):
    if not native:
        monkeypatch.setattr(cpu_adam, "_cpu_adam", None)
    generator = torch.Generator().manual_seed(3)
    n = 300_001
    grad = torch.randn(n, generator=generator).to(torch.bfloat16)
    start = [torch.randn(n, generator=generator), torch.zeros(n), torch.zeros(n)]
    results = []
    for grad_sumsq in (False, True):
        param, exp_avg, exp_avg_sq = (t.clone() for t in start)
        out = torch.empty(n, dtype=torch.bfloat16)
        returned = fused_adam_step(param, grad, exp_avg, exp_avg_sq, out, lr=LR, betas=BETAS, eps=EPS,
                                   weight_decay=WEIGHT_DECAY, step=1, grad_scale=0.5, grad_sumsq=grad_sumsq)
        results.append((returned, param, exp_avg, exp_avg_sq, out))
    assert results[0][0] is None
    assert results[1][0] == pytest.approx(_float64_sumsq(grad), rel=1e-5)  # before grad_scale
    for name, plain, summed in zip(("param", "exp_avg", "exp_avg_sq", "out"), results[0][1:], results[1][1:]):
        assert_bits_equal(summed, plain, name)


def test_the_updates_sum_of_squares_is_the_same_whatever_the_thread_count():
    """The clip coefficient comes from this sum, so a rank's update must not depend on how many threads
    summed it, nor on which thread happened to take which block."""
    generator = torch.Generator().manual_seed(4)
    n = 1_000_003
    grad = torch.randn(n, generator=generator).to(torch.bfloat16)
    start = [torch.randn(n, generator=generator), torch.zeros(n), torch.zeros(n)]
    sums = set()
    for threads in (1, 2, 3, 7, 2, 3):
        param, exp_avg, exp_avg_sq = (t.clone() for t in start)
        sums.add(fused_adam_step(param, grad, exp_avg, exp_avg_sq, None, lr=LR, betas=BETAS, eps=EPS,
                                 weight_decay=WEIGHT_DECAY, step=1, threads=threads, grad_sumsq=True))
    assert len(sums) == 1, sums


# ------------------------------------------------------------------------------------------------
# Updates run together (fused_adam_steps): one pass for many tensors, as the engine's step runs them

TOGETHER = [  # (n, grad dtype, lr, step, grad_sumsq): a split one, an empty one, a tail alone, one more
    (1_000_003, torch.bfloat16, 1e-2, 1, True), (0, torch.float32, 1e-3, 2, True),
    (17, torch.float16, 1e-3, 3, False), (300_001, torch.float32, 5e-3, 7, True)]


def _together_inputs(n: int, grad_dtype: torch.dtype, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"param": torch.randn(n, generator=generator), "grad": torch.randn(n, generator=generator).to(grad_dtype),
            "exp_avg": torch.randn(n, generator=generator) * 1e-3,
            "exp_avg_sq": torch.rand(n, generator=generator) * 1e-4,
            "out": torch.empty(n, dtype=torch.bfloat16)}


def test_updates_run_together_equal_each_update_run_alone():
    alone = [_together_inputs(n, dtype, seed) for seed, (n, dtype, *_) in enumerate(TOGETHER)]
    together = [{name: t.clone() for name, t in inputs.items()} for inputs in alone]
    hyper = [{"lr": lr, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY, "step": step, "grad_sumsq": sumsq}
             for _, _, lr, step, sumsq in TOGETHER]
    sums_alone = [fused_adam_step(**inputs, **h) for inputs, h in zip(alone, hyper)]
    sums_together = fused_adam_steps([AdamUpdate(**inputs, **h) for inputs, h in zip(together, hyper)])
    for index, (mine, reference) in enumerate(zip(together, alone)):
        for name in mine:
            assert_bits_equal(mine[name], reference[name], f"updates[{index}].{name}")
    assert [s is None for s in sums_together] == [not h["grad_sumsq"] for h in hyper]
    for mine, reference, inputs in zip(sums_together, sums_alone, alone):
        if mine is not None:  # blocks are cut from the whole split: the same squares, added in other groups
            assert mine == pytest.approx(reference, rel=1e-12)
            assert mine == pytest.approx(_float64_sumsq(inputs["grad"]), rel=1e-5)


def test_updates_run_together_are_all_checked_before_any_runs():
    good = {**_arguments(), "param": torch.ones(64)}
    updates = [AdamUpdate(**good), AdamUpdate(**{**_arguments(), "grad": torch.zeros(64, dtype=torch.int32)})]
    with pytest.raises(ValueError, match=r"^updates\[1\]: grad has dtype int32"):
        fused_adam_steps(updates)
    assert torch.equal(good["param"], torch.ones(64))
