"""Attention sinks + sliding window (StreamingLLM): the block scan against a token-by-token
streaming computation in float64, written from the rule, not from lexjax's code."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import evaluation
from lexjax.blockwise import KVCache, sink_window
from lexjax.errors import ConfigError
from lexjax.model import Decoder
from tests import paper
from tests.helpers import SMALL_MODEL, TRAIN_LEN, np_gelu, np_layer_norm

W = TRAIN_LEN // 2


def _model(position, seed=1):
    config = dataclasses.replace(SMALL_MODEL, position=position)
    model = Decoder(config)
    params = model.init(jax.random.key(seed), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"]
    return model, nn.unbox(params)


def _tokens(batch, length, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, SMALL_MODEL.vocab_size, (batch, length)), jnp.int32)


def _streaming(config, params, tokens, sinks, pi_factor=1.0):
    """log p(tokens[t+1] | ...) for one row, token by token as streaming inference runs.

    Token t's cache: the sinks ``0 … min(S, t+1)−1`` then the most recent tokens
    ``max(S, t−W+1) … t`` (W = train_len − S), at cache positions ``0, 1, …`` in that
    order, the query (token t itself) last. Each layer's key and value of token t are
    computed once, when t is processed, and kept un-encoded; the encoding is applied
    at the cache position of the step that reads them. ``pi_factor`` s: position
    interpolation (Chen et al. 2023), every cache position p read as p/s.
    """
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    window = TRAIN_LEN - sinks
    heads = config.num_heads
    kept = [[] for _ in range(config.num_layers)]  # per layer: (k, v) of every token so far
    out = []
    for t, token in enumerate(tokens[:-1]):
        ids = [*range(min(sinks, t + 1)), *range(max(sinks, t - window + 1), t + 1)]
        cache_positions = np.arange(len(ids)) / pi_factor
        q_position = cache_positions[-1:]
        x = p["embed"]["embedding"][token]
        for layer in range(config.num_layers):
            lp = p[f"layer_{layer}"]
            a = lp["attention"]
            h = np_layer_norm(x, lp["ln_attention"])
            q, k, v = (np.einsum("d,dhk->hk", h, a[n]["kernel"]) for n in ("query", "key", "value"))
            kept[layer].append((k, v))
            keys = np.stack([kept[layer][j][0] for j in ids])[None]  # [1, n, H, K]
            values = np.stack([kept[layer][j][1] for j in ids])[None]
            q = q[None, None]  # [1, 1, H, K]
            bias = None
            if config.position == "xpos":
                q = paper.xpos(q, q_position, scale_base=config.scale_base)
                keys = paper.xpos(
                    keys, cache_positions, scale_base=config.scale_base, downscale=True
                )
            elif config.position == "rope":
                q, keys = paper.rope(q, q_position), paper.rope(keys, cache_positions)
            elif config.position == "alibi":
                slopes = np.asarray(paper.alibi_slopes(heads))
                distance = q_position[0] - cache_positions
                bias = (-slopes[:, None] * distance[None, :])[None, :, None, :]
            attended, _ = paper.attention(q, keys, values, logit_bias=bias)
            x = x + np.einsum("hk,hkd->d", attended[0, 0], a["out"]["kernel"])
            h = np_layer_norm(x, lp["ln_mlp"])
            h = np_gelu(h @ lp["mlp_in"]["kernel"] + lp["mlp_in"]["bias"])
            x = x + h @ lp["mlp_out"]["kernel"] + lp["mlp_out"]["bias"]
        x = np_layer_norm(x, p["ln_final"])
        logits = p["embed"]["embedding"] @ x * config.d_model**-0.5
        logits = logits - logits.max()
        out.append(logits[tokens[t + 1]] - np.log(np.exp(logits).sum()))
    return np.asarray(out)


@pytest.mark.parametrize(
    "position,sinks",
    [("xpos", 4), ("rope", 4), ("alibi", 4), ("none", 4), ("rope", 0), ("xpos", W)],
)
def test_block_scan_equals_token_by_token_streaming(position, sinks):
    model, params = _model(position)
    tokens = _tokens(2, 79, seed=3)  # 78 inputs: the last block is padded
    scanned = np.asarray(evaluation.sinks_logprobs(model, params, tokens, W, sinks))
    for row in range(2):
        want = _streaming(model.config, params, np.asarray(tokens[row]), sinks)
        np.testing.assert_allclose(scanned[row], want, atol=1e-5, rtol=1e-5)
    if position != "rope":
        return
    # The rule matters here: beyond train_len the mode differs from dense and BCA.
    beyond = slice(TRAIN_LEN, None)
    for other in (
        evaluation.full_logprobs(model, params, tokens, chunk=W),
        evaluation.block_scan_logprobs(model, params, tokens, W),
    ):
        assert np.abs(scanned[:, beyond] - np.asarray(other)[:, beyond]).max() > 1e-3


@pytest.mark.parametrize("position", ["xpos", "rope"])
@pytest.mark.parametrize("factor", [2.0, 0.0])
def test_position_interpolation_reads_every_cache_position_over_s(position, factor):
    """A RoPE extension applies to the sinks as to the window keys (one softmax, one
    s), and factor 0 is the evaluated length / train_len, as in the other modes."""
    model, params = _model(position)
    config = dataclasses.replace(
        model.config, rope_scaling="pi", rope_factor=factor, rope_train_len=TRAIN_LEN
    )
    tokens = _tokens(1, 41, seed=5)  # 40 inputs: factor 0 is s = 40/16
    scanned = evaluation.sinks_logprobs(Decoder(config), params, tokens, W, 4)
    s = factor or 40 / TRAIN_LEN
    want = _streaming(config, params, np.asarray(tokens[0]), 4, pi_factor=s)
    np.testing.assert_allclose(np.asarray(scanned[0]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", ["xpos", "rope"])
def test_dynamic_ntk_changes_nothing_as_the_cache_positions_stay_below_train_len(position):
    """StreamingLLM's cache positions never pass l − 1, so dynamic NTK's s is 1. The
    scan's window positions 0 … 3w−1 gave the window group s = 1.5 and the sinks
    s = 1, at every length (up to train_len too, where the mode is dense attention)."""
    model, params = _model(position)
    config = dataclasses.replace(model.config, rope_scaling="dynamic_ntk", rope_train_len=TRAIN_LEN)
    tokens = _tokens(1, 41, seed=5)
    scanned = evaluation.sinks_logprobs(Decoder(config), params, tokens, W, 4)
    want = _streaming(model.config, params, np.asarray(tokens[0]), 4)
    np.testing.assert_allclose(np.asarray(scanned[0]), want, atol=1e-5, rtol=1e-5)
    # Below 2·block, s would be more than 1 (positions up to 2·block − 1): refused.
    short = Decoder(dataclasses.replace(config, rope_train_len=W))
    with pytest.raises(
        evaluation.EvaluationError, match=rf"needs model.rope_train_len ≥ {2 * W}, not {W} "
    ):
        evaluation.sinks_logprobs(short, params, tokens, W, 4)


@pytest.mark.parametrize("position", ["xpos", "rope", "alibi", "none"])
def test_up_to_train_len_nothing_is_evicted_and_it_equals_full(position):
    model, params = _model(position, seed=2)
    tokens = _tokens(2, TRAIN_LEN + 1, seed=4)
    sinks = evaluation.sinks_logprobs(model, params, tokens, W, 4)
    full = evaluation.full_logprobs(model, params, tokens, chunk=W)
    np.testing.assert_allclose(sinks, full, atol=2e-5, rtol=1e-5)


def test_sink_counts_outside_the_first_block_are_refused():
    assert sink_window(W, 0) == TRAIN_LEN and sink_window(W, W) == W
    for bad in (-1, W + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"^sinks=.* must be an integer"):
            sink_window(W, bad)
    model, params = _model("xpos")
    # Named as the API's argument (eval.py: its flag), with the value given.
    with pytest.raises(ConfigError, match=rf"^sinks={W + 1} must be an integer in \[0, {W}\]"):
        evaluation.sinks_logprobs(model, params, _tokens(1, 9), W, W + 1)


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_absolute_encodings_have_no_sinks_cell(position):
    model, params = _model(position)
    config = model.config
    cell = evaluation.cell_problem(config, "sinks", TRAIN_LEN, 2 * TRAIN_LEN, W)
    assert "StreamingLLM" in cell
    with pytest.raises(evaluation.EvaluationError, match="relative encoding"):
        evaluation.sinks_logprobs(model, params, _tokens(1, 9), W)
    docs = [np.asarray(_tokens(1, 2 * TRAIN_LEN + 1, seed=5)[0])]
    notes = []
    results = evaluation.perplexity(
        model, params, docs, [TRAIN_LEN], block=W, modes=["bca", "sinks"], strict=False,
        say=notes.append,
    )  # fmt: skip
    assert [r.mode for r in results] == ["bca"] and "no sinks cell" in notes[0]


def test_sinks_refuse_an_xpos_scale_base_their_wider_window_overflows(monkeypatch):
    """A step's keys span window positions 0 … 3w−1, ±1.5w centred: at b = 0.15,
    BCA's ±w keeps XPOS's scale finite and sinks' positions overflow it. They were
    evaluated anyway (a review found 556 of 1500 log-probs not finite)."""
    model, params = _model("xpos")
    model = Decoder(dataclasses.replace(model.config, scale_base=0.15))
    tokens = _tokens(1, 4 * TRAIN_LEN + 1, seed=3)
    assert np.isfinite(np.asarray(evaluation.block_scan_logprobs(model, params, tokens, W))).all()
    said = f"sinks + window at block {W} puts XPOS positions at ±{3 * W // 2}, beyond"
    with pytest.raises(evaluation.EvaluationError, match=f"^{re.escape(said)}.* or mode bca$"):
        evaluation.sinks_logprobs(model, params, tokens, W)
    cell = evaluation.cell_problem(model.config, "sinks", TRAIN_LEN, TRAIN_LEN, W)
    assert cell.startswith(said)
    smaller = int(re.search(r"block ≤ (\d+)", cell)[1])
    assert (
        smaller < W and np.isfinite(evaluation.sinks_logprobs(model, params, tokens, smaller)).all()
    )
    # What the refusal saves: the same scan without it is not finite.
    monkeypatch.setattr(evaluation, "sinks_problem", lambda config, block: None)
    assert not np.isfinite(np.asarray(evaluation.sinks_logprobs(model, params, tokens, W))).all()


def test_perplexity_reports_the_sinks_mode():
    model, params = _model("rope")
    docs = [np.asarray(_tokens(1, 4 * TRAIN_LEN + 1, seed=s)[0]) for s in range(2)]
    (result,) = evaluation.perplexity(
        model, params, docs, [4 * TRAIN_LEN], block=W, modes=["sinks"]
    )
    assert result.as_dict()["mode"] == "sinks" and result.tokens == 2 * 4 * TRAIN_LEN
    tokens = jnp.asarray(np.stack(docs))
    nll = -float(jnp.mean(evaluation.sinks_logprobs(model, params, tokens, W)))
    assert result.nll == pytest.approx(nll, rel=1e-5)
    with pytest.raises(ConfigError, match="^sinks=9 must be an integer"):
        evaluation.perplexity(model, params, docs, [TRAIN_LEN], block=W, modes=["sinks"], sinks=9)


def test_scan_memory_does_not_grow_with_the_length():
    model, params = _model("xpos")
    temp = {}
    for multiple in (2, 64):
        n = multiple * TRAIN_LEN
        args = (params, jnp.zeros((1, n), jnp.int32), jnp.zeros((1, n), jnp.int32))
        compiled = evaluation._compiled_sinks(model, W, 4).lower(*args).compile()
        temp[multiple] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[64] - temp[2] <= 16 * 62 * TRAIN_LEN  # per-token inputs and outputs only


def test_a_query_sees_only_the_sinks_not_after_its_sink_position():
    """Decoder's contract: a query sees every valid sink whose position is not after
    its *sink* position. A mask built from the window positions instead (all past
    every sink in the scan, so the scan could not tell) let a query at sink position
    1 see the sinks at 2 and 3."""
    model, params = _model("xpos")
    tokens = _tokens(1, 12)
    _, (k, v) = model.apply({"params": params}, tokens)
    window = KVCache(k[:, :, 4:8], v[:, :, 4:8], jnp.arange(10, 14)[None], jnp.ones((1, 4), bool))

    def logits(sink_position, valid):
        sinks = KVCache(k[:, :, :4], v[:, :, :4], jnp.arange(4)[None], jnp.asarray([valid]))
        out, _ = model.apply(
            {"params": params},
            tokens[:, 8:],
            jnp.arange(14, 18)[None],
            cache=window,
            window=8,
            sinks=sinks,
            sink_positions_BxT=jnp.full((1, 4), sink_position),
        )
        return np.asarray(out)

    first_two = logits(1, [True, True, False, False])
    np.testing.assert_allclose(logits(1, [True] * 4), first_two, rtol=1e-6, atol=1e-6)
    assert not np.allclose(logits(3, [True] * 4), first_two, rtol=1e-3, atol=1e-3)
