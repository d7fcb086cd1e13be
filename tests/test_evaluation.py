"""Evaluation at any length: the block scan equals the explicit blockwise mask, the
chunked dense path equals one dense forward, memory does not grow with the length."""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import blockwise, evaluation, reports
from lexjax import config as config_lib
from lexjax.model import Decoder
from tests.helpers import SMALL_MODEL, TRAIN_LEN, np_nll

W = TRAIN_LEN // 2
BASE = SMALL_MODEL


def _model(position):
    config = dataclasses.replace(BASE, position=position)
    model = Decoder(config)
    params = nn.unbox(model.init(jax.random.key(1), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    return model, params


KINDS = config_lib.POSITION_KINDS  # every kind, a new one included


@pytest.fixture(scope="module")
def models():
    return {kind: _model(kind) for kind in KINDS}


def _scaled(model, scaling, factor=0.0):
    """The same model (and parameters) with an inference-time RoPE extension."""
    config = dataclasses.replace(
        model.config, rope_scaling=scaling, rope_factor=factor, rope_train_len=TRAIN_LEN
    )
    return Decoder(config)


def _tokens(batch, length, seed=0):
    return jnp.asarray(
        np.random.default_rng(seed).integers(0, BASE.vocab_size, (batch, length)), jnp.int32
    )


def _logprobs(logits, targets):
    return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def _explicit_bca(model, params, tokens):
    """BCA by the explicit mask over the whole sequence (masks.blockwise_causal).

    Relative encodings: positions 0 … N−1 give the window-relative distances.
    Absolute encodings: each token carries the position the scan gives it,
    t for the first block and w + t mod w after it.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    t = np.arange(inputs.shape[1])
    if model.config.position in ("sinusoidal", "learned"):
        positions = np.where(t < W, t, W + t % W)
    else:
        positions = t
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), inputs.shape)
    logits, _ = model.apply({"params": params}, inputs, positions, block=W)
    return _logprobs(logits, targets)


@pytest.mark.parametrize("length", [2, 2 * W + 1, 3 * W + 4])
def test_block_scan_equals_explicit_blockwise_mask(models, length):
    model, params = models["xpos"]
    tokens = _tokens(2, length)
    scan = evaluation.block_scan_logprobs(model, params, tokens, W)
    assert scan.shape == (2, length - 1)
    np.testing.assert_allclose(scan, _explicit_bca(model, params, tokens), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("position", [k for k in KINDS if k != "xpos"])
def test_every_position_kind_scans_like_the_explicit_mask(models, position):
    model, params = models[position]
    tokens = _tokens(2, 4 * W + 3, seed=2)
    scan = evaluation.block_scan_logprobs(model, params, tokens, W)
    np.testing.assert_allclose(scan, _explicit_bca(model, params, tokens), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("position", KINDS)
def test_full_mode_equals_one_dense_causal_forward(models, position):
    model, params = models[position]
    length = TRAIN_LEN + 1 if position == "learned" else 3 * W + 4
    tokens = _tokens(2, length, seed=3)
    chunked = evaluation.full_logprobs(model, params, tokens, chunk=W)
    logits, _ = model.apply({"params": params}, tokens[:, :-1])
    np.testing.assert_allclose(chunked, _logprobs(logits, tokens[:, 1:]), atol=2e-5, rtol=1e-5)


SCALINGS = ("pi", "ntk", "dynamic_ntk", "yarn")


def test_a_scaling_changes_a_long_sequence_and_not_the_training_length(models):
    model, params = models["rope"]
    tokens = _tokens(1, 3 * TRAIN_LEN + 1, seed=7)
    short = tokens[:, : TRAIN_LEN + 1]
    unscaled = evaluation.full_logprobs(model, params, tokens, chunk=W)
    unscaled_short = evaluation.full_logprobs(model, params, short, chunk=W)
    for scaling in SCALINGS:
        scaled = _scaled(model, scaling)
        long = evaluation.full_logprobs(scaled, params, tokens, chunk=W)
        # Factor 0 is each length / train_len: s = 1 at the training length.
        np.testing.assert_allclose(
            evaluation.full_logprobs(scaled, params, short, chunk=W), unscaled_short, atol=1e-6
        )
        # Within the first chunk (positions < w) dynamic NTK keeps s = 1 too.
        first = slice(0, W) if scaling == "dynamic_ntk" else slice(0, 0)
        np.testing.assert_allclose(long[:, first], unscaled[:, first], atol=1e-6)
        assert np.abs(np.asarray(long - unscaled)).max() > 1e-3, scaling
    # An explicit factor applies at every length, the training length too.
    pi2 = evaluation.full_logprobs(_scaled(model, "pi", 2.0), params, short, chunk=W)
    assert np.abs(np.asarray(pi2 - unscaled_short)).max() > 1e-3


@pytest.mark.parametrize("position,scaling", [("xpos", "pi"), ("rope", "ntk"), ("xpos", "yarn")])
def test_a_scaling_scans_like_the_explicit_mask_and_chunks_like_one_forward(
    models, position, scaling
):
    # Factor 0: both paths take s = (L − 1)/train_len for the L − 1 inputs; the scaled
    # encodings stay relative, so window positions give the explicit mask's scores.
    model, params = models[position]
    model = _scaled(model, scaling)
    tokens = _tokens(2, 4 * W + 3, seed=8)
    scan = evaluation.block_scan_logprobs(model, params, tokens, W)
    np.testing.assert_allclose(scan, _explicit_bca(model, params, tokens), atol=2e-5, rtol=1e-5)
    chunked = evaluation.full_logprobs(model, params, tokens, chunk=W)
    logits, _ = model.apply({"params": params}, tokens[:, :-1])
    np.testing.assert_allclose(chunked, _logprobs(logits, tokens[:, 1:]), atol=2e-5, rtol=1e-5)


def test_dynamic_ntk_without_bca_takes_the_factor_of_each_chunk():
    """Chunk j (queries jC … jC + C − 1) of a one-layer model is scored as a dense
    forward over the prefix up to its end with NTK's s = max(1, (j + 1)·C / train_len):
    every earlier key is re-encoded with the chunk's s. (With more layers the cached
    keys of layer 2 on come from hidden states computed at their own chunk's s.)
    A last chunk padded to C ends at the last real token: padding took s from its own
    positions."""
    model = Decoder(dataclasses.replace(BASE, num_layers=1))
    params = nn.unbox(model.init(jax.random.key(4), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    for tokens in (_tokens(2, 5 * W + 1, seed=9), _tokens(2, 4 * W + 4, seed=9)):
        n = tokens.shape[1] - 1
        got = np.asarray(
            evaluation.full_logprobs(_scaled(model, "dynamic_ntk"), params, tokens, chunk=W)
        )
        for j in range(-(-n // W)):
            end = min((j + 1) * W, n)
            s = max(1.0, end / TRAIN_LEN)
            ntk = _scaled(model, "ntk", s) if s > 1 else model
            logits, _ = ntk.apply({"params": params}, tokens[:, :end])
            want = _logprobs(logits, tokens[:, 1 : end + 1])[:, j * W - end :]
            np.testing.assert_allclose(
                got[:, j * W : end], want, atol=2e-5, rtol=1e-5, err_msg=f"{n} tokens, {j}"
            )
    # Under BCA the window positions stay below train_len: s = 1, no change at all.
    np.testing.assert_allclose(
        evaluation.block_scan_logprobs(_scaled(model, "dynamic_ntk"), params, tokens, W),
        evaluation.block_scan_logprobs(model, params, tokens, W),
        atol=1e-6,
    )


def test_perplexity_rows_carry_the_scaling_and_its_factor(models):
    model, params = models["rope"]
    docs = _documents(2, 2 * TRAIN_LEN + 1, seed=10)
    lengths, budget = [W, 2 * TRAIN_LEN], 2 * TRAIN_LEN
    scaled = _scaled(model, "yarn")
    rows = evaluation.perplexity(
        scaled, params, docs, lengths, block=W, max_length=budget, modes=["full"]
    )
    assert [(r.length, r.rope_scaling, r.rope_factor) for r in rows] == [
        (W, "yarn", 1.0),
        (2 * TRAIN_LEN, "yarn", 2.0),
    ]
    plain = evaluation.perplexity(
        model, params, docs, [W], block=W, max_length=budget, modes=["full"]
    )
    assert {(r.rope_scaling, r.rope_factor) for r in plain} == {("none", None)}


def test_a_model_whose_nll_overflows_exp_has_an_infinite_perplexity_in_strict_json(
    models, tmp_path
):
    """Parameters × 1e4: a finite NLL of thousands of nats, whose exp overflowed
    (OverflowError: eval.py's traceback, exit 1); and a NaN model's report held NaN,
    which strict JSON parsers refuse."""
    model, params = models["alibi"]
    docs = _documents(1, TRAIN_LEN + 1, seed=11)
    huge = jax.tree.map(lambda x: x * 1e4, params)
    (row,) = evaluation.perplexity(model, huge, docs, [TRAIN_LEN], block=W, modes=["bca"])
    assert np.isfinite(row.nll) and row.nll > 710 and row.perplexity == np.inf
    # A NaN model stays NaN (not an overflow's inf).
    broken = jax.tree.map(lambda x: x * np.nan, params)
    (nan,) = evaluation.perplexity(model, broken, docs, [TRAIN_LEN], block=W, modes=["bca"])
    assert np.isnan(nan.nll) and np.isnan(nan.perplexity)
    path = str(tmp_path / "r.json")
    reports.write_json(path, {"perplexity": row.perplexity, "rows": [np.float32("nan"), 1.5]})

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    with open(path) as f:
        assert json.load(f, parse_constant=refuse) == {"perplexity": None, "rows": [None, 1.5]}


def test_learned_positions_beyond_their_table_fail_clearly_without_bca(models):
    model, params = models["learned"]
    with pytest.raises(evaluation.EvaluationError, match="table of 16"):
        evaluation.full_logprobs(model, params, _tokens(1, 2 * TRAIN_LEN + 1), chunk=W)


def test_xpos_beyond_its_safe_range_fails_clearly_without_bca():
    config = dataclasses.replace(BASE, dtype="float16")
    with pytest.raises(evaluation.EvaluationError, match="safe range"):
        evaluation.check_full_length(config, 200 * int(config.scale_base))


def test_scan_at_64x_train_len_runs_in_memory_independent_of_length(models):
    model, params = models["xpos"]
    temp = {}
    for multiple in (2, 64):
        n = multiple * TRAIN_LEN
        args = (params, jnp.zeros((1, n), jnp.int32), jnp.zeros((1, n), jnp.int32))
        compiled = blockwise.compiled_scan(model, W).lower(*args).compile()
        temp[multiple] = compiled.memory_analysis().temp_size_in_bytes
    # Besides the block step's fixed working set, only per-token vectors of the
    # input and output (a few int32/float32 per token) may grow with the length.
    assert temp[64] - temp[2] <= 16 * 62 * TRAIN_LEN
    tokens = _tokens(1, 64 * TRAIN_LEN + 1, seed=4)
    logprobs = evaluation.block_scan_logprobs(model, params, tokens, W)
    assert logprobs.shape == (1, 64 * TRAIN_LEN)
    assert bool(jnp.all(jnp.isfinite(logprobs)))


def test_resolution_pools_the_scores_each_mode_attends(models):
    model, params = models["xpos"]
    tokens = _tokens(3, 2 * TRAIN_LEN, seed=5)
    full = evaluation.measure_resolution(model, params, tokens, block=W, mode="full")
    bca = evaluation.measure_resolution(model, params, tokens, block=W, mode="bca")
    assert len(full.per_layer) == len(bca.per_layer) == BASE.num_layers
    assert len(full.expected_scores[0]) == 2 * TRAIN_LEN  # distances 0 … N−1
    assert len(bca.expected_scores[0]) == 2 * W  # distances inside a window
    # Layer 0 scores depend only on the two tokens and their distance, and up to
    # distance w every causal pair lies inside a window: both modes agree there.
    np.testing.assert_allclose(
        bca.expected_scores[0][: W + 1], full.expected_scores[0][: W + 1], rtol=1e-4, atol=1e-5
    )
    # Layer 0 depends on no other token: its expected scores by hand, eq. 11.
    _, _, scores = model.apply({"params": params}, tokens, return_scores=True)
    s = np.asarray(scores[0]).mean((0, 1))
    by_hand = [np.mean(np.diagonal(s, -d)) for d in range(2 * TRAIN_LEN)]
    np.testing.assert_allclose(full.expected_scores[0], by_hand, rtol=1e-4, atol=1e-5)
    assert np.isfinite(full.mean) and np.isfinite(bca.mean)


def _resolution_by_eq3(curve):
    """R of paper eq. 3 in float64: Σ_{i<N} e^{s_i}(e^{s_i} − e^{s_{i+1}}) / (Σ_i e^{s_i})²."""
    e = np.exp(np.asarray(curve, np.float64) - np.max(curve))
    return np.sum(e[:-1] * (e[:-1] - e[1:])) / np.sum(e) ** 2


def test_resolution_curves_and_r_by_hand_from_one_causal_forward(models):
    """Each mode's layer-0 curve (eq. 11) by hand from one causal forward's layer-0
    scores (they depend only on the two tokens and their distance): full pools every
    pair j ≤ i, bca only the pairs the blockwise rule lets attend (j ≥ (⌊i/w⌋ − 1)·w),
    distances 0 … 2w − 1, with a last block part padding whose pairs must not count.
    R of every layer, its mean and the window mean (distances 0 … 2w − 1) by eq. 3
    in float64 from the curves (the test above checks none of them)."""
    model, params = models["xpos"]
    n = 2 * TRAIN_LEN - 3  # not whole blocks: the scan pads the last one
    tokens = _tokens(3, n, seed=14)
    _, _, scores = model.apply({"params": params}, tokens, return_scores=True)
    layer0 = np.asarray(scores[0], np.float64).mean((0, 1))  # over texts and heads
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    causal = j <= i
    blockwise = causal & (j >= (i // W - 1) * W)
    for mode, mask, distances in (("full", causal, n), ("bca", blockwise, 2 * W)):
        got = evaluation.measure_resolution(model, params, tokens, block=W, mode=mode)
        by_hand = [np.mean(layer0[mask & (i - j == d)]) for d in range(distances)]
        np.testing.assert_allclose(
            got.expected_scores[0], by_hand, rtol=1e-4, atol=1e-5, err_msg=mode
        )
        curves = np.asarray(got.expected_scores, np.float64)
        r = [_resolution_by_eq3(curve) for curve in curves]
        np.testing.assert_allclose(got.per_layer, r, rtol=1e-4, atol=1e-6, err_msg=mode)
        assert got.mean == pytest.approx(np.mean(r), rel=1e-4, abs=1e-6), mode
        window = np.mean([_resolution_by_eq3(curve[: 2 * W]) for curve in curves])
        assert got.window_mean == pytest.approx(window, rel=1e-4, abs=1e-6), mode
    assert got.window_mean == pytest.approx(got.mean, rel=1e-6)  # bca: the window is all


def test_resolution_names_the_measurements_a_mode_could_not_make(models):
    """A learned table of train_len positions cannot be read at 2 × train_len without
    BCA: skipped with a note, and now also listed (resolution.json had no trace of it)."""
    model, params = models["learned"]
    docs = _documents(2, 2 * TRAIN_LEN, seed=12)
    skipped, notes = [], []
    results = evaluation.resolution_protocol(
        model,
        params,
        docs,
        train_len=TRAIN_LEN,
        block=W,
        modes=("bca", "full"),
        max_docs=2,
        say=notes.append,
        skipped=skipped,
    )
    assert [(r.mode, r.length) for r in results] == [
        ("bca", TRAIN_LEN),
        ("bca", 2 * TRAIN_LEN),
        ("full", TRAIN_LEN),
    ]
    assert [(m["mode"], m["length"]) for m in skipped] == [("full", 2 * TRAIN_LEN)]
    assert skipped[0]["reason"].startswith("learned absolute positions") and len(notes) == 1


def _documents(count, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, BASE.vocab_size, length).astype(np.int32) for _ in range(count)]


def test_perplexity_is_e_to_the_mean_nll_of_the_segments_scored_by_hand(models):
    """Each row against its definition, from plain forwards: the budget's targets cut
    into segments doc[s : s + length + 1], each scored by one forward under its mode's
    mask (full: causal; bca: the explicit blockwise mask), the targets' −log p averaged
    over every target, and e to that. Beyond 2w the two modes differ, so a mode scored
    the other's way, or a perplexity not e^nll, fails here."""
    model, params = models["xpos"]
    budget = 2 * TRAIN_LEN
    docs = _documents(2, budget + 3, seed=13)
    rows = evaluation.perplexity(model, params, docs, [W, budget], block=W, max_length=budget)
    assert {(r.mode, r.length) for r in rows} == {
        (m, n) for m in ("bca", "full") for n in (W, budget)
    }
    nll = {}
    for r in rows:
        segments = np.stack(
            [d[s : s + r.length + 1] for d in docs for s in range(0, budget, r.length)]
        )
        block = W if r.mode == "bca" else None
        logits, _ = model.apply({"params": params}, jnp.asarray(segments[:, :-1]), block=block)
        nats = np_nll(logits, segments[:, 1:])
        nll[r.mode, r.length] = np.mean(nats)
        assert r.tokens == nats.size == 2 * budget
        assert r.nll == pytest.approx(nll[r.mode, r.length], rel=1e-5), (r.mode, r.length)
        assert r.perplexity == pytest.approx(np.exp(nll[r.mode, r.length]), rel=1e-5)
    assert abs(nll["bca", budget] - nll["full", budget]) > 1e-3  # the oracle tells them apart


def test_a_length_gives_the_same_number_whatever_other_lengths_are_asked(models):
    model, params = models["xpos"]
    docs = _documents(3, 4 * TRAIN_LEN + 1)
    alone = evaluation.perplexity(model, params, docs, [W], block=W, max_length=4 * TRAIN_LEN)
    among = evaluation.perplexity(
        model, params, docs, [W, TRAIN_LEN, 4 * TRAIN_LEN], block=W, max_length=4 * TRAIN_LEN
    )
    for mode in evaluation.DEFAULT_MODES:
        a = next(r for r in alone if r.mode == mode)
        b = next(r for r in among if (r.mode, r.length) == (mode, W))
        assert (a.tokens, a.max_length) == (b.tokens, b.max_length) == (3 * 64, 64)
        assert a.perplexity == pytest.approx(b.perplexity, rel=1e-6)


def test_a_last_batch_filled_with_padding_rows_gives_the_same_numbers(models):
    """6 segments of length w in batches of 4: the second batch holds 2 segments and 2
    rows of padding, which must not count; in one batch of 6 there is none."""
    model, params = models["xpos"]
    docs = _documents(3, 2 * W + 1, seed=2)
    run = lambda per_batch: evaluation.perplexity(
        model, params, docs, [W], block=W, max_length=2 * W, tokens_per_batch=per_batch
    )
    for padded, whole in zip(run(4 * W), run(6 * W), strict=True):
        assert padded.tokens == whole.tokens == 6 * W
        assert padded.perplexity == pytest.approx(whole.perplexity, rel=1e-6)


def test_every_cell_of_a_table_scores_the_same_tokens(models):
    """Learned positions cannot go past their table without BCA, and 12 does not
    divide the budget: those cells are missing, the others score the same tokens."""
    model, params = models["learned"]
    docs = _documents(2, 2 * TRAIN_LEN + 1, seed=1)
    budget = 2 * TRAIN_LEN
    notes = []
    results = evaluation.perplexity(
        model, params, docs, [W, 12, TRAIN_LEN, budget], block=W, max_length=budget,
        strict=False, say=notes.append,
    )  # fmt: skip
    cells = {(r.mode, r.length) for r in results}
    assert cells == {
        ("bca", W),
        ("bca", TRAIN_LEN),
        ("bca", budget),
        ("full", W),
        ("full", TRAIN_LEN),
    }
    assert {r.tokens for r in results} == {2 * budget} and {r.documents for r in results} == {2}
    assert len(notes) == 3  # bca 12, full 12, full 32
    with pytest.raises(evaluation.EvaluationError, match="does not divide"):
        evaluation.perplexity(model, params, docs, [12], block=W, max_length=budget)
    # The budget, not the largest length, fixes the tokens: W alone on the same budget.
    alone = evaluation.perplexity(
        model, params, docs, [W], block=W, max_length=budget, modes=["full"]
    )
    full_w = next(r for r in results if (r.mode, r.length) == ("full", W))
    assert alone[0].perplexity == pytest.approx(full_w.perplexity, rel=1e-6)


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_bca_gives_absolute_encodings_window_relative_positions(position):
    """What the scan computes for absolute encodings, built by hand window by window:
    for a one-layer model, token t of block b ≥ 1 is the plain training forward (no
    cache, no block mask) over the tokens of blocks b − 1 … t, each embedded at the
    position it had when its own block was scored (w + j after the first block,
    j in it) — not at its position in the sequence, as the authors' code keeps."""
    config = dataclasses.replace(BASE, position=position, num_layers=1)
    model = Decoder(config)
    params = nn.unbox(model.init(jax.random.key(3), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    tokens = _tokens(1, 4 * W + 1, seed=6)
    scanned = np.asarray(evaluation.block_scan_logprobs(model, params, tokens, W))[0]
    inputs, targets = np.asarray(tokens[0, :-1]), np.asarray(tokens[0, 1:])
    forward = jax.jit(lambda x, p: model.apply({"params": params}, x[None], p[None])[0][0])
    for t in range(len(inputs)):
        b = t // W
        window = np.arange(max(b - 1, 0) * W, t + 1)
        embedded_at = np.where(window < W, window % W, W + window % W)
        # Padded to 2w after the last token (causal: it cannot change it), one compile.
        pad = 2 * W - len(window)
        logits = forward(
            jnp.asarray(np.pad(inputs[window], (0, pad))),
            jnp.asarray(np.pad(embedded_at, (0, pad))),
        )
        by_hand = jax.nn.log_softmax(logits[len(window) - 1])[targets[t]]
        np.testing.assert_allclose(scanned[t], by_hand, rtol=1e-5, atol=1e-5, err_msg=f"t={t}")


@pytest.mark.parametrize("scored", [None, 10])
def test_bits_per_byte_is_the_nll_over_the_bytes_of_the_scored_text(scored):
    """Bits per byte by hand: the summed NLL in nats over ln 2 and over the UTF-8 bytes
    of the text whose tokens are scored, counted here from the text itself. A model
    with the byte tokenizer's whole vocabulary, so that begin-of-text keeps its id
    (no bytes): counting the inputs' bytes instead of the targets' is one byte short."""
    from lexjax.data.tokenizer import BYTES

    config = dataclasses.replace(BASE, vocab_size=264)
    model = Decoder(config)
    params = nn.unbox(model.init(jax.random.key(1), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    text = "naïve café — 12 bytes more".encode()  # multi-byte characters count as bytes
    doc = np.asarray(BYTES.encode_document(text), np.int32)  # BOS, the bytes, EOS
    # Targets: every byte of the text (tokens 1 … len), not EOS; or its first 10 bytes.
    budget = scored or len(text)
    (r,) = evaluation.perplexity(
        model, params, [doc], [budget], block=W, max_length=budget, modes=["bca"], tokenizer=BYTES
    )
    logprobs = evaluation.block_scan_logprobs(model, params, doc[None, : budget + 1], W)
    nats = -float(np.sum(np.asarray(logprobs, np.float64)))
    assert r.bytes == len(text[:budget])
    assert r.bits_per_byte == pytest.approx(nats / (np.log(2) * budget), rel=1e-5)
    assert r.bits_per_byte == pytest.approx(r.nll * r.tokens / (np.log(2) * budget), rel=1e-6)


def test_eval_files_skip_empty_and_binary_files_as_the_corpus_build_does(tmp_path):
    from lexjax.errors import DataError
    from tests.helpers import small_config

    (tmp_path / "a.txt").write_text("lexjax " * 20)
    (tmp_path / "b.txt").write_bytes(bytes(range(256)) * 12)  # NULs: binary
    (tmp_path / "c.txt").write_bytes(b"")
    notes = []
    where, docs = evaluation.held_out_documents(
        small_config(), str(tmp_path / "*.txt"), say=notes.append
    )
    assert (where, len(docs)) == (f"1 file of {tmp_path}/*.txt", 1)
    assert notes == ["note: evaluation files: skipped 1 empty, 1 binary of 3"]
    with pytest.raises(DataError, match="no evaluation text: .* 1 binary .*all skipped"):
        evaluation.held_out_documents(small_config(), str(tmp_path / "b.txt"))
    # Text saved as UTF-16 (a Windows export) has NULs too: the message says what to do.
    (tmp_path / "d.txt").write_text("hello world\n", encoding="utf-16")
    with pytest.raises(DataError, match="convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8"):
        evaluation.held_out_documents(small_config(), str(tmp_path / "d.txt"))


def test_eval_files_with_invalid_utf8_are_read_as_the_corpus_build_reads_them(tmp_path):
    """A latin-1 file: the byte tokenizer took its raw bytes and SentencePiece its
    U+FFFD replacements, so bits per byte counted 1800 bytes for one and 2400 for the
    other. Both now see the corpus build's text (U+FFFD), with a note."""
    from lexjax import data as data_lib
    from tests.helpers import small_config

    (tmp_path / "latin1.txt").write_bytes("café naïve\n".encode("latin-1") * 10)
    notes = []
    _, (doc,) = evaluation.held_out_documents(
        small_config(), str(tmp_path / "*.txt"), say=notes.append
    )
    text = "café naïve\n".encode("latin-1").decode("utf-8", errors="replace") * 10
    np.testing.assert_array_equal(doc, data_lib.BYTES.encode_document(text))
    assert data_lib.BYTES.num_bytes(doc) == len(text.encode()) == 150  # 110 bytes in the file
    assert notes == [
        "note: evaluation files with invalid UTF-8 (the first read: latin1.txt) are read with "
        "U+FFFD in its place, as in a corpus build (bits per byte counts its 3 bytes)"
    ]


def test_eval_files_are_each_one_document_and_read_only_as_far_as_needed(tmp_path):
    """A file reached through a symlinked directory was scored once per path (the
    build counts it once); and every file was read and tokenized before the first
    max_docs were chosen (SentencePiece: ~30× the text's size in memory)."""
    from lexjax import data as data_lib
    from tests.helpers import small_config

    (tmp_path / "sub").mkdir()
    for i in range(30):
        (tmp_path / ("sub" if i % 2 else ".") / f"d{i:02}.txt").write_text(f"doc {i} " * (i + 1))
    (tmp_path / "sublink").symlink_to(tmp_path / "sub")
    encoded = []

    class Counting(type(data_lib.BYTES)):
        def encode(self, text):
            encoded.append(text)
            return super().encode(text)

    where, docs = evaluation.held_out_documents(
        small_config(), str(tmp_path / "**" / "*.txt"), tokenizer=Counting()
    )
    assert (where, len(docs), encoded) == (f"30 files of {tmp_path}/**/*.txt", 30, [])
    # In sorted order the even files come first (sub/ after them): d00, d02 and d04
    # ("doc 4 " x 5: 30 bytes + BOS, EOS) are shorter than 40 tokens + 1.
    chosen = evaluation.select_documents(docs, 40, max_docs=2, where=where)
    assert [len(d) for d in chosen] == [len("doc 6 " * 7) + 2, len("doc 8 " * 9) + 2]
    assert len(encoded) == 5  # d00 … d08, and no further


def test_a_large_eval_file_is_read_no_further_than_the_tokens_scored(tmp_path):
    """Each file of --eval_files was read whole and tokenized whole, though only the
    first max_length + 1 tokens are scored: memory grew with the largest file."""
    from lexjax import data as data_lib
    from lexjax.data.builders import _MAX_DOCUMENT_BYTES
    from tests.helpers import small_config

    raw = b"".join(b"line %d of a long held-out file\n" % i for i in range(300_000))
    assert len(raw) > 2 * _MAX_DOCUMENT_BYTES  # three pieces
    (tmp_path / "big.txt").write_bytes(raw)
    encoded = []

    class Counting(type(data_lib.BYTES)):
        def encode(self, text):
            encoded.append(len(text))
            return super().encode(text)

    bos, eos = data_lib.BYTES.bos, data_lib.BYTES.eos
    every_byte = np.frombuffer(raw, np.uint8).astype(np.int32)
    glob = str(tmp_path / "*.txt")
    _, docs = evaluation.held_out_documents(
        small_config(), glob, tokenizer=Counting(), max_tokens=1000
    )
    np.testing.assert_array_equal(docs[0], np.concatenate([[bos], every_byte[:999]]))
    assert len(encoded) == 1 and encoded[0] <= _MAX_DOCUMENT_BYTES  # one piece, not three
    encoded.clear()
    _, docs = evaluation.held_out_documents(small_config(), glob, tokenizer=Counting())
    np.testing.assert_array_equal(docs[0], np.concatenate([[bos], every_byte, [eos]]))
    assert len(encoded) == 3 and sum(encoded) == len(raw)


def test_an_eval_file_whose_size_says_nothing_of_its_contents_is_read_to_its_end():
    """A /sys file reports 4096 bytes and holds a few: reading in pieces up to the
    reported size stopped with "changed while it was read" (f.read() had read it)."""
    from lexjax import data as data_lib
    from lexjax.data.builders import file_document

    path = "/sys/devices/system/cpu/online"
    if not os.path.exists(path):
        pytest.skip("no sysfs here")
    with open(path, "rb") as f:
        raw = f.read()
    assert os.path.getsize(path) != len(raw)  # the case this covers
    document, replaced = file_document(path, data_lib.BYTES)
    expected = [data_lib.BYTES.bos, *raw, data_lib.BYTES.eos]
    assert document.tolist() == expected and not replaced


def test_the_table_counts_one_document_in_the_singular():
    one = evaluation.PerplexityResult("bca", 64, 2.0, 0.69, 64, 1, 0.1, 64)
    assert "every cell: 1 document × the first 64 tokens = 64 scored tokens" in (
        reports.perplexity_table([one], "xpos")
    )
    # And one token, one byte (--lengths=1 --max_length=1): it said "1 scored tokens".
    single = evaluation.PerplexityResult("bca", 1, 2.0, 0.69, 1, 1, 0.1, 1, bytes=1)
    assert "1 document × the first 1 token = 1 scored token (1 byte of text)" in (
        reports.perplexity_table([single], "xpos")
    )


def test_no_document_long_enough_says_where_how_many_and_the_largest_budget():
    """It said "2 files of … has 2 documents" (eval.py's one file: test_eval_cli.py)."""
    from lexjax.errors import DataError

    documents = [[1] * 10, [1] * 20]
    with pytest.raises(DataError) as e:
        evaluation.select_documents(documents, 30, max_docs=5, where="2 files of x/*.txt")
    assert str(e.value).startswith(
        "no document is long enough for the budget of 30 tokens (in 2 files of x/*.txt: "
        "2 documents, the longest 20 tokens); pass max_length=19 or less"
    ), e.value
    # 19 is enough: the budget and the token after it.
    assert evaluation.select_documents(documents, 19, max_docs=5, where="x") == [[1] * 20]
    # With the lengths asked, the advice names a budget and lengths that work as given:
    # "19 or less" alone, followed with the default lengths, was the next error (the
    # budget must hold the largest length and be divided by one).
    for lengths, such in (
        ([4, 8, 16, 32, 64], "max_length=16 lengths=4,8,16"),
        ([3, 4, 6, 40], "max_length=12 lengths=3,4,6"),
        ([7, 9, 30], "max_length=9 lengths=9"),  # lcm 63 > 19: the largest that fits
        ([20, 40], ""),  # none fits: no example
    ):
        with pytest.raises(DataError) as e:
            evaluation.select_documents(documents, 30, max_docs=5, where="x", lengths=lengths)
        assert str(e.value).endswith(
            f"(with lengths that divide it{such and ', such as ' + such}) or other eval_files"
        ), e.value
        if such:
            budget, asked = (part.split("=")[1] for part in such.split())
            asked = [int(n) for n in asked.split(",")]
            assert evaluation.check_settings(asked, int(budget)) == asked
            assert evaluation.select_documents(documents, int(budget), max_docs=5, where="x")
