#!/usr/bin/env bash
# The paper-size model on this host's GPU/TPU: a few dozen train steps and the
# block-scan eval at 16k and 64k tokens; under 5 minutes; one JSON line on stdout.
#
#   bash bench/accelerator.sh                 # defaults: 16 sequences/device, 30 steps
#   bash bench/accelerator.sh --per_device_batch 32 --json /tmp/accelerator.json
#   PYTHON=.venv/bin/python bash bench/accelerator.sh --small   # CPU check, tiny shapes
#
# Needs jax (with the accelerator's plugin), flax and optax; see bench/accelerator.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 295 "${PYTHON:-python3}" bench/accelerator.py "$@"
