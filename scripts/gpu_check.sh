#!/usr/bin/env bash
# The GPU checks, in one run that fits the device budget (< 10 minutes), on a machine with a
# CUDA GPU. Never run this on our CPU machines: it installs a CUDA build of torch.
#
#   bash scripts/gpu_check.sh            # results under $OUT (default: ./gpu-results)
#
# What it does:
#   1. the python3 whose torch sees CUDA, as it is, with this checkout on PYTHONPATH (offline
#      GPU images); else a fresh venv in .venv-gpu (system site packages visible, so a preinstalled CUDA torch is
#      used as it is); torch is installed from the registry only if none with CUDA imports;
#   2. `pytest -m gpu`: CUDA RNG restored exactly, the memory tier from device memory, a 1-rank
#      NCCL group aborted with a collective pending;
#   3. benchmarks/checkpoint.py --device cuda with 4 GiB of state (blocked per snapshot vs DCP
#      async_save with pinned staging, restore to device vs torch.load to device);
#   4. the example on one GPU, fault-free and with rank 0 SIGKILLed: bit-equal final weights;
#   5. writes everything (logs, junit XML, the benchmark's JSON, nvidia-smi) under $OUT.
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
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # A CUDA torch is already there (an offline GPU image): use it as it is, with this checkout on the
  # path; every other dependency must already be importable (checked next).
  VPY="$PY"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  [ -x .venv-gpu/bin/python ] || "$PY" -m venv --system-site-packages .venv-gpu
  VPY=.venv-gpu/bin/python
  $VPY -m pip install -q "${UNBROKEN_TORCH:-torch==2.13.0}" || { echo "could not install a CUDA torch"; exit 1; }
  $VPY -m pip install -q -e ".[test]" || { echo "could not install unbroken"; exit 1; }
fi
$VPY -c "import unbroken, msgpack, safetensors, psutil, fsspec, xxhash, prometheus_client, pytest" \
  || { echo "a dependency is missing (see pyproject.toml)"; exit 1; }
$VPY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')" | tee "$OUT/torch.txt"

rc=0
step "pytest -m gpu"
timeout 180 $VPY -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs \
  --junitxml="$OUT/pytest-gpu.xml" || rc=1

step "the example on one GPU (NCCL group, device tensors): fault-free, then rank 0 SIGKILLed at step 12"
# One rank: NCCL refuses two ranks on one device. The kill makes a job restart that restores
# the device state from the memory tier; the final weights must equal the fault-free run's.
W=$(mktemp -d)  # run dirs and weights stay here: $OUT takes few files
E2E=(examples/train_gpt.py --steps 30 --optimizer plain --num-replicas 1 --dropout 0.1 --log-every 10)
timeout 240 $VPY -m unbroken.cli.main run --nproc-per-node 1 --run-dir "$W/ref" \
  "${E2E[@]}" --out "$W/ref.safetensors" || rc=1
timeout 240 $VPY -m unbroken.cli.main run --nproc-per-node 1 --save "$W/ckpt" --run-dir "$W/kill" \
  --inject kill:rank=0:step=12 "${E2E[@]}" --out "$W/kill.safetensors" || rc=1
cp "$W/kill/events.jsonl" "$OUT/e2e-kill-events.jsonl"
grep -h '"recovered"\|"restored"' "$W/kill/events.jsonl" || rc=1
$VPY - "$W/ref.safetensors" "$W/kill.safetensors" <<'PYEOF' || rc=1
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print("e2e bit_equal", same, "tensors", len(a))
sys.exit(0 if same else 1)
PYEOF
rm -rf "$W"

step "benchmarks/checkpoint.py --device cuda --size-mb 4096"
timeout 240 $VPY benchmarks/checkpoint.py --device cuda --size-mb 4096 --repeats 3 \
  --json "$OUT/checkpoint-cuda.json" || rc=1

step "done (rc $rc)"
exit $rc
