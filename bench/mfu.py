"""``mfu``: the train step's achieved FLOP/s against this machine's measured matmul peak.

Peak: a jitted square matmul, float32 and bfloat16 inputs with float32
accumulation (``preferred_element_type``), the best size of a few. Achieved:
tokens/s × :func:`lexjax.metrics.flops_per_token` (6·matmul parameters +
causal attention counted half). Each round measures the peaks and the train
step back to back, so the ratio is taken under the same load.

Also: where the step's time goes (forward, backward, optimizer update, by
timing the three prefixes of the step) and XLA's own FLOP count of the
compiled step next to the analytic one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from lexjax.metrics import flops_per_token
from lexjax.steps import loss_fn

SIZES = (512, 1024, 2048)


def _matmul(n: int, dtype):
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), dtype)
    mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    mm(a, b).block_until_ready()

    def flops_per_sec(reps: int = 3) -> float:
        best = min(common.timed(lambda: mm(a, b).block_until_ready()) for _ in range(reps))
        return 2.0 * n**3 / best

    return flops_per_sec


def peak(dtype, sizes=SIZES):
    """``{n: timer}`` for each size; the peak is the best over sizes."""
    return {n: _matmul(n, dtype) for n in sizes}


def _train_rate(dtype: str, steps: int, model: dict):
    """``(setup, batches, rate)``: ``rate()`` times ``steps`` train steps → tokens/s."""
    config = common.tiny_config(dtype=dtype, **model)
    batches = common.train_batches(config.batch_size, config.train_len, 2)
    setup, timer = common.train_timer(config, batches, steps)
    tokens = steps * config.batch_size * config.train_len
    return setup, batches, (lambda: tokens / timer())


def breakdown(setup, batch, reps: int) -> dict:
    """Seconds of the forward loss, forward+backward (the step's own loss function,
    jitted alone with the step's XLA options) and the library's whole train step
    (median of reps, each timed warm)."""
    params = setup.init_state().params
    model = setup.model
    # Compiled as the step is (its XLA options), or step − forward_backward compares
    # differently compiled programs (it came out negative).
    options = setup.compiler_options
    forward = jax.jit(lambda p, b: loss_fn(p, model, b)[0], compiler_options=options)
    grads = jax.jit(
        lambda p, b: jax.grad(lambda q: loss_fn(q, model, b)[0])(p), compiler_options=options
    )
    b = setup.global_batch(batch)
    fns = {
        "forward": lambda: forward(params, b).block_until_ready(),
        "forward_backward": lambda: jax.block_until_ready(grads(params, b)),
    }
    for fn in fns.values():
        fn()
    state = {"s": setup.init_state()}

    def step():
        with jax.set_mesh(setup.mesh):
            state["s"], m = setup.train_step(state["s"], b)
        jax.block_until_ready(state["s"])

    fns["step"] = step
    step()
    seconds = common.alternate(
        {k: (lambda f=f: common.timed(f)) for k, f in fns.items()}, reps, warm=True
    )
    out = {k: common.Summary.of(v).median for k, v in seconds.items()}
    out["compiler_options"] = dict(options)
    out["backward"] = out["forward_backward"] - out["forward"]
    out["optimizer_update"] = out["step"] - out["forward_backward"]
    with jax.set_mesh(setup.mesh):
        compiled = setup.train_step.lower(setup.init_state(), b).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out["xla_flops_per_step"] = float(cost.get("flops", float("nan")))
    out["xla_bytes_accessed_per_step"] = float(cost.get("bytes accessed", float("nan")))
    return out


def run(args) -> dict:
    rounds, steps = (2, 1) if args.quick else (5, 2)
    sizes = (512, 1024) if args.quick else SIZES
    model = common.QUICK_MODEL if args.quick else {}
    config = common.tiny_config(**model)
    flops = flops_per_token(config)
    peaks = {"float32": peak(jnp.float32, sizes), "bfloat16": peak(jnp.bfloat16, sizes)}
    setups = {}
    sides = {}
    for dtype in ("float32", "bfloat16"):
        setup, batches, timer = _train_rate(dtype, steps, model)
        setups[dtype] = (setup, batches)
        sides[f"train_{dtype}"] = timer
        for n, fn in peaks[dtype].items():
            sides[f"peak_{dtype}_{n}"] = fn
    # alternate() times callables returning seconds; these return rates, which
    # is all the rounds need. Warm: the step's first call after the matmul sides is
    # slow and swings from round to round (docs/benchmarks.md §12), as in the first
    # runs' figures (§4, §13).
    measured = common.alternate(sides, rounds, warm=True)
    out = {}
    for dtype in ("float32", "bfloat16"):
        peak_rounds = [max(measured[f"peak_{dtype}_{n}"][r] for n in sizes) for r in range(rounds)]
        achieved = [t * flops for t in measured[f"train_{dtype}"]]
        out[dtype] = {
            "peak_flops": common.Summary.of(peak_rounds).as_dict(),
            "peak_by_size": {
                str(n): common.Summary.of(measured[f"peak_{dtype}_{n}"]).median for n in sizes
            },
            "tokens_per_sec": common.Summary.of(measured[f"train_{dtype}"]).as_dict(),
            "achieved_flops": common.Summary.of(achieved).as_dict(),
            "mfu": common.ratios(achieved, peak_rounds).as_dict(),
        }
    best = max(("float32", "bfloat16"), key=lambda d: out[d]["tokens_per_sec"]["median"])
    headline = common.Summary(**out[best]["mfu"])
    # The machine's best peak, whichever dtype reached it: what a step would
    # reach if all its matmuls ran at bfloat16 speed.
    best_peak = [
        max(measured[f"peak_{d}_{n}"][r] for d in ("float32", "bfloat16") for n in sizes)
        for r in range(rounds)
    ]
    vs_best = common.ratios([t * flops for t in measured[f"train_{best}"]], best_peak)
    setup, batches = setups["float32"]
    where = breakdown(setup, batches[0], 2 if args.quick else 4)
    where["analytic_flops_per_step"] = flops * config.batch_size * config.train_len
    return common.result(
        100 * headline.median,
        "% of measured matmul peak (same dtype)",
        "≥ 50%",
        headline.median >= 0.5,
        best_dtype=best,
        model_overrides=model,
        mfu_vs_best_peak=vs_best.as_dict(),
        flops_per_token=flops,
        by_dtype=out,
        rounds=rounds,
        steps_per_round=steps,
        warm=True,  # each side timed right after one untimed call of its own
        step_breakdown_seconds=where,
    )


def rows(entry: dict) -> list[tuple[str, str]]:
    out = []
    for dtype in ("float32", "bfloat16"):
        d = entry["by_dtype"][dtype]
        out.append((f"matmul peak {dtype} (GFLOP/s)", common.fmt(d["peak_flops"], ".1f", 1e-9)))
        out.append((f"train step {dtype} (GFLOP/s)", common.fmt(d["achieved_flops"], ".1f", 1e-9)))
        out.append((f"train step {dtype} MFU (%)", common.fmt(d["mfu"], ".1f", 100)))
    out.append(
        (
            f"{entry['best_dtype']} step vs best peak (%)",
            common.fmt(entry["mfu_vs_best_peak"], ".1f", 100),
        )
    )
    w = entry["step_breakdown_seconds"]
    out.append(
        (
            "f32 step: fwd / bwd / update (s)",
            f"{w['forward']:.2f} / {w['backward']:.2f} / {w['optimizer_update']:.2f}",
        )
    )
    out.append(
        (
            "FLOPs/step XLA vs analytic",
            f"{w['xla_flops_per_step'] / 1e9:.0f} G vs {w['analytic_flops_per_step'] / 1e9:.0f} G",
        )
    )
    return out
