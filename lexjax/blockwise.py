"""The blockwise-causal window (BCA, paper §3.3): key/value cache, window positions, block scan.

Letters in names: B batch, N tokens, W block (w = train_len/2), S cache slots,
L layers, H heads, K head_dim, V vocabulary.

A sequence is cut into blocks of w tokens. Token t, in block ``b = ⌊t/w⌋``,
attends to the whole block ``b − 1`` (none for b = 0) and to block b up to
itself: the mask of :func:`lexjax.masks.blockwise_causal`. Positions are
window-relative (:func:`window_positions`): the previous block stands at
``0 … w−1`` and the current one at ``w … 2w−1``, so no distance exceeds
``2w − 1 = train_len − 1``. The first block has no previous block (its slots
are invalid). For relative encodings (XPOS, RoPE, ALiBi) only distances matter:
it stands at ``w … 2w−1`` like every other block, so each step encodes the same
positions and a scan computes their tables once. For absolute ones (sinusoidal,
learned) it stands at ``0 … w−1``, what training showed the model for a
sequence start; every position stays below ``train_len``.

Keys and values are cached *before* position encoding, so a block's keys are
re-encoded at ``0 … w−1`` once it is the previous block; its values (and, for
absolute encodings, the embedding added before the first layer) come from the
step that computed it. The whole scan therefore equals the explicit mask over
the sequence with positions ``0 … N−1`` for relative encodings and
``i mod w + w·[i ≥ w]`` for absolute ones (tested).

**Sinks + sliding window** (StreamingLLM, Xiao et al. 2023; :func:`scan_sinks`).
With ``S`` sinks (0 ≤ S ≤ w) and ``W = train_len − S``, token t attends to the
sinks ``0 … S−1`` and to the W most recent tokens ``t−W+1 … t`` (for
``t < train_len`` that is every token ``0 … t``). Positions are those of
StreamingLLM's cache — sinks at ``0 … S−1``, window keys after them, the query
last — so the query stands at ``min(t, train_len−1)``, a window key j at the
true distance ``t − j`` and a sink s at distance ``min(t, train_len−1) − s``:
no distance reaches train_len. Each token's keys and values are computed once,
in its own step, with its own context. The scan runs w queries per step: the
window group (keys ``[two previous blocks, current block]`` at window positions
``0 … 3w−1``, queries at ``2w … 3w−1``, sliding-window mask of W) and the sink
group (sinks at ``0 … S−1``, queries at ``min(t, train_len−1)`` — one position,
``train_len − 1``, for every query from block 2 on) share one softmax. Block 0
stores its first S keys/values as the sinks and marks them invalid in the
window, so no key is seen twice.

This module sits above :mod:`lexjax.model` (it calls the :class:`Decoder` with
a :class:`KVCache`) and below :mod:`lexjax.evaluation` and
:mod:`lexjax.generation`; all window arithmetic lives here. It is public
(``lexjax.blockwise``): code of one's own scores a long sequence block by block as

    model, w = run.model, run.config.block              # a loaded run (lexjax.load)
    previous = KVCache.empty(run.config.model, batch, w)
    for i in range(n):                                  # tokens_BxN: n·w tokens (pad_to)
        logits_BxWxV, previous, _ = block_step(model, run.params, previous,
                                               tokens_BxN[:, i * w:(i + 1) * w], i == 0)

or all at once with :func:`scan_blocks` (one compiled step); token-by-token
decoding over a 2w-slot cache (:meth:`KVCache.write`, :meth:`KVCache.rotate`) is
what :mod:`lexjax.generation` does.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lexjax.config import ABSOLUTE_ENCODINGS, ModelConfig, check_int
from lexjax.errors import ConfigError, arg
from lexjax.model import _DTYPES, Decoder, halve_kernels

__all__ = [
    "KVCache",
    "window_positions",
    "window_mask",
    "window_ntk_problem",
    "bca_problem",
    "check_bca",
    "block_step",
    "scan_blocks",
    "scan_prefix",
    "target_logprobs",
    "compiled_scan",
    "pad_to",
    "sink_window",
    "sink_step",
    "scan_sinks",
]


@struct.dataclass
class KVCache:
    """Keys and values of earlier tokens, before position encoding (a pytree).

    ``k``, ``v``: ``[L, B, S, H, K]``, as the model returns them (keys of a
    rotary kind in ``positions.to_halves``'s layout); ``positions``: int32
    ``[B, S]``, the position each key is encoded at; ``valid``: bool ``[B, S]``,
    which slots hold a key. Pure: every operation returns a new cache.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    valid: jax.Array

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, size: int) -> KVCache:
        """``size`` invalid slots per layer: zeros at position 0, in the compute dtype."""
        if not isinstance(config, ModelConfig):  # the whole Config was an AttributeError
            given = "the whole Config: give config.model" if hasattr(config, "model") else config
            raise ConfigError(f"KVCache.empty takes a ModelConfig (a Config's .model), got {given}")
        shape = (config.num_layers, batch, size, config.num_heads, config.head_dim)
        zeros = jnp.zeros(shape, _DTYPES[config.dtype])
        return cls(
            zeros, zeros, jnp.zeros((batch, size), jnp.int32), jnp.zeros((batch, size), bool)
        )

    def write(self, start, kv, positions_BxT, valid_BxT=None) -> KVCache:
        """Stores ``kv = (k, v): [L, B, T, H, K]`` (a Decoder's ``new_kv``) at slots
        ``start … start+T−1`` with their positions; valid unless ``valid_BxT`` says
        otherwise. ``start`` may be traced (then XLA clamps it so the T slots fit);
        a Python int past the end raises ValueError."""
        k, v = kv
        T, S = positions_BxT.shape[1], self.valid.shape[1]
        if T > S or (isinstance(start, numbers.Integral) and not 0 <= start <= S - T):
            raise ValueError(f"cannot write {T} tokens at slot {start} of a {S}-slot cache")
        if valid_BxT is None:
            valid_BxT = jnp.ones(positions_BxT.shape, bool)
        put = lambda old, new, axis: jax.lax.dynamic_update_slice_in_dim(
            old, new.astype(old.dtype), start, axis
        )
        return KVCache(
            put(self.k, k, 2),
            put(self.v, v, 2),
            put(self.positions, positions_BxT, 1),
            put(self.valid, valid_BxT, 1),
        )

    def rotate(self, block: int) -> KVCache:
        """For a cache of 2w slots ``[previous block, current block]``: the current
        block becomes the previous one, at positions ``0 … w−1``, and the current
        half empties (its slots keep stale keys, marked invalid)."""
        B = self.valid.shape[0]
        k, v = self.k[:, :, block:], self.v[:, :, block:]
        positions_BxW = jnp.broadcast_to(window_positions(block, first=True), (B, block))
        return KVCache(
            jnp.concatenate([k, k], axis=2),
            jnp.concatenate([v, v], axis=2),
            jnp.concatenate([positions_BxW, positions_BxW], axis=1),
            jnp.concatenate([self.valid[:, block:], jnp.zeros((B, block), bool)], axis=1),
        )


def for_loop(model: Decoder, params):
    """``(model, params)`` for a loop that calls the model with these parameters many
    times (a scan over blocks or tokens): the query and key kernels permuted once
    here (:func:`lexjax.model.halve_kernels`), not in every call. Computes the same
    outputs; a second call changes nothing."""
    if model.kernels_halved:
        return model, params
    return model.clone(kernels_halved=True), halve_kernels(model.config, params)


def window_positions(block: int, *, first, offsets=None) -> jax.Array:
    """Window-relative int32 positions of tokens at ``offsets`` (default ``0 … w−1``)
    inside the current block: the offsets in the first block, ``w + offsets`` after
    it, where the previous block holds ``0 … w−1``. ``first`` may be traced."""
    if offsets is None:
        offsets = jnp.arange(block, dtype=jnp.int32)
    return jnp.where(first, offsets, offsets + block).astype(jnp.int32)


def window_mask(index: int, block: int, length: int) -> np.ndarray:
    """bool ``[W, 2W]``: the (query, key) pairs of window ``index`` — queries its
    block, keys ``[previous block, its block]`` — that attend, among the first
    ``length`` tokens of the sequence (padding is never a query or a key)."""
    q = np.arange(block)[:, None]
    k = np.arange(2 * block)[None, :]
    start = index * block
    previous = (k < block) & (index > 0)
    current = (k >= block) & (k - block <= q) & (start + k - block < length)
    return (previous | current) & (start + q < length)


def window_ntk_problem(config: ModelConfig, block: int, mode: str, instead: str) -> str | None:
    """Why ``mode`` (``"BCA"``, ``"sinks + window"``), whose positions stay below
    2·block, cannot take dynamic NTK's s as 1 there, or None: that is right only while
    ``rope_train_len`` covers those positions (``instead``: what else to evaluate)."""
    if config.rope_scaling == "dynamic_ntk" and (config.rope_train_len or 0) < 2 * block:
        return (
            f"{mode} with dynamic NTK takes s = 1, as its positions stay below 2·block = "
            f"{2 * block}; that needs model.rope_train_len ≥ {2 * block}, not "
            f"{config.rope_train_len} (or {instead})"
        )
    return None


def bca_problem(config: ModelConfig, block: int) -> str | None:
    """Why BCA cannot run this model at ``block``, or None: where dynamic NTK's factor
    would differ between the block scan and BCA decoding. Its s = (largest query
    position + 1) / ``rope_train_len`` is 1 in both only while ``rope_train_len``
    covers the window's 2·block positions (a scan's queries stand at w … 2w−1 in
    every block, a decoding step's anywhere in 0 … 2w−1)."""
    return window_ntk_problem(config, block, "BCA", "evaluate without BCA")


def check_bca(config: ModelConfig, block: int) -> None:
    """A one-line :class:`~lexjax.errors.ConfigError` where :func:`bca_problem` names one."""
    if problem := bca_problem(config, block):
        raise ConfigError(problem)


def block_step(
    model: Decoder, params, previous: KVCache, tokens_BxW, first, *, return_scores: bool = False
):
    """One BCA step: the current block attends to ``[previous block, itself]``.

    Args:
      previous: w slots holding the previous block at positions ``0 … w−1``
        (all invalid before the first block).
      tokens_BxW: the current block.
      first: bool scalar, whether this is the sequence's first block. Only an
        absolute encoding (sinusoidal, learned) places it differently: at
        positions ``0 … w−1``, later blocks at ``w … 2w−1``.

    Returns:
      ``(logits_BxWxV, this block as the next step's previous KVCache, scores)``;
      scores are ``[L, B, H, W, 2W]`` (keys ``[previous, current]``) when
      ``return_scores``, else None.
    """
    B, W = tokens_BxW.shape
    check_bca(model.config, W)
    if previous.valid.shape != (B, W):
        raise ValueError(
            f"the previous block's cache holds {previous.valid.shape[0]} rows of "
            f"{previous.valid.shape[1]} slots for {B} rows of a block of {W} tokens; give "
            f"KVCache.empty(config, {B}, {W})"
        )
    if model.config.position not in ABSOLUTE_ENCODINGS:
        # A relative encoding's scores depend on m − n only, so every block, the first
        # too (whose previous slots are invalid), is encoded at the same positions:
        # queries w … 2w−1, keys 0 … 2w−1. The rotary tables, the ALiBi bias and the
        # centring shift are then the same at every step; in a scan XLA computes them
        # once before the loop, not in every step (tests/test_blockwise.py).
        first = False
        previous = previous.replace(
            positions=jnp.broadcast_to(window_positions(W, first=True), (B, W))
        )
    positions_BxW = jnp.broadcast_to(window_positions(W, first=first), (B, W))
    out = model.apply(
        {"params": params}, tokens_BxW, positions_BxW, cache=previous, return_scores=return_scores
    )
    logits, kv = out[:2]
    following = previous.write(0, kv, jnp.broadcast_to(window_positions(W, first=True), (B, W)))
    return logits, following, out[2] if return_scores else None


def pad_to(x_BxN, multiple: int):
    """Zero-pads the token axis (1) to a multiple of ``multiple``: on the host for a
    numpy array (a device's pad compiles once per length, and keeps it)."""
    check_int(arg("multiple"), multiple)  # 0 was a ZeroDivisionError
    widths = ((0, 0), (0, -x_BxN.shape[1] % multiple))
    return np.pad(x_BxN, widths) if isinstance(x_BxN, np.ndarray) else jnp.pad(x_BxN, widths)


def scan_blocks(
    model: Decoder,
    params,
    tokens_BxN,
    block: int,
    emit: Callable | None = None,
    *,
    extra_BxN=None,
    return_scores: bool = False,
):
    """The block scan: :func:`block_step` over every block of ``tokens_BxN``
    (N a multiple of w), carrying only the previous block.

    ``emit(logits_BxWxV, extra_BxW, scores)`` reduces each block's outputs on
    the device (``extra_BxN`` is cut into blocks alongside the tokens; scores as
    in :func:`block_step`); its results are stacked on a leading block axis.
    Returns ``(the last block as a KVCache of w slots, stacked outputs or None)``.
    XLA compiles the step once; memory is O(B·w) besides the inputs and outputs.
    """
    model, params = for_loop(model, params)
    step = lambda previous, tokens_BxW, index: block_step(
        model, params, previous, tokens_BxW, index == 0, return_scores=return_scores
    )
    first = KVCache.empty(model.config, tokens_BxN.shape[0], block)
    return _scan(step, first, tokens_BxN, block, emit, extra_BxN)


def _check_whole_blocks(tokens_BxN, block: int) -> None:
    check_int(arg("block"), block)  # 0 was a ZeroDivisionError
    if (N := tokens_BxN.shape[1]) % block:
        raise ValueError(f"{N} tokens are not whole blocks of {block}; pad them with pad_to first")


def scan_prefix(model: Decoder, params, tokens_BxN, block: int, blocks):
    """:func:`scan_blocks` over the first ``blocks`` blocks of ``tokens_BxN`` only,
    without outputs: the last of them as a KVCache of w slots (empty for none).
    ``blocks`` may be traced (a loop of that many steps, nothing spent on the rest),
    so one compilation serves every count up to N/w."""
    B = tokens_BxN.shape[0]
    _check_whole_blocks(tokens_BxN, block)
    model, params = for_loop(model, params)

    def body(index, previous):
        tokens_BxW = jax.lax.dynamic_slice_in_dim(tokens_BxN, index * block, block, axis=1)
        return block_step(model, params, previous, tokens_BxW, index == 0)[1]

    return jax.lax.fori_loop(0, blocks, body, KVCache.empty(model.config, B, block))


def target_logprobs(logits_BxTxV, targets_BxT):
    """float32 ``[B, T]``: each target's log-probability under the logits."""
    logprobs = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logprobs, targets_BxT[..., None], axis=-1)[..., 0]


@functools.cache
def compiled_scan(model: Decoder, block: int):
    """``(params, inputs [B, n·w], targets [B, n·w]) → logprobs [B, n·w]``:
    :func:`scan_blocks` jitted, each block reduced to its targets' log-probabilities
    (what :func:`lexjax.evaluation.block_scan_logprobs` runs, without its checks).

    XLA compiles the scan body once per (B, n); only its trip count depends on
    the length, and the previous block is the only state kept between blocks.
    """

    def run(params, inputs_BxN, targets_BxN):
        emit = lambda logits, targets_BxW, _: target_logprobs(logits, targets_BxW)
        _, logprobs_nxBxW = scan_blocks(
            model, params, inputs_BxN, block, emit, extra_BxN=targets_BxN
        )
        return logprobs_nxBxW.swapaxes(0, 1).reshape(inputs_BxN.shape)

    return jax.jit(run)


def _scan(step: Callable, carry, tokens_BxN, block: int, emit: Callable | None, extra_BxN):
    """``jax.lax.scan`` of ``step(carry, tokens_BxW, index) → (logits, carry, scores)``
    over the blocks of ``tokens_BxN`` (``extra_BxN`` cut alongside), each block's
    outputs reduced by ``emit`` as :func:`scan_blocks` describes."""
    B, N = tokens_BxN.shape
    _check_whole_blocks(tokens_BxN, block)
    n = N // block
    to_blocks = lambda x: None if x is None else x.reshape(B, n, block).swapaxes(0, 1)

    def body(carry, xs):
        tokens_BxW, extra_BxW, index = xs
        logits, carry, scores = step(carry, tokens_BxW, index)
        return carry, None if emit is None else emit(logits, extra_BxW, scores)

    xs = (to_blocks(tokens_BxN), to_blocks(extra_BxN), jnp.arange(n, dtype=jnp.int32))
    return jax.lax.scan(body, carry, xs)


# --------------------------------------------------------------------------- sinks + window


def sink_window(block: int, sinks: int) -> int:
    """W = train_len − sinks = 2w − sinks: the recent tokens each query sees
    (itself included). Raises :class:`~lexjax.errors.ConfigError` (a ValueError)
    unless ``0 ≤ sinks ≤ w`` (the sinks come from the first block)."""
    check_int(arg("block"), block)
    if (
        not isinstance(sinks, numbers.Integral)
        or isinstance(sinks, bool)
        or not 0 <= sinks <= block
    ):
        raise ConfigError(
            f"{arg('sinks')}={sinks!r} must be an integer in [0, {block}] (train_len/2)"
        )
    return 2 * block - sinks


def sink_step(
    model: Decoder,
    params,
    carry: tuple[KVCache | None, KVCache],
    tokens_BxW,
    index,
    *,
    sinks: int,
    return_scores: bool = False,
):
    """One step of the sink + sliding-window scan (module docstring): block ``index``.

    Args:
      carry: ``(sink cache of S slots at positions 0 … S−1, or None when S = 0;
        window cache of 2w slots holding blocks index−2 and index−1 at window
        positions 0 … 2w−1)``; invalid slots before they are filled.
      tokens_BxW: the block's tokens.
      index: int32 scalar (may be traced), the block's index in the sequence.

    Returns:
      ``(logits_BxWxV, the next step's carry, scores)``; scores are ``[L, B, H,
      W, S + 3W]`` (keys ``[sinks, window cache, block]``) when ``return_scores``,
      else None.
    """
    sink_cache, window = carry
    B, W = tokens_BxW.shape
    offsets = jnp.arange(W, dtype=jnp.int32)
    positions_BxW = jnp.broadcast_to(2 * W + offsets, (B, W))
    sink_positions_BxW = jnp.broadcast_to(jnp.minimum(index * W + offsets, 2 * W - 1), (B, W))
    out = model.apply(
        {"params": params},
        tokens_BxW,
        positions_BxW,
        cache=window,
        window=sink_window(W, sinks),
        sinks=sink_cache,
        sink_positions_BxT=sink_positions_BxW if sink_cache is not None else None,
        return_scores=return_scores,
    )
    logits, (k, v) = out[:2]
    # Block 0's first S tokens become the sinks: out of the window, so seen once.
    kept_BxW = jnp.broadcast_to((offsets >= sinks) | (index > 0), (B, W))
    window = KVCache(
        jnp.concatenate([window.k[:, :, W:], k.astype(window.k.dtype)], axis=2),
        jnp.concatenate([window.v[:, :, W:], v.astype(window.v.dtype)], axis=2),
        window.positions,
        jnp.concatenate([window.valid[:, W:], kept_BxW], axis=1),
    )
    if sink_cache is not None:
        first = sink_cache.write(0, (k[:, :, :sinks], v[:, :, :sinks]), sink_cache.positions)
        sink_cache = jax.tree.map(lambda a, b: jnp.where(index == 0, a, b), first, sink_cache)
    return logits, (sink_cache, window), out[2] if return_scores else None


def scan_sinks(
    model: Decoder,
    params,
    tokens_BxN,
    block: int,
    sinks: int,
    emit: Callable | None = None,
    *,
    extra_BxN=None,
    return_scores: bool = False,
):
    """The sink + sliding-window scan: :func:`sink_step` over every block of
    ``tokens_BxN`` (N a multiple of w); ``emit`` and the result as in
    :func:`scan_blocks`, the carry being ``(sink cache, window cache)``.

    Per block the attention scores w queries against S + 3w keys (BCA: 2w);
    memory is O(B·w) besides the inputs and outputs, whatever the length.
    """
    sink_window(block, sinks)
    B = tokens_BxN.shape[0]
    model, params = for_loop(model, params)
    step = lambda carry, tokens_BxW, index: sink_step(
        model, params, carry, tokens_BxW, index, sinks=sinks, return_scores=return_scores
    )
    window = KVCache.empty(model.config, B, 2 * block)
    window = window.replace(
        positions=jnp.broadcast_to(jnp.arange(2 * block, dtype=jnp.int32), (B, 2 * block))
    )
    sink_cache = None
    if sinks:
        sink_cache = KVCache.empty(model.config, B, sinks)
        sink_cache = sink_cache.replace(
            positions=jnp.broadcast_to(jnp.arange(sinks, dtype=jnp.int32), (B, sinks))
        )
    return _scan(step, (sink_cache, window), tokens_BxN, block, emit, extra_BxN)
