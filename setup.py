"""Builds the three optional native extensions from `native/`.

- `zerooffload._aio`: the async-I/O engine (io_uring and a pthread pool, native/aio.h). Portable C
  against libc, pthreads and the kernel headers (no liburing).
- `zerooffload._cpu_adam`: the fused CPU Adam pass (native/cpu_adam.h). Its vector levels are x86
  intrinsics chosen at run time; elsewhere it builds the scalar level alone.
- `zerooffload._quantize`: ZeRO++'s int8/int4 block code for collectives (native/quantize.h), with
  the same run-time levels.

None needs torch: Python passes addresses and lengths. Each is `optional=True` and built on its
own, so a machine without a compiler still installs, and a failure to build one never takes the
other with it; `zerooffload doctor` says which loaded and what falls back to Python. Headers are
`depends` (a change rebuilds) and ship in the sdist through MANIFEST.in.
"""
from setuptools import Extension, setup

COMMON = ["-O3", "-std=gnu11", "-Wall", "-Wextra", "-pthread", "-fvisibility=hidden"]


def native(name: str, sources: list[str], headers: list[str], extra: tuple[str, ...] = ()) -> Extension:
    return Extension(
        f"zerooffload.{name}",
        sources=[f"native/{s}" for s in sources],
        depends=[f"native/{h}" for h in headers],
        include_dirs=["native"],
        extra_compile_args=[*COMMON, *extra],
        extra_link_args=["-pthread"],
        optional=True,
    )


setup(ext_modules=[
    native("_aio", ["aio_module.c", "aio_engine.c", "aio_pool.c", "aio_uring.c", "checksum.c"],
           ["bindings.h", "aio.h", "aio_backend.h", "checksum.h"]),
    # -ffp-contract=off and -fno-trapping-math as well as the files' own pragmas: a compiler that ignores
    # GCC's pragmas (clang) would otherwise fuse products differently per level (see cpu_adam.c).
    native("_cpu_adam", ["cpu_adam_module.c", "cpu_adam.c", "adam_avx2.c", "adam_avx512.c"],
           ["bindings.h", "cpu_adam.h", "adam_pass.h", "int8_moments.h"],
           ("-ffp-contract=off", "-fno-trapping-math")),
    # ZeRO++'s block code (int8/int4 with a scale a block) for collectives; the same flags keep its levels equal.
    native("_quantize", ["quantize_module.c", "quantize.c"], ["bindings.h", "quantize.h"],
           ("-ffp-contract=off", "-fno-trapping-math")),
])
