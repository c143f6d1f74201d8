#!/usr/bin/env bash
# GPU checks for a session lent a CUDA machine (the project's H200: torch 2.11, Python 3.12, no network).
# Builds native/ (the engine falls back to the pool backend by itself when io_uring is refused), runs
# the CUDA-marked tests plus the native-kernel and async-I/O tests, then a short offloaded GPT run, and
# writes what it saw under $OUT (default ./gpu-check). Sized to finish in well under 8 minutes.
# Usage (device tool): bash bench/gpu_check.sh
set -uo pipefail
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "== build"; python3 -m pip install -e . --no-deps --no-build-isolation -q 2>&1 | tail -3
  python3 -c "from zerooffload.io import AsyncIO; print('aio backend:', AsyncIO().backend)"
  echo "== tests"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cpu_adam.py tests/test_aio.py 2>&1 | tail -15
  echo "== offloaded GPT (small preset, stage 3, bf16, params + optimizer on NVMe)"
  timeout 150 python3 -m zerooffload train --model small --steps 20 zero.stage=3 train.precision=bf16 \
      offload.param.tier=nvme offload.optimizer.tier=nvme --out "$OUT/train" 2>&1 | grep -v "train small:" | tail -5
} 2>&1 | tee "$OUT/report.txt"
