"""``remat``: the memory and speed of each ``model.remat_policy`` in the train step.

The tiny config's train step (one device), layers scanned as configs/paper.py
does, with ``remat_policy`` = none, full, dots_except_mlp; everything else
equal. (With unrolled layers XLA's CPU scheduler keeps every recomputed
activation alive at once, so remat then saves no memory on a CPU.) Memory is
XLA's own account of the compiled step (``memory_analysis()``: temporaries,
i.e. activations kept for the backward and workspace), exact and
load-independent; time alternates the policies round by round, each timed call
right after an untimed one of the same policy (steady state, as in a training
loop; docs/benchmarks.md §12). The headline
is the slowdown of ``full`` over ``none``; the other figures are the
trade-off table of docs/benchmarks.md.
"""

from __future__ import annotations

import jax

from bench import common

POLICIES = ("none", "full", "dots_except_mlp")


def _temp_bytes(setup, batch) -> int:
    lowered = setup.train_step.lower(setup.abstract_state, setup.global_batch(batch))
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def run(args) -> dict:
    rounds, steps = (2, 1) if args.quick else (9, 2)
    model = common.QUICK_MODEL if args.quick else {}
    config = common.tiny_config(scan_layers=True, **model)
    batches = common.train_batches(config.batch_size, config.train_len, 2)
    timers, memory = {}, {}
    for policy in POLICIES:
        setup, timers[policy] = common.train_timer(
            common.tiny_config(scan_layers=True, remat_policy=policy, **model), batches, steps
        )
        with jax.set_mesh(setup.mesh):
            memory[policy] = _temp_bytes(setup, batches[0])
    seconds = common.alternate(timers, rounds, warm=True)
    tokens = steps * config.batch_size * config.train_len
    slowdown = {
        p: common.Summary.of([a / b - 1 for a, b in zip(seconds[p], seconds["none"])]).as_dict()
        for p in POLICIES
        if p != "none"
    }
    return common.result(
        100 * slowdown["full"]["median"],
        "% slower than remat_policy=none (train step, full)",
        "report",
        None,
        temp_mib={p: memory[p] / 2**20 for p in POLICIES},
        tokens_per_sec={
            p: common.Summary.of([tokens / s for s in v]).as_dict() for p, v in seconds.items()
        },
        slowdown_vs_none=slowdown,
        rounds=rounds,
        steps_per_round=steps,
        model_overrides=model,
    )


def rows(entry: dict) -> list[tuple[str, str]]:
    out = []
    for p in POLICIES:
        extra = (
            "" if p == "none" else f"   {common.fmt(entry['slowdown_vs_none'][p], '+.1f', 100)} %"
        )
        out.append(
            (
                f"{p}: XLA temp {entry['temp_mib'][p]:.1f} MiB, tokens/s",
                common.fmt(entry["tokens_per_sec"][p], ".0f") + extra,
            )
        )
    return out
