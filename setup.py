"""Builds the optional native extension `zerooffload._native` from `native/`.

The extension is plain C against libc, pthreads and the kernel headers (no torch, no
liburing): Python passes addresses and lengths. It is `optional=True` so that a machine
without a compiler still installs; `zerooffload doctor` then says the Python backend is used.
"""
from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("native")
native = Extension(
    "zerooffload._native",
    sources=sorted(str(p) for p in NATIVE.glob("*.c")),
    include_dirs=[str(NATIVE)],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-pthread", "-fvisibility=hidden"],
    extra_link_args=["-pthread"],
    optional=True,
)
setup(ext_modules=[native] if native.sources else [])
