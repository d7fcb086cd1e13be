"""train.py that records the batches its steps consume: the elastic-resume tests' hook.

    python tests/recording_train.py PREFIX [train.py flags...]

Every process appends one JSON line per training step to ``PREFIX.p<process>.jsonl``:
the rows of the batch it fed that step (``inputs``, ``targets``, ``segment_ids``,
``positions``). The library has no such setting; this script wraps the data iterator
the training loop reads from (after the checkpoint restored its position), so what is
recorded is exactly what the steps were given.
"""

from __future__ import annotations

import json
import pathlib
import runpy
import sys

import jax

from lexjax import training


class _Recorder:
    """Forwards an iterator (and its checkpoint state), writing each batch to ``path``."""

    def __init__(self, iterator, path: str):
        self._iterator, self._path = iterator, path

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._iterator)
        with open(self._path, "a") as f:
            f.write(json.dumps({k: v.tolist() for k, v in batch.items()}) + "\n")
        return batch

    def get_state(self):
        return self._iterator.get_state()

    def set_state(self, state):
        self._iterator.set_state(state)


def record(prefix: str) -> None:
    """Makes every later training loop record its batches under ``prefix``."""
    real_init = training._Loop.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        path = f"{prefix}.p{jax.process_index()}.jsonl"
        self.data_iter = _Recorder(self.data_iter, path)

    training._Loop.__init__ = init


if __name__ == "__main__":
    record(sys.argv.pop(1))
    train_py = pathlib.Path(__file__).resolve().parent.parent / "train.py"
    sys.argv[0] = str(train_py)
    runpy.run_path(str(train_py), run_name="__main__")
