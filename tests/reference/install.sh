#!/usr/bin/env bash
# Installs the reference implementation (microsoft/torchscale) for the live
# tests (`python -m pytest -q -m reference tests`) and for make_golden.py.
#
#   bash tests/reference/install.sh .venv/bin/python
#
# into the environment of the given Python. That is all make_golden.py needs; the
# tests also need lexjax's requirements and pytest there. Keep it out of the
# main development environment if you want that one torch-free.
#
# torch is pinned to a CPU build: a plain `pip install torch` pulls a
# multi-gigabyte CUDA build. torchscale is installed without its dependencies
# because its declared ones (timm, fairscale, ...) serve modules the tests never
# import: they use only torchscale.component.xpos_relative_position,
# torchscale.component.multihead_attention and torchscale.architecture.config,
# which need torch and numpy alone (apex is optional there).
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: bash $0 PATH/TO/python" >&2
  exit 2
fi
PY=$1

"$PY" -m pip install -q "torch==2.13.0" "numpy>=2.0"
"$PY" -m pip install -q --no-deps "torchscale==0.3.0"
"$PY" -c '
import torch
from torchscale.component.multihead_attention import MultiheadAttention
from torchscale.component.xpos_relative_position import XPOS
print("reference ready: torch", torch.__version__, "with torchscale XPOS and MultiheadAttention")
'
