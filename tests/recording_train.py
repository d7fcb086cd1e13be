"""train.py that records the batches its steps consume: the elastic-resume tests' hook.

    python tests/recording_train.py PREFIX [train.py flags...]

Every process appends one JSON line per training step to ``PREFIX.p<process>.jsonl``:
the rows of the batch it fed that step (``inputs``, ``targets``, ``segment_ids``,
``positions``). The library has no such setting; this script wraps the training
loop's ``_next_batch`` (which reads the data iterator after the checkpoint restored its
position, and replaces it if its workers ended), so what is recorded is exactly what
the steps were given.

With ``LATE_LISTING_S=<seconds>`` in the environment, every process but 0 waits that
long before the checkpointer lists the steps it may delete, as a loaded host's would:
process 0 has deleted by then whatever its own listing doomed.
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import sys
import time

import jax

from lexjax import checkpoint, training


def record(prefix: str) -> None:
    """Makes every later training loop record its batches under ``prefix``."""
    real_next_batch = training._Loop._next_batch

    def next_batch(self, *args, **kwargs):
        batch = real_next_batch(self, *args, **kwargs)
        with open(f"{prefix}.p{jax.process_index()}.jsonl", "a") as f:
            f.write(json.dumps({k: v.tolist() for k, v in batch.items()}) + "\n")
        return batch

    training._Loop._next_batch = next_batch


def list_late(seconds: float) -> None:
    """Makes every process but 0 list checkpoint steps ``seconds`` late, at garbage collection."""
    real_collect = checkpoint.Checkpointer._collect_garbage

    def collect(self):
        if jax.process_index() != 0:
            time.sleep(seconds)
        return real_collect(self)

    checkpoint.Checkpointer._collect_garbage = collect


if __name__ == "__main__":
    record(sys.argv.pop(1))
    if os.environ.get("LATE_LISTING_S"):
        list_late(float(os.environ["LATE_LISTING_S"]))
    train_py = pathlib.Path(__file__).resolve().parent.parent / "train.py"
    sys.argv[0] = str(train_py)
    runpy.run_path(str(train_py), run_name="__main__")
