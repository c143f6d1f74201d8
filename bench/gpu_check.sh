#!/usr/bin/env bash
# GPU checks for a session lent a CUDA machine (the project's H200: torch 2.11, Python 3.12, no network).
# Builds native/ (the engine falls back to the pool backend by itself when io_uring is refused), runs
# the CUDA-marked tests plus the native-kernel and async-I/O tests, then a short GPT run on the GPU
# without offload and with parameters + optimizer on NVMe, and writes what it saw under $OUT (default
# ./gpu-check): report.txt (the summary) and pytest.log (every test's outcome). Sized for < 6 minutes.
# Usage (device tool): bash bench/gpu_check.sh
set -uo pipefail
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "== build"
  if ! python3 -m pip install -e . --no-deps --no-build-isolation -q 2>&1 | tail -3; then
    python3 setup.py build_ext --inplace -q 2>&1 | tail -3; export PYTHONPATH="$PWD"
  fi
  timeout 60 python3 -m zerooffload doctor 2>&1 | tail -12
  echo "== tests (CUDA-marked, native Adam, async I/O)"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" \
      tests/test_cuda.py tests/test_cpu_adam.py tests/test_aio.py >"$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; tail -25 "$OUT/pytest.log"
  for offload in none nvme; do
    echo "== GPT small on the GPU, stage 3, bf16, 30 steps, offload: $offload"
    extra=(); [ "$offload" = nvme ] && extra=(offload.param.tier=nvme offload.optimizer.tier=nvme)
    timeout 90 python3 -m zerooffload train --model small --steps 30 zero.stage=3 train.precision=bf16 \
        "${extra[@]}" --out "$OUT/train-$offload" 2>&1 | tr "\r" "\n" | uniq | tail -5
  done
} 2>&1 | tee "$OUT/report.txt"
