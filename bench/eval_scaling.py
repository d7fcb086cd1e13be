"""``eval_scaling``: evaluation throughput and memory from 2× to 128× the training length.

Three ways to score a sequence of N tokens with the tiny XPOS model (batch 1):

- ``bca_scan``: :func:`lexjax.evaluation.block_scan_logprobs`, the block scan
  (one compiled step of w = train_len/2 tokens over a 2w key window);
- ``dense``: :func:`lexjax.evaluation.full_logprobs`, the "− BCA" path: causal
  attention over all earlier tokens, w queries at a time against a cache of N;
- ``naive``: one forward over all N tokens with the full N × N causal mask.

Memory is XLA's own account of the compiled call (``memory_analysis()``:
temporaries + arguments + outputs) and, without ``--quick``, the peak
resident memory (``ru_maxrss``) of a fresh process that compiles and runs
that one call (VmHWM). A call whose compiled memory exceeds ``MEMORY_CAP`` (2 GiB) or whose
time, extrapolated from the previous length, exceeds the time cap is skipped
and says so. The bca_scan lengths are timed in alternating rounds, so the
128×-over-2× throughput ratio (over the longest length the caps let run, which
its unit names) is measured under the same load, each
length repeated to the same number of tokens per measurement.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from bench import common

MODES = ("bca_scan", "dense", "naive")
MULTIPLES = (2, 8, 32, 128)
MEMORY_CAP = 2 << 30


class TooFewLengths(RuntimeError):
    """The caps left the block scan one length: there is no ratio to take."""


EXPECTED_ERRORS = (TooFewLengths,)


def _model_and_params():
    from lexjax.model import Decoder

    config = common.tiny_config()
    model = Decoder(config.model)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    return config, model, nn.unbox(variables)["params"]


def _function(mode: str, model, block: int):
    """A jitted ``(params, tokens [B, N+1]) → log-probabilities [B, N]``."""
    from lexjax import evaluation

    if mode == "bca_scan":
        return jax.jit(lambda p, t: evaluation.block_scan_logprobs(model, p, t, block))
    if mode == "dense":
        return jax.jit(lambda p, t: evaluation.full_logprobs(model, p, t, chunk=block))

    def naive(params, tokens):
        logits, _ = model.apply({"params": params}, tokens[:, :-1])
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]

    return jax.jit(naive)


def _compiled_bytes(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {
        k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
        for k in ("temp", "argument", "output", "generated_code")
    }
    out["total"] = out["temp"] + out["argument"] + out["output"]
    return out


def _peak_rss_bytes() -> int:
    """This process's peak resident memory. Not ``ru_maxrss``: Linux carries that
    across exec from the forked parent, so a child would report the parent's."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _point(mode: str, length: int) -> dict:
    """Compile and run one (mode, length) in this process; report its peak RSS."""
    config, model, params = _model_and_params()
    tokens = jnp.asarray(common.text_tokens(length + 1, seed=3)[None])
    fn = _function(mode, model, config.block)
    fn(params, tokens).block_until_ready()
    return {"peak_rss_bytes": _peak_rss_bytes()}


def _rss(mode: str, length: int) -> int | None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.eval_scaling", "--point", mode, str(length)],
        capture_output=True,
        text=True,
        cwd=common.ROOT,
    )
    if proc.returncode:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


def run(args) -> dict:
    config, model, params = _model_and_params()
    multiples = (2, 8) if args.quick else MULTIPLES
    time_cap = 10.0 if args.quick else 60.0
    rounds = 2 if args.quick else 5
    memory_cap = MEMORY_CAP
    lengths = [m * config.train_len for m in multiples]
    points: dict[str, dict[int, dict]] = {mode: {} for mode in MODES}
    timers = {}
    for mode in MODES:
        previous = None  # (length, seconds)
        for length in lengths:
            point = points[mode].setdefault(length, {})
            tokens = jnp.asarray(common.text_tokens(length + 1, seed=3)[None])
            fn = _function(mode, model, config.block)
            compiled = fn.lower(params, tokens).compile()
            point["compiled_bytes"] = _compiled_bytes(compiled)
            if point["compiled_bytes"]["total"] > memory_cap:
                point["skipped"] = (
                    f"needs {point['compiled_bytes']['total'] / 2**30:.1f} GiB "
                    f"> cap {memory_cap / 2**30:.1f} GiB"
                )
                continue
            growth = 1 if mode == "bca_scan" else 2  # time ∝ N, or ∝ N² with full attention
            if previous and previous[1] * (length / previous[0]) ** growth > time_cap:
                point["skipped"] = (
                    f"would take ~{previous[1] * (length / previous[0]) ** growth:.0f}"
                    f" s > cap {time_cap:.0f} s"
                )
                continue
            run_once = lambda c=compiled, t=tokens: common.timed(
                lambda: c(params, t).block_until_ready()
            )
            seconds = run_once()  # first call: allocation, thread pools
            if mode == "bca_scan":
                # Equal tokens per measurement at every length: short calls alone
                # would be timed over a few milliseconds, all noise.
                reps = max(1, lengths[-1] // length)
                timers[length] = lambda f=run_once, n=reps: sum(f() for _ in range(n)) / n
            else:
                seconds = run_once()
                point["tokens_per_sec"] = length / seconds
            previous = (length, seconds)
            if not args.quick:
                point["peak_rss_bytes"] = _rss(mode, length)
    measured = common.alternate(timers, rounds)
    for length, seconds in measured.items():
        points["bca_scan"][length]["tokens_per_sec"] = common.Summary.of(
            [length / s for s in seconds]
        ).as_dict()
        points["bca_scan"][length]["seconds"] = seconds
    # The longest length the caps let run: on a machine slow enough to skip 128×, the
    # ratio (and its unit) names the length it reached instead of failing on a key.
    ran = sorted(measured)
    if len(ran) < 2:
        raise TooFewLengths(
            f"the block scan ran at {f'{ran[0]} tokens only' if ran else 'no length'} (the "
            "caps skipped the others): no throughput ratio to report on this machine"
        )
    first, last = ran[0], ran[-1]
    ratio = common.ratios([last / s for s in measured[last]], [first / s for s in measured[first]])
    memory = [points["bca_scan"][n]["compiled_bytes"]["temp"] for n in lengths]
    flat = max(memory) <= 1.1 * min(memory)
    return common.result(
        ratio.median,
        f"× tokens/s at {last // config.train_len}× vs {first // config.train_len}× "
        "train_len (bca_scan)",
        "≥ 0.85× (within 15%), flat memory",
        ratio.median >= 0.85 and flat,
        ratio=ratio.as_dict(),
        flat_temp_memory=flat,
        train_len=config.train_len,
        block=config.block,
        batch=1,
        rounds=rounds,
        memory_cap_bytes=memory_cap,
        time_cap_seconds=time_cap,
        points={mode: {str(n): p for n, p in by_len.items()} for mode, by_len in points.items()},
    )


def rows(entry: dict) -> list[tuple[str, str]]:
    out = []
    train_len = entry["train_len"]
    for mode in MODES:
        for length, p in entry["points"][mode].items():
            label = f"{mode} {int(length) // train_len}× ({length} tokens)"
            mem = p["compiled_bytes"]
            text = f"XLA temp {mem['temp'] / 2**20:.1f} MiB, total {mem['total'] / 2**20:.1f} MiB"
            if p.get("peak_rss_bytes"):
                text += f", RSS {p['peak_rss_bytes'] / 2**20:.0f} MiB"
            if "skipped" in p:
                out.append((label, f"skipped: {p['skipped']} ({text})"))
                continue
            rate = p["tokens_per_sec"]
            rate = common.fmt(rate, ".0f") if isinstance(rate, dict) else f"{rate:.0f}"
            out.append((label, f"{rate} tok/s; {text}"))
    return out


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--point":
        print(json.dumps(_point(sys.argv[2], int(sys.argv[3]))))
    else:
        sys.exit("usage: python -m bench.eval_scaling --point MODE LENGTH (run by bench/run.py)")
