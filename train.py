"""Trains a LEX language model.

    python train.py                                   # configs/tiny.py on the stdlib corpus
    python train.py --config=configs/tiny.py --workdir=runs/tiny --config.model.position=rope
    python train.py --config=configs/paper.py --workdir=DIR   # accelerators

A workdir with checkpoints is resumed from its latest good one. SIGTERM or
Ctrl-C finishes the current step, saves and exits 0.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(_HERE, "configs", "tiny.py"), "Config file (get_config()).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", os.path.join("runs", "tiny"),
                               "Directory for checkpoints, metrics.jsonl and TensorBoard logs.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from lexjax import cli
    return cli.run_training(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    sys.path.insert(0, _HERE)  # so configs/*.py can import each other
    app.run(main)
