"""Sampling with a bounded key/value cache that follows the blockwise pattern.

Letters: B batch, P prompt tokens, W block (w = train_len/2), L layers, H heads,
K head_dim, V vocabulary.

**The attention pattern.** Exactly that of the block scan
(:mod:`lexjax.evaluation`): token t of a sequence, in block ``b = ⌊t/w⌋``,
attends to the whole block ``b − 1`` (none for b = 0) and to the tokens of
block b up to and including itself, i.e. keys ``(b − 1)·w … t`` — the mask of
:func:`lexjax.masks.blockwise_causal`. Positions are window-relative: block
``b − 1`` stands at ``0 … w−1`` and block b at ``w … 2w−1`` (block 0 at
``0 … w−1``). Keys and values are cached before position encoding, so a
block's keys are re-encoded at ``0 … w−1`` once it becomes the previous one.

**The cache** has 2w slots per layer: slots ``0 … w−1`` hold the previous
block, slots ``w … 2w−1`` the current, partly filled block. When the current
block is full and another token comes, it becomes the previous block and the
current half empties. Memory per generated token is therefore constant, and
no position ever reaches train_len, however long the generation.

A long prompt is prefilled through the block scan (one compiled step per
block); generation then continues token by token from the state it leaves.
Token-by-token decoding computes the same logits as the scan over the same
tokens (tested).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lexjax.evaluation import EvaluationError, block_positions, block_step, empty_carry
from lexjax.model import Decoder

__all__ = ["prefill", "decode_step", "sample_logits", "generate"]

State = dict[str, Any]


@functools.cache
def _compiled_prefill(model: Decoder, block: int):
    def run(params, prompt_BxN, length):
        """prompt padded to n·w tokens; ``length`` real ones, in the last block."""
        B, N = prompt_BxN.shape
        n = N // block
        blocks = prompt_BxN.reshape(B, n, block).swapaxes(0, 1)

        def step(carry, xs):
            tokens_BxW, index = xs
            _, carry, _ = block_step(model, params, carry, tokens_BxW, index)
            return carry, None

        previous, _ = jax.lax.scan(
            step,
            empty_carry(model.config, B, block),
            (blocks[:-1], jnp.arange(n - 1, dtype=jnp.int32)),
        )
        logits, current, _ = block_step(model, params, previous, blocks[-1], n - 1)
        filled = length - (n - 1) * block
        slots = jnp.arange(block)
        cache = {
            "k": jnp.concatenate([previous["k"], current["k"]], axis=2),
            "v": jnp.concatenate([previous["v"], current["v"]], axis=2),
            "positions": jnp.broadcast_to(
                jnp.concatenate([slots.astype(jnp.int32), block_positions(n - 1, block)]),
                (B, 2 * block),
            ),
            "valid": jnp.concatenate(
                [previous["valid"], jnp.broadcast_to(slots < filled, (B, block))], axis=1
            ),
        }
        state = {
            "cache": cache,
            "filled": jnp.asarray(filled, jnp.int32),
            "first": jnp.asarray(n == 1),
        }
        return logits[:, filled - 1], state

    return jax.jit(run)


def prefill(model: Decoder, params, prompt_BxP, *, block: int):
    """Runs the prompt through the block scan.

    Returns ``(logits_BxV, state)``: the next-token logits after the last
    prompt token and the decoding state ``{"cache": {"k", "v": [L, B, 2W, H, K],
    "positions": [B, 2W], "valid": [B, 2W]}, "filled": tokens in the current
    block (1 … w), "first": whether it is block 0}``.
    """
    prompt_BxP = jnp.asarray(prompt_BxP, jnp.int32)
    if prompt_BxP.ndim != 2 or prompt_BxP.shape[1] < 1:
        raise EvaluationError(f"prompt must be [batch, length ≥ 1], got {prompt_BxP.shape}")
    P = prompt_BxP.shape[1]
    padded = -(-P // block) * block
    prompt = jnp.pad(prompt_BxP, ((0, 0), (0, padded - P)))
    return _compiled_prefill(model, block)(params, prompt, P)


def _decode(model: Decoder, params, state: State, token_B, block: int):
    cache, filled, first = state["cache"], state["filled"], state["first"]
    B = token_B.shape[0]
    # A full current block becomes the previous one; its keys keep their values
    # and are re-encoded at 0 … w−1 from now on.
    rotate = filled == block
    halves = lambda x, axis: jnp.concatenate(
        [jax.lax.slice_in_dim(x, block, 2 * block, axis=axis)] * 2, axis=axis
    )
    k = jnp.where(rotate, halves(cache["k"], 2), cache["k"])
    v = jnp.where(rotate, halves(cache["v"], 2), cache["v"])
    empty = jnp.concatenate([jnp.ones((B, block), bool), jnp.zeros((B, block), bool)], axis=1)
    valid = jnp.where(rotate, empty, cache["valid"])
    filled = jnp.where(rotate, 0, filled)
    first = first & ~rotate

    position = jnp.where(first, filled, block + filled).astype(jnp.int32)
    positions_Bx1 = jnp.broadcast_to(position, (B, 1))
    logits, kv = model.apply(
        {"params": params},
        token_B[:, None],
        positions_Bx1,
        cache={"k": k, "v": v, "valid": valid, "positions": cache["positions"]},
    )
    slot = block + filled
    cache = {
        "k": jax.lax.dynamic_update_slice_in_dim(k, kv["k"].astype(k.dtype), slot, axis=2),
        "v": jax.lax.dynamic_update_slice_in_dim(v, kv["v"].astype(v.dtype), slot, axis=2),
        "positions": jax.lax.dynamic_update_slice_in_dim(
            cache["positions"], positions_Bx1, slot, axis=1
        ),
        "valid": jax.lax.dynamic_update_slice_in_dim(valid, jnp.ones((B, 1), bool), slot, axis=1),
    }
    return logits[:, 0], {"cache": cache, "filled": filled + 1, "first": first}


@functools.cache
def _compiled_decode(model: Decoder, block: int):
    return jax.jit(functools.partial(_decode, model, block=block))


def decode_step(model: Decoder, params, state: State, token_B, *, block: int):
    """Feeds one token per row; returns ``(logits_BxV for the token after it, state)``."""
    return _compiled_decode(model, block)(params, state, jnp.asarray(token_B, jnp.int32))


def sample_logits(logits_BxV, rng, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """One token per row: greedy when ``temperature == 0``, else sampled from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
    tokens (0: all) and to the smallest set whose probability reaches ``top_p``
    (1: all; the most likely token is always kept)."""
    logits = logits_BxV.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(before < top_p, ordered, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _check_sampling(temperature, top_k, top_p, max_new_tokens):
    if temperature < 0:
        raise EvaluationError(f"temperature must be ≥ 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise EvaluationError(f"top_k must be ≥ 0 (0 = no limit), got {top_k}")
    if not 0 < top_p <= 1:
        raise EvaluationError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise EvaluationError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")


@functools.cache
def _compiled_generate(
    model: Decoder, block: int, max_new_tokens: int, temperature: float, top_k: int, top_p: float
):
    def run(params, logits_BxV, state, rng):
        def step(carry, key):
            logits, state = carry
            token = sample_logits(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)
            logits, state = _decode(model, params, state, token, block)
            return (logits, state), token

        keys = jax.random.split(rng, max_new_tokens)
        _, tokens = jax.lax.scan(step, (logits_BxV, state), keys)
        return tokens.swapaxes(0, 1)

    return jax.jit(run)


def generate(
    model: Decoder,
    params,
    prompt_BxP,
    *,
    block: int,
    max_new_tokens: int,
    rng,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """Prefills the prompt and samples ``max_new_tokens`` more: int32 ``[B, max_new_tokens]``.

    The cache never holds more than 2w tokens, so any number of tokens can be
    generated in constant memory per token.
    """
    _check_sampling(temperature, top_k, top_p, max_new_tokens)
    logits, state = prefill(model, params, prompt_BxP, block=block)
    return _compiled_generate(
        model, block, int(max_new_tokens), float(temperature), int(top_k), float(top_p)
    )(params, logits, state, rng)
