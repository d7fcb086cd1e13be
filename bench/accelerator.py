"""``accelerator``: the paper-size model on a GPU or TPU, every option in one run, JSON lines.

    bash bench/accelerator.sh [--per_device_batch 16] [--steps 10] [--out DIR]
    python bench/accelerator.py --small      # tiny shapes: checks the script on a CPU

Trains configs/paper.py's model (24 layers, d_model 1024, 16 heads, MLP 4096,
bfloat16 compute, scanned layers, train_len 1024, its 32768-id vocabulary) on
synthetic batches over every local device, for each attention implementation
(explicit, fused = cuDNN on NVIDIA GPUs; splash on TPUs) and each
``model.remat_policy`` (none, full, dots_except_mlp): tokens/s/device, MFU
against the chip's datasheet bf16 peak (:data:`lexjax.metrics.PEAK_FLOPS`)
and against a measured bf16 matmul, and the memory each configuration's
compiled step needs per device (XLA's ``memory_analysis()``). Then XPOS's
overhead (the first configuration again with ``position=none``) and the block-scan evaluation
(:func:`lexjax.blockwise.compiled_scan`) at 16k, 64k and 256k tokens.

One JSON object per measurement, on stdout and in
``OUT/<device>-<date>.jsonl`` (default docs/accelerator/); progress on
stderr. The most informative measurements run first; once ``--budget``
seconds would be exceeded the rest are recorded as skipped, and a
configuration that fails (out of memory) is recorded with its error.

Needs only jax, flax, optax (no ml_collections, grain, TFDS): the config
comes from configs/paper.py when ml_collections imports, else from the
literal ``bench.common.PAPER`` that mirrors it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from bench import common

# Alternating rounds of the XPOS and position=none steps (each round: 2 × steps steps a side).
XPOS_ROUNDS = 5
# A configuration's timed steps run in this many rounds: its figures are the median round's.
TRAIN_ROUNDS = 5
# What bench/accelerator.sh gives the run (its `timeout`), in seconds.
SHELL_TIMEOUT = "ACCELERATOR_TIMEOUT_S"
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
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--per_device_batch",
        type=int,
        default=16,
        help="sequences per device per step (16 fits an H200 with remat)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed train steps per configuration")
    p.add_argument(
        "--eval_lengths", default="16384,65536,262144", help="block-scan lengths (tokens)"
    )
    p.add_argument("--eval_batch", type=int, default=4, help="sequences per block-scan call")
    p.add_argument(
        "--budget",
        type=float,
        default=500.0,
        help="seconds; later parts are skipped once this would be exceeded",
    )
    p.add_argument("--remat_policies", default="full,dots_except_mlp,none")
    p.add_argument(
        "--attention_impls",
        default=None,
        help="default: fused,explicit (splash,fused,explicit on TPUs)",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="tiny shapes (2 layers, d_model 128, train_len 128): a CPU check",
    )
    p.add_argument(
        "--out",
        default=str(common.ROOT / "docs" / "accelerator"),
        help="directory of the JSON-lines file ('' for none)",
    )
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p, args) -> None:
    """Refuses a bad flag before anything is measured: on a leased accelerator a typo
    found after the first configuration costs its start-up and compile time."""
    from lexjax.config import ATTENTION_IMPLS, REMAT_POLICIES

    for flag, value, choices in (
        ("--remat_policies", args.remat_policies, REMAT_POLICIES),
        ("--attention_impls", args.attention_impls, ATTENTION_IMPLS),
    ):
        if value is None:
            continue
        names = value.split(",")
        bad = [n for n in names if n not in choices]
        if bad:
            p.error(f"{flag}={value}: {bad[0]!r} is not one of {', '.join(choices)}")
    p.check_counts(args, "per_device_batch", "steps", "eval_batch")
    if not args.budget > 0:
        p.error(f"--budget={args.budget}: give a positive number of seconds")
    try:
        limit = float(os.environ.get(SHELL_TIMEOUT) or "inf")
    except ValueError:
        p.error(f"{SHELL_TIMEOUT}={os.environ[SHELL_TIMEOUT]!r}: give a number of seconds")
    if args.budget > limit - 60:  # the last measurement may start just before the budget
        p.error(
            f"--budget={args.budget:g}: accelerator.sh stops the run after {limit:g} s; give "
            f"at most {limit - 60:g}, or raise {SHELL_TIMEOUT}"
        )
    try:
        args.lengths = [int(n) for n in args.eval_lengths.split(",")]
    except ValueError:
        args.lengths = []
    if not args.lengths or min(args.lengths) < 1:
        p.error(
            f"--eval_lengths={args.eval_lengths}: give comma-separated token counts of at least 1"
        )
    if jax.default_backend() == "cpu" and not args.small:  # a GPU host whose jax lacks its plugin
        p.error(
            "jax found no accelerator (backend cpu); install jax with this host's GPU or TPU "
            "plugin, or pass --small to check the script on a CPU"
        )


def matmul_peak(n: int) -> float:
    """Measured bf16 × bf16 → f32 matmul FLOP/s on one device (best of 5), on random
    operands: a GPU multiplies constant ones or zeros faster than the varied values a
    train step sees (fewer bits toggle, less power drawn, less clock throttling), which
    put the measured peak above what any step can reach and ``mfu_vs_measured_matmul``
    below its true value."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    mm(a).block_until_ready()
    best = min(common.timed(lambda: mm(a).block_until_ready()) for _ in range(5))
    return 2.0 * n**3 / best


def _process_peak_memory_gib() -> float | None:
    """The allocator's high-water mark since this process started (None where the
    device reports none, as on CPUs): the maximum over every configuration measured
    so far, not one configuration's own figure; JAX cannot reset it."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def compiled_memory(compiled) -> dict:
    """XLA's own account of one compiled train step, bytes per device: its temporaries,
    arguments, outputs and the outputs that reuse a donated argument's buffer (the
    state), whose sum ``total`` (temp + argument + output − alias) is what the step
    needs on the device, whatever ran before it in this process."""
    m = compiled.memory_analysis()
    out = {
        k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
        for k in ("temp", "argument", "output", "alias", "generated_code")
    }
    out["total"] = out["temp"] + out["argument"] + out["output"] - out["alias"]
    return out


def describe(config) -> dict:
    """What a measurement's figures depend on, for its JSON line: the vocabulary above all
    (the output layer's share of the step; docs/accelerator's earlier rows were at 320 ids)."""
    m = config.model
    return dict(
        attention_impl=m.attention_impl,
        remat_policy=m.remat_policy,
        position=m.position,
        vocab_size=m.vocab_size,
        train_len=config.train_len,
        layers=m.num_layers,
        d_model=m.d_model,
        dtype=m.dtype,
    )


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
        # The executable the step just compiled (cached: lowering again does not compile).
        memory = compiled_memory(setup.train_step.lower(state, batches[0]).compile())
        log(
            f"compiled and ran the first step in {compile_s:.1f} s "
            f"({setup.num_params / 1e6:.0f} M parameters, {n_dev} devices)"
        )
        for i in range(2):  # warm
            state, step_metrics = setup.train_step(state, batches[i % 2])
        jax.block_until_ready(state)
        # Rounds of steps, each waited for: the median round, and the spread of rounds.
        rounds = min(TRAIN_ROUNDS, steps)
        per_step = []
        for r in range(rounds):
            count = steps // rounds + (r < steps % rounds)
            start = time.perf_counter()
            for i in range(count):
                state, step_metrics = setup.train_step(state, batches[i % 2])
            jax.block_until_ready(state)
            per_step.append((time.perf_counter() - start) / count)
    step_s = float(np.median(per_step))
    tokens_per_step_per_device = config.batch_size * config.train_len / n_dev
    tokens_per_sec_per_device = tokens_per_step_per_device / step_s
    kind = jax.devices()[0].device_kind
    peak = metrics.peak_flops(kind)
    flops = metrics.flops_per_token(config)
    return {
        "tokens_per_sec_per_device": tokens_per_sec_per_device,
        "step_seconds": step_s,
        "step_seconds_rounds": per_step,  # per step, each round of the timed steps
        "steps": steps,
        "compile_seconds": compile_s,
        "mfu": None if peak is None else tokens_per_sec_per_device * flops / peak,
        "mfu_range": None  # of the slowest and the fastest round
        if peak is None
        else [
            tokens_per_step_per_device / s * flops / peak for s in (max(per_step), min(per_step))
        ],
        "peak_flops": peak,
        "peak_source": f"{kind} datasheet bf16 dense" if peak else f"{kind}: no datasheet peak",
        "flops_per_token": flops,
        "num_params": setup.num_params,
        "final_loss": float(step_metrics["loss"]),
        "memory_bytes": memory,
        "memory_gib": memory["total"] / 2**30,
        "process_peak_memory_gib": _process_peak_memory_gib(),
        "live": Live(setup, state, batches, steps),
    }


class Live:
    """A measured configuration's compiled step and state, kept to time it again
    (``timer()``: ``steps`` more steps → seconds) and to evaluate its ``params``."""

    def __init__(self, setup, state, batches, steps: int):
        self.setup, self.state, self.batches, self.steps = setup, state, batches, steps

    @property
    def params(self):
        return self.state.params

    def timer(self) -> float:
        state, start = self.state, time.perf_counter()
        with jax.set_mesh(self.setup.mesh):
            for i in range(self.steps):
                state, _ = self.setup.train_step(state, self.batches[i % 2])
            jax.block_until_ready(state)
        self.state = state
        return time.perf_counter() - start


def evaluate(config, params, lengths: list[int], batch: int, deadline: float):
    """Yields ``(length, fields)`` as each length is measured, so its JSON line is
    written before the next (longer) one runs; a length that fails (out of memory) is
    recorded with its error, and the longer ones after it as skipped."""
    # blockwise's scan, not evaluation's block_scan_logprobs: evaluation imports the
    # data and checkpoint modules (grain, TFDS), which an accelerator host may lack.
    from lexjax.blockwise import compiled_scan, pad_to
    from lexjax.model import Decoder

    model = Decoder(config.model)
    scan = compiled_scan(model, config.block)
    previous, failed = None, None
    for length in lengths:
        if failed is not None:
            yield length, {"skipped": f"{failed} tokens failed"}
            continue
        if previous and time.perf_counter() + previous * length / 1e3 > deadline:
            yield length, {"skipped": "time budget"}
            continue
        try:
            tokens = jnp.asarray(
                np.random.default_rng(1).integers(0, 258, (batch, length + 1), dtype=np.int32)
            )
            inputs, targets = (pad_to(t, config.block) for t in (tokens[:, :-1], tokens[:, 1:]))
            scan(params, inputs, targets).block_until_ready()
            seconds = min(
                common.timed(lambda x=inputs, y=targets: scan(params, x, y).block_until_ready())
                for _ in range(2)
            )
        except Exception as e:  # out of memory at a long length is a result
            failed = length
            log(f"block scan {length} tokens × {batch}: {common.error_text(e)}")
            yield length, {"error": common.error_text(e), "batch": batch}
            continue
        previous = seconds / length * 1e3  # seconds per 1k tokens, to predict the next
        log(f"block scan {length} tokens × {batch}: {batch * length / seconds:,.0f} tokens/s")
        yield (
            length,
            {"tokens_per_sec": batch * length / seconds, "seconds": seconds, "batch": batch},
        )


def main(argv=None) -> int:
    args = parse(argv)
    start = time.perf_counter()
    deadline = start + args.budget
    base, source = paper_dict()
    backend, device = jax.default_backend(), jax.devices()[0]
    impls = args.attention_impls or (
        "splash,fused,explicit" if backend == "tpu" else "fused,explicit"
    )
    policies = args.remat_policies.split(",")
    steps = 3 if args.small else args.steps
    lengths = [1024, 4096] if args.small else args.lengths
    per_device = 2 if args.small else args.per_device_batch
    top = {"train_len": 128} if args.small else {}
    common_fields = dict(
        device=device.device_kind,
        device_count=jax.device_count(),
        backend=backend,
        jax=jax.__version__,
        config_source=source,
        small=args.small,
        per_device_batch=per_device,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=" ".join(["python", *sys.argv]),
    )
    out_path = None
    if args.out:
        slug = device.device_kind.lower().replace(" ", "_")
        out_path = pathlib.Path(args.out) / f"{slug}-{common_fields['date'][:10]}.jsonl"
        out_path.parent.mkdir(parents=True, exist_ok=True)

    def emit(kind: str, **fields) -> dict:
        line = json.dumps({"kind": kind, **fields, **common_fields})
        print(line, flush=True)
        if out_path is not None:
            with open(out_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        return fields

    def config_of(**model):
        model = {**(SMALL_MODEL if args.small else {}), **model}
        return common.make_config(
            base, model=model, batch_size=per_device * jax.device_count(), **top
        )

    from lexjax.errors import ConfigError

    try:  # every configuration is valid before anything is measured
        for impl in impls.split(","):
            for policy in policies:
                config_of(attention_impl=impl, remat_policy=policy)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    log(f"{jax.device_count()} × {device.device_kind} ({backend}), jax {jax.__version__}")
    measured_peak = matmul_peak(1024 if args.small else 8192)
    emit("matmul_peak", bf16_flops=measured_peak)
    last_seconds, first = 0.0, None

    def measure(kind: str, keep: bool = False, **model):
        """``(config, Live or None, figures)``, or None when skipped or failed; only
        ``keep`` keeps the trained state (3.75 GiB at paper size: parameters and
        AdamW's two moments) alive."""
        nonlocal last_seconds
        config = config_of(**model)
        described = describe(config)
        if time.perf_counter() + last_seconds > deadline:
            emit(kind, skipped="time budget", **described)
            return None
        began = time.perf_counter()
        try:
            trained = train(config, steps)
        except Exception as e:  # an option that does not fit (out of memory) is a result
            emit(kind, error=common.error_text(e), **described)
            return None
        finally:
            last_seconds = time.perf_counter() - began
        live = trained.pop("live")
        if not keep:
            live = None
        flops = trained["tokens_per_sec_per_device"] * trained["flops_per_token"]
        trained["mfu_vs_measured_matmul"] = flops / measured_peak
        log(
            f"{kind} {described}: {trained['tokens_per_sec_per_device']:,.0f} tokens/s/device, "
            f"MFU {trained['mfu'] if trained['mfu'] is None else round(100 * trained['mfu'], 1)}%"
        )
        emit(kind, **described, **trained)
        return config, live, trained

    def xpos_overhead(first, none) -> None:
        """Both compiled steps timed in alternating rounds (each after an untimed call of
        its own), the overhead a median [min–max] of per-round ratios."""
        # The configuration compared (its position is xpos against none).
        model = {k: v for k, v in describe(first[0]).items() if k != "position"}
        rounds = 3 if args.small else XPOS_ROUNDS
        need = 2 * rounds * steps * (first[2]["step_seconds"] + none[2]["step_seconds"])
        if time.perf_counter() + need > deadline:
            emit("xpos_overhead", skipped="time budget", **model)
            return
        try:
            seconds = common.alternate(
                {"xpos": first[1].timer, "none": none[1].timer}, rounds, warm=True
            )
        except Exception as e:
            emit("xpos_overhead", error=common.error_text(e), **model)
            return
        # Same tokens on both sides: none's tokens/s over xpos's = xpos's seconds over none's.
        percent = common.Summary.of(
            [100 * (x / n - 1) for x, n in zip(seconds["xpos"], seconds["none"])]
        )
        log(f"XPOS overhead: {percent:+.1f} %")
        emit(
            "xpos_overhead",
            percent=percent.median,
            percent_min=percent.min,
            percent_max=percent.max,
            percent_per_round=percent.values,
            rounds=rounds,
            steps_per_round=steps,
            **model,
        )

    for impl in impls.split(","):
        for policy in policies:
            if first is not None:
                measure("train", attention_impl=impl, remat_policy=policy)
                continue
            first = measure("train", keep=True, attention_impl=impl, remat_policy=policy)
            if first is None:
                continue
            # XPOS's cost, and the block scan, right after the first configuration.
            none = measure(
                "train_position_none",
                keep=True,
                attention_impl=impl,
                remat_policy=policy,
                position="none",
            )
            if none is not None:
                xpos_overhead(first, none)
            none = None  # its state is not needed any more
            batch = 1 if args.small else args.eval_batch
            # The model scanned (evaluation: no remat), with each length's figures.
            scanned = {k: v for k, v in describe(first[0]).items() if k != "remat_policy"}
            for length, fields in evaluate(first[0], first[1].params, lengths, batch, deadline):
                emit("block_scan", length=length, **fields, **scanned)
            first = (first[0], None, first[2])  # nor is the first configuration's
    log(
        f"done in {time.perf_counter() - start:.0f} s" + (f"; wrote {out_path}" if out_path else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
