#!/usr/bin/env bash
# GPU checks for a session lent a CUDA machine (the project's H200: torch 2.11, Python 3.12, no network).
# Builds native/ (the engine falls back to the pool backend by itself when io_uring is refused), runs
# the CUDA-marked tests plus the native-kernel and async-I/O tests, `plan` (its probe on the GPU), then
# three short GPT runs on the GPU (no offload; parameters + optimizer on NVMe; the same with compact
# states, split master + int8 moments, then resumed from its step-15 checkpoint) and prints their table
# last: s/step measured and planned, loss, the engine's device peak beside CUDA's own
# max_memory_allocated, NVMe peak, and whether the resumed losses are bitwise the uninterrupted ones.
# Writes under $OUT (default ./gpu-check):
# report.txt (everything printed), pytest.log (every test's outcome) and one summary JSON per run;
# the runs' directories and swap stay in a scratch folder, so $OUT keeps a handful of files.
# Sized for < 6 minutes (each step has its own timeout). Usage (device tool): bash bench/gpu_check.sh
set -uo pipefail
OUT="${OUT:-gpu-check}"
RUNS="$(mktemp -d)"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
section() { echo "== [${SECONDS}s] $*"; }
# the small GPT on the GPU, stage 3, bf16, 30 steps, swap in the scratch folder; more arguments after
train() { timeout 60 python3 -m zerooffload train --model small --steps 30 zero.stage=3 train.precision=bf16 \
              nvme.path="$RUNS/swap" "$@" 2>&1 | tr "\r" "\n" | uniq; }
{
  section "machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  section "build"
  if ! python3 -m pip install -e . --no-deps --no-build-isolation -q 2>&1 | tail -3; then
    python3 setup.py build_ext --inplace -q 2>&1 | tail -3; export PYTHONPATH="$PWD"
  fi
  timeout 30 python3 -m zerooffload doctor 2>&1 | tail -12
  section "tests (CUDA-marked, native Adam, async I/O)"
  timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" --tb=short -rfE \
      tests/test_cuda.py tests/test_cpu_adam.py tests/test_aio.py >"$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; tail -25 "$OUT/pytest.log"
  section "plan on the GPU (its probe, cached, gives the runs below their predictions)"
  mkdir -p "$RUNS/swap"  # one swap folder for all: the probe's disk rate is kept per folder
  timeout 120 python3 -m zerooffload plan --model small zero.stage=3 train.precision=bf16 nvme.path="$RUNS/swap" \
      2>&1 | tail -7
  declare -A OPTIONS=([none]="" [nvme]="offload.param.tier=nvme offload.optimizer.tier=nvme"
                      [nvme-split-int8]="offload.param.tier=nvme offload.optimizer.tier=nvme optimizer.master=split
                                         optimizer.moments=int8 --save-every 15")
  for run in none nvme nvme-split-int8; do
    section "GPT small on the GPU, stage 3, bf16, 30 steps: $run"
    # shellcheck disable=SC2086  # the options are words on purpose
    train ${OPTIONS[$run]} --out "$RUNS/$run" | tail -12
    cp "$RUNS/$run/summary.json" "$OUT/train-$run.json" 2>/dev/null || echo "($run wrote no summary)"
  done
  section "resume on the GPU: nvme-split-int8 from its step-15 checkpoint to step 30"
  # shellcheck disable=SC2086
  train ${OPTIONS[nvme-split-int8]} --out "$RUNS/nvme-split-int8" --resume --tag step00000015 | tail -3
  cp "$RUNS/nvme-split-int8/summary.json" "$OUT/resumed.json" 2>/dev/null || echo "(the resumed run wrote no summary)"
  section "table"
  python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
MB, NAN = 1e6, float("nan")
print(f"{'run':<16} {'s/step':>7} {'plan':>7} {'tok/s':>7} {'loss first>last':>16} {'engine dev MB':>13} "
      f"{'cuda max MB':>11} {'nvme MB':>8}")
for path in sorted(Path(sys.argv[1]).glob("train-*.json")):
    s = json.loads(path.read_text())
    measured, planned, peak = s.get("measured", {}), s.get("predicted", {}), s["peak_bytes"]
    print(f"{path.stem[6:]:<16} {measured.get('step_seconds', NAN):>7.3f} {planned.get('step_seconds', NAN):>7.3f} "
          f"{s['tokens_per_second']:>7} {s['first_loss_mean']:>7.3f}>{s['last_loss_mean']:<8.3f} "
          f"{peak['device'] / MB:>13.1f} {measured.get('peak_bytes', {}).get('device', NAN) / MB:>11.1f} "
          f"{peak.get('nvme', 0) / MB:>8.1f}")
resumed = Path(sys.argv[1]) / "resumed.json"
if resumed.exists():
    whole = json.loads((Path(sys.argv[1]) / "train-nvme-split-int8.json").read_text())["losses"]
    again = json.loads(resumed.read_text())
    print(f"resumed at step {again['first_step']}: its {len(again['losses']) - again['first_step']} losses "
          f"{'bitwise equal to' if again['losses'] == whole else 'DIFFER from'} the uninterrupted run's")
PY
  section "done"
} 2>&1 | tee "$OUT/report.txt"
rm -rf "$RUNS"
