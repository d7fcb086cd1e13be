"""Passkey retrieval: does the model *use* a token far back, not only predict text near it?

The synthetic, offline task of Mohtashami & Jaggi (2023, "Landmark
Attention"): filler text with a random key hidden at a chosen depth, then a
question; the model is right when its greedy continuation is the key.

A **sample** of length N (:func:`make_sample`) is exactly N tokens of the
model's tokenizer, prompt and answer together::

    BOS  filler[:a]  "\\nThe pass key is " KEY ".\\n"  filler[a:]
         "\\nWhat is the pass key? The pass key is "  | KEY

where ``a = round(depth · F)`` of the F filler tokens stand before the key
line: depth 0 puts the key right after BOS, depth 1 right before the question.
Each piece is encoded on its own and the ids are joined, so the key has the
same ids where it is hidden and where it is asked for, whatever the tokenizer.
The filler is a sentence repeated (:data:`FILLER`, the task's usual one) or a
stream of held-out token ids, read from a seeded offset. The key is
:data:`KEY_DIGITS` random digits; a seed fixes the key and the filler offset,
and not the length or depth, so cells of a table differ only in those.

**Scoring** (:func:`is_correct`): greedy decoding writes ``KEY_DIGITS + 1``
tokens (enough for the key and the character after it in any tokenizer, a
token covering at least one byte); the continuation, cut at EOS, is right iff
its leading run of digits is exactly the key: ``"12345. The"`` is right,
``"1234"``, ``"12346"`` and ``"123456"`` are wrong, and so is ``" 12345"``.

**Training** (:class:`PasskeyMix`): a small model retrieves nothing unless it
has learned to copy, so ``data.passkey_fraction`` adds passkey documents of
exactly one training row (length ``train_len``, plus EOS) to the training
source, at random depths, and ``data.copy_fraction`` copy documents
(:func:`copy_document`: random strings, each repeated), from which a small
model learns to copy much sooner than from passkey documents alone. The
fractions are of training *rows*, estimated from a fixed sample of the
source's documents: with long documents a fraction of documents would be
almost no rows.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from lexjax import data as data_lib
from lexjax import evaluation, generation, reports
from lexjax import sharding as shard_lib
from lexjax.blockwise import bca_problem
from lexjax.config import (
    Config,
    ConfigError,
    ModelConfig,
    check_int,
    check_seed,
    is_real,
    is_sequence,
)
from lexjax.errors import DataError, EvaluationError, arg, counted
from lexjax.model import Decoder
from lexjax.progress import Progress, note

__all__ = [
    "FILLER",
    "DEFAULT_TRIALS",
    "FILLERS",
    "KEY_DIGITS",
    "NEW_TOKENS",
    "CHANCE_NATS",
    "DEPTHS",
    "Sample",
    "make_sample",
    "min_length",
    "continuation_text",
    "is_correct",
    "PasskeyMix",
    "training_document",
    "copy_document",
    "COPY_SPAN",
    "COPY_ALPHABET",
    "mix_count",
    "PasskeyResult",
    "default_lengths",
    "parse_depths",
    "check_settings",
    "cell_problem",
    "skipped_cells",
    "passkey_accuracy",
    "evaluate_passkey",
]

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
FILLERS = ("repeat", "text")  # eval.py --passkey_filler: FILLER repeated, or held-out text
DEFAULT_TRIALS = 10  # keys per length and depth
KEY_DIGITS = 5
NEW_TOKENS = KEY_DIGITS + 1  # generated per sample: the key and what follows it
# −log p(key) of a model that knows a key is KEY_DIGITS digits, the first not 0, but
# not which: ln(9·10⁴) ≈ 11.41 nats for five digits (byte level).
CHANCE_NATS = float(np.log(9 * 10.0 ** (KEY_DIGITS - 1)))
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_KEY_BEFORE = "\nThe pass key is "
_KEY_AFTER = ".\n"
_QUESTION = "\nWhat is the pass key? The pass key is "
_MIX_STREAM = 1  # seeds training documents apart from evaluation samples
_COPY_STREAM = 2  # seeds copy documents apart from passkey documents
# A copy document's units: a random string of COPY_SPAN characters (drawn per unit)
# of COPY_ALPHABET, "|", the same string again, a newline. Digits are in the
# alphabet because a key is digits: heads that learned to copy letters only did
# not copy a key (docs/results.md, "Passkey retrieval after copy training").
COPY_SPAN = (8, 40)
COPY_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


class Sample(NamedTuple):
    prompt: np.ndarray  # int32 [N − len(answer)]: BOS … the question
    answer: np.ndarray  # int32: the key's ids
    key: str  # its digits


def _pieces(tokenizer: data_lib.Tokenizer):
    return tuple(tokenizer.encode(t) for t in (_KEY_BEFORE, _KEY_AFTER, _QUESTION))


def min_length(tokenizer: data_lib.Tokenizer = data_lib.BYTES) -> int:
    """The shortest length every sample fits in (no filler; a key of at most
    ``KEY_DIGITS`` tokens, twice)."""
    return 1 + sum(len(p) for p in _pieces(tokenizer)) + 2 * KEY_DIGITS


def make_sample(
    seed,
    length: int,
    depth: float,
    tokenizer: data_lib.Tokenizer = data_lib.BYTES,
    filler: str | np.ndarray = FILLER,
) -> Sample:
    """The passkey sample of ``seed`` (an int or a sequence of ints): exactly
    ``length`` tokens of prompt and answer, the key line after ``round(depth·F)``
    of the F filler tokens (module docstring).

    ``filler``: a text repeated from its start, or int32 token ids read
    cyclically from an offset the seed draws. Raises :class:`EvaluationError`
    when ``length`` cannot hold the format, or for a depth outside [0, 1].
    """
    if not 0 <= depth <= 1:
        raise EvaluationError(f"depth {depth} must be in [0, 1]")
    rng = np.random.default_rng(seed)
    key = str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS)))
    before, after, question = _pieces(tokenizer)
    key_ids = tokenizer.encode(key)
    fixed = 1 + len(before) + 2 * len(key_ids) + len(after) + len(question)
    count = length - fixed
    if count < 0:
        raise EvaluationError(
            f"a passkey sample of {length} tokens cannot hold its {fixed} tokens of format; "
            f"use lengths of at least {min_length(tokenizer)}"
        )
    if isinstance(filler, str):
        stream, offset = tokenizer.encode(filler), 0
    else:
        stream = np.asarray(filler, np.int32)
        offset = int(rng.integers(len(stream))) if len(stream) else 0
    if count and not len(stream):
        raise EvaluationError("the passkey filler is empty; give text to fill with")
    fill = np.take(stream, offset + np.arange(count), mode="wrap") if count else stream[:0]
    cut = int(np.floor(depth * count + 0.5))
    prompt = np.concatenate(
        [[tokenizer.bos], fill[:cut], before, key_ids, after, fill[cut:], question]
    ).astype(np.int32)
    return Sample(prompt, key_ids.astype(np.int32), key)


def continuation_text(ids, tokenizer: data_lib.Tokenizer = data_lib.BYTES) -> str:
    """The text of generated ``ids`` up to their first EOS."""
    ids = np.asarray(ids).reshape(-1)
    end = np.nonzero(ids == tokenizer.eos)[0]
    return tokenizer.decode(ids[: end[0]] if len(end) else ids)


def is_correct(continuation: str, key: str) -> bool:
    """Whether the continuation's leading run of ASCII digits is exactly ``key``."""
    return re.match(r"[0-9]*", continuation).group() == key


# --------------------------------------------------------------------------- the training mix


def training_document(
    seed: int, index: int, length: int, tokenizer: data_lib.Tokenizer = data_lib.BYTES
) -> np.ndarray:
    """Passkey document ``index`` of the training mix of ``seed``: a sample of
    ``length`` tokens (the training length) at a random depth, then EOS — int32
    ``[length + 1]``, one packed row of ``length`` (input, target) pairs."""
    depth = np.random.default_rng([seed, index, _MIX_STREAM]).random()
    sample = make_sample([seed, index, _MIX_STREAM, 0], length, depth, tokenizer)
    return np.concatenate([sample.prompt, sample.answer, [tokenizer.eos]]).astype(np.int32)


def copy_document(
    seed: int, index: int, length: int, tokenizer: data_lib.Tokenizer = data_lib.BYTES
) -> np.ndarray:
    """Copy document ``index`` of the training mix of ``seed``: BOS, then units of a
    random string of :data:`COPY_ALPHABET` (lowercase letters and digits), ``|``, the
    same string, a newline, cut to ``length`` tokens, then EOS (int32
    ``[length + 1]``, one packed row).

    The second half of every unit can only be predicted by finding the first: an
    induction head's task (Olsson et al. 2022), which a passkey's answer needs
    and which a small model barely meets in text or passkey documents alone. The
    strings' lengths vary, so no fixed attention offset predicts them."""
    rng = np.random.default_rng([seed, index, _COPY_STREAM])
    characters = [tokenizer.encode(ch) for ch in COPY_ALPHABET]
    bar, newline = tokenizer.encode("|"), tokenizer.encode("\n")
    ids = [np.asarray([tokenizer.bos])]
    total = 1
    while total < length:
        span = rng.integers(len(characters), size=int(rng.integers(*COPY_SPAN)))
        text = np.concatenate([characters[i] for i in span])
        ids += [text, bar, text, newline]
        total += 2 * len(text) + len(bar) + len(newline)
    return np.concatenate([np.concatenate(ids)[:length], [tokenizer.eos]]).astype(np.int32)


def mix_count(
    source: Sequence,
    fraction: float,
    length: int,
    tokenizer: data_lib.Tokenizer = data_lib.BYTES,
    sample: int = 64,
) -> int:
    """How many generated documents make ``fraction`` of the training rows: the
    source's rows (its (input, target) pairs / ``length``) are estimated from
    ``sample`` documents evenly spread over it, so the count is deterministic."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"the fraction of generated rows must be in [0, 1), got {fraction}")
    n = len(source)
    if fraction == 0 or n == 0:
        return 0
    picks = np.unique(np.linspace(0, n - 1, min(n, sample)).round().astype(int))
    pairs = np.mean([len(data_lib.as_document(source[int(i)], tokenizer)) - 1 for i in picks])
    return max(1, round(fraction / (1 - fraction) * n * pairs / length))


class PasskeyMix:
    """A training source (``len`` and ``[i]``) with passkey and copy documents added.

    Items ``0 … n−1`` are the source's, unchanged; then ``count`` passkey
    documents (:func:`training_document`), then ``copies`` copy documents
    (:func:`copy_document`), int32 ids the pipeline passes through untokenized.
    The counts (:func:`mix_count`) make them ``fraction`` and ``copy_fraction``
    of the rows. Deterministic and stateless, so the pipeline's shuffle, sharding
    and checkpointed iterator state work as for any source.
    """

    def __init__(
        self,
        source: Sequence,
        *,
        fraction: float,
        length: int,
        tokenizer: data_lib.Tokenizer = data_lib.BYTES,
        seed: int = 0,
        copy_fraction: float = 0.0,
    ):
        self.source, self.length, self.tokenizer, self.seed = source, length, tokenizer, seed
        if not (fraction >= 0 and copy_fraction >= 0 and fraction + copy_fraction < 1):
            raise ConfigError(
                f"data.passkey_fraction={fraction} and data.copy_fraction={copy_fraction} "
                "must each be ≥ 0 and sum to less than 1"
            )
        mixed = mix_count(source, fraction + copy_fraction, length, tokenizer)
        self.copies = round(mixed * copy_fraction / (fraction + copy_fraction)) if mixed else 0
        self.count = mixed - self.copies
        if self.count and length < (shortest := min_length(tokenizer)):
            raise ConfigError(
                f"train_len={length} is below the {shortest} tokens of a passkey document; "
                f"use train_len ≥ {shortest + shortest % 2} (even) or data.passkey_fraction=0"
            )

    def __len__(self) -> int:
        return len(self.source) + self.count + self.copies

    def __getitem__(self, index: int):
        index = int(index)
        n = len(self.source)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} of a source of {len(self)} documents")
        if index < n:
            return self.source[index]
        if index < n + self.count:
            return training_document(self.seed, index - n, self.length, self.tokenizer)
        return copy_document(self.seed, index - n - self.count, self.length, self.tokenizer)


# --------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class PasskeyResult:
    mode: str  # one of lexjax.evaluation.MODES
    length: int  # tokens of prompt and answer
    depth: float
    accuracy: float  # the fraction of trials whose greedy continuation is the key
    trials: int
    # −log p(key | prompt) in nats, teacher-forced in the same mode, mean over the trials:
    # graded where accuracy is 0 or 1 (CHANCE_NATS: the format known, the key not).
    answer_nats: float = float("nan")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# The longest passkey sample, as generation's longest continuation.
MAX_LENGTH = generation.MAX_NEW_TOKENS


def default_lengths(train_len: int) -> list[int]:
    """1, 2, 4 and 8 × ``train_len``."""
    return [m * train_len for m in (1, 2, 4, 8)]


def parse_depths(values) -> list[float] | None:
    """``--passkey_depths`` strings → sorted floats in [0, 1]; None (not given) → None."""
    if values is None:
        return None
    if not values:
        raise ConfigError("--passkey_depths is empty; give depths such as 0,0.5,1 or leave it out")
    depths = []
    for value in values:
        try:
            depths.append(float(value))
        except ValueError:
            raise ConfigError(f"--passkey_depths: {value!r} is not a number") from None
        if not 0 <= depths[-1] <= 1:
            raise ConfigError(f"--passkey_depths: every depth must be in [0, 1], got {value}")
    return sorted(set(depths))


def check_settings(
    *,
    trials: int,
    filler: str,
    seed: int = 0,
    depths: Sequence[float] = DEPTHS,
    eval_files: str | None = None,
    max_docs: int | None = None,
    modes: Sequence[str] = evaluation.DEFAULT_MODES,
    lengths: Sequence[int] | None = None,
) -> tuple[int, int, list[float], tuple[str, ...]]:
    """Raises :class:`ConfigError` for a trial count, filler kind, seed, depth or
    length out of range, a mode generation cannot decode in, or held-out files or a
    document count given to the repeated filler (which would ignore them); returns
    ``(trials, seed, depths, modes)``: ints (numpy's become Python's, as the JSON
    needs), the depths sorted and the modes in order, without repeats. The errors name the
    Python API's arguments, or eval.py's flags within it (:func:`lexjax.errors.arg`)."""
    modes = evaluation.check_modes(modes, allowed=generation.MODES)
    for n in evaluation.check_settings(lengths) or ():  # a sample is built whole on the host
        if n > MAX_LENGTH:
            raise ConfigError(
                f"{arg('lengths')}={n}: give passkey lengths of at most {MAX_LENGTH:,}"
            )
    seed = check_seed(seed, name=arg("seed"))
    trials_, filler_ = arg("trials", "--passkey_trials"), arg("filler", "--passkey_filler")
    trials = check_int(trials_, trials)
    if filler not in FILLERS:
        raise ConfigError(f"{filler_}={filler!r}: use {' or '.join(FILLERS)}")
    for name, value in (("eval_files", eval_files), ("max_docs", max_docs)):
        if filler != "text" and value is not None:
            raise ConfigError(
                f"passkey with {filler_}={filler} does not use {arg(name)}; give "
                f"{filler_}=text to fill the samples with held-out text, or leave it out"
            )
    return trials, seed, _sorted_depths(depths), modes


def _sorted_depths(depths: Sequence[float]) -> list[float]:
    one = is_real(depths) or isinstance(depths, str)
    if one or not is_sequence(depths):
        raise ConfigError(f"depths must be a sequence of numbers in [0, 1], got {depths!r}")
    depths = list(depths)
    if not all(is_real(d) for d in depths):
        raise ConfigError(f"depths must be numbers in [0, 1], got {depths!r}")
    depths = sorted(set(float(d) for d in depths))
    if not depths or not all(0 <= d <= 1 for d in depths):  # NaN fails every comparison
        raise ConfigError(f"depths must be in [0, 1], got {depths}")
    return depths


def cell_problem(
    config: ModelConfig,
    mode: str,
    length: int,
    tokenizer: data_lib.Tokenizer = data_lib.BYTES,
    block: int | None = None,
) -> str | None:
    """Why the cell (mode, length) cannot be measured (at ``block``, if given), or None."""
    if mode not in generation.MODES:
        return f"generation cannot decode in mode {mode}"
    if length < min_length(tokenizer):
        return f"length {length} is below the {min_length(tokenizer)} tokens of the format"
    if mode == "full":
        try:
            evaluation.check_full_length(config, length + NEW_TOKENS)
        except EvaluationError as e:
            return str(e)
    if mode == "bca" and block is not None:
        return bca_problem(config, block)
    return None


def skipped_cells(
    config: ModelConfig,
    modes: Sequence[str],
    lengths: Sequence[int],
    tokenizer: data_lib.Tokenizer,
    block: int,
) -> list[dict]:
    """The cells :func:`passkey_accuracy` skips (``strict=False``), with why: a
    ``{"mode", "length", "reason"}`` per cell :func:`cell_problem` refuses."""
    return [
        {"mode": mode, "length": n, "reason": problem}
        for mode in modes
        for n in lengths
        if (problem := cell_problem(config, mode, n, tokenizer, block))
    ]


def _logprobs(model: Decoder, params, tokens_BxL, mode: str, block: int):
    """Teacher-forced next-token log-probabilities in ``mode``, as generation attends."""
    if mode == "full":
        return evaluation.full_logprobs(model, params, tokens_BxL, chunk=block)
    return evaluation.block_scan_logprobs(model, params, tokens_BxL, block)


def passkey_accuracy(
    model: Decoder,
    params,
    *,
    block: int,
    lengths: Sequence[int],
    depths: Sequence[float] = DEPTHS,
    trials: int = DEFAULT_TRIALS,
    modes: Sequence[str] = evaluation.DEFAULT_MODES,
    tokenizer: data_lib.Tokenizer = data_lib.BYTES,
    filler: str | np.ndarray = FILLER,
    seed: int = 0,
    tokens_per_batch: int = 8192,
    strict: bool = True,
    progress: bool = False,
    say: Callable[[str], None] = note,
    batch_sharding: jax.sharding.NamedSharding | None = None,
) -> list[PasskeyResult]:
    """Passkey accuracy per (mode, length, depth) by greedy decoding
    (:func:`lexjax.generation.generate` in that mode), and the key's mean
    teacher-forced negative log-likelihood in that mode (``answer_nats``).

    Trial t uses the sample of seed ``[seed, t]`` at every length, depth and
    mode. ``block``: w = train_len/2 (the full mode's prefill chunk too).
    ``strict``: a cell :func:`cell_problem` refuses raises; otherwise it is
    skipped with a note through ``say`` and missing from the results (a mode of
    :data:`lexjax.evaluation.MODES` that generation cannot decode yet, a length
    too short, or one the full mode cannot reach). ``batch_sharding``: where
    each batch of samples goes (``sharding.batch_sharding`` of the run's mesh;
    batches are rounded up to a multiple of its parts), as in
    :func:`lexjax.evaluation.perplexity`.
    """
    lengths = sorted(set(int(n) for n in lengths))
    depths, modes = _sorted_depths(depths), list(modes)  # (a generator is read once)
    evaluation.check_grid(modes, lengths)
    if trials < 1:
        raise EvaluationError(f"trials must be positive, got {trials}")
    cells = evaluation.usable_cells(
        modes,
        lengths,
        lambda mode, length: cell_problem(model.config, mode, length, tokenizer, block),
        strict=strict,
        say=say,
        what="passkey ",
    )
    bar = Progress(len(cells) * len(depths) * trials, label="samples", enabled=progress)
    done, results = 0, []
    writes_text = tokenizer.sampleable(model.config.vocab_size)
    for mode, length in cells:
        samples = [
            (depth, make_sample([seed, t], length, depth, tokenizer, filler))
            for depth in depths
            for t in range(trials)
        ]
        correct, nats = dict.fromkeys(depths, 0), dict.fromkeys(depths, 0.0)
        batch = max(1, min(len(samples), tokens_per_batch // length))
        batch = shard_lib.fit_batch(batch, batch_sharding)
        # A key of another token count gives another prompt length: one call per length.
        for prompt_len in sorted({len(s.prompt) for _, s in samples}):
            group = [(d, s) for d, s in samples if len(s.prompt) == prompt_len]
            for start in range(0, len(group), batch):
                part = group[start : start + batch]
                # Prompt and key of each sample; short calls repeat the first row.
                whole = np.stack([np.concatenate([s.prompt, s.answer]) for _, s in part])
                whole = np.concatenate([whole, np.repeat(whole[:1], batch - len(part), 0)])
                prompts = whole[:, :prompt_len]
                if batch_sharding is not None:
                    whole, prompts = jax.device_put((whole, prompts), batch_sharding)
                out = generation.generate(
                    model,
                    params,
                    prompts,
                    block=block,
                    max_new_tokens=NEW_TOKENS,
                    rng=jax.random.key(0),
                    temperature=0.0,
                    mode=mode,
                    allowed_V=writes_text,  # an id writing no text would vanish from the answer
                )
                out = shard_lib.host_array(out)
                logprobs = shard_lib.host_array(_logprobs(model, params, whole, mode, block))
                for row, (depth, sample) in enumerate(part):
                    correct[depth] += is_correct(continuation_text(out[row], tokenizer), sample.key)
                    nats[depth] -= float(logprobs[row, prompt_len - 1 :].sum())
                done += len(part)
                bar.update(done, f"{mode} {length}")
        results += [
            PasskeyResult(mode, length, d, correct[d] / trials, trials, nats[d] / trials)
            for d in depths
        ]
    bar.close()
    return results


def _text_filler(config, eval_files, max_docs, tokenizer, corpus, say) -> tuple[str, np.ndarray]:
    where, documents = evaluation.held_out_documents(
        config, eval_files, say, tokenizer=tokenizer, corpus=corpus
    )
    bodies = [d[1:-1] for d in documents[:max_docs]]
    stream = np.concatenate(bodies) if bodies else np.zeros(0, np.int32)
    if not len(stream):
        raise DataError(f"{where} holds no text to fill passkey samples with")
    used = counted(min(len(documents), max_docs), "document")
    return f"{used} of {where}", stream.astype(np.int32)


def evaluate_passkey(
    config: Config,
    params,
    step: int,
    workdir: str,
    *,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] | None = None,
    trials: int = DEFAULT_TRIALS,
    modes: Sequence[str] = evaluation.DEFAULT_MODES,
    filler: str = FILLERS[0],
    eval_files: str | None = None,
    max_docs: int | None = None,
    seed: int = 0,
    tokenizer: data_lib.Tokenizer = data_lib.BYTES,
    corpus: str | None = None,
    say: Callable[[str], None] = note,
    mesh: jax.sharding.Mesh | None = None,
    out_dir: str | None = None,
) -> tuple[list[PasskeyResult], list[str]]:
    """``eval.py --passkey``: accuracy at each length (default 1, 2, 4, 8 ×
    train_len), depth (default :data:`DEPTHS`) and mode, ``trials`` keys each.

    ``filler``: ``"repeat"`` (:data:`FILLER`) or ``"text"``: the first
    ``max_docs`` (default 20) held-out documents (``eval_files``, else the run's
    test split).
    Prints a table per mode and writes ``WORKDIR/eval/passkey.json``
    (``{"train_len", ..., "skipped", "results": [{"mode", "length", "depth",
    "accuracy", "trials"}]}``), the same under a name of its settings
    (:func:`lexjax.evaluation.settings_name`), and a length × depth heat map per
    mode, ``passkey-MODE.png`` (an earlier run's map of a mode not measured now
    is removed). Returns the results and the paths written. ``mesh``:
    the evaluation mesh (``params`` sharded on it, called under
    ``jax.set_mesh``); the samples of a batch are split over its batch axes.
    """
    trials, seed, depths, modes = check_settings(
        trials=trials,
        filler=filler,
        seed=seed,
        depths=DEPTHS if depths is None else depths,
        eval_files=eval_files,
        max_docs=max_docs,
        modes=modes,
        lengths=lengths,
    )
    max_docs = evaluation.DEFAULT_MAX_DOCS if max_docs is None else max_docs
    train_len, position = config.train_len, config.model.position
    lengths = evaluation.check_settings(
        lengths, max_docs=max_docs, eval_files=eval_files
    ) or default_lengths(train_len)
    max_docs = int(max_docs)
    eval_files = None if eval_files is None else os.fspath(eval_files)
    source, stream = "the repeated filler sentence", FILLER
    if filler == "text":
        source, stream = _text_filler(config, eval_files, max_docs, tokenizer, corpus, say)
    skipped = skipped_cells(config.model, modes, lengths, tokenizer, config.block)
    if len(skipped) == len(modes) * len(lengths):
        shortest = min_length(tokenizer)
        advice = f"; use {arg('lengths')} of at least {shortest}" * (max(lengths) < shortest)
        # The settings' contradiction, as perplexity's "no length can be evaluated".
        raise ConfigError(f"no passkey cell can be measured: {skipped[0]['reason']}{advice}")
    out_dir = reports.output_dir(workdir, out_dir)  # every setting checked: before the trials
    results = passkey_accuracy(
        Decoder(config.model, shard_lib.rules(config)),
        params,
        block=config.block,
        lengths=lengths,
        depths=depths,
        trials=trials,
        modes=modes,
        tokenizer=tokenizer,
        filler=stream,
        seed=seed,
        strict=False,
        progress=True,
        say=say,
        batch_sharding=None
        if mesh is None
        else shard_lib.batch_sharding(mesh, shard_lib.rules(config)),
    )
    # Written before anything is printed: a stdout that fails (`| head`) loses nothing.
    summary = reports.passkey_json(
        results,
        train_len=train_len,
        position=position,
        step=step,
        filler=source,
        seed=seed,
        skipped=skipped,
    )
    # passkey.json is the latest run's; a copy named by its settings stays, as
    # perplexity's does, so runs with other settings never write over each other.
    settings = dict(
        kind="passkey", step=step, modes=list(modes), lengths=lengths, max_length=max(lengths)
    )
    settings.update(depths=depths, trials=trials, filler=source, seed=seed)
    if filler == "text":  # the held-out text as it is now (a file edited since: another name)
        settings.update(scored_sha256=evaluation.scored_digest([stream], len(stream)))
    summary["settings"] = settings  # which settings made passkey.json, as perplexity's
    written = [
        os.path.join(out_dir, f"{stem}.json")
        for stem in ("passkey", evaluation.settings_name("passkey", settings))
    ]
    drawn = dict.fromkeys(r.mode for r in results)
    written += [os.path.join(out_dir, f"passkey-{mode}.png") for mode in drawn]

    def show():
        print(
            f"passkey retrieval of {workdir} (step {step}, position={position}, "
            f"train_len={train_len}): {counted(trials, 'key')} per cell, filler: {source}\n"
        )
        print(reports.passkey_table(results, position, skipped=skipped))

    # The settings' own record first, passkey.json (the latest) last, after its heat
    # maps, as perplexity's reports: a write cut short keeps the latest record as it was.
    def write():
        reports.write_json(written[1], summary)
        for mode in set(evaluation.MODES) - set(drawn):  # a heat map of an earlier run's mode
            reports.remove(os.path.join(out_dir, f"passkey-{mode}.png"))
        for mode, path in zip(drawn, written[2:]):
            reports.plot_passkey(
                [r for r in results if r.mode == mode],
                path,
                train_len=train_len,
                title=f"passkey, {position} {reports.MODE_NAMES.get(mode, mode)}",
            )
        reports.write_json(written[0], summary)

    reports.write_then_show(write, show)
    print(f"\nwrote {', '.join(written)}")
    return results, written
