"""``xpos_overhead``: what each position encoding costs, in training and in the eval block scan.

The tiny config's train step, and the block-scan evaluation of 8 × train_len
tokens (w = train_len/2 per block step, the cache holding the previous
block), with ``position`` = xpos, none, rope, alibi; everything else equal.
Each round times every kind once in rotating order; the overhead of a kind
is its per-round time over ``none``'s, minus one.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from bench import common

KINDS = ("xpos", "none", "rope", "alibi")


def _eval_timer(kind: str, tokens_BxL, model_overrides: dict, params_seed: int = 0):
    from lexjax import evaluation
    from lexjax.model import Decoder

    config = common.tiny_config(position=kind, **model_overrides)
    model = Decoder(config.model)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(params_seed), tokens_BxL[:, :8]))
    params = params["params"]
    block = config.block

    def work():
        evaluation.block_scan_logprobs(model, params, tokens_BxL, block).block_until_ready()

    work()
    return lambda: common.timed(work)


def run(args) -> dict:
    # Round-to-round noise on a shared 2-core VM is ±10% or more, against a 3% target:
    # many short rounds, judged by the median and its interquartile range.
    rounds, steps = (2, 1) if args.quick else (21, 2)
    model = common.QUICK_MODEL if args.quick else {}
    config = common.tiny_config(**model)
    batches = common.train_batches(config.batch_size, config.train_len, 2)
    eval_len = (2 if args.quick else 8) * config.train_len
    eval_batch = 4
    tokens = common.text_tokens(eval_batch * (eval_len + 1), seed=2).reshape(eval_batch, -1)
    train = common.alternate(
        {
            k: common.train_timer(common.tiny_config(position=k, **model), batches, steps)[1]
            for k in KINDS
        },
        rounds,
        warm=True,
    )
    evals = common.alternate({k: _eval_timer(k, tokens, model) for k in KINDS}, rounds, warm=True)
    out = {}
    for name, seconds, count in (
        ("train_step", train, steps * config.batch_size * config.train_len),
        ("eval_block_scan", evals, eval_batch * eval_len),
    ):
        out[name] = {
            "tokens_per_sec": {
                k: common.Summary.of([count / s for s in v]).as_dict() for k, v in seconds.items()
            },
            "overhead_vs_none": {
                k: common.Summary.of([a / b - 1 for a, b in zip(v, seconds["none"])]).as_dict()
                for k, v in seconds.items()
                if k != "none"
            },
        }
    headline = out["train_step"]["overhead_vs_none"]["xpos"]["median"]
    eval_overhead = out["eval_block_scan"]["overhead_vs_none"]["xpos"]["median"]
    return common.result(
        100 * headline,
        "% slower than position=none (train step)",
        "≤ 3% in the train step and in the eval block scan",
        headline <= 0.03 and eval_overhead <= 0.03,
        eval_overhead_percent=100 * eval_overhead,
        rounds=rounds,
        steps_per_round=steps,
        eval_tokens=eval_len,
        eval_batch=eval_batch,
        model_overrides=model,
        **out,
    )


def rows(entry: dict) -> list[tuple[str, str]]:
    out = []
    for name in ("train_step", "eval_block_scan"):
        t, o = entry[name]["tokens_per_sec"], entry[name]["overhead_vs_none"]
        for kind in KINDS:
            extra = "" if kind == "none" else f"   {common.fmt(o[kind], '+.1f', 100)} %"
            if kind != "none" and o[kind].get("q25") is not None:
                extra += f" (quartiles {100 * o[kind]['q25']:+.1f} … {100 * o[kind]['q75']:+.1f})"
            out.append((f"{name} {kind} tokens/s", common.fmt(t[kind], ".0f") + extra))
    return out
