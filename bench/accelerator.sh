#!/usr/bin/env bash
# The paper-size model on this host's GPU/TPU: every attention implementation ×
# remat policy, XPOS overhead, block scan at 16k/64k/256k tokens; under 10
# minutes; JSON lines on stdout and in docs/accelerator/<device>-<date>.jsonl.
#
#   bash bench/accelerator.sh       # 16 sequences/device, 10 steps per configuration
#   bash bench/accelerator.sh --per_device_batch 32 --out /tmp/accel
#   PYTHON=.venv/bin/python bash bench/accelerator.sh --small   # CPU check, tiny shapes
#
# Needs jax (with the accelerator's plugin), flax and optax; see bench/accelerator.py.
set -euo pipefail
cd "$(dirname "$0")/.."
# One call of a lent device may run 600 s: the run gets 570 (accelerator.py refuses a
# --budget it cannot finish within that).
export ACCELERATOR_TIMEOUT_S="${ACCELERATOR_TIMEOUT_S:-570}"
exec timeout "$ACCELERATOR_TIMEOUT_S" "${PYTHON:-python3}" bench/accelerator.py "$@"
