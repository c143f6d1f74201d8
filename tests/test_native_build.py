"""The three native extensions as setup.py builds them: ``zerooffload._aio`` (async I/O),
``zerooffload._cpu_adam`` (the fused Adam pass) and ``zerooffload._quantize`` (ZeRO++'s wire code), each
optional and each on its own.

The slow tests rebuild them from ``native/`` with setup.py itself (a copy of it and of ``native/`` in a
temporary directory, a real compiler run) under CFLAGS that a portable build uses: plain x86-64 with
AVX switched off (the vector levels must still be there, by target attribute and run-time dispatch),
and ``-DZO_ADAM_SCALAR_ONLY``, which compiles cpu_adam.c as on a machine that is not x86 (no
<immintrin.h>, scalar only). A fresh interpreter then loads the built files in place of the
installed ones and checks that io_uring moves bytes, that the Adam pass matches torch and that the wire
code decodes within its bound.

Where an aarch64 cross compiler is installed, every source is also compiled for aarch64 (the build that
failed on <immintrin.h> before the split); and the sdist must carry every source and header of native/.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LEVELS = {"avx512", "avx2", "scalar"}
X86 = platform.machine() in ("x86_64", "i386", "i686", "AMD64")


def test_both_extensions_import_on_their_own():
    from zerooffload import _aio, _cpu_adam

    assert _cpu_adam.adam_simd() in LEVELS
    if not X86:
        assert _cpu_adam.adam_simd() == "scalar"
    assert _aio.uring_supported() is (_aio.uring_probe() == 0)
    assert {_aio.READ, _aio.WRITE} == {0, 1} and isinstance(_aio.Engine, type)
    assert not hasattr(_aio, "adam_steps") and not hasattr(_cpu_adam, "Engine")  # no twin of the other


# ------------------------------------------------------------------------------------------------
# Rebuilding from the sources


def _build(tmp_path: Path, cflags: str) -> tuple[dict[str, Path], str]:
    """setup.py's build_ext in a copy of setup.py and native/ under ``cflags``; the built files by
    module name, and the build log (both extensions are optional: a failure shows only there)."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "native", src / "native")
    shutil.copy(REPO / "setup.py", src)
    lib = tmp_path / "lib"
    env = dict(os.environ, CFLAGS=cflags)
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(lib), "--build-temp",
                           str(tmp_path / "obj")], cwd=src, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    built = {p.name.split(".")[0]: p for p in (lib / "zerooffload").glob("*.so")}
    assert set(built) == {"_aio", "_cpu_adam", "_quantize"}, log
    return built, log


_CHECK = r"""
import importlib.util, json, os, sys, tempfile
for name, path in json.loads(sys.argv[1]).items():  # the built files stand in for the installed ones
    spec = importlib.util.spec_from_file_location(f"zerooffload.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module

import torch
from zerooffload import _aio, _cpu_adam, _quantize
from zerooffload.comm.quantize import BLOCK, decode, encode, native_level, wire_bytes
from zerooffload.config import AioConfig
from zerooffload.io import AsyncIO, aligned_empty, open_file
from zerooffload.optim import fused_adam_step, simd_level

report = {"files": [_aio.__file__, _cpu_adam.__file__, _quantize.__file__], "uring": _aio.uring_supported(),
          "level": simd_level()}
if report["uring"]:
    data = torch.randint(0, 256, (3 * 4096 + 5,), dtype=torch.uint8)
    back = aligned_empty(data.numel())
    with tempfile.TemporaryDirectory() as tmp, AsyncIO(AioConfig(backend="uring", block_size=4096)) as aio:
        with open_file(os.path.join(tmp, "f.bin"), "rw") as f:
            assert aio.write(f, data, 0).wait() == data.numel()
            assert aio.read(f, back, 0).wait() == data.numel()
        report["backend"] = aio.backend
    report["round_trip"] = bool(torch.equal(back, data))

torch.manual_seed(0)
n = 1000 + 13  # whole vectors and a tail
param, grads = torch.randn(n), [torch.randn(n) for _ in range(3)]
p, m, v = param.clone(), torch.zeros(n), torch.zeros(n)
ref = param.clone().requires_grad_()
opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
for step, g in enumerate(grads, 1):
    fused_adam_step(p, g, m, v, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=step)
    ref.grad = g.clone()
    opt.step()
state = opt.state[ref]
for name, ours, theirs in (("param", p, ref.detach()), ("exp_avg", m, state["exp_avg"]),
                           ("exp_avg_sq", v, state["exp_avg_sq"])):
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name}: {s}")
report["adam"] = "matches torch"

x = torch.randn(3 * BLOCK + 7)
wire = torch.empty(wire_bytes(x.numel()), dtype=torch.uint8)
back = decode(encode(x, wire), torch.empty_like(x))
bound = torch.cat([b.abs().max().expand(b.numel()) for b in x.split(BLOCK)]) / 127 / 2
report["quantize"] = {"level": native_level(), "within_bound": bool(((back - x).abs() <= bound * (1 + 1e-6)).all())}
print(json.dumps(report))
"""


def _check(built: dict[str, Path], **env: str) -> dict:
    run_env = dict(os.environ, PYTHONPATH=str(REPO), **env)
    done = subprocess.run([sys.executable, "-c", _CHECK, json.dumps({k: str(v) for k, v in built.items()})],
                          capture_output=True, text=True, env=run_env, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["files"] == [str(built[name]) for name in ("_aio", "_cpu_adam", "_quantize")]  # not installed
    assert report["adam"] == "matches torch" and report["quantize"]["within_bound"]
    from zerooffload import _aio

    assert report["uring"] is _aio.uring_supported()  # as the installed build sees this kernel
    if report["uring"]:
        assert report["backend"] == "uring" and report["round_trip"]
    return report


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="x86 CFLAGS")
def test_a_build_without_avx_keeps_io_uring_and_dispatches_adam_at_run_time(tmp_path):
    """CFLAGS of a portable x86-64 build: io_uring is there, and the Adam pass still picks the CPU's best
    level at run time (the vector functions carry their own target attributes)."""
    built, log = _build(tmp_path, "-march=x86-64 -mno-avx -mno-avx2 -mno-avx512f")
    assert "-mno-avx2" in log  # the flags reached the compiler
    from zerooffload import _cpu_adam

    report = _check(built)
    assert report["level"] == _cpu_adam.adam_simd()  # the installed build's choice on this CPU
    assert _check(built, ZO_ADAM_SIMD="scalar")["level"] == "scalar"


CROSS_AARCH64 = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(CROSS_AARCH64 is None, reason="no aarch64 cross compiler (apt install gcc-aarch64-linux-gnu)")
def test_every_native_source_compiles_for_aarch64(tmp_path):
    """Compile only (nothing here runs aarch64 code), warnings as errors: the x86 intrinsics must stay
    out of a non-x86 build, and nothing may be left unused there. Python's headers are the host's,
    whose pyconfig.h agrees with aarch64's on the sizes the bindings use (LP64)."""
    import sysconfig

    for source in sorted((REPO / "native").glob("*.c")):
        done = subprocess.run([CROSS_AARCH64, "-O3", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-pthread",
                               "-ffp-contract=off", "-fPIC", f"-I{REPO / 'native'}",
                               f"-I{sysconfig.get_paths()['include']}", "-c", str(source), "-o",
                               str(tmp_path / f"{source.stem}.o")], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{source.name}: {done.stderr}"


@pytest.mark.slow
def test_a_scalar_only_build_as_off_x86(tmp_path):
    """-DZO_ADAM_SCALAR_ONLY takes the branch a non-x86 compiler takes: no intrinsics, "scalar" whatever
    ZO_ADAM_SIMD asks (a lower level than the best is the only thing it may ask for)."""
    built, _ = _build(tmp_path, "-DZO_ADAM_SCALAR_ONLY")
    assert _check(built)["level"] == "scalar"
    assert _check(built, ZO_ADAM_SIMD="avx512")["level"] == "scalar"


def test_the_sdist_ships_every_native_source_and_header(tmp_path):
    """Without its headers an sdist builds neither extension, and both being optional it says so only
    in the build log: every file of native/ must be in it."""
    src = tmp_path / "src"  # a copy, so that the checkout's egg-info and build/ stay as they are
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__",
                                                             "*.so", "tests", "bench", "examples"))
    done = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    archive, = (tmp_path / "dist").glob("zerooffload-*.tar.gz")
    with tarfile.open(archive) as tar:
        shipped = {Path(*Path(name).parts[1:]).as_posix() for name in tar.getnames()}
    wanted = {f"native/{p.name}" for p in (REPO / "native").iterdir() if p.suffix in (".c", ".h")}
    assert wanted <= shipped, sorted(wanted - shipped)
    assert "setup.py" in shipped
