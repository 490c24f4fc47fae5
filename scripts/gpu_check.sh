#!/usr/bin/env bash
# The GPU checks, in one run that fits the device budget (< 10 minutes), on a machine with a
# CUDA GPU. Never run this on our CPU machines: it installs a CUDA build of torch.
#
#   bash scripts/gpu_check.sh            # results under $OUT (default: ./gpu-results)
#
# What it does:
#   1. a fresh venv in .venv-gpu (system site packages visible, so a preinstalled CUDA torch is
#      used as it is); torch is installed from the registry only if none with CUDA imports;
#   2. `pytest -m gpu`: CUDA RNG restored exactly, the memory tier from device memory, a 1-rank
#      NCCL group aborted with a collective pending;
#   3. benchmarks/checkpoint.py --device cuda with 4 GiB of state (blocked per snapshot vs DCP
#      async_save with pinned staging, restore to device vs torch.load to device);
#   4. writes everything (logs, junit XML, the benchmark's JSON, nvidia-smi) under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
started=$(date +%s)
step() { printf '\n== %s (%ss)\n' "$*" "$(( $(date +%s) - started ))"; }

step "machine"
nvidia-smi || echo "nvidia-smi not found"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>/dev/null

step "environment"
PY="${PYTHON:-python3}"
[ -x .venv-gpu/bin/python ] || "$PY" -m venv --system-site-packages .venv-gpu
VPY=.venv-gpu/bin/python
if ! $VPY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  $VPY -m pip install -q "${UNBROKEN_TORCH:-torch==2.13.0}" || { echo "could not install a CUDA torch"; exit 1; }
fi
$VPY -m pip install -q -e ".[test]" || { echo "could not install unbroken"; exit 1; }
$VPY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')" | tee "$OUT/torch.txt"

rc=0
step "pytest -m gpu"
timeout 300 $VPY -m pytest -q -m gpu tests/gpu -rs \
  --junitxml="$OUT/pytest-gpu.xml" || rc=1

step "benchmarks/checkpoint.py --device cuda --size-mb 4096"
timeout 300 $VPY benchmarks/checkpoint.py --device cuda --size-mb 4096 --repeats 3 \
  --json "$OUT/checkpoint-cuda.json" || rc=1

step "done (rc $rc)"
exit $rc
