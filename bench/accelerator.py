"""``accelerator``: the paper-size model on a GPU or TPU, in under five minutes, one JSON line.

    bash bench/accelerator.sh [--per_device_batch 16] [--steps 30] [--json OUT]
    python bench/accelerator.py --small      # tiny shapes: checks the script on a CPU

Trains configs/paper.py's model (24 layers, d_model 1024, 16 heads, MLP 4096,
bfloat16 compute, remat + scanned layers, train_len 1024) on synthetic batches
for a few dozen steps over every local device, and reports tokens/s/device and
MFU against the chip's datasheet bf16 peak (:data:`lexjax.metrics.PEAK_FLOPS`;
989 TFLOP/s for H100/H200; none on a CPU) and against a measured bf16 matmul. Then the
block-scan evaluation (:func:`lexjax.evaluation.block_scan_logprobs`) at 16k
and 64k tokens. Progress goes to stderr; the last stdout line is the JSON
``{"accelerator": {"value", "unit", "target", "met", ...}}``.

Needs only jax, flax, optax (no ml_collections, grain, TFDS): the config
comes from configs/paper.py when ml_collections imports, else from the
literal ``bench.common.PAPER`` that mirrors it. Parts that would overrun the
time budget are skipped and say so.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from bench import common

SMALL_MODEL = dict(num_layers=2, d_model=128, num_heads=2, mlp_dim=256, max_len=128)


def log(message: str) -> None:
    print(f"[accelerator {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def paper_dict() -> tuple[dict, str]:
    try:
        import ml_collections  # noqa: F401
    except ImportError:
        return common.PAPER, "bench.common.PAPER (ml_collections not installed)"
    return common.config_dict("paper"), "configs/paper.py"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--per_device_batch",
        type=int,
        default=16,
        help="sequences per device per step (16 fits an H200 with remat)",
    )
    p.add_argument("--steps", type=int, default=30, help="timed train steps")
    p.add_argument("--eval_lengths", default="16384,65536", help="block-scan lengths (tokens)")
    p.add_argument("--eval_batch", type=int, default=4, help="sequences per block-scan call")
    p.add_argument(
        "--budget",
        type=float,
        default=270.0,
        help="seconds; later parts are skipped once this would be exceeded",
    )
    p.add_argument(
        "--remat",
        choices=("config", "on", "off"),
        default="config",
        help="override the config's per-layer rematerialisation",
    )
    p.add_argument(
        "--attention_impl",
        choices=("config", "explicit", "fused"),
        default="config",
        help="override model.attention_impl",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="tiny shapes (2 layers, d_model 128, train_len 128): a CPU check",
    )
    p.add_argument("--json", help="also write the JSON here")
    return p.parse_args(argv)


def matmul_peak(n: int) -> float:
    """Measured bf16 × bf16 → f32 matmul FLOP/s on one device (best of 5)."""
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    mm(a).block_until_ready()
    best = min(common.timed(lambda: mm(a).block_until_ready()) for _ in range(5))
    return 2.0 * n**3 / best


def train(config, steps: int) -> dict:
    """Times ``steps`` of the library's jitted train step over every local device."""
    from lexjax import metrics
    from lexjax.steps import TrainSetup

    setup = TrainSetup(config)
    n_dev = jax.device_count()
    rng = np.random.default_rng(0)
    local = config.batch_size // jax.process_count()
    batches = []
    for _ in range(2):
        rows = rng.integers(0, 258, (local, config.train_len + 1), dtype=np.int32)
        batches.append(
            setup.global_batch(
                {
                    "inputs": rows[:, :-1],
                    "targets": rows[:, 1:],
                    "segment_ids": np.ones((local, config.train_len), np.int32),
                    "positions": np.broadcast_to(
                        np.arange(config.train_len, dtype=np.int32), (local, config.train_len)
                    ).copy(),
                }
            )
        )
    t0 = time.perf_counter()
    state = setup.init_state()
    with jax.set_mesh(setup.mesh):
        state, step_metrics = setup.train_step(state, batches[0])
        jax.block_until_ready(step_metrics)
        compile_s = time.perf_counter() - t0
        log(
            f"compiled and ran the first step in {compile_s:.1f} s "
            f"({setup.num_params / 1e6:.0f} M parameters, {n_dev} devices)"
        )
        for i in range(2):  # warm
            state, step_metrics = setup.train_step(state, batches[i % 2])
        jax.block_until_ready(state)
        start = time.perf_counter()
        for i in range(steps):
            state, step_metrics = setup.train_step(state, batches[i % 2])
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
    tokens_per_sec_per_device = steps * config.batch_size * config.train_len / seconds / n_dev
    kind = jax.devices()[0].device_kind
    peak = metrics.peak_flops(kind)
    flops = metrics.flops_per_token(config)
    return {
        "tokens_per_sec_per_device": tokens_per_sec_per_device,
        "step_seconds": seconds / steps,
        "steps": steps,
        "compile_seconds": compile_s,
        "mfu": None if peak is None else tokens_per_sec_per_device * flops / peak,
        "peak_flops": peak,
        "peak_source": f"{kind} datasheet bf16 dense" if peak else f"{kind}: no datasheet peak",
        "flops_per_token": flops,
        "num_params": setup.num_params,
        "final_loss": float(step_metrics["loss"]),
        "params": state.params,
    }


def evaluate(config, params, lengths: list[int], batch: int, deadline: float) -> dict:
    from lexjax import evaluation
    from lexjax.model import Decoder

    model = Decoder(config.model)
    out = {}
    previous = None
    for length in lengths:
        if previous and time.perf_counter() + previous * length / 1e3 > deadline:
            out[str(length)] = {"skipped": "time budget"}
            continue
        tokens = jnp.asarray(
            np.random.default_rng(1).integers(0, 258, (batch, length + 1), dtype=np.int32)
        )
        evaluation.block_scan_logprobs(model, params, tokens, config.block).block_until_ready()
        seconds = min(
            common.timed(
                lambda t=tokens: evaluation.block_scan_logprobs(
                    model, params, t, config.block
                ).block_until_ready()
            )
            for _ in range(2)
        )
        out[str(length)] = {
            "tokens_per_sec": batch * length / seconds,
            "seconds": seconds,
            "batch": batch,
        }
        previous = seconds / length * 1e3  # seconds per 1k tokens, to predict the next
        log(f"block scan {length} tokens × {batch}: {batch * length / seconds:,.0f} tokens/s")
    return out


def main(argv=None) -> int:
    args = parse(argv)
    start = time.perf_counter()
    deadline = start + args.budget
    base, source = paper_dict()
    model = dict(SMALL_MODEL) if args.small else {}
    if args.remat != "config":
        model["remat"] = args.remat == "on"
    if args.attention_impl != "config":
        model["attention_impl"] = args.attention_impl
    top = {"train_len": 128} if args.small else {}
    steps = 3 if args.small else args.steps
    lengths = [1024, 4096] if args.small else [int(n) for n in args.eval_lengths.split(",")]
    per_device = 2 if args.small else args.per_device_batch
    config = common.make_config(
        base, model=model, batch_size=per_device * jax.device_count(), **top
    )
    device = jax.devices()[0]
    log(
        f"{jax.device_count()} × {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}; config from {source}"
    )
    measured_peak = matmul_peak(1024 if args.small else 8192)
    trained = train(config, steps)
    params = trained.pop("params")
    mfu_percent = None if trained["mfu"] is None else 100 * trained["mfu"]
    log(
        f"train: {trained['tokens_per_sec_per_device']:,.0f} tokens/s/device, "
        + ("no MFU" if mfu_percent is None else f"MFU {mfu_percent:.1f}%")
        + f" ({trained['peak_source']})"
    )
    evals = evaluate(config, params, lengths, 1 if args.small else args.eval_batch, deadline)
    m = config.model
    entry = common.result(
        trained["tokens_per_sec_per_device"],
        "tokens/s/device (train)",
        "report (MFU vs datasheet bf16 peak)",
        None,
        mfu_percent=mfu_percent,
        mfu_vs_measured_matmul_percent=100
        * trained["tokens_per_sec_per_device"]
        * trained["flops_per_token"]
        / measured_peak,
        measured_bf16_matmul_flops=measured_peak,
        train=trained,
        eval_block_scan=evals,
        device=device.device_kind,
        device_count=jax.device_count(),
        backend=jax.default_backend(),
        jax=jax.__version__,
        config_source=source,
        small=args.small,
        per_device_batch=per_device,
        train_len=config.train_len,
        model=dict(
            layers=m.num_layers,
            d_model=m.d_model,
            heads=m.num_heads,
            mlp=m.mlp_dim,
            dtype=m.dtype,
            remat=m.remat,
            scan_layers=m.scan_layers,
            attention_impl=m.attention_impl,
        ),
        wall_seconds=time.perf_counter() - start,
    )
    line = json.dumps({"accelerator": entry})
    if args.json:
        pathlib.Path(args.json).write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
