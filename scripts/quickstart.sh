#!/usr/bin/env bash
# Sets up a virtual environment (once) and runs the demo or the tests.
#   bash scripts/quickstart.sh demo     # 4-rank training run that survives injected faults
#   bash scripts/quickstart.sh test     # the test suite (what CI runs)
# Torch: UNBROKEN_TORCH names the torch requirement to install (default torch==2.13.0, the CPU
# build). GPU users: create .venv with their own CUDA torch first; an importable torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-}"
case "$what" in demo|test) ;; *) echo "usage: bash scripts/quickstart.sh demo|test" >&2; exit 2 ;; esac
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q "${UNBROKEN_TORCH:-torch==2.13.0}"
fi
.venv/bin/pip install -q -e ".[test,plot]"
# The controller-failover tests run a real etcd (Debian's etcd-server): install it once, quietly,
# for the test command only (the demo needs nothing new); without it those tests are skipped.
if [ "$what" = test ] && ! command -v etcd >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; }; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -qq etcd-server >/dev/null 2>&1 \
      || { $SUDO apt-get update -qq >/dev/null 2>&1 && $SUDO apt-get install -y -qq etcd-server >/dev/null 2>&1; } \
      || echo "note: could not install etcd-server; the etcd tests will be skipped" >&2
  else
    echo "note: etcd is not on PATH (apt-get install etcd-server); the etcd tests will be skipped" >&2
  fi
fi
status=0
if [ "$what" = demo ]; then
  .venv/bin/unbroken demo "${@:2}" || status=$?
else
  .venv/bin/python -m pytest -q "${@:2}" || status=$?
fi
# `unbroken` is installed in .venv, not on PATH: say how to call it next (after the demo only:
# the test run ends on pytest's own summary line, which CI reads).
if [ "$what" = demo ]; then
  echo
  echo "unbroken is installed in .venv: run 'source .venv/bin/activate' to get 'unbroken run ...' on your PATH"
  echo "(or call .venv/bin/unbroken directly), then e.g.: unbroken run --nproc-per-node 4 examples/train_gpt.py"
fi
exit "$status"
