"""Trains a LEX language model.

    python train.py                                   # configs/tiny.py on the stdlib corpus
    python train.py --config=configs/tiny.py --workdir=runs/tiny --config.model.position=rope
    python train.py --config=configs/paper.py --workdir=DIR   # accelerators

The run's settings: --config=FILE[:PRESET] (default configs/tiny.py) and
--config.FIELD=VALUE for any field of the dataclasses in lexjax/config.py,
which give each default and what it means (--helpfull lists every flag).
A workdir with checkpoints is resumed from its latest good one. SIGTERM or
Ctrl-C finishes the current step, saves and exits 0 (before the first step it
exits 0 at once: nothing to save).

Multi-process (one process per host; README "Multi-host training"): on a
Cloud TPU VM, under SLURM ``srun``, ``mpirun`` or a Kubernetes Indexed Job
the processes find each other by themselves; elsewhere start each with

    python train.py --coordinator_address=HOST0:PORT --num_processes=N --process_id=I ...
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    from lexjax import errors, hugepages, signals

    errors.closed_std_streams_to_devnull()  # before anything opens a file
    hugepages.reexec_with_hugepages()  # before JAX loads; see lexjax/hugepages.py
    signals.defer()  # a stop while JAX loads ends the run at its start (exit 0)

from absl import app, flags, logging

from lexjax import cli, distributed, lease
from lexjax.config import flags_parser

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKDIR = flags.DEFINE_string(
    "workdir",
    os.path.join("runs", "tiny"),
    "Directory for checkpoints, metrics.jsonl and TensorBoard logs.",
)
_CLUSTER = distributed.define_flags()  # --coordinator_address, --num_processes, ...
_LEASE_TIMEOUT = flags.DEFINE_float(
    "lease_timeout_s",
    lease.DEFAULT_TIMEOUT_S,
    "The workdir lease's heartbeat timeout: another job takes over this job's lease once "
    "it has sent no heartbeat for this long (a dead pid on the same host is noticed at once).",
    lower_bound=1.0,
    upper_bound=lease.MAX_TIMEOUT_S,  # inf ended the heartbeat thread at once
)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    return cli.run_training(
        flags.FLAGS.config, _WORKDIR.value, _CLUSTER(), lease_timeout_s=_LEASE_TIMEOUT.value
    )


def run(argv: list[str] | None = None) -> int:
    """The program on ``argv`` (default ``sys.argv``); raises SystemExit like ``app.run``."""
    # Flag parsing runs inside cli.main too: a bad flag or --config is one line, exit status 2.
    parse = flags_parser(os.path.join(_HERE, "configs", "tiny.py"))
    return cli.main(app.run, main, argv=argv, flags_parser=parse)


if __name__ == "__main__":
    sys.path.insert(0, _HERE)  # so configs/*.py can import each other
    sys.exit(run())
