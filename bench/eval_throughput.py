"""Evaluation throughput of a trained workdir: tokens/s of the block scan or the dense path.

    /usr/bin/time -v python bench/eval_throughput.py --workdir=runs/tiny --multiple=64 --mode=bca

Random tokens (speed does not depend on them); one warm-up call compiles,
then ``--repeats`` timed calls. Peak memory: the ``Maximum resident set
size`` of ``/usr/bin/time -v`` (the whole process, JAX runtime included).
"""

import os
import sys
import time

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKDIR = flags.DEFINE_string("workdir", os.path.join("runs", "tiny"), "Trained workdir.")
_MULTIPLE = flags.DEFINE_integer("multiple", 2, "Sequence length in units of train_len.")
_MODE = flags.DEFINE_enum("mode", "bca", ["bca", "full"], "Block scan or dense causal.")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences per call.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed calls after the warm-up.")


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)
    import jax
    import numpy as np

    from lexjax import checkpoint, evaluation
    from lexjax.model import Decoder

    config, params, _ = checkpoint.load_params(_WORKDIR.value)
    model = Decoder(config.model)
    length = _MULTIPLE.value * config.train_len
    tokens = np.random.default_rng(0).integers(0, 256, (_BATCH.value, length + 1)).astype(np.int32)
    if _MODE.value == "bca":
        run = lambda: evaluation.block_scan_logprobs(model, params, tokens, config.block)
    else:
        run = lambda: evaluation.full_logprobs(model, params, tokens, chunk=config.block)
    start = time.perf_counter()
    jax.block_until_ready(run())
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(_REPEATS.value):
        jax.block_until_ready(run())
    seconds = (time.perf_counter() - start) / _REPEATS.value
    print(
        f"{_MODE.value} length {length} ({_MULTIPLE.value}× train_len {config.train_len}), "
        f"batch {_BATCH.value}: {_BATCH.value * length / seconds:,.0f} tokens/s "
        f"({seconds:.2f} s per call; first call incl. compile {compile_s:.1f} s)"
    )


if __name__ == "__main__":
    app.run(main)
