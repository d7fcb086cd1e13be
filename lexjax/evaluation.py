"""Evaluation at any length: perplexity and attention resolution, with and without BCA,
and with attention sinks + a sliding window.

Letters in names: B batch, N tokens, W block (w = train_len/2), L layers,
H heads, K head_dim, V vocabulary, C query chunk.

**With BCA** (paper §3.3): the block scan of :mod:`lexjax.blockwise`, whose
module docstring gives the window and its positions.

**Without BCA** (the paper's "− BCA" rows): plain causal attention over
positions ``0 … N−1``, evaluated C queries at a time against a key/value cache
of all N positions, so the largest score matrix is ``C × (N + C)``, not
``N × N``.

**Sinks + sliding window** (``"sinks"``; StreamingLLM, Xiao et al. 2023):
token t attends to the first S tokens of the segment (the sinks, default
:data:`DEFAULT_SINKS`) and to its ``W = train_len − S`` most recent tokens
(itself included), at the positions of StreamingLLM's cache: sinks at
``0 … S−1``, window keys after them, the query last, so a window key is at its
true distance and a sink at ``min(t, train_len−1) − s``. It runs block by
block like BCA (:func:`lexjax.blockwise.scan_sinks`), each token's keys and
values computed once in its own step. Up to train_len tokens nothing is
evicted and it equals ``"full"``. Absolute encodings (sinusoidal, learned)
have no such cell: StreamingLLM re-positions cached keys, and an absolute
position is added to a token's input once, before any key exists.

Perplexity follows the paper's protocol with a fixed **token budget**
``max_length`` (the paper's 4k): documents of at least ``max_length + 1``
tokens; the first ``max_length + 1`` of each give ``max_length`` (input,
target) pairs, which are split into segments of the evaluated length ``l``,
each evaluated on its own from its first token; perplexity = exp(mean NLL
over every target). Every cell (mode, length) of a table therefore scores the
same ``docs × max_length`` targets, and a cell's number depends only on the
checkpoint, its mode and length, the budget and the documents — never on
which other lengths were asked. A cell that cannot score all of them (a
length that does not divide the budget, a mode that cannot evaluate a
length) is missing, never computed on other tokens.

**RoPE extensions** (``model.rope_scaling``, :mod:`lexjax.positions`): a
factor of 0 means each evaluated length / ``rope_train_len``, resolved here
per length (:func:`at_length`) in both modes, so a BCA window of train_len
tokens is compressed by the same s as the dense path (the windows never exceed
train_len, so there a scaling can only compress). ``dynamic_ntk`` follows the
positions processed: with BCA they stay below train_len (s = 1, no change;
BCA refuses a ``rope_train_len`` below its window,
:func:`lexjax.blockwise.bca_problem`); without BCA each chunk of ``w`` queries
takes s = max(1, (end of the chunk)/L), the last real token's position + 1 for
a padded last chunk, and rotates every cached key with it (keys are cached
before encoding). For one layer that is exactly a dense forward over the
prefix with that s (tested); from the second layer on, a cached key is the
projection of a hidden state computed when its own chunk ran, at that chunk's
s — what any KV cache keeps (implementations that cache rotated keys also keep
their old rotation). With the default factor, ``ntk`` instead takes s = L/train_len for every chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lexjax import checkpoint, reports
from lexjax import data as data_lib
from lexjax import lease as lease_lib
from lexjax import positions as pos_lib
from lexjax import resolution as res_lib
from lexjax import sharding as shard_lib
from lexjax.blockwise import (
    KVCache,
    bca_problem,
    compiled_scan,
    for_loop,
    pad_to,
    scan_blocks,
    scan_sinks,
    sink_window,
    target_logprobs,
    window_mask,
    window_ntk_problem,
)
from lexjax.config import (
    ABSOLUTE_ENCODINGS,
    DECAYING_ENCODINGS,
    Config,
    ConfigError,
    ModelConfig,
    check_bool,
    check_int,
    check_rope_scaling,
    is_sequence,
)
from lexjax.data.builders import distinct_files, file_document, glob_files, text_files_of
from lexjax.errors import DataError, EvaluationError, LexjaxError, arg, counted, one_line
from lexjax.model import Decoder
from lexjax.progress import Progress, note

__all__ = [
    "MODES",
    "DEFAULT_MODES",
    "DEFAULT_SINKS",
    "DEFAULT_MAX_DOCS",
    "check_settings",
    "at_length",
    "block_scan_logprobs",
    "sinks_logprobs",
    "check_sinks",
    "sinks_problem",
    "sink_window",  # lexjax.blockwise's: the sink-count check of the programs
    "RESOLUTION_MODES",
    "check_modes",
    "full_logprobs",
    "check_full_length",
    "full_length_problem",
    "full_length_limit",
    "segments",
    "PerplexityResult",
    "perplexity",
    "ResolutionResult",
    "measure_resolution",
    "held_out_documents",
    "select_documents",
    "default_lengths",
    "budget",
    "settings_name",
    "scored_digest",
    "cell_problem",
    "check_grid",
    "usable_cells",
    "resolution_protocol",
    "resolution_documents",
    "evaluate_run",
    "load_on_mesh",
]

# Every evaluation mode; DEFAULT_MODES: those evaluated unless others are asked for.
MODES = ("bca", "full", "sinks")
DEFAULT_MODES = ("bca", "full")
# The modes attention resolution is measured in (measure_resolution).
RESOLUTION_MODES = ("bca", "full")
# StreamingLLM's attention sinks: the first tokens every query keeps (its paper uses 4).
DEFAULT_SINKS = 4
# Documents read unless more or fewer are asked for (eval.py's --max_docs).
DEFAULT_MAX_DOCS = 20


def _check_block(block: int):
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise EvaluationError(f"block must be a positive integer, got {block!r}")


def _inputs_targets(tokens_BxL):
    tokens_BxL = jnp.asarray(tokens_BxL, jnp.int32)
    if tokens_BxL.ndim != 2 or tokens_BxL.shape[1] < 2:
        raise EvaluationError(f"tokens must be [batch, length ≥ 2], got shape {tokens_BxL.shape}")
    return tokens_BxL[:, :-1], tokens_BxL[:, 1:]


def at_length(model: Decoder, length: int) -> Decoder:
    """``model`` with a RoPE extension's factor 0 resolved to ``length`` / its
    ``rope_train_len`` (:func:`lexjax.positions.length_factor`); unchanged for no
    extension, an explicit factor, or ``dynamic_ntk`` (whose factor follows the
    positions at run time)."""
    c = model.config
    if c.rope_scaling in ("none", "dynamic_ntk") or c.rope_factor:
        return model
    factor = pos_lib.length_factor(length, c.rope_train_len)
    return model.clone(config=dataclasses.replace(c, rope_factor=factor))


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
      the tokens and the result. A RoPE extension's factor 0 is L−1 / its
      training length (:func:`at_length`).
    """
    _check_block(block)
    inputs, targets = _inputs_targets(tokens_BxL)
    n = inputs.shape[1]
    model = at_length(model, n)
    logprobs = compiled_scan(model, block)(params, pad_to(inputs, block), pad_to(targets, block))
    return logprobs[:, :n]


# --------------------------------------------------------------------------- sinks + window


@functools.cache
def _compiled_sinks(model: Decoder, block: int, sinks: int):
    """``(params, inputs [B, n·w], targets) → logprobs``: the sink + window scan, jitted."""

    def run(params, inputs_BxN, targets_BxN):
        emit = lambda logits, targets_BxW, _: target_logprobs(logits, targets_BxW)
        _, logprobs_nxBxW = scan_sinks(
            model, params, inputs_BxN, block, sinks, emit, extra_BxN=targets_BxN
        )
        return logprobs_nxBxW.swapaxes(0, 1).reshape(inputs_BxN.shape)

    return jax.jit(run)


def check_sinks(config: ModelConfig, block: int, sinks: int) -> None:
    """Raises :class:`ConfigError` for a sink count outside ``0 … train_len/2``,
    :class:`EvaluationError` where :func:`sinks_problem` names why the sink + window
    mode cannot run this model at ``block``."""
    sink_window(block, sinks)
    if problem := sinks_problem(config, block):
        raise EvaluationError(problem)


def sinks_problem(config: ModelConfig, block: int) -> str | None:
    """Why the sink + window mode cannot run this model at ``block``, or None.

    An absolute encoding cannot be re-positioned. Dynamic NTK takes s = 1 here
    (:class:`lexjax.Decoder`'s ``window``), right only where ``rope_train_len`` is
    at least the cache's 2·block positions. XPOS's keys in a step span
    window positions 0 … 3w−1 (two cached blocks and the current one), ±1.5·w once
    centred, half as far again as BCA's ±w: the scale must stay within
    :func:`lexjax.positions.max_safe_position` there (PI's decay base b·s is not
    counted: the check stays conservative, as mode full's)."""
    if config.position in ABSOLUTE_ENCODINGS:
        return (
            f"sinks + window needs a relative encoding or none, not {config.position}: "
            "StreamingLLM re-positions cached keys inside its cache, and an absolute "
            "position is added to a token's input once (evaluate bca or full)"
        )
    # Its s is 1 here (the model: StreamingLLM's positions stay below 2·block).
    if problem := window_ntk_problem(config, block, "sinks + window", "evaluate bca or full"):
        return problem
    if config.position in DECAYING_ENCODINGS:
        limit = pos_lib.max_safe_position(config.scale_base, dtype=config.dtype)
        if 3 * block / 2 > limit:
            return (
                f"sinks + window at block {block} puts XPOS positions at ±{3 * block // 2}, "
                f"beyond the {config.dtype} safe range ±{int(limit)} for scale_base "
                f"{config.scale_base:g}; use a block ≤ {math.floor(2 * limit / 3)} or mode bca"
            )
    return None


def sinks_logprobs(model: Decoder, params, tokens_BxL, block: int, sinks: int = DEFAULT_SINKS):
    """Next-token log-probabilities with ``sinks`` attention sinks and a sliding
    window of ``2·block − sinks`` tokens (module docstring), by the block scan.

    Same contract as :func:`block_scan_logprobs`: entry t of the float32
    ``[B, L−1]`` result is ``log p(tokens[t+1] | sinks, tokens[t−W+1 … t])``;
    memory O(B·w) whatever L; a RoPE extension's factor 0 is L−1 / its training
    length (:func:`at_length`), as in the other modes. Raises
    :class:`EvaluationError` where :func:`check_sinks` does.
    """
    _check_block(block)
    check_sinks(model.config, block, sinks)
    inputs, targets = _inputs_targets(tokens_BxL)
    n = inputs.shape[1]
    run = _compiled_sinks(at_length(model, n), block, sinks)
    return run(params, pad_to(inputs, block), pad_to(targets, block))[:, :n]


# --------------------------------------------------------------------------- without BCA


def check_full_length(config: ModelConfig, length: int) -> None:
    """Raises :class:`EvaluationError` when plain causal attention over ``length``
    positions cannot be evaluated faithfully (:func:`full_length_problem`)."""
    if problem := full_length_problem(config, length):
        raise EvaluationError("; ".join(problem))


def full_length_problem(config: ModelConfig, length: int) -> tuple[str, str] | None:
    """``(why, what to do)`` when plain causal attention over ``length`` positions
    cannot be evaluated faithfully, else None; callers that offer other remedies
    (generation) give the reason with their own.

    - learned absolute positions: only ``max_len`` positions exist;
    - XPOS (and its decay alone): positions are centred
      (``attention.encode_qk``), so the largest magnitude is about
      ``length/2``; it must stay within :func:`lexjax.positions.max_safe_position`
      for the compute dtype (PI's decay sees p/s: the check stays conservative).
    """
    if full_length_limit(config) >= length:
        return None
    if config.position == "learned":
        return (
            f"learned absolute positions have a table of {config.max_len}",
            f"length {length} without BCA would need positions beyond it (evaluate it with "
            "BCA, whose window-relative positions stay below train_len)",
        )
    limit = pos_lib.max_safe_position(config.scale_base, dtype=config.dtype)
    return (
        f"length {length} without BCA puts XPOS positions at ±{length // 2}, beyond the "
        f"{config.dtype} safe range ±{int(limit)} for scale_base {config.scale_base:g}",
        "use BCA or a shorter length",
    )


def full_length_limit(config: ModelConfig) -> float:
    """The most positions :func:`check_full_length` accepts (``inf``: no limit)."""
    if config.position == "learned":
        return config.max_len
    if config.position in DECAYING_ENCODINGS:
        return math.floor(2 * pos_lib.max_safe_position(config.scale_base, dtype=config.dtype))
    return math.inf


@functools.cache
def _compiled_full(model: Decoder, chunk: int):
    """``(params, inputs [B, n·C], targets, length) → logprobs``: causal attention over
    all earlier positions, C queries per step against an ``n·C``-slot cache; the first
    ``length`` inputs are real (dynamic NTK counts no padding)."""

    def run(params, inputs_BxN, targets_BxN, length):
        B, N = inputs_BxN.shape
        n = N // chunk
        # Unwritten slots keep position 0 (and are invalid), so XPOS's centring
        # shift spans only the positions used so far: |p| ≤ N/2.
        cache = KVCache.empty(model.config, B, N)
        loop_model, loop_params = for_loop(model, params)
        chunks = (
            inputs_BxN.reshape(B, n, chunk).swapaxes(0, 1),
            targets_BxN.reshape(B, n, chunk).swapaxes(0, 1),
            jnp.arange(n, dtype=jnp.int32),
        )

        def step(cache, xs):
            tokens_BxC, targets_BxC, index = xs
            start = index * chunk
            positions_BxC = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
            seen = jnp.minimum(start + chunk, length)
            logits, kv = loop_model.apply(
                {"params": loop_params}, tokens_BxC, positions_BxC, cache=cache, rope_length=seen
            )
            return cache.write(start, kv, positions_BxC), target_logprobs(logits, targets_BxC)

        _, logprobs_nxBxC = jax.lax.scan(step, cache, chunks)
        return logprobs_nxBxC.swapaxes(0, 1).reshape(B, N)

    return jax.jit(run)


def full_logprobs(model: Decoder, params, tokens_BxL, *, chunk: int):
    """Next-token log-probabilities under plain causal attention over positions 0 … L−2.

    Same contract as :func:`block_scan_logprobs`, without the block limit:
    token t sees every token ≤ t. Queries run ``chunk`` at a time against a
    cache of all positions (memory O(B·L·chunk) for the scores, O(B·L) for the
    cache). Raises :class:`EvaluationError` where :func:`check_full_length` does.
    A RoPE extension's factor 0 is L−1 / its training length (:func:`at_length`);
    ``dynamic_ntk``'s follows each chunk's end (module docstring).
    """
    _check_block(chunk)
    inputs, targets = _inputs_targets(tokens_BxL)
    n = inputs.shape[1]
    check_full_length(model.config, n)
    model = at_length(model, n)
    if model.config.position == "learned":
        # n ≤ max_len, a training-sized matrix; padding could stand past the
        # table, where a lookup is NaN and 0·NaN would reach the real tokens.
        chunk = n
    run = _compiled_full(model, chunk)
    logprobs = run(params, pad_to(inputs, chunk), pad_to(targets, chunk), jnp.int32(n))
    return logprobs[:, :n]


# --------------------------------------------------------------------------- perplexity


def segments(documents: Sequence[np.ndarray], length: int, max_length: int) -> np.ndarray:
    """``[docs · max_length/length, length + 1]`` int32: the paper's segments.

    The first ``max_length + 1`` tokens of each document give ``max_length``
    targets, split into runs of ``length`` (which must divide ``max_length``,
    so no target is left out); a segment carries its ``length`` inputs and
    the one token after them (consecutive segments share it).
    """
    if not 1 <= length <= max_length or max_length % length:
        raise EvaluationError(f"length {length} must divide the budget of {max_length} tokens")
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
    mode: str  # one of MODES
    length: int
    perplexity: float
    nll: float  # mean negative log-likelihood per token (nats)
    tokens: int
    documents: int
    seconds: float
    max_length: int  # the token budget per document (every cell of a table scores the same)
    bytes: int | None = None  # UTF-8 bytes of text the scored tokens cover
    bits_per_byte: float | None = None  # nll · tokens / (ln 2 · bytes): across tokenizers
    rope_scaling: str = "none"  # the model's inference-time RoPE extension (model.rope_scaling)
    rope_factor: float | None = None  # its s at this length; None: none, or dynamic_ntk's

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


def check_grid(modes: Sequence[str], lengths: Sequence[int]) -> None:
    """Raises :class:`EvaluationError` for no mode, one not in :data:`MODES`, or no
    length or one below 1: what every protocol over (mode, length) cells refuses."""
    for mode in modes:
        if mode not in MODES:
            raise EvaluationError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    if not modes:
        raise EvaluationError(f"no mode to evaluate: choose from {', '.join(MODES)}")
    if not lengths or min(lengths) < 1:
        raise EvaluationError(f"lengths must be positive, got {lengths}")


def usable_cells(
    modes: Iterable[str],
    lengths: Iterable[int],
    problem_of: Callable[[str, int], str | None],
    *,
    strict: bool,
    say: Callable[[str], None],
    what: str = "",
) -> list[tuple[str, int]]:
    """The ``(mode, length)`` cells ``problem_of`` finds no problem with, in order; a
    problem raises :class:`EvaluationError` when ``strict``, else it is a note
    ("no ``what`` MODE cell at length(s) N, …: …", one per mode and problem)
    through ``say``."""
    cells, notes = [], {}
    for mode in modes:
        for length in lengths:
            problem = problem_of(mode, length)
            if problem is None:
                cells.append((mode, length))
            elif strict:
                raise EvaluationError(problem)
            else:
                notes.setdefault((mode, problem), []).append(str(length))
    for (mode, problem), at in notes.items():
        s = "s" if len(at) > 1 else ""
        say(f"note: no {what}{mode} cell at length{s} {', '.join(at)}: {problem}")
    return cells


def cell_problem(
    config: ModelConfig, mode: str, length: int, max_length: int, block: int
) -> str | None:
    """Why the cell (mode, length) cannot score the budget's tokens at ``block``, or None."""
    if max_length % length:
        return f"length {length} does not divide the budget of {max_length} tokens"
    if mode == "full":
        try:
            check_full_length(config, length)
        except EvaluationError as e:
            return str(e)
    if mode == "sinks":
        return sinks_problem(config, block)
    if mode == "bca":
        return bca_problem(config, block)
    return None


def perplexity(
    model: Decoder,
    params,
    documents: Sequence[np.ndarray],
    lengths: Iterable[int],
    *,
    block: int,
    max_length: int | None = None,
    modes: Iterable[str] = DEFAULT_MODES,
    sinks: int = DEFAULT_SINKS,
    tokens_per_batch: int = 8192,
    progress: bool = False,
    strict: bool = True,
    say: Callable[[str], None] = note,
    tokenizer: data_lib.Tokenizer | None = None,
    batch_sharding: jax.sharding.NamedSharding | None = None,
) -> list[PerplexityResult]:
    """Perplexity at each length and mode by the paper's protocol (module docstring).

    Args:
      documents: int32 token arrays, each at least ``max_length + 1`` long.
      lengths: evaluated lengths.
      block: w = train_len/2; the full mode uses it as its query chunk too.
      modes: some of :data:`MODES` (default :data:`DEFAULT_MODES`).
      sinks: the sink count of mode ``"sinks"`` (0 … w).
      max_length: the token budget per document (default: the largest length).
      tokenizer: the documents' tokenizer; with it every result also gives the
        UTF-8 ``bytes`` the scored tokens cover and ``bits_per_byte``.
      tokens_per_batch: segments are batched up to this many tokens per call.
      progress: show a :class:`lexjax.progress.Progress` on stderr, counting
        targets over all lengths and modes.
      strict: a cell :func:`cell_problem` refuses (a length that does not
        divide the budget; one the mode cannot evaluate) raises; otherwise it
        is skipped, saying so with ``say``, and missing from the results.
      batch_sharding: where segments go (``sharding.batch_sharding`` of the
        evaluation mesh; call under ``jax.set_mesh``): batches are rounded up
        to a multiple of its batch shards with zero rows, which are dropped.
        None: the default device.
    """
    lengths = sorted(set(int(n) for n in lengths))
    modes = list(modes)
    check_grid(modes, lengths)
    if "sinks" in modes:
        sink_window(block, sinks)
    if not documents:
        raise EvaluationError("no documents to evaluate")
    max_length = lengths[-1] if max_length is None else int(max_length)
    if lengths[-1] > max_length:
        raise EvaluationError(f"length {lengths[-1]} exceeds the budget of {max_length} tokens")
    cells = usable_cells(
        modes,
        lengths,
        lambda mode, length: cell_problem(model.config, mode, length, max_length, block),
        strict=strict,
        say=say,
    )
    total = len(documents) * max_length * len(cells)
    # Every cell scores targets 1 … max_length of every document: the same bytes.
    covered = None
    if tokenizer is not None:
        covered = sum(tokenizer.num_bytes(d[1 : max_length + 1]) for d in documents)
    bar = Progress(total, label="tokens", enabled=progress)
    done = 0
    results = []
    for mode, length in cells:
        rows = segments(documents, length, max_length)
        batch = max(1, min(len(rows), tokens_per_batch // length))
        batch = shard_lib.fit_batch(batch, batch_sharding)
        start = time.perf_counter()
        nll_sum, count = 0.0, 0
        # One batch in flight: a batch's sum is read (a wait on the device) only once
        # the next one is dispatched, so the device never idles on the host's read.
        pending = []
        for part, real in itertools.chain(_batches(rows, batch), [(None, 0)]):
            if part is not None:
                if batch_sharding is not None:
                    part = jax.device_put(part, batch_sharding)
                if mode == "bca":
                    logprobs = block_scan_logprobs(model, params, part, block)
                elif mode == "sinks":
                    logprobs = sinks_logprobs(model, params, part, block, sinks)
                else:
                    logprobs = full_logprobs(model, params, part, chunk=block)
                pending.append((jnp.sum(logprobs[:real], dtype=jnp.float32), real))
            if len(pending) == 2 or part is None and pending:
                batch_sum, batch_rows = pending.pop(0)
                nll_sum -= float(batch_sum)
                count += batch_rows * length
                done += batch_rows * length
                bar.update(done, f"{mode} {length}")
        nll = nll_sum / count
        seconds = time.perf_counter() - start
        # A finite NLL past ~709 nats overflows exp: an infinite perplexity, not a crash.
        # (A NaN NLL stays NaN: a broken model, not an overflow.)
        perplexity = math.inf if nll >= math.log(sys.float_info.max) else math.exp(nll)
        bpb = nll_sum / (math.log(2) * covered) if covered else None
        scaled = at_length(model, length).config
        factor = None if scaled.rope_scaling in ("none", "dynamic_ntk") else scaled.rope_factor
        results.append(
            PerplexityResult(
                mode,
                length,
                perplexity,
                nll,
                count,
                len(documents),
                seconds,
                max_length,
                covered,
                bpb,
                scaled.rope_scaling,
                factor,
            )
        )
    bar.close()
    return results


# --------------------------------------------------------------------------- resolution


@dataclasses.dataclass(frozen=True)
class ResolutionResult:
    mode: str  # one of RESOLUTION_MODES
    length: int
    per_layer: tuple  # R of paper eq. 3 for each layer
    mean: float  # mean over layers
    expected_scores: tuple  # per layer, s[n] for n = 0 … max distance (eq. 11)
    documents: int
    # R's sums run over every distance s holds, so R of two modes compares only at
    # equal N: this is the mean R over the distances 0 … 2w−1 a BCA window holds.
    window_mean: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.cache
def _compiled_dense_scores(model: Decoder):
    """``(params, inputs [B, N]) → [L, N, N]``: causal pre-softmax scores averaged
    over texts and heads (the average is taken on the device to keep L×B×H×N² off it)."""

    def run(params, inputs_BxN):
        _, _, scores_LxBxHxNxN = model.apply({"params": params}, inputs_BxN, return_scores=True)
        return jnp.mean(scores_LxBxHxNxN, axis=(1, 2))

    return jax.jit(run)


@functools.cache
def _compiled_window_scores(model: Decoder, block: int):
    """``(params, inputs [B, n·w]) → [n, L, W, 2W]``: each BCA window's scores
    (queries: its block; keys: [previous block, its block]) averaged over texts and heads."""

    def run(params, inputs_BxN):
        emit = lambda _, __, scores_LxBxHxWx2W: jnp.mean(scores_LxBxHxWx2W, axis=(1, 2))
        return scan_blocks(model, params, inputs_BxN, block, emit, return_scores=True)[1]

    return jax.jit(run)


def _distance_counts(mask_QxK: np.ndarray) -> np.ndarray:
    """Number of True pairs at each distance n = i + K − Q − j (bottom-right aligned)."""
    q, k = mask_QxK.shape
    distance = np.arange(q)[:, None] + (k - q) - np.arange(k)[None, :]
    return np.bincount(distance[mask_QxK], minlength=k)[:k]


# Compiled once per shape: op by op they were ~100 small compiles at a first call.
_expected_scores = jax.jit(res_lib.expected_scores)
_attention_resolution = jax.jit(res_lib.attention_resolution)


def _pooled_expected_scores(scores_list, masks_list):
    """Per-distance means pooled over score sets ``[L, Q, K]`` (same K) with masks ``[Q, K]``.

    Each set's means come from :func:`lexjax.resolution.expected_scores`; sets
    are combined weighted by how many pairs they have at each distance.
    Returns ``[L, D]`` for the distances 0 … D−1 that occur.
    """
    total, count = 0.0, 0
    for scores, mask in zip(scores_list, masks_list):
        counts = _distance_counts(mask)
        means = np.nan_to_num(np.asarray(_expected_scores(scores, mask)))
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
    if mode not in RESOLUTION_MODES:
        raise EvaluationError(
            f"resolution mode {mode!r}: choose from {', '.join(RESOLUTION_MODES)}"
        )
    _check_block(block)
    tokens_BxN = jnp.asarray(tokens_BxN, jnp.int32)
    B, n = tokens_BxN.shape
    if n < 2:
        raise EvaluationError(f"resolution needs at least 2 tokens, got {n}")
    model = at_length(model, n)
    if mode == "full":
        check_full_length(model.config, n)
        scores = shard_lib.host_array(_compiled_dense_scores(model)(params, tokens_BxN))
        mask = np.tril(np.ones((n, n), bool))
        curves = _pooled_expected_scores([scores], [mask])
    else:
        windows = shard_lib.host_array(
            _compiled_window_scores(model, block)(params, pad_to(tokens_BxN, block))
        )
        score_sets = list(windows)
        mask_sets = [window_mask(b, block, n) for b in range(len(windows))]
        curves = _pooled_expected_scores(score_sets, mask_sets)
    per_layer = np.asarray(_attention_resolution(curves))
    window = np.asarray(_attention_resolution(curves[:, : 2 * block]))
    return ResolutionResult(
        mode,
        n,
        tuple(float(r) for r in per_layer),
        float(per_layer.mean()),
        tuple(map(tuple, curves.tolist())),
        B,
        float(window.mean()),
    )


# --------------------------------------------------------------------------- the protocols


def _check_same_corpus(name: str, trained: str, now: str | None, split: str) -> None:
    if now != trained:
        raise DataError(
            f"the {name} corpus changed since this run trained on it (build {trained} "
            f"then, {now} now): its {split} split may hold text the run trained "
            f"on; restore the files, or evaluate on other text with {arg('eval_files')}"
        )


def held_out_documents(
    config: Config,
    eval_files: str | None = None,
    say=note,
    splits=("test", "validation"),
    tokenizer: data_lib.Tokenizer = data_lib.BYTES,
    corpus: str | None = None,
    max_tokens: int | None = None,
):
    """``(where, documents)``: the held-out text as int32 token arrays of
    ``tokenizer`` (the run's: :func:`lexjax.checkpoint.load_tokenizer`) and its
    description — the files of ``eval_files`` (a glob; each file one document,
    read in a build's 4 MiB pieces), else the first of the run dataset's
    ``splits`` it has (by default ``test``, else ``validation``). With
    ``max_tokens``, each document is its first ``max_tokens`` tokens and a file
    is read no further than the piece that holds them.
    Raises :class:`DataError` when the text cannot be read, when the corpus build
    of ``config.data`` is not ``corpus`` (the build the run trained on, where
    recorded: the files changed since, so its held-out split may hold text the
    run trained on), or when the build holds another tokenizer than ``tokenizer``."""
    try:
        if eval_files:
            root, relpaths = glob_files(eval_files, arg("eval_files"))
            # A file reached by several paths (symlinks) is one document, as in a build.
            relpaths = text_files_of(root, distinct_files(root, relpaths), "evaluation", say)
            noted = []

            def read(index: int) -> np.ndarray:
                # As a corpus build reads its files: every tokenizer the same text.
                path = os.path.join(root, relpaths[index])
                document, invalid = file_document(path, tokenizer, max_tokens)
                if invalid and not noted:  # one note for them all
                    noted.append(relpaths[index])
                    say(
                        f"note: evaluation files with invalid UTF-8 (the first read: "
                        f"{relpaths[index]}) are read with U+FFFD in its place, as in a corpus "
                        "build (bits per byte counts its 3 bytes)"
                    )
                return document

            where = f"{counted(len(relpaths), 'file')} of {eval_files}"
            return where, _Documents(len(relpaths), read)
        d = config.data
        # Found from the files first, so a changed corpus is refused before it is built.
        if corpus is not None and (planned := data_lib.planned_build(d)):
            _check_same_corpus(d.name, corpus, planned, splits[0])
        for split, fallback in zip(splits, [*splits[1:], None]):
            try:
                source = data_lib.load_source(d.name, split, **d.corpus())
            except data_lib.MissingSplit as e:  # not a damaged one: that stops
                if fallback is None:
                    raise
                say(f"note: {e}; using the {fallback} split")
                continue
            break
        if corpus is not None:
            _check_same_corpus(d.name, corpus, source.build, split)
        built = data_lib.load_tokenizer(
            d.tokenizer, d.vocab_size, d.name, **d.corpus(), train=False
        )
        if built is not None and built.fingerprint != tokenizer.fingerprint:
            raise DataError(
                f"the {d.name} build holds a {built.describe(tokenizer)} tokenizer other than "
                f"the {tokenizer.describe(built)} one this run was trained with; evaluate with "
                f"{arg('eval_files')} or rebuild the corpus the run was trained on"
            )
        docs = _Documents(
            len(source), lambda i: data_lib.as_document(source[i], tokenizer)[:max_tokens]
        )
        return f"{d.name} {split} split", docs
    except data_lib.NoFiles as e:
        if eval_files:
            raise
        # Not a flag of eval.py's: say what was moved.
        raise DataError(
            f"{e.what}={e.pattern!r}, the files this run trained on, matches no files now; "
            "put them back at that path (a symlink to where they are now will do), or "
            f"evaluate on held-out text of your own with {arg('eval_files')}"
        ) from None
    except (ValueError, OSError) as e:
        if isinstance(e, LexjaxError):
            raise
        raise DataError(one_line(e)) from e


class _Documents(Sequence):
    """Held-out documents (int32 token arrays), each read and tokenized when it is
    used and not kept: choosing the first few of a large collection holds only
    those in memory (every document was read and tokenized first, many times the
    text's size with SentencePiece)."""

    def __init__(self, count: int, load: Callable[[int], np.ndarray]):
        self._count, self._load = count, load

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._load(i) for i in range(*index.indices(self._count))]
        if not -self._count <= index < self._count:
            raise IndexError(index)
        return self._load(index % self._count)


def _first_long(documents, length: int, count: int) -> tuple[list, int, int]:
    """``(the first count documents of at least length tokens, documents looked at,
    the longest of those)``, reading no further than needed."""
    chosen, seen, longest = [], 0, 0
    for document in documents:
        seen, longest = seen + 1, max(longest, len(document))
        if len(document) >= length:
            chosen.append(document)
            if len(chosen) == count:
                break
    return chosen, seen, longest


def select_documents(documents, max_length: int, *, max_docs: int, where: str, lengths=()):
    """The first ``max_docs`` documents with at least ``max_length + 1`` tokens (the
    budget and the token after it); :class:`DataError` when there is none, whose advice
    names a budget and the asked ``lengths`` that fit and divide it."""
    chosen, seen, longest = _first_long(documents, max_length + 1, max_docs)
    if 0 < len(chosen) < seen:
        among = seen if seen == len(documents) else f"the first {seen}"
        note(
            f"note: {seen - len(chosen)} of {among} documents of {where} are shorter than "
            f"the budget of {max_length} tokens + 1 and are left out"
        )
    if not chosen:
        fit = max(longest - 1, 1)
        # The default lengths (1…16 × train_len) left the advice to the user, whose budget
        # then held not the largest one: a second error. Here, those of the asked lengths
        # that fit, and the largest budget they all divide (or the largest of them).
        fitting = [n for n in lengths if n <= fit]
        such = ""
        if fitting:
            most = fit // math.lcm(*fitting) * math.lcm(*fitting) or max(fitting)
            fitting = [n for n in fitting if most % n == 0]
            such = f", such as {arg('max_length')}={most} {arg('lengths')}="
            such += ",".join(map(str, fitting))
        raise DataError(
            f"no document is long enough for the budget of {max_length} tokens (in {where}: "
            f"{counted(len(documents), 'document')}, the longest {longest} tokens); pass "
            f"{arg('max_length')}={fit} or less (with {arg('lengths')} that "
            f"divide it{such}) or other {arg('eval_files')}"
        )
    return chosen


def default_lengths(train_len: int) -> list[int]:
    """1, 2, 4, 8 and 16 × ``train_len``."""
    return [m * train_len for m in (1, 2, 4, 8, 16)]


def check_modes(
    modes, *, sinks: int = DEFAULT_SINKS, allowed=MODES, resolution: bool = False
) -> tuple[str, ...]:
    """``modes`` in their order without repeats, some of ``allowed`` (else a
    :class:`ConfigError`: none, or one unknown); a sink count other than the
    default (``sinks``) only with mode ``"sinks"``, the one that uses it, and
    ``resolution`` only with a mode it is measured in (:data:`RESOLUTION_MODES`;
    eval.py refuses it before the run loads, exit 2). The message names the API's
    arguments, or eval.py's flags (:func:`lexjax.errors.arg`)."""
    use = f"use some of {', '.join(allowed)}"
    if not isinstance(modes, str) and not is_sequence(modes):
        raise ConfigError(f"{arg('modes')}={modes!r}: {use}")
    modes = tuple(dict.fromkeys([modes] if isinstance(modes, str) else modes))
    if not all(isinstance(m, str) for m in modes):
        raise ConfigError(f"{arg('modes')}={modes!r}: {use}")
    if not modes or set(modes) - set(allowed):
        raise ConfigError(f"{arg('modes')}={','.join(modes)}: {use}")
    if sinks != DEFAULT_SINKS and "sinks" not in modes:
        raise ConfigError(
            f"{arg('sinks')}={sinks} is the sink count of mode sinks, which {arg('modes')}="
            f"{','.join(modes)} leaves out; add sinks to {arg('modes')} or leave {arg('sinks')} out"
        )
    if resolution and not set(modes) & set(RESOLUTION_MODES):
        raise ConfigError(
            f"{arg('resolution')} is measured in {' or '.join(RESOLUTION_MODES)} mode, which "
            f"{arg('modes')}={','.join(modes)} leaves out; add one or leave "
            f"{arg('resolution')} out"
        )
    return modes


def check_settings(
    lengths: Sequence[int] | None = None,
    max_length: int | None = None,
    *,
    sinks: int = DEFAULT_SINKS,
    max_docs: int = DEFAULT_MAX_DOCS,
    eval_files: str | None = None,
) -> list[int] | None:
    """The evaluation's settings as :func:`evaluate_run` (and eval.py, whose flags
    :func:`lexjax.errors.arg` names) accepts them: sorted distinct ``lengths`` (None: the
    default), else a one-line :class:`ConfigError`. Integers may be numpy's."""
    if lengths is not None:
        if not is_sequence(lengths):
            raise ConfigError(
                f"{arg('lengths')}={lengths!r} must be a sequence of lengths such as 256,1024"
            )
        lengths = list(lengths)  # (a generator is read once)
        if not lengths:
            raise ConfigError(
                f"{arg('lengths')} is empty; give lengths such as 256,1024 or leave it out"
            )
        lengths = sorted({check_int(arg("lengths"), n) for n in lengths})
    if max_length is not None:
        check_int(arg("max_length"), max_length)
        if lengths:  # before any work: the budget must hold the largest length
            budget(0, lengths, max_length)
            _check_divides(lengths, max_length)
    check_int(arg("sinks"), sinks, 0, bound="an integer ≥ 0 (StreamingLLM uses 4)")
    check_int(arg("max_docs"), max_docs)
    if eval_files is not None and not isinstance(eval_files, (str, os.PathLike)):
        raise ConfigError(f"{arg('eval_files')}={eval_files!r} must be a glob (a str or a path)")
    if eval_files is not None and not os.fspath(eval_files).strip():
        raise ConfigError(
            f"{arg('eval_files')} is empty; give a glob of text files or leave it out"
        )
    return lengths


def _check_divides(lengths: Sequence[int], max_length: int, given: bool = True) -> None:
    """A ConfigError unless some length divides the budget (each cuts it into segments);
    ``given``: the budget was asked for (else it is the default)."""
    if any(max_length % n == 0 for n in lengths):
        return
    budget_flag, lcm = arg("max_length"), math.lcm(*lengths)
    what = f"{budget_flag}={max_length}" if given else f"the default budget of {max_length} tokens"
    # The budgets every length divides on either side (the one below keeps within
    # documents that only just hold max_length, if it still holds the largest length).
    below, above = max_length // lcm * lcm, -(-max_length // lcm) * lcm
    such = [n for n in (below, above) if max(lengths) <= n <= 2**24]
    such = f" such as {' or '.join(map(str, such))}" if such else ""
    raise ConfigError(
        f"no length can be evaluated as asked: none of {arg('lengths')}="
        f"{','.join(map(str, lengths))} divides {what}; give lengths that divide it, or a "
        f"{budget_flag} they divide{such}"
    )


def budget(train_len: int, lengths: Sequence[int], max_length: int | None = None) -> int:
    """The token budget: ``max_length`` if given (it must hold the largest length),
    else 16 × ``train_len``, raised to the largest length when that is larger."""
    if max_length is None:
        return max(16 * train_len, *lengths)
    if max_length < max(lengths):
        raise ConfigError(
            f"{arg('max_length')}={max_length} is below the largest length {max(lengths)}; "
            f"raise it or ask for shorter {arg('lengths')}"
        )
    return int(max_length)  # numpy's too: it goes into the JSON


def scored_digest(documents, length: int) -> str:
    """16 hex digits of sha256 over the first ``length`` tokens of each document, in
    order: what an evaluation scored, recorded in its settings (so in its file name)."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(np.asarray(doc[:length], "<i4").tobytes())
    return digest.hexdigest()[:16]


def settings_name(kind: str, settings: dict) -> str:
    """A file stem derived from the settings of an evaluation, e.g.
    ``perplexity-step200-bca+full-budget4096-5d8e21c0``, with a RoPE extension
    ``…-budget4096-yarn-…`` (``pi4``: an explicit factor 4): runs with other
    settings never write over each other; the same settings give the same numbers."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    modes = "+".join(settings["modes"])
    rope, factor = settings.get("rope_scaling", "none"), settings.get("rope_factor") or 0
    rope = "" if rope == "none" else f"-{rope}" + (f"{factor:g}" if factor else "")
    return f"{kind}-step{settings['step']}-{modes}-budget{settings['max_length']}{rope}-{digest}"


def resolution_documents(documents, train_len: int, *, max_docs: int, where: str) -> list:
    """The documents attention resolution measures: the first ``max_docs`` of at
    least 2× ``train_len`` tokens; :class:`DataError` where there is none."""
    chosen, _, longest = _first_long(documents, 2 * train_len, max_docs)
    if not chosen:
        raise DataError(
            f"resolution needs documents of {2 * train_len} tokens; {where} has none "
            f"(longest {longest})"
        )
    return chosen


def resolution_protocol(
    model: Decoder,
    params,
    documents,
    *,
    train_len: int,
    block: int,
    modes: Sequence[str] = RESOLUTION_MODES,
    max_docs: int,
    where: str = "the held-out text",
    say: Callable[[str], None] = note,
    skipped: list[dict] | None = None,
) -> list[ResolutionResult]:
    """Attention resolution at 1× and 2× ``train_len`` (paper Table 3) over the
    first ``max_docs`` documents of at least 2× ``train_len`` tokens, in each of
    ``modes`` (some of :data:`RESOLUTION_MODES`). A length a mode cannot evaluate
    is skipped with a note (raises when it is the only mode), and appended to
    ``skipped`` (if given) as ``{"mode", "length", "reason"}``."""
    longest = 2 * train_len
    chosen = resolution_documents(documents, train_len, max_docs=max_docs, where=where)
    results = []
    for mode in modes:
        for length in (train_len, longest):
            tokens = np.stack([d[:length] for d in chosen])
            try:
                results.append(measure_resolution(model, params, tokens, block=block, mode=mode))
            except EvaluationError as e:
                if len(modes) == 1:
                    raise
                say(f"note: no resolution at length {length} without BCA: {e}")
                if skipped is not None:
                    skipped.append({"mode": mode, "length": length, "reason": str(e)})
    return results


def evaluate_run(
    config: Config,
    params,
    step: int,
    workdir: str,
    *,
    lengths: Sequence[int] | None = None,
    max_length: int | None = None,
    modes: Sequence[str] = DEFAULT_MODES,
    sinks: int = DEFAULT_SINKS,
    eval_files: str | None = None,
    max_docs: int = 20,
    resolution: bool = False,
    figure: bool = False,
    say: Callable[[str], None] = note,
    tokenizer: data_lib.Tokenizer = data_lib.BYTES,
    corpus: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rope_scaling: str = "none",
    rope_factor: float = 0.0,
    out_dir: str | None = None,
) -> tuple[list[PerplexityResult], list[str]]:
    """eval.py's evaluation of a trained run: perplexity by length (default 1, 2,
    4, 8, 16 × train_len) on a fixed token budget (:func:`budget`) in each of
    ``modes`` (``sinks``: the sink count of mode ``"sinks"``), optionally
    attention resolution (in the modes of :data:`RESOLUTION_MODES` asked) and Figure 1.
    Prints the tables on stdout and writes
    ``WORKDIR/eval/perplexity.{json,png}`` (the latest run) and the same under a
    name derived from the settings (:func:`settings_name`), which later runs with
    other settings leave in place (likewise ``resolution``); ``expectation.png``;
    in ``out_dir`` instead of ``WORKDIR/eval`` where given.
    ``mesh``: the evaluation mesh (``sharding.eval_mesh``; ``params`` sharded on
    it): documents are split over its batch axes (data × fsdp). ``rope_scaling``,
    ``rope_factor``: an inference-time RoPE extension of an xpos/rope run
    (``model.rope_scaling``/``rope_factor``; factor 0: each length / train_len),
    recorded in the settings, the file name and every result. Returns the
    perplexity results and the paths written. ``corpus``: the build the run trained
    on (:attr:`lexjax.api.Run.corpus`), see :func:`held_out_documents`."""
    lengths = check_settings(
        lengths, max_length, sinks=sinks, max_docs=max_docs, eval_files=eval_files
    ) or default_lengths(config.train_len)
    sinks, max_docs = int(sinks), int(max_docs)  # numpy's too: they go into the JSON
    resolution, figure = check_bool("resolution", resolution), check_bool("figure", figure)
    eval_files = None if eval_files is None else os.fspath(eval_files)
    names = (arg("rope_scaling"), arg("rope_factor"))  # eval.py's flags, or the API's
    check_rope_scaling(rope_scaling, rope_factor, config.model.position, names=names)
    modes = check_modes(modes, sinks=sinks, resolution=resolution)
    if rope_scaling != "none":
        scaled = dataclasses.replace(
            config.model, rope_scaling=rope_scaling, rope_factor=float(rope_factor)
        )
        config = dataclasses.replace(config, model=scaled)
    # What runs, the flag's or the run's own (trained with one): labels, names, JSON.
    rope_scaling, rope_factor = config.model.rope_scaling, config.model.rope_factor
    rules = shard_lib.rules(config)
    model = Decoder(config.model, rules)
    train_len, position = config.train_len, config.model.position
    if "sinks" in modes:
        sink_window(config.block, sinks)
    resolution_modes = [m for m in modes if m in RESOLUTION_MODES]
    # The tables' and figures' name of the model: the position and its extension.
    label = position if rope_scaling == "none" else f"{position}+{rope_scaling}"
    given, max_length = max_length is not None, budget(train_len, lengths, max_length)
    missing = [
        {"mode": m, "length": n, "reason": problem}
        for m in modes
        for n in lengths
        if (problem := cell_problem(config.model, m, n, max_length, config.block))
    ]
    if len(missing) == len(modes) * len(lengths):  # before any text is read
        _check_divides(lengths, max_length, given)
        raise ConfigError(f"no length can be evaluated as asked: {missing[0]['reason']}")
    # Read no further than scored: the budget and the token after it, and the 2×
    # train_len tokens resolution measures.
    needed = max(max_length + 1, 2 * train_len if resolution else 0)
    where, documents = held_out_documents(
        config, eval_files, say, tokenizer=tokenizer, corpus=corpus, max_tokens=needed
    )
    chosen = select_documents(
        documents, max_length, max_docs=max_docs, where=where, lengths=lengths
    )
    if resolution:  # refused before the perplexity run, not after it
        measured_docs = resolution_documents(documents, train_len, max_docs=max_docs, where=where)
    out_dir = reports.output_dir(workdir, out_dir)  # every setting checked: before computing
    results = perplexity(
        model,
        params,
        chosen,
        lengths,
        block=config.block,
        max_length=max_length,
        modes=modes,
        sinks=sinks,
        strict=False,
        say=say,
        progress=True,
        tokenizer=tokenizer,
        batch_sharding=None if mesh is None else shard_lib.batch_sharding(mesh, rules),
    )
    settings = dict(
        step=step,
        modes=list(modes),
        lengths=lengths,
        max_length=max_length,
        documents=len(chosen),
        source=where,
        # Other text under the same settings (a file edited, a glob that now matches
        # others) wrote over the earlier file of the same name.
        scored_sha256=scored_digest(chosen, max_length + 1),
    )
    # Only with the mode, so the settings (and file names) of other evaluations stay as they were.
    sink_info = {"sinks": int(sinks)} if "sinks" in modes else {}
    settings.update(sink_info)
    info = dict(train_len=train_len, position=position, step=step, source=where)
    if rope_scaling != "none":
        # Only then: the settings (and so the file names) of unscaled runs stay as they were.
        settings.update(rope_scaling=rope_scaling, rope_factor=float(rope_factor))
        info.update(rope_scaling=rope_scaling, rope_factor=float(rope_factor))
    stems = ["perplexity", settings_name("perplexity", settings)]
    summary = reports.perplexity_json(
        results, **info, **sink_info, max_length=max_length, settings=settings, missing=missing
    )
    curves = [
        (label, m, sorted((r.length, r.perplexity) for r in results if r.mode == m)) for m in modes
    ]

    def show():
        print(
            f"perplexity of {workdir} (step {step}, position={label}, train_len={train_len}) "
            f"on {where}\n"
        )
        print(reports.perplexity_table(results, label, missing=missing))
        if sink_info:
            print(
                f"sinks + window: each token sees the first {sinks} tokens of its segment and "
                f"its {2 * config.block - sinks} most recent, at StreamingLLM's cache positions"
            )
        print(f"\nbits per byte ({tokenizer.describe()} tokens; lengths are in tokens)\n")
        print(reports.perplexity_table(results, label, missing=missing, metric="bits_per_byte"))

    # The settings' own files first; the latest pair last, figure before record, so a
    # write cut short (a full disk) leaves the pair before it whole.
    written = [
        os.path.join(out_dir, f"{stem}.{kind}") for stem in stems for kind in ("json", "png")
    ]

    def write():
        for stem in reversed(stems):
            path = os.path.join(out_dir, stem)
            title = f"{label}, train_len {train_len}"
            reports.plot_perplexity(curves, f"{path}.png", train_len=train_len, title=title)
            reports.write_json(f"{path}.json", summary)

    # Printed once written: a stdout that fails (`| head`) loses nothing.
    reports.write_then_show(write, show)
    if resolution:
        if len(resolution_modes) < len(modes):
            unmeasured = ", ".join(m for m in modes if m not in RESOLUTION_MODES)
            say(f"note: attention resolution is not measured in mode {unmeasured}")
        unmeasurable = []  # in the JSON, as perplexity's missing cells
        measured = resolution_protocol(
            model,
            params,
            measured_docs,
            train_len=train_len,
            block=config.block,
            modes=resolution_modes,
            max_docs=max_docs,
            where=where,
            say=say,
            skipped=unmeasurable,
        )
        # What it measured: its own documents and modes (a name per measurement).
        # Not perplexity's lengths or sinks, which it does not measure: one measurement
        # got a copy per perplexity setting.
        settings = {k: v for k, v in settings.items() if k not in ("lengths", "sinks")}
        settings.update(max_length=2 * train_len, kind="resolution")
        settings.update(documents=len(measured_docs), modes=resolution_modes)
        settings.update(scored_sha256=scored_digest(measured_docs, 2 * train_len))
        paths = [
            os.path.join(out_dir, f"{stem}.json")
            for stem in ("resolution", settings_name("resolution", settings))
        ]
        written += paths

        def show_resolution():
            # Its own documents: those holding 2 × train_len tokens, maybe fewer than
            # the perplexity table's.
            n = len(measured_docs)
            print(f"\nattention resolution (paper eq. 3 with eq. 11; {counted(n, 'document')})\n")
            print(reports.resolution_table(measured, label))

        def write_resolution():  # the settings' own record first, the latest last
            for path in reversed(paths):
                record = reports.resolution_json(
                    measured, **info, settings=settings, missing=unmeasurable
                )
                reports.write_json(path, record)

        reports.write_then_show(write_resolution, show_resolution)
    if figure:
        m = config.model
        written.append(os.path.join(out_dir, "expectation.png"))
        reports.plot_expectation(
            written[-1],
            head_dim=m.head_dim,
            scale_base=m.scale_base,
            theta=m.theta,
            max_distance=max(8 * int(m.scale_base), 2 * train_len),
        )
    print(f"\nwrote {', '.join(written)}")
    return results, written


def load_on_mesh(workdir: str, devices=None, check: Callable[[Config], None] | None = None):
    """``(loaded, mesh)``: the newest good checkpoint in ``workdir``
    (:class:`lexjax.checkpoint.Loaded`: config, params, step, and the tokenizer and
    corpus recorded with that step, read with it) and the run's mesh
    (``sharding.eval_mesh``: its preset and mesh config re-fitted to ``devices``,
    default all). Every parameter is read directly into its sharding there, never
    gathered onto one device. ``check``: called with the stored config before any
    parameter is read (settings that depend on the run are refused there)."""
    meshes = []

    def shardings(config: Config):
        if check is not None:
            check(config)
        meshes.append(shard_lib.eval_mesh(config, devices))
        return shard_lib.model_param_shardings(config, meshes[-1])

    loaded = checkpoint.load_params_and_tokenizer(workdir, sharding=shardings)
    if (holder := lease_lib.live_holder(workdir)) is not None:
        # A step saved as its run's last, read while a job extends the run, is not "S of S".
        steps = loaded.config.num_train_steps
        of = f" of {steps}" if loaded.step < steps else ""
        note(
            f"note: {workdir} is still being trained by {holder}: this reads step "
            f"{loaded.step}{of}, its newest complete checkpoint, and no later one"
        )
    here = _runnable_here(loaded.config)
    if here != loaded.config:
        note(
            f"note: this run trained with model.attention_impl=splash, a TPU kernel; on "
            f"{jax.default_backend()} it is evaluated with {here.model.attention_impl} "
            "(the same attention)"
        )
    return loaded._replace(config=here), meshes[-1]


def _runnable_here(config: Config) -> Config:
    """``config`` with attention this backend runs: a run trained with splash (a TPU
    kernel) is evaluated with fused attention elsewhere; how attention is computed is
    not part of the trained model (a resume may change it too)."""
    if config.model.attention_impl != "splash" or jax.default_backend() == "tpu":
        return config
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, attention_impl="fused")
    )
