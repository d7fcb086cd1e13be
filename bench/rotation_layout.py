"""The rotation alone, in each pair layout: why the model's queries and keys come split in halves.

    python bench/rotation_layout.py --json docs/benchmarks_2026-12-06_rotation_layout.json

``positions.apply_rotary`` on XPOS tables at the tiny config's attention shapes
(batch 4, 4 heads, head_dim 64; 128, 256 and 1,024 tokens: a block step's
queries, its keys, a training row), with the pairs interleaved (the paper's
layout, ``halves=False``) or split into halves (``positions.to_halves``, the
layout the model's projections emit), against a plain elementwise scale of the
same array as the floor. Each round times every variant once (100 calls each)
in rotating order; the JSON keeps every round's microseconds per call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common

LENGTHS = (128, 256, 1024)
CALLS = 100


def _timer(fn, *args):
    """A callable returning the microseconds per call of ``fn(*args)`` over CALLS calls."""

    def run():
        start = time.perf_counter()
        for _ in range(CALLS):
            y = fn(*args)
        y.block_until_ready()
        return (time.perf_counter() - start) / CALLS * 1e6

    run()  # compiles
    return run


def measure(rounds: int) -> dict:
    import jax
    import jax.numpy as jnp

    from lexjax import positions

    B, H, K = 4, 4, 64
    out = {}
    for T in LENGTHS:
        x = jax.random.normal(jax.random.key(0), (B, T, H, K))
        cos, sin = positions.xpos_tables(jnp.arange(T), K)
        variants = {
            "interleaved": jax.jit(lambda x, c, s: positions.apply_rotary(x, c, s)),
            "halves": jax.jit(lambda x, c, s: positions.apply_rotary(x, c, s, halves=True)),
            "scale_only": jax.jit(lambda x, c, s: x * 1.0001),
        }

        timers = {k: _timer(f, x, cos, sin) for k, f in variants.items()}
        micros = common.alternate(timers, rounds, warm=True)
        out[f"tokens_{T}"] = {
            "us_per_call": {k: common.Summary.of(v).as_dict() for k, v in micros.items()},
            "interleaved_over_halves": common.ratios(
                micros["interleaved"], micros["halves"]
            ).as_dict(),
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: give 1 or more")
    provenance = common.Provenance()
    result = {"machine": common.machine(), "rounds": args.rounds, "calls_per_round": CALLS}
    result.update(measure(args.rounds))
    result.update(provenance.record())
    for T in LENGTHS:
        row = result[f"tokens_{T}"]
        medians = {k: v["median"] for k, v in row["us_per_call"].items()}
        ratio = row["interleaved_over_halves"]["median"]
        print(
            f"{T:5d} tokens: interleaved {medians['interleaved']:.1f} µs, halves "
            f"{medians['halves']:.1f} µs, scale only {medians['scale_only']:.1f} µs "
            f"(interleaved / halves {ratio:.2f}×)"
        )
    if args.json:
        from lexjax import reports

        reports.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
