"""eval.py on which every process but 0 finds no checkpoint step when it lists them.

    python tests/unlisted_eval.py [eval.py flags...]

As a process whose listing came before the first save of a training run writing the
workdir finished, or a host whose view of a shared filesystem lags. The processes
must read the step process 0 listed, together: each reading its own newest would
stop one with "no complete checkpoint" while the other waits in a collective, or,
with two steps listed differently, assemble the parameters from two checkpoints.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

import jax

from lexjax import checkpoint

if __name__ == "__main__":
    real_all_steps = checkpoint.Checkpointer.all_steps
    checkpoint.Checkpointer.all_steps = lambda self: (
        real_all_steps(self) if jax.process_index() == 0 else []
    )
    eval_py = pathlib.Path(__file__).resolve().parent.parent / "eval.py"
    sys.argv[0] = str(eval_py)
    runpy.run_path(str(eval_py), run_name="__main__")
