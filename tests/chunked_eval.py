"""eval.py with another number of tokens per compiled generation call.

    python tests/chunked_eval.py CHUNK [eval.py flags...]

``lexjax.generation.CHUNK`` (1024) sets how many tokens one compiled call
samples, and so where a multi-process generation can stop: after a chunk,
when the processes agree. A test of that stop needs two chunks, and 2 × 1024
greedy tokens over two processes' collectives take minutes on CPU; a small
chunk exercises the same code in seconds.
"""

from __future__ import annotations

import pathlib
import runpy
import sys

from lexjax import generation

if __name__ == "__main__":
    generation.CHUNK = int(sys.argv.pop(1))
    eval_py = pathlib.Path(__file__).resolve().parent.parent / "eval.py"
    sys.argv[0] = str(eval_py)
    runpy.run_path(str(eval_py), run_name="__main__")
