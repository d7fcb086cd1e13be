"""train.py with one step's loss and gradients made NaN: the fault-injection hook of the tests.

    python tests/poisoned_train.py STEP [train.py flags...]

Steps count from 1, as in metrics.jsonl and the error messages. The library
has no fault-injection setting; this script wraps :func:`lexjax.steps.train_step`
before ``TrainSetup`` jits it, so the non-finite value enters where a real one
would (the loss, hence every gradient) and the library's own handling of it is
what the tests see.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

import jax.numpy as jnp

from lexjax import steps


def poison(step: int) -> None:
    """Makes the loss of ``step`` NaN (so every gradient too) in every later ``TrainSetup``."""
    real_step, real_loss = steps.train_step, steps.loss_fn

    def poisoned_step(state, batch, **kwargs):
        scale = jnp.where(state.step + 1 == step, jnp.nan, 1.0)

        def poisoned_loss(params, model, batch):
            loss, weight = real_loss(params, model, batch)
            return loss * scale, weight

        # The swap lasts for the trace only: jit calls this once per compilation.
        steps.loss_fn = poisoned_loss
        try:
            return real_step(state, batch, **kwargs)
        finally:
            steps.loss_fn = real_loss

    steps.train_step = poisoned_step


if __name__ == "__main__":
    poison(int(sys.argv.pop(1)))
    train_py = pathlib.Path(__file__).resolve().parent.parent / "train.py"
    sys.argv[0] = str(train_py)
    runpy.run_path(str(train_py), run_name="__main__")
