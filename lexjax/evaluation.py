"""Evaluation at any length: the block scan, dense causal evaluation, perplexity, resolution.

Letters in names: B batch, N tokens, W block (w = train_len/2), L layers,
H heads, K head_dim, V vocabulary, C query chunk.

**Blockwise causal attention (BCA, paper §3.3) as a scan.** A sequence is cut
into blocks of w tokens and ``jax.lax.scan`` runs one block step per block.
The carry holds every layer's keys and values of the previous block *before*
position encoding. A step calls the training :class:`lexjax.model.Decoder`
with that carry as its ``cache``: the previous block's keys stand at window
positions ``0 … w−1`` and the current block at ``w … 2w−1``, so queries see
their own block causally and the whole previous block, and no distance ever
exceeds ``2w − 1 = train_len − 1``. The first block has no previous block
(its cache is invalid) and stands at ``0 … w−1``: for relative encodings
(XPOS, RoPE, ALiBi) only distances matter, so that is the same as ``w … 2w−1``;
for absolute ones (sinusoidal, learned) it is what training showed the model
for a sequence start. Under BCA every position is below ``train_len``, so a
learned position table of ``train_len`` entries serves any length.

A key's position encoding comes from the window it is *used* in; its value
(and, for absolute encodings, the embedding added to the token before the
first layer) comes from the step that computed it. That is exactly
:func:`lexjax.masks.blockwise_causal` applied over the whole sequence with
positions ``0 … N−1`` for relative encodings (scores depend only on
distance), and with positions ``i mod w + w·[i ≥ w]`` for absolute ones;
the tests check both.

**Without BCA** (the paper's "− BCA" rows): plain causal attention over
positions ``0 … N−1``, evaluated C queries at a time against a key/value cache
of all N positions, so the largest score matrix is ``C × (N + C)``, not
``N × N``.

Perplexity follows the paper's protocol: documents of at least ``L_max + 1``
tokens; the first ``L_max + 1`` of each give ``L_max`` (input, target) pairs,
which are split into segments of the evaluated length ``l``, each evaluated
on its own from its first token; perplexity = exp(mean NLL over every
target). Each length and mode therefore scores the same ``docs × L_max``
targets.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lexjax import positions as pos_lib
from lexjax import resolution as res_lib
from lexjax.config import ModelConfig
from lexjax.errors import EvaluationError
from lexjax.model import Decoder, init_cache

__all__ = [
    "EvaluationError",
    "MODES",
    "block_positions",
    "block_step",
    "block_scan_logprobs",
    "full_logprobs",
    "check_full_length",
    "segments",
    "PerplexityResult",
    "perplexity",
    "ResolutionResult",
    "measure_resolution",
]

MODES = ("bca", "full")


# --------------------------------------------------------------------------- the block scan


def block_positions(block_index, block: int):
    """Window-relative positions ``[W]`` of the current block: ``0 … w−1`` for the
    first block, ``w … 2w−1`` after it (the previous block holds ``0 … w−1``)."""
    offsets = jnp.arange(block, dtype=jnp.int32)
    return jnp.where(block_index == 0, offsets, offsets + block)


def empty_carry(config: ModelConfig, batch: int, block: int) -> dict:
    """The carry before the first block: w invalid slots per layer."""
    cache = init_cache(config, batch, block)
    return {"k": cache["k"], "v": cache["v"], "valid": cache["valid"]}


def _layer_scores(intermediates) -> jax.Array:
    """Sown pre-softmax scores as ``[L, B, H, Tq, Tk]`` (scanned or unrolled layers)."""
    tree = intermediates["intermediates"]
    if "layers" in tree:
        return tree["layers"]["attention"]["scores"][0]
    count = sum(1 for name in tree if name.startswith("layer_"))
    return jnp.stack([tree[f"layer_{i}"]["attention"]["scores"][0] for i in range(count)])


def block_step(
    model: Decoder, params, carry: dict, tokens_BxW, block_index, *, capture_scores: bool = False
):
    """One BCA step: the current block attends to ``[previous block, itself]``.

    Args:
      carry: ``{"k", "v": [L, B, W, H, K], "valid": [B, W]}``, the previous
        block's keys/values before position encoding (see :func:`empty_carry`).
      tokens_BxW: the current block.
      block_index: int32 scalar; 0 marks the first block (see :func:`block_positions`).

    Returns:
      ``(logits_BxWxV, new_carry, scores)``; ``new_carry`` holds this block's
      keys/values, all valid; ``scores`` is ``[L, B, H, W, 2W]`` (the keys are
      ``[previous, current]``) when ``capture_scores``, else None.
    """
    B, W = tokens_BxW.shape
    positions_BxW = jnp.broadcast_to(block_positions(block_index, W), (B, W))
    cache = {
        "k": carry["k"],
        "v": carry["v"],
        "valid": carry["valid"],
        "positions": jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W)),
    }
    scores = None
    if capture_scores:
        (logits, kv), intermediates = model.apply(
            {"params": params}, tokens_BxW, positions_BxW, cache=cache, mutable=["intermediates"]
        )
        scores = _layer_scores(intermediates)
    else:
        logits, kv = model.apply({"params": params}, tokens_BxW, positions_BxW, cache=cache)
    new_carry = {
        "k": kv["k"].astype(carry["k"].dtype),
        "v": kv["v"].astype(carry["v"].dtype),
        "valid": jnp.ones((B, W), bool),
    }
    return logits, new_carry, scores


def _target_logprobs(logits_BxTxV, targets_BxT):
    logprobs = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logprobs, targets_BxT[..., None], axis=-1)[..., 0]


def _pad_to(x_BxN, multiple: int):
    n = x_BxN.shape[1]
    padded = -(-n // multiple) * multiple
    return jnp.pad(x_BxN, ((0, 0), (0, padded - n)))


@functools.cache
def _compiled_scan(model: Decoder, block: int, capture_scores: bool):
    """``(params, inputs [B, n·w], targets [B, n·w]) → (logprobs [B, n·w], scores)``, jitted.

    XLA compiles the scan body once per (B, n); only its trip count depends on
    the length, and the carry is the only state kept between blocks.
    """

    def run(params, inputs_BxN, targets_BxN):
        B, N = inputs_BxN.shape
        n = N // block
        blocks = (
            inputs_BxN.reshape(B, n, block).swapaxes(0, 1),
            targets_BxN.reshape(B, n, block).swapaxes(0, 1),
            jnp.arange(n, dtype=jnp.int32),
        )

        def step(carry, xs):
            tokens_BxW, targets_BxW, index = xs
            logits, carry, scores = block_step(
                model, params, carry, tokens_BxW, index, capture_scores=capture_scores
            )
            return carry, (_target_logprobs(logits, targets_BxW), scores)

        _, (logprobs_nxBxW, scores) = jax.lax.scan(
            step, empty_carry(model.config, B, block), blocks
        )
        return logprobs_nxBxW.swapaxes(0, 1).reshape(B, N), scores

    return jax.jit(run)


def _check_block(block: int):
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise EvaluationError(f"block must be a positive integer, got {block!r}")


def _inputs_targets(tokens_BxL):
    tokens_BxL = jnp.asarray(tokens_BxL, jnp.int32)
    if tokens_BxL.ndim != 2 or tokens_BxL.shape[1] < 2:
        raise EvaluationError(f"tokens must be [batch, length ≥ 2], got shape {tokens_BxL.shape}")
    return tokens_BxL[:, :-1], tokens_BxL[:, 1:]


def block_scan_logprobs(model: Decoder, params, tokens_BxL, block: int):
    """Next-token log-probabilities under blockwise causal attention, by the block scan.

    Args:
      model: the training :class:`~lexjax.model.Decoder`.
      params: its parameters (unboxed).
      tokens_BxL: int32 ``[B, L]``, L ≥ 2, any length.
      block: w, half the training length.

    Returns:
      float32 ``[B, L−1]``: entry t is ``log p(tokens[t+1] | tokens[≤t])``,
      token t seeing tokens ``(⌊t/w⌋ − 1)·w … t``. The inputs are padded to a
      multiple of w; padding comes after every real token, so it never
      influences one, and its outputs are dropped. Memory is O(B·w) apart from
      the tokens and the result.
    """
    _check_block(block)
    inputs, targets = _inputs_targets(tokens_BxL)
    n = inputs.shape[1]
    logprobs, _ = _compiled_scan(model, block, False)(
        params, _pad_to(inputs, block), _pad_to(targets, block)
    )
    return logprobs[:, :n]


# --------------------------------------------------------------------------- without BCA


def check_full_length(config: ModelConfig, length: int) -> None:
    """Raises :class:`EvaluationError` when plain causal attention over ``length``
    positions cannot be evaluated faithfully.

    - learned absolute positions: only ``max_len`` positions exist;
    - XPOS: positions are centred (``attention.encode_qk``), so the largest
      magnitude is about ``length/2``; it must stay within
      :func:`lexjax.positions.max_safe_position` for the compute dtype.
    """
    if config.position == "learned" and length > config.max_len:
        raise EvaluationError(
            f"learned absolute positions have a table of {config.max_len}; length {length} "
            "without BCA would need positions beyond it (evaluate it with BCA, whose "
            "window-relative positions stay below train_len)"
        )
    if config.position == "xpos":
        limit = pos_lib.max_safe_position(config.scale_base, dtype=config.dtype)
        if length / 2 > limit:
            raise EvaluationError(
                f"length {length} without BCA puts XPOS positions at ±{length // 2}, beyond "
                f"the {config.dtype} safe range ±{int(limit)} for scale_base "
                f"{config.scale_base:g}; use BCA or a shorter length"
            )


@functools.cache
def _compiled_full(model: Decoder, chunk: int):
    """``(params, inputs [B, n·C], targets) → logprobs``: causal attention over all
    earlier positions, C queries per step against an ``n·C``-slot cache."""

    def run(params, inputs_BxN, targets_BxN):
        B, N = inputs_BxN.shape
        n = N // chunk
        # Unwritten slots keep position 0 (and are invalid), so XPOS's centring
        # shift spans only the positions used so far: |p| ≤ N/2.
        cache = init_cache(model.config, B, N)
        chunks = (
            inputs_BxN.reshape(B, n, chunk).swapaxes(0, 1),
            targets_BxN.reshape(B, n, chunk).swapaxes(0, 1),
            jnp.arange(n, dtype=jnp.int32),
        )

        def step(cache, xs):
            tokens_BxC, targets_BxC, index = xs
            start = index * chunk
            positions_BxC = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
            logits, kv = model.apply({"params": params}, tokens_BxC, positions_BxC, cache=cache)
            at = (0, 0, start, 0, 0)
            cache = dict(
                cache,
                k=jax.lax.dynamic_update_slice(cache["k"], kv["k"].astype(cache["k"].dtype), at),
                v=jax.lax.dynamic_update_slice(cache["v"], kv["v"].astype(cache["v"].dtype), at),
                positions=jax.lax.dynamic_update_slice(
                    cache["positions"], positions_BxC, (0, start)
                ),
                valid=jax.lax.dynamic_update_slice(
                    cache["valid"], jnp.ones((B, chunk), bool), (0, start)
                ),
            )
            return cache, _target_logprobs(logits, targets_BxC)

        _, logprobs_nxBxC = jax.lax.scan(step, cache, chunks)
        return logprobs_nxBxC.swapaxes(0, 1).reshape(B, N)

    return jax.jit(run)


def full_logprobs(model: Decoder, params, tokens_BxL, *, chunk: int):
    """Next-token log-probabilities under plain causal attention over positions 0 … L−2.

    Same contract as :func:`block_scan_logprobs`, without the block limit:
    token t sees every token ≤ t. Queries run ``chunk`` at a time against a
    cache of all positions (memory O(B·L·chunk) for the scores, O(B·L) for the
    cache). Raises :class:`EvaluationError` where :func:`check_full_length` does.
    """
    _check_block(chunk)
    inputs, targets = _inputs_targets(tokens_BxL)
    n = inputs.shape[1]
    check_full_length(model.config, n)
    if model.config.position == "learned":
        # n ≤ max_len, a training-sized matrix; padding could stand past the
        # table, where a lookup is NaN and 0·NaN would reach the real tokens.
        chunk = n
    logprobs = _compiled_full(model, chunk)(params, _pad_to(inputs, chunk), _pad_to(targets, chunk))
    return logprobs[:, :n]


# --------------------------------------------------------------------------- perplexity


def segments(documents: Sequence[np.ndarray], length: int, max_length: int) -> np.ndarray:
    """``[docs · ⌊max_length/length⌋, length + 1]`` int32: the paper's segments.

    The first ``max_length + 1`` tokens of each document give ``max_length``
    targets, split into runs of ``length`` (a remainder shorter than
    ``length`` is left out); a segment carries its ``length`` inputs and the
    one token after them (consecutive segments share it).
    """
    if not 1 <= length <= max_length:
        raise EvaluationError(f"length {length} must be in 1 … {max_length}")
    rows = []
    for doc in documents:
        if len(doc) < max_length + 1:
            raise EvaluationError(
                f"a document of {len(doc)} tokens is shorter than max_length + 1 = {max_length + 1}"
            )
        for start in range(0, max_length - length + 1, length):
            rows.append(np.asarray(doc[start : start + length + 1], np.int32))
    return np.stack(rows) if rows else np.zeros((0, length + 1), np.int32)


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    mode: str  # "bca" | "full"
    length: int
    perplexity: float
    nll: float  # mean negative log-likelihood per token (nats)
    tokens: int
    documents: int
    seconds: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _batches(rows: np.ndarray, batch: int):
    """Fixed-size batches (the last one padded with zero rows) and their real row counts."""
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        real = len(part)
        if real < batch:
            part = np.concatenate([part, np.zeros((batch - real, rows.shape[1]), rows.dtype)])
        yield part, real


def perplexity(
    model: Decoder,
    params,
    documents: Sequence[np.ndarray],
    lengths: Iterable[int],
    *,
    block: int,
    modes: Iterable[str] = MODES,
    tokens_per_batch: int = 8192,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[PerplexityResult]:
    """Perplexity at each length and mode by the paper's protocol (module docstring).

    Args:
      documents: int32 token arrays, each at least ``max(lengths) + 1`` long.
      lengths: evaluated lengths (see :func:`segments` for one that does not
        divide the largest).
      block: w = train_len/2; the full mode uses it as its query chunk too.
      tokens_per_batch: segments are batched up to this many tokens per call.
      progress: called as ``progress(done, total, label)`` after each batch
        (counts in targets over all lengths and modes).
    """
    lengths = sorted(set(int(n) for n in lengths))
    modes = list(modes)
    for mode in modes:
        if mode not in MODES:
            raise EvaluationError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    if not lengths or lengths[0] < 1:
        raise EvaluationError(f"lengths must be positive, got {lengths}")
    if not documents:
        raise EvaluationError("no documents to evaluate")
    max_length = lengths[-1]
    if "full" in modes:
        for length in lengths:
            check_full_length(model.config, length)
    total = len(documents) * sum(max_length // n * n for n in lengths) * len(modes)
    done = 0
    results = []
    for mode in modes:
        for length in lengths:
            rows = segments(documents, length, max_length)
            batch = max(1, min(len(rows), tokens_per_batch // length))
            start = time.perf_counter()
            nll_sum, count = 0.0, 0
            for part, real in _batches(rows, batch):
                if mode == "bca":
                    logprobs = block_scan_logprobs(model, params, part, block)
                else:
                    logprobs = full_logprobs(model, params, part, chunk=block)
                nll_sum -= float(jnp.sum(logprobs[:real], dtype=jnp.float32))
                count += real * length
                done += real * length
                if progress is not None:
                    progress(done, total, f"{mode} {length}")
            nll = nll_sum / count
            results.append(
                PerplexityResult(
                    mode,
                    length,
                    math.exp(nll),
                    nll,
                    count,
                    len(documents),
                    time.perf_counter() - start,
                )
            )
    return results


# --------------------------------------------------------------------------- resolution


@dataclasses.dataclass(frozen=True)
class ResolutionResult:
    mode: str  # "bca" | "full"
    length: int
    per_layer: tuple  # R of paper eq. 3 for each layer
    mean: float  # mean over layers
    expected_scores: tuple  # per layer, s[n] for n = 0 … max distance (eq. 11)
    documents: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.cache
def _compiled_dense_scores(model: Decoder):
    """``(params, inputs [B, N]) → [L, N, N]``: causal pre-softmax scores averaged
    over texts and heads (the average is taken on the device to keep L×B×H×N² off it)."""

    def run(params, inputs_BxN):
        _, intermediates = model.apply({"params": params}, inputs_BxN, mutable=["intermediates"])
        return jnp.mean(_layer_scores(intermediates), axis=(1, 2))

    return jax.jit(run)


@functools.cache
def _compiled_window_scores(model: Decoder, block: int):
    """``(params, inputs [B, n·w]) → [n, L, W, 2W]``: each BCA window's scores
    (queries: its block; keys: [previous block, its block]) averaged over texts and heads."""

    def run(params, inputs_BxN):
        B, N = inputs_BxN.shape
        n = N // block
        blocks = (inputs_BxN.reshape(B, n, block).swapaxes(0, 1), jnp.arange(n, dtype=jnp.int32))

        def step(carry, xs):
            tokens_BxW, index = xs
            _, carry, scores = block_step(
                model, params, carry, tokens_BxW, index, capture_scores=True
            )
            return carry, jnp.mean(scores, axis=(1, 2))

        return jax.lax.scan(step, empty_carry(model.config, B, block), blocks)[1]

    return jax.jit(run)


def _distance_counts(mask_QxK: np.ndarray) -> np.ndarray:
    """Number of True pairs at each distance n = i + K − Q − j (bottom-right aligned)."""
    q, k = mask_QxK.shape
    distance = np.arange(q)[:, None] + (k - q) - np.arange(k)[None, :]
    return np.bincount(distance[mask_QxK], minlength=k)[:k]


def _pooled_expected_scores(scores_list, masks_list):
    """Per-distance means pooled over score sets ``[L, Q, K]`` (same K) with masks ``[Q, K]``.

    Each set's means come from :func:`lexjax.resolution.expected_scores`; sets
    are combined weighted by how many pairs they have at each distance.
    Returns ``[L, D]`` for the distances 0 … D−1 that occur.
    """
    total, count = 0.0, 0
    for scores, mask in zip(scores_list, masks_list):
        counts = _distance_counts(mask)
        means = np.nan_to_num(np.asarray(res_lib.expected_scores(scores, mask)))
        total, count = total + means * counts, count + counts
    last = np.nonzero(count)[0].max() + 1
    return total[:, :last] / np.maximum(count[:last], 1)


def measure_resolution(
    model: Decoder, params, tokens_BxN, *, block: int, mode: str
) -> ResolutionResult:
    """Attention resolution per layer (paper eq. 3) from measured scores (eq. 11).

    ``s[n]`` is the pre-softmax score of query i and key i − n averaged over
    queries, heads and texts (the rows of ``tokens_BxN``, all of length N), for
    every pair the mode lets attend:

    - ``"full"``: every pair j ≤ i of one causal forward over positions 0 … N−1
      (n = 0 … N−1);
    - ``"bca"``: every pair inside a BCA window — a block's queries against the
      previous block and their own causal prefix, as the block scan scores them
      (n = 0 … 2w−1; pairs at one distance from all windows are pooled).

    R is then :func:`lexjax.resolution.attention_resolution` of each layer's s.
    """
    if mode not in MODES:
        raise EvaluationError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    _check_block(block)
    tokens_BxN = jnp.asarray(tokens_BxN, jnp.int32)
    B, n = tokens_BxN.shape
    if n < 2:
        raise EvaluationError(f"resolution needs at least 2 tokens, got {n}")
    if mode == "full":
        check_full_length(model.config, n)
        scores = np.asarray(_compiled_dense_scores(model)(params, tokens_BxN))
        mask = np.tril(np.ones((n, n), bool))
        curves = _pooled_expected_scores([scores], [mask])
    else:
        windows = np.asarray(
            _compiled_window_scores(model, block)(params, _pad_to(tokens_BxN, block))
        )
        q = np.arange(block)[:, None]
        k = np.arange(2 * block)[None, :]
        score_sets, mask_sets = [], []
        for b in range(windows.shape[0]):
            previous = (k < block) & (b > 0)
            current = (k >= block) & (k - block <= q)
            real = (b * block + q < n) & (b * block + k - block < n)  # padding never counts
            score_sets.append(windows[b])
            mask_sets.append(np.asarray(previous | (current & real)) & (b * block + q < n))
        curves = _pooled_expected_scores(score_sets, mask_sets)
    per_layer = np.asarray(res_lib.attention_resolution(curves))
    return ResolutionResult(
        mode,
        n,
        tuple(float(r) for r in per_layer),
        float(per_layer.mean()),
        tuple(map(tuple, curves.tolist())),
        B,
    )
