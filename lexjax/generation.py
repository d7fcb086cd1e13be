"""Sampling with a bounded key/value cache that follows the blockwise pattern.

Letters: B batch, P prompt tokens, W block (w = train_len/2), L layers, H heads,
K head_dim, V vocabulary.

The attention pattern and window positions are the block scan's
(:mod:`lexjax.blockwise`): token t attends to the whole previous block and to
its own block up to itself, so no position ever reaches train_len.

**The cache** is a :class:`~lexjax.blockwise.KVCache` of 2w slots: slots
``0 … w−1`` hold the previous block, slots ``w … 2w−1`` the current, partly
filled block. When the current block is full and another token comes, it
becomes the previous block (:meth:`KVCache.rotate`). Memory per generated
token is therefore constant, however long the generation.

A long prompt is prefilled through the block scan; generation then continues
token by token from the state it leaves. Token-by-token decoding computes the
same logits as the scan over the same tokens (tested).

**Without BCA** (mode ``"full"``, the evaluation's "− BCA"): plain causal
attention over positions ``0 … P+n−1``. The prompt is prefilled C queries at a
time (C = w) into a cache of every position, as
:func:`lexjax.evaluation.full_logprobs` scores it, and each new token is
appended; memory grows with the sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lexjax import data as data_lib
from lexjax import distributed
from lexjax import sharding as shard_lib
from lexjax.blockwise import (
    KVCache,
    block_step,
    check_bca,
    for_loop,
    pad_to,
    scan_prefix,
    window_positions,
)
from lexjax.config import Config, ModelConfig, check_bool, check_int, check_seed, is_real
from lexjax.errors import ConfigError, EvaluationError, StdoutClosed, arg
from lexjax.evaluation import full_length_limit, full_length_problem
from lexjax.model import Decoder
from lexjax.progress import Progress

__all__ = [
    "MODES",
    "is_greedy",
    "print_continuation",
    "prefill",
    "sample_logits",
    "check_sampling",
    "generate",
    "complete",
    "TextStream",
]

# The attention patterns generate() decodes with (lexjax.evaluation.MODES names them).
MODES = ("bca", "full")

State = dict[str, Any]


@functools.cache
def _compiled_prefill(model: Decoder, block: int):
    def run(params, prompt_BxN, length):
        """prompt padded to whole blocks (a power of two of them); ``length`` real
        tokens, traced: prompts of as many blocks up to N/w share this compilation."""
        B = prompt_BxN.shape[0]
        n = (length + block - 1) // block  # blocks holding real tokens
        loop_model, params = for_loop(model, params)
        previous = scan_prefix(loop_model, params, prompt_BxN, block, n - 1)
        last_BxW = jax.lax.dynamic_slice_in_dim(prompt_BxN, (n - 1) * block, block, axis=1)
        logits, current, _ = block_step(loop_model, params, previous, last_BxW, n == 1)
        filled = length - (n - 1) * block
        positions_BxW = jnp.broadcast_to(window_positions(block, first=n == 1), (B, block))
        real_BxW = jnp.broadcast_to(jnp.arange(block) < filled, (B, block))
        cache = (
            KVCache.empty(model.config, B, 2 * block)
            .write(0, (previous.k, previous.v), previous.positions, previous.valid)
            .write(block, (current.k, current.v), positions_BxW, real_BxW)
        )
        state = {"cache": cache, "filled": filled.astype(jnp.int32), "first": n == 1}
        return jnp.take(logits, filled - 1, axis=1), state

    return jax.jit(run)


def prefill(model: Decoder, params, prompt_BxP, *, block: int):
    """Runs the prompt through the block scan.

    Returns ``(logits_BxV, state)``: the next-token logits after the last
    prompt token and the decoding state ``{"cache": KVCache of 2w slots,
    "filled": tokens in the current block (1 … w), "first": whether it is
    block 0}``. Prompts are padded to a power of two of blocks, so a server's
    prompts of many lengths compile a few times, not once per block count.
    """
    prompt_BxP = _tokens(prompt_BxP)
    check_bca(model.config, block)  # its decoding steps' s would follow their positions
    length = prompt_BxP.shape[1]
    padded = pad_to(prompt_BxP, _blocks_bucket(length, block) * block)
    return _compiled_prefill(model, block)(params, padded, jnp.asarray(length, jnp.int32))


def _tokens(prompt_BxP):
    """The prompt as int32 ``[B, P ≥ 1]``: a numpy array stays on the host (padded
    there), a JAX array (perhaps sharded) where it is."""
    if isinstance(prompt_BxP, jax.Array):
        prompt_BxP = prompt_BxP.astype(jnp.int32)
    else:
        prompt_BxP = np.asarray(prompt_BxP, np.int32)
    if prompt_BxP.ndim != 2 or prompt_BxP.shape[1] < 1:
        raise EvaluationError(f"prompt must be [batch, length ≥ 1], got {prompt_BxP.shape}")
    return prompt_BxP


def _prefix_stable(rng) -> bool:
    """Whether ``split(rng, n)`` begins with ``split(rng, m)`` for every m < n:
    threefry with partitionable bits (JAX's default), not rbg or the older threefry."""
    if not getattr(jax.config, "jax_threefry_partitionable", True):
        return False
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return "threefry" in str(jax.random.key_impl(rng))
    return jax.config.jax_default_prng_impl == "threefry2x32"


def _blocks_bucket(length: int, block: int) -> int:
    """Blocks of ``block`` tokens that hold ``length``, rounded up to a power of two."""
    return 1 << (-(-length // block) - 1).bit_length()


def _decode(model: Decoder, params, state: State, token_B, block: int):
    cache, filled, first = state["cache"], state["filled"], state["first"]
    B = token_B.shape[0]
    rotate = filled == block
    cache = jax.tree.map(lambda a, b: jnp.where(rotate, a, b), cache.rotate(block), cache)
    filled = jnp.where(rotate, 0, filled)
    first = first & ~rotate
    positions_Bx1 = jnp.broadcast_to(window_positions(block, first=first, offsets=filled), (B, 1))
    logits, kv = model.apply({"params": params}, token_B[:, None], positions_Bx1, cache=cache)
    cache = cache.write(block + filled, kv, positions_Bx1)
    return logits[:, 0], {"cache": cache, "filled": filled + 1, "first": first}


@functools.cache
def _compiled_dense_prefill(model: Decoder, chunk: int, slots: int):
    def run(params, prompt_BxN, length):
        """prompt padded to n·C tokens, ``length`` real ones; a cache of ``slots`` ≥ N."""
        B, N = prompt_BxN.shape
        n = N // chunk
        loop_model, loop_params = for_loop(model, params)

        def step(carry, xs):
            cache, last_BxV = carry
            tokens_BxC, index = xs
            start = index * chunk
            positions_BxC = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
            # Dynamic NTK's n: the real tokens up to this chunk's end, not its padding.
            seen = jnp.minimum(start + chunk, length)
            logits, kv = loop_model.apply(
                {"params": loop_params}, tokens_BxC, positions_BxC, cache=cache, rope_length=seen
            )
            at = length - 1 - start  # the last real token, if in this chunk
            here = (at >= 0) & (at < chunk)
            last_BxV = jnp.where(here, logits[:, jnp.clip(at, 0, chunk - 1)], last_BxV)
            return (cache.write(start, kv, positions_BxC), last_BxV), None

        # Unwritten slots stand at position 0, invalid (as in evaluation's full mode).
        cache = KVCache.empty(model.config, B, slots)
        last = jnp.zeros((B, model.config.vocab_size), jnp.float32)
        chunks = (prompt_BxN.reshape(B, n, chunk).swapaxes(0, 1), jnp.arange(n, dtype=jnp.int32))
        (cache, last), _ = jax.lax.scan(step, (cache, last), chunks)
        # Padding was written after the real tokens; it is never a key of theirs, nor later.
        cache = cache.replace(valid=jnp.broadcast_to(jnp.arange(slots) < length, (B, slots)))
        return last, {"cache": cache, "next": jnp.asarray(length, jnp.int32)}

    return jax.jit(run)


def _dense_decode(model: Decoder, params, state: State, token_B):
    cache, position = state["cache"], state["next"]
    positions_Bx1 = jnp.broadcast_to(position, (token_B.shape[0], 1)).astype(jnp.int32)
    logits, kv = model.apply({"params": params}, token_B[:, None], positions_Bx1, cache=cache)
    cache = cache.write(position, kv, positions_Bx1)
    return logits[:, 0], {"cache": cache, "next": position + 1}


def sample_logits(logits_BxV, rng, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """One token per row: greedy when ``temperature == 0``, else sampled from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
    tokens (0: all) and then to the smallest set whose probability, renormalised
    after top-k, reaches ``top_p`` (1: all; the most likely token is always kept).
    Tokens tied with the last one kept are kept too. A temperature below float32's
    smallest normal number (about 1.2e-38) is greedy, the limit it stands for.
    Values out of range raise :class:`ConfigError`, as :func:`generate`'s do
    (a negative temperature sampled from ``softmax(-logits)``)."""
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    top_k = min(top_k, logits_BxV.shape[-1])  # within int32: no more ids to keep
    return _sample(
        logits_BxV,
        rng,
        temperature,
        top_k,
        top_p,
        greedy=is_greedy(temperature),
        nucleus=top_p < 1.0,
        k_room=top_k,
    )


def is_greedy(temperature: float) -> bool:
    """Whether sampling at ``temperature`` is greedy: 0, or so small that logits /
    temperature would overflow float32 (its limit is the argmax)."""
    return bool(abs(float(np.float32(temperature))) < np.finfo(np.float32).tiny)


def _sample(
    logits_BxV,
    rng,
    temperature,
    top_k,
    top_p,
    *,
    greedy: bool,
    nucleus: bool,
    k_room: int,
    bias_V=0.0,
):
    """:func:`sample_logits` with ``temperature``, ``top_k`` and ``top_p`` possibly
    traced: which steps apply (``greedy``, ``nucleus``, top-k where ``k_room`` > 0)
    is static, and ``k_room`` ≥ min(top_k, vocabulary) bounds the top-k search.
    ``bias_V`` (0 or −inf per id) rules ids out first, whatever their logits (a
    NaN or +inf logit plus −inf was NaN, and such a ruled-out id was drawn)."""
    logits = jnp.where(jnp.asarray(bias_V) < 0, -jnp.inf, logits_BxV.astype(jnp.float32))
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Largest logit 0 first: a small temperature sends the others to -inf, never to +inf.
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    if k_room > 0:
        best = jax.lax.top_k(logits, k_room)[0]  # descending
        kth = jnp.take(best, jnp.minimum(top_k, k_room) - 1, axis=-1)[..., None]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if nucleus:
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        # The most likely id always stays, also where top_p is below float32's range.
        keep = (before < top_p) | (jnp.arange(ordered.shape[-1]) == 0)
        kept = jnp.where(keep, ordered, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


# Beyond about 1/float32's smallest normal number (8.5e37) the division by it makes the
# ruled-out ids' −inf a NaN that wins the draw; far below that, at any temperature over
# ~1e9, every allowed id is already equally likely in float32.
_MAX_TEMPERATURE = 1e30


def check_sampling(
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 1,
    seed: int = 0,
    prompt: str = "",
) -> None:
    """Raises :class:`ConfigError` for sampling parameters out of range, or a prompt
    that is not text."""
    if not isinstance(prompt, str):
        raise ConfigError(f"prompt must be text (a str), got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # e.g. a byte argv held that is not UTF-8
        raise ConfigError(
            f"the prompt is not valid text: {prompt[e.start : e.end]!r} at character {e.start} "
            "cannot be written in UTF-8; pass UTF-8 text"
        ) from None
    if not is_real(temperature) or not 0 <= temperature <= _MAX_TEMPERATURE:  # NaN too
        raise ConfigError(
            f"{arg('temperature')} must be ≥ 0 (0 = greedy) and at most {_MAX_TEMPERATURE:g} "
            f"(uniform in float32 long before), got {temperature!r}"
        )
    check_int(arg("top_k"), top_k, 0, bound="an integer ≥ 0 (0 = no limit)")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise ConfigError(f"{arg('top_p')} must be in (0, 1], got {top_p!r}")
    bound = f"an integer in [1, {MAX_NEW_TOKENS:,}]"
    check_int(arg("max_new_tokens"), max_new_tokens, 1, MAX_NEW_TOKENS + 1, bound=bound)
    check_seed(seed, name=arg("seed"))


def check_full_mode(config: ModelConfig, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raises :class:`EvaluationError` when mode ``"full"`` cannot generate
    ``max_new_tokens`` after ``prompt_tokens`` (its begin-of-text included), where
    :func:`lexjax.evaluation.full_length_problem` finds one with their sum: the
    message says how many new tokens fit."""
    if problem := full_length_problem(config, prompt_tokens + max_new_tokens):
        fits = full_length_limit(config) - prompt_tokens
        # No thousands separator: the number is copied into --max_new_tokens.
        instead = f"at most {fits} new tokens" if fits > 0 else "a shorter prompt"
        bca = arg("mode='bca'", "--bca=on")
        raise EvaluationError(
            f"{arg('max_new_tokens')}={max_new_tokens} after {prompt_tokens:,} prompt tokens "
            f"without BCA: {problem[0]}; generate with {bca}, or {instead}"
        )


def check_stored_run(config: Config, prompt: str, max_new_tokens: int, mode: str) -> None:
    """What :func:`check_full_mode` refuses, checked on a run's stored config before
    its parameters load: exact for the byte tokenizer, which needs no loading (the
    prompt's ids after begin-of-text, as :func:`complete` makes them); another
    tokenizer's count is known, and checked, once it loads."""
    if mode == "full" and config.data.tokenizer == "bytes":
        prompt_tokens = 1 + len(data_lib.BYTES.encode(prompt))
        check_full_mode(config.model, prompt_tokens, max_new_tokens)


MAX_NEW_TOKENS = 1 << 24
"""The most tokens one call generates (each needs its random key in memory up front;
up to twice as many keys are split, see :func:`generate`)."""


# Tokens sampled per compiled call of generate(): the steps of its progress display.
CHUNK = 1024


def _chunk(max_new_tokens: int) -> int:
    """Tokens per compiled call: ``max_new_tokens`` rounded up to a power of two
    (≥ 16) up to 128, then to a multiple of 128, at most :data:`CHUNK`; so other
    counts share a compilation, for at most 127 surplus tokens (dropped)."""
    if max_new_tokens <= 128:
        return min(CHUNK, 1 << max(4, (max_new_tokens - 1).bit_length()))
    return min(CHUNK, -(-max_new_tokens // 128) * 128)


@functools.cache
def _compiled_generate(
    model: Decoder, block: int, greedy: bool, k_room: int, nucleus: bool, mode: str = "bca"
):
    def run(params, logits_BxV, state, keys_N, temperature, top_k, top_p, bias_V):
        """One token per key: ``(tokens_BxN, the logits and state after them)``."""
        loop_model, loop_params = for_loop(model, params)

        def step(carry, key):
            logits, state = carry
            token = _sample(
                logits, key, temperature, top_k, top_p, greedy=greedy, nucleus=nucleus,
                k_room=k_room, bias_V=bias_V,
            )  # fmt: skip
            if mode == "bca":
                logits, state = _decode(loop_model, loop_params, state, token, block)
            else:
                logits, state = _dense_decode(loop_model, loop_params, state, token)
            return (logits, state), token

        (logits_BxV, state), tokens_NxB = jax.lax.scan(step, (logits_BxV, state), keys_N)
        return tokens_NxB.swapaxes(0, 1), logits_BxV, state

    # The logits and the state (mode full's cache grows with the text) are each
    # chunk's to replace: donated, the new ones take their buffers.
    return jax.jit(run, donate_argnums=(1, 2))


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
    mode: str = "bca",
    progress: bool = False,
    stop_token: int | None = None,
    allowed_V=None,
    on_chunk=None,
):
    """Prefills the prompt and samples ``max_new_tokens`` more: int32 ``[B, max_new_tokens]``.

    ``allowed_V``: bool ``[vocab]``, the ids that may be sampled (default all; a
    run's are :meth:`lexjax.data.Tokenizer.sampleable`).

    ``mode`` (one of :data:`MODES`): ``"bca"``, the blockwise window, whose
    cache never holds more than 2w tokens, so any number of tokens can be
    generated in constant memory per token; ``"full"``, plain causal attention
    over every earlier token (positions ``0 … P+max_new_tokens−1``), which
    raises :class:`EvaluationError` where :func:`check_full_mode` does. Tokens are
    sampled up to :data:`CHUNK` at a time (64 with ``on_chunk``); with ``progress``,
    more than one chunk shows the progress display (:mod:`lexjax.progress`) on
    stderr. With ``stop_token``,
    sampling ends after the first chunk by which every row has sampled it, so the
    result may be shorter (the tokens it has are the same). ``on_chunk``, if
    given, is called with each chunk's tokens as they come, a numpy ``[B, ≤ 64]``
    (on every process, which must all call this alike); where it returns true, on
    any process, sampling ends after that chunk on every process (they agree on it
    in one collective per chunk), e.g. once the reader of the text went away.
    """
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens)
    check_int(arg("block"), block)  # 0 was a ZeroDivisionError
    progress = check_bool("progress", progress)
    max_new_tokens = int(max_new_tokens)  # numpy's too
    if mode not in MODES:
        raise ConfigError(f"{arg('mode')}={mode!r}: generation decodes in {' or '.join(MODES)}")
    if allowed_V is not None:
        allowed_V = np.asarray(allowed_V, bool)
        if allowed_V.shape != (model.config.vocab_size,) or not allowed_V.any():
            raise ConfigError(
                f"{arg('allowed_V')} (shape {allowed_V.shape}, {int(allowed_V.sum())} true) must be"
                f" a bool [{model.config.vocab_size}] mask allowing at least one id"
            )
    if mode == "bca":
        logits, state = prefill(model, params, prompt_BxP, block=block)
    else:
        logits, state = _dense_prefill(model, params, prompt_BxP, block, max_new_tokens)
    # Temperature, top_k and top_p are arguments: a new value compiles nothing, except a
    # top_k past the power of two its search was compiled for (k_room).
    k_room = min(1 << (int(top_k) - 1).bit_length(), logits.shape[-1]) if top_k else 0
    run = _compiled_generate(model, block, is_greedy(temperature), k_room, top_p < 1.0, mode)
    bias_V = jnp.zeros(logits.shape[-1], jnp.float32)
    if allowed_V is not None:
        bias_V = jnp.where(jnp.asarray(allowed_V, bool), bias_V, -jnp.inf)
    top_k = min(int(top_k), k_room)  # within int32: the search finds no more
    sampling = jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p), bias_V
    # Every call samples `chunk` tokens, so one compilation serves them all (and other
    # max_new_tokens): the surplus tokens come after every kept one and are dropped (as
    # are their cache writes, in mode full). A reader of each chunk (on_chunk: a text
    # streamed as it comes) gets one at most every 64 tokens.
    chunk = _chunk(max_new_tokens) if on_chunk is None else min(_chunk(max_new_tokens), 64)
    # Token i's key is the i-th of a split of a power of two, rounded to whole chunks:
    # one compilation per power of two, not one set of small ones per max_new_tokens,
    # each kept for the process's life. Where a split is not a prefix of a longer one
    # (rbg keys, threefry without partitionable bits), max_new_tokens keys as before.
    if _prefix_stable(rng):
        count = -(-(1 << (max_new_tokens - 1).bit_length()) // chunk) * chunk
        keys = jax.random.split(rng, count)
    else:
        count = -(-max_new_tokens // chunk) * chunk
        keys = jax.random.split(rng, max_new_tokens)
        keys = jnp.concatenate([keys, jnp.repeat(keys[:1], count - max_new_tokens, axis=0)])
    keys = keys.reshape(count // chunk, chunk, *keys.shape[1:])
    bar = Progress(max_new_tokens, label="generated", enabled=progress and chunk < max_new_tokens)
    pieces, stopped_B = [], False
    try:  # the display ends its line also after a Ctrl-C
        for start in range(0, max_new_tokens, chunk):
            tokens_BxC, logits, state = run(params, logits, state, keys[start // chunk], *sampling)
            pieces.append(tokens_BxC)
            sharding = tokens_BxC.sharding  # [B, *] alike: the rows' split, none of the tokens'
            if bar.enabled:  # wait for the chunk, so the display follows the computation
                jax.block_until_ready(tokens_BxC)
                bar.update(min(start + chunk, max_new_tokens))
            if on_chunk is None and stop_token is None:
                continue
            # host_array: every process sees every row, and takes the same decision.
            host_BxC = shard_lib.host_array(tokens_BxC)[:, : max_new_tokens - start]
            pieces[-1] = host_BxC
            if on_chunk is not None and distributed.any_process(bool(on_chunk(host_BxC))):
                break
            if stop_token is not None:
                stopped_B = stopped_B | (host_BxC == stop_token).any(axis=1)
                if stopped_B.all():
                    break
    finally:
        bar.close()
    # Joined and cut on the host, then put where the chunks were (the rows sharded as
    # the prompt's), shard by shard: on a device, or through jnp.asarray, each
    # max_new_tokens compiled its own.
    tokens = np.concatenate([shard_lib.host_array(p) for p in pieces], axis=1)
    tokens = tokens[:, :max_new_tokens]
    try:
        rows_only = sharding.shard_shape(tokens.shape)[1] == tokens.shape[1]
    except ValueError:  # a split of the tokens' axis that does not divide it
        rows_only = False
    if not rows_only:
        return jax.device_put(tokens)
    return jax.make_array_from_callback(tokens.shape, sharding, lambda index: tokens[index])


def _dense_prefill(model: Decoder, params, prompt_BxP, chunk: int, max_new_tokens: int):
    """Mode ``"full"``'s prefill: ``(next-token logits_BxV, {"cache", "next"})`` with
    room in the cache for ``max_new_tokens`` more tokens, rounded up to whole chunks."""
    prompt_BxP = _tokens(prompt_BxP)
    length = prompt_BxP.shape[1]
    check_full_mode(model.config, length, max_new_tokens)
    if model.config.position == "learned":
        # No padding: it could stand past the table (see evaluation.full_logprobs).
        chunk = length
    # A cache with room for whole sampling chunks (generate's surplus tokens included),
    # rounded up to one of 8 sizes per octave (at most 12.5% more): token counts and
    # prompts of one size share the decode loop's compilation. (The prompt is not
    # padded further: padding is computed here, at positions the checks did not see.)
    padded = pad_to(prompt_BxP, chunk)
    per_call = _chunk(max_new_tokens)
    slots = padded.shape[1] + -(-int(max_new_tokens) // per_call) * per_call
    step = 1 << max(0, slots.bit_length() - 4)
    slots = -(-slots // step) * step
    return _compiled_dense_prefill(model, chunk, slots)(params, padded, length)


SAMPLING = dict(max_new_tokens=256, temperature=1.0, top_k=0, top_p=1.0, seed=0)
"""The sampling settings of :func:`complete` and eval.py, with their defaults."""


def complete(
    config: Config,
    params,
    prompt: str,
    *,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    tokenizer: data_lib.Tokenizer = data_lib.BYTES,
    mode: str = "bca",
    on_text=None,
    progress: bool | None = None,
) -> str:
    """The text a run's model writes after ``prompt`` (from BOS), up to its first EOS,
    in the run's ``tokenizer`` (:func:`lexjax.checkpoint.load_tokenizer`), decoding
    in ``mode`` (:func:`generate`).

    ``on_text``, if given, is called with the text as it is written, in pieces
    (one per chunk of :func:`generate`, a character split between chunks held
    back until it is whole): joined, they are the returned text. Where it returns
    ``True`` (or numpy's, on any process), the writing ends there and the text so
    far is returned; any other value goes on (a writer's ``write`` returns a count).
    ``progress``: the progress display on stderr of more than one chunk; None (the
    default): only where no ``on_text`` takes the text, which shows its own progress
    as it comes (on a terminal the display's redrawn line wrote over that text).
    """
    check_sampling(prompt=prompt)
    if on_text is not None and not callable(on_text):
        raise ConfigError(f"on_text must be a function of the text or None, got {on_text!r}")
    if progress is None:
        progress = on_text is None
    stream = TextStream(tokenizer)

    def show(tokens_BxC) -> bool:
        piece = stream.add(tokens_BxC[0])
        return bool(piece) and _is_true(on_text(piece))

    tokens = np.concatenate([[tokenizer.bos], tokenizer.encode(prompt)]).astype(np.int32)
    out = generate(
        Decoder(config.model, shard_lib.rules(config)),
        params,
        tokens[None],
        block=config.block,
        max_new_tokens=max_new_tokens,
        rng=jax.random.key(check_seed(seed, name=arg("seed"))),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        mode=mode,
        progress=progress,
        stop_token=tokenizer.eos,
        allowed_V=tokenizer.sampleable(config.model.vocab_size),
        on_chunk=None if on_text is None else show,
    )
    out = shard_lib.host_array(out)[0]
    end = np.nonzero(out == tokenizer.eos)[0]
    text = tokenizer.decode(out[: end[0]] if len(end) else out)
    if on_text is not None and (rest := stream.flush()):
        on_text(rest)
    return text


def _is_true(value) -> bool:
    """``True`` or numpy's; a count (``write``'s) or another truthy value is not."""
    return isinstance(value, (bool, np.bool_)) and bool(value)


class TextStream:
    """The text of ids that come in pieces, as soon as it is final.

    :meth:`add` takes the next ids and returns the text they complete: all of it,
    except the last ids while they hold the first bytes of a character that later
    ids may finish (a UTF-8 sequence that byte-level ids or byte-fallback pieces
    have only begun: at most 3 ids that have bytes); nothing after EOS.
    :meth:`flush` returns what waits. Text is cut only where a character starts,
    so, joined, the pieces are ``tokenizer.decode`` of every id before the first
    EOS; each call decodes only its ids and the few waiting.
    """

    def __init__(self, tokenizer: data_lib.Tokenizer):
        self.tokenizer = tokenizer
        self.waiting = np.zeros(0, np.int64)
        self.ended = False

    def add(self, ids) -> str:
        if self.ended:
            return ""
        ids = np.asarray(ids, np.int64).reshape(-1)
        end = np.nonzero(ids == self.tokenizer.eos)[0]
        if len(end):
            ids, self.ended = ids[: end[0]], True
        self.waiting = np.concatenate([self.waiting, ids])
        if self.ended:
            return self.flush()
        done = len(self.waiting) - self._unfinished()
        text = self.tokenizer.decode(self.waiting[:done])
        self.waiting = self.waiting[done:]
        return text

    def _unfinished(self) -> int:
        """How many of the last waiting ids hold a character's first bytes, too few of
        them for it (0: the bytes end in a whole character, or in bytes that no later
        byte can make one). Ids without bytes (BOS, ids past the vocabulary) among
        them wait too."""
        seen = 0  # bytes, from the end
        for k, id_ in enumerate(self.waiting[::-1], start=1):
            if seen == 4:  # a character has at most 4 bytes
                return 0
            for byte in self.tokenizer.utf8([id_])[::-1]:
                seen += 1
                if byte < 0x80:  # ASCII: a whole character
                    return 0
                if byte >= 0xF5 or byte in (0xC0, 0xC1):  # never in UTF-8: U+FFFD now
                    return 0
                if byte >= 0xC0:  # a first byte: 110xxxxx, 1110xxxx, 11110xxx
                    need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
                    return k if seen < need else 0
        return 0  # continuation bytes (10xxxxxx) alone: their first byte is further back

    def flush(self) -> str:
        text, self.waiting = self.tokenizer.decode(self.waiting), self.waiting[:0]
        return text


def print_continuation(prompt: str, generate: Callable[[Callable[[str], bool]], Any]) -> None:
    """eval.py --generate's output: ``prompt``, then the text that ``generate(show)``
    passes to ``show`` as it comes, on stdout, and a newline after it (also after a
    Ctrl-C). The prompt waits for the first text: by then the processes have
    connected, and the C++ lines gloo prints then on stdout come before it. ``show``
    says whether stdout's reader went away (``eval.py --generate | head``): every
    process then stops after this chunk, and this one raises
    :class:`lexjax.errors.StdoutClosed` (a quiet exit)."""
    waiting, closed = [prompt], []

    def show(text: str) -> bool:
        try:
            if not closed:
                print(waiting.pop() if waiting else "", text, sep="", end="", flush=True)
        except StdoutClosed:
            closed.append(True)
        return bool(closed)

    try:
        generate(show)
        show("")  # the prompt, when no text came
    finally:
        if not waiting:
            show("\n")  # the text's end, also after a Ctrl-C
    if closed:
        raise StdoutClosed
