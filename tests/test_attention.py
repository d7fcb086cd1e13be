"""Attention against an explicit float64 softmax over the paper's encodings."""

import functools
import math
import re
from typing import get_args

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from lexjax import attention, config, masks, positions, reports
from tests import paper

B, TQ, TK, H, D = 2, 4, 6, 2, 8


def _qkv(seed, q_len=TQ, k_len=TK):
    rng = np.random.default_rng(seed)
    return tuple(
        rng.standard_normal(shape).astype(np.float32)
        for shape in ((B, q_len, H, D), (B, k_len, H, D), (B, k_len, H, D))
    )


def _reference(q, k, v, q_pos, k_pos, position, mask):
    """Encode with the paper's equations at the given (un-shifted) positions, then
    an explicit masked softmax."""
    q_pos, k_pos = np.broadcast_to(q_pos, q.shape[:2]), np.broadcast_to(k_pos, k.shape[:2])
    bias = None
    if position == "xpos":
        q, k = paper.xpos(q, q_pos), paper.xpos(k, k_pos, downscale=True)
    elif position == "rope":
        q, k = paper.rope(q, q_pos), paper.rope(k, k_pos)
    elif position == "xpos_norotate":  # the paper's Table 4: θ_i = 0
        zeros = [0.0] * (D // 2)
        q, k = paper.xpos(q, q_pos, freqs=zeros), paper.xpos(k, k_pos, downscale=True, freqs=zeros)
    elif position == "alibi":
        slopes = np.asarray(paper.alibi_slopes(H))
        bias = -slopes[None, :, None, None] * (q_pos[:, None, :, None] - k_pos[:, None, None, :])
    elif position in config.RELATIVE_ENCODINGS:
        raise NotImplementedError(f"add the paper's equations of position={position!r} here")
    return paper.attention(q, k, v, logit_bias=bias, mask=mask)


def _padded_causal_mask():
    """Causal over TK tokens, with padding (segment 0) at the end of both examples."""
    pos = np.arange(TK, dtype=np.int32)
    segments = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 2, 2, 2, 0]], np.int32)
    mask = (
        masks.causal_by_position(pos, pos)[None, None]
        & masks.same_segment(segments, segments)[:, None]
    )
    return pos, mask


def test_the_position_kinds_are_one_list():
    """attention.PositionKind (the type) and config.POSITION_KINDS (what make_config
    accepts) name the same kinds, and each paired (table) encoding is built by
    context: a kind added to one list only was accepted and then refused, or fell
    through to XPOS's decaying tables."""
    assert sorted(get_args(attention.PositionKind)) == sorted(config.POSITION_KINDS)
    # The tables' names (XPOS's, "XPOS b=…", is made where it is shown).
    assert sorted([*reports.POSITION_NAMES, "xpos"]) == sorted(config.POSITION_KINDS)
    assert set(config.DECAYING_ENCODINGS) <= set(config.PAIRED_ENCODINGS)
    assert set(config.PAIRED_ENCODINGS) <= set(config.RELATIVE_ENCODINGS)
    for kind in config.PAIRED_ENCODINGS:
        ctx = attention.context(np.arange(4), np.arange(4), num_heads=H, head_dim=D, position=kind)
        assert ctx.q_rotary is not None and ctx.k_rotary is not None, kind


@pytest.mark.parametrize("position", ["xpos", "rope", "alibi"])
def test_float64_gradients_match_finite_differences(position):
    """Under x64, float64 q, k, v are computed in float64 (the tables stay float32
    and are constants here): x was cast to float32 for the rotation and the scores
    accumulated in float32, so a float64 gradient check failed (relative error
    6e-2 at eps 1e-6) though the gradients were right."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 4))) for _ in range(3))
        at = jnp.arange(6) + 40

        def loss(q, k, v):
            out, logits = attention.multihead_attention(
                q, k, v, at, at, position=position, mask=masks.causal(6), scale_base=8.0
            )
            assert out.dtype == logits.dtype == jnp.float64
            return (out**2).sum()

        jax.test_util.check_grads(loss, (q, k, v), order=1, modes=["rev"], eps=1e-6)


def test_alibi_under_a_shard_map_that_splits_heads_as_documented():
    """A context built inside the shard_map sees its shard's heads and gives them the
    slopes of a smaller model; built outside with every head and passed in,
    its bias split over heads as q is, the result is the unsplit one's."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("h",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 4, 8)), jnp.float32) for _ in range(3))
    at = jnp.arange(8)
    ctx = attention.context(at, at, num_heads=4, head_dim=8, position="alibi", mask=masks.causal(8))
    want, _ = attention.attention(q, k, v, ctx)
    heads = P(None, None, "h")
    split = jax.shard_map(
        lambda q, k, v, ctx: attention.attention(q, k, v, ctx)[0],
        mesh=mesh,
        in_specs=(heads, heads, heads, ctx.replace(bias=P(None, "h"), mask=P())),
        out_specs=heads,
    )
    np.testing.assert_allclose(split(q, k, v, ctx), want, rtol=1e-6, atol=1e-6)


class MultiheadAttentionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    # Every kind attention encodes (the absolute ones are added to the embeddings).
    @parameterized.parameters(*config.RELATIVE_ENCODINGS, "none")
    def test_matches_explicit_softmax_with_mask(self, position):
        q, k, v = _qkv(0)
        # Queries are the last 4 of 6 tokens at positions 20 …; the second example has
        # a padded key (segment 0) on top of the causal pattern.
        k_pos = np.arange(20, 20 + TK, dtype=np.int32)
        q_pos = k_pos[TK - TQ :]
        segments = np.array([[1] * TK, [0] + [1] * (TK - 1)], np.int32)
        mask = (
            masks.causal_by_position(q_pos, k_pos)[None, None]
            & masks.same_segment(segments[:, TK - TQ :], segments)[:, None]
        )
        run = self.variant(functools.partial(attention.multihead_attention, position=position))
        out, logits = run(q, k, v, q_pos, k_pos, mask=mask)
        want_out, want_logits = _reference(q, k, v, q_pos, k_pos, position, np.asarray(mask))
        self.assertEqual(out.shape, (B, TQ, H, D))
        self.assertEqual(logits.shape, (B, H, TQ, TK))
        np.testing.assert_allclose(
            np.asarray(logits, np.float64), want_logits, rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=1e-5, atol=1e-5)

    @parameterized.parameters("xpos", "rope")
    def test_per_example_positions(self, position):
        q, k, v = _qkv(1, TK, TK)
        pos = np.array([np.arange(TK), np.arange(TK) * 3 + 100], np.int32)
        mask = masks.causal_by_position(pos, pos)[:, None]
        out, logits = attention.multihead_attention(q, k, v, pos, pos, position=position, mask=mask)
        want_out, want_logits = _reference(q, k, v, pos, pos, position, np.asarray(mask))
        np.testing.assert_allclose(
            np.asarray(logits, np.float64), want_logits, rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=1e-5, atol=1e-5)

    @parameterized.parameters((jnp.float32, 100_000), (jnp.float16, 5_000))
    def test_xpos_far_positions_stay_finite(self, dtype, offset):
        # Absolute positions past where 3.5^(p/b) overflows (≈ 141·b = 72k in float32,
        # ≈ 8.9·b = 4.5k in float16): scores depend only on m − n, so attention at
        # positions offset + … must equal attention at the same small positions.
        q, k, v = (jnp.asarray(a, dtype) for a in _qkv(5))
        k_pos = np.arange(TK, dtype=np.int32)
        q_pos = k_pos[TK - TQ :]
        mask = masks.causal(TQ, TK)
        near = attention.multihead_attention(q, k, v, q_pos, k_pos, position="xpos", mask=mask)
        far = attention.multihead_attention(
            q, k, v, q_pos + offset, k_pos + offset, position="xpos", mask=mask
        )
        for got, want in zip(far, near):
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            self.assertTrue(np.all(np.isfinite(got)))
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    @parameterized.parameters("xpos", "rope")
    def test_rows_at_far_and_different_offsets_score_as_near_ones(self, position):
        # Scores depend only on m − n (paper §3), whatever each row's offset: one row
        # near 0, the other past int32's half range (2^30 + …, where a sum of two
        # positions overflows). The shift that keeps XPOS finite and RoPE's float32
        # angles exact was one for the whole batch: the near row pushed the far one
        # out of range, and every output was NaN.
        q, k, v = _qkv(6)
        k_pos = np.arange(TK, dtype=np.int32)
        q_pos = k_pos[TK - TQ :]
        mask = masks.causal_by_position(q_pos, k_pos)[None, None]
        near = attention.multihead_attention(q, k, v, q_pos, k_pos, position=position, mask=mask)
        offsets = np.array([[0], [2**30 + 12_345]], np.int32)
        far = attention.multihead_attention(
            q, k, v, q_pos + offsets, k_pos + offsets, position=position, mask=mask
        )
        for got, want in zip(far, near):
            self.assertTrue(np.all(np.isfinite(got)))
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)

    @parameterized.parameters("xpos", "rope")
    def test_a_scalar_query_position_is_one_position(self, position):
        # One decoding query at position 5 against keys 0 … 5 (the per-row centring
        # took axis −1 of a 0-d array).
        one = attention.context(
            jnp.int32(5), jnp.arange(6), num_heads=H, head_dim=D, position=position
        )
        many = attention.context(
            jnp.asarray([5]), jnp.arange(6), num_heads=H, head_dim=D, position=position
        )
        chex.assert_trees_all_equal(one.q_rotary, many.q_rotary)
        chex.assert_trees_all_equal(one.k_rotary, many.k_rotary)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*config.RELATIVE_ENCODINGS, "none")
    def test_zero_queries_or_zero_keys_attend_as_jax_numpy_does(self, position):
        # xpos, rope and "none" take zero tokens; the rotary kinds' centring shift was
        # a min/max over no positions: "zero-size array to reduction operation min".
        q, k, v = _qkv(7)
        run = self.variant(functools.partial(attention.multihead_attention, position=position))
        no_queries, logits = run(q[:, :0], k, v, np.arange(0), np.arange(TK))
        self.assertEqual(no_queries.shape, (B, 0, H, D))
        self.assertEqual(logits.shape, (B, H, 0, TK))
        # No key to see: the weighted sum over nothing, zeros (finite, far queries too).
        no_keys, _ = run(q, k[:, :0], v[:, :0], np.arange(TQ) + 10**6, np.arange(0))
        np.testing.assert_array_equal(np.asarray(no_keys), np.zeros((B, TQ, H, D)))
        nothing, _ = run(q[:, :0], k[:, :0], v[:, :0], np.arange(0), np.arange(0))
        self.assertEqual(nothing.shape, (B, 0, H, D))
        scaled = attention.context(
            np.arange(0),
            np.arange(TK),
            num_heads=H,
            head_dim=D,
            position="rope",
            rope_scaling="dynamic_ntk",
            train_len=4,
        )
        self.assertEqual(scaled.k_rotary[0].shape, (TK, 1, D // 2))

    def test_a_mask_that_is_not_boolean_is_refused(self):
        # Flax's and PyTorch's additive 0/−inf mask was taken as True where it is −inf:
        # query 0 attended only to the future keys it hides.
        q, k, v = _qkv(3, 6, 6)
        causal = masks.causal(6)
        for mask in (jnp.where(causal, 0.0, -jnp.inf), causal.astype(jnp.int32)):
            with self.assertRaisesRegex(ValueError, r"^the mask is \w+; give a boolean mask"):
                attention.multihead_attention(
                    q, k, v, *[jnp.arange(6)] * 2, position="xpos", mask=mask
                )
            with self.assertRaisesRegex(ValueError, r"^the mask is \w+; give a boolean mask"):
                attention.attend(jnp.zeros((B, H, 6, 6)), v, mask)  # the public softmax too

    def test_shape_mismatches_are_value_errors_naming_the_shapes(self):
        q, k, v = _qkv(7)
        pos = np.arange(TK, dtype=np.int32)
        run = functools.partial(attention.multihead_attention, position="xpos")
        for args, said in (
            ((q, k[..., :4], v, pos[:TQ], pos), "must share batch, heads and head_dim"),
            ((q[0], k[0], v[0], pos[:TQ], pos), "q must be [batch, seq, heads, head_dim]"),
            ((q, k, v[:, :3], pos[:TQ], pos), "v (2, 3, 2, 8) must share batch, seq and heads"),
            ((q, k, v, pos[:3], pos), "q_positions of shape (3,) do not broadcast to"),
        ):
            with self.assertRaisesRegex(ValueError, re.escape(said)):
                run(*args)
        # A context built by hand for another head count (a broadcasting TypeError).
        ctx = attention.context(
            pos, pos, num_heads=H + 1, head_dim=D, position="alibi", mask=masks.causal(TK)
        )
        said = f"the context's ALiBi bias has {H + 1} heads and q {k.shape} has {H}"
        with self.assertRaisesRegex(ValueError, re.escape(said)):
            attention.attention(k, k, v, ctx)

    @parameterized.parameters("xpos", "rope", "alibi")
    def test_unsigned_positions_score_as_signed_ones(self, position):
        # uint32 positions wrapped in the centring shift (and ALiBi's i − j): NaN.
        q, k, v = _qkv(8, q_len=TK)
        pos, mask = _padded_causal_mask()
        run = functools.partial(attention.multihead_attention, position=position, mask=mask)
        signed = run(q, k, v, pos, pos)
        unsigned = run(q, k, v, pos.astype(np.uint32), pos.astype(np.uint32))
        for got, want in zip(unsigned, signed):
            self.assertTrue(np.all(np.isfinite(got)))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(
            positions.sinusoidal(pos.astype(np.uint8), D), positions.sinusoidal(pos, D)
        )

    def test_a_context_built_for_other_shapes_is_refused(self):
        q, k, v = _qkv(9, q_len=TK)
        pos = np.arange(TK, dtype=np.int32)
        build = functools.partial(attention.context, num_heads=H, position="xpos")
        decode = build(pos[-1:], pos, head_dim=D, mask=masks.causal(1, TK))
        wide = build(pos, pos, head_dim=2 * D, mask=masks.causal(TK))
        per_row = masks.same_segment(np.ones((B, TK)), np.ones((B, TK))) & masks.causal(TK)
        for ctx, said in (
            (decode, "q tables hold 1 positions of head_dim 8 and q (2, 6, 2, 8) has 6"),
            (wide, "q tables hold 6 positions of head_dim 16"),
            (build(pos, pos, head_dim=D, mask=per_row), "mask of shape (2, 6, 6) does not"),
            (build(pos, pos, head_dim=D, mask=masks.causal(TK - 1)), "mask of shape (5, 5)"),
        ):
            with self.assertRaisesRegex(ValueError, re.escape(said)):
                attention.attention(q, k, v, ctx)
        # Each mask the message offers works: [T, S], and [B, H, T, S] from [B, T, S].
        fine = build(pos, pos, head_dim=D, mask=per_row[:, None])
        np.testing.assert_allclose(
            attention.attention(q, k, v, fine)[0],
            attention.attention(q, k, v, fine.replace(mask=masks.causal(TK)))[0],
        )

    def test_sinks_without_their_context_are_refused_and_a_missing_mask_sees_all(self):
        q, k, v = _qkv(10, q_len=TK)
        pos = np.arange(TK, dtype=np.int32)
        build = functools.partial(attention.context, num_heads=H, head_dim=D, position="xpos")
        ctx = build(pos, pos, mask=masks.causal(TK))
        with self.assertRaisesRegex(ValueError, "sinks need ctx.sinks"):
            attention.attention(q, k, v, ctx, sinks=(k[:, :1], v[:, :1]))
        # Unmasked sinks: one softmax over [sink, keys], as the explicit computation.
        sinks_ctx = ctx.replace(sinks=build(pos, pos[:1]))
        out, _ = attention.attention(q, k, v, sinks_ctx, sinks=(k[:, :1], v[:, :1]))
        keys = np.concatenate([k[:, :1], k], axis=1)
        both = np.concatenate([np.ones((TK, 1), bool), np.asarray(masks.causal(TK))], axis=1)
        want = _reference(
            q, keys, np.concatenate([v[:, :1], v], axis=1), pos, np.r_[0, pos], "xpos", both
        )
        np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-5)

    def test_alibi_bias_enters_the_logits(self):
        # The ALiBi logits are the plain logits plus −m_h·(i − j), head by head.
        q, k, v = _qkv(2)
        k_pos = np.arange(TK, dtype=np.int32)
        q_pos = k_pos[TK - TQ :]
        _, plain = attention.multihead_attention(q, k, v, q_pos, k_pos, position="none")
        _, alibi = attention.multihead_attention(q, k, v, q_pos, k_pos, position="alibi")
        plain, alibi = np.asarray(plain), np.asarray(alibi)
        slopes = paper.alibi_slopes(H)
        for h in range(H):
            for i in range(TQ):
                for j in range(TK):
                    np.testing.assert_allclose(
                        alibi[:, h, i, j] - plain[:, h, i, j],
                        -slopes[h] * (q_pos[i] - k_pos[j]),
                        atol=1e-5,
                    )
        np.testing.assert_array_equal(
            attention.logit_bias(q_pos, k_pos, H, position="alibi")[0],
            positions.alibi_bias(H, q_pos, k_pos),
        )
        self.assertIsNone(attention.logit_bias(q_pos, k_pos, H, position="xpos"))

    @chex.variants(with_jit=True, without_jit=True)
    def test_fully_masked_rows_are_finite(self):
        # A padding query sees no key. Its output is finite (uniform weights: the mean
        # of v) and the other rows are those of the explicit softmax.
        q, k, v = _qkv(3, TK, TK)
        pos, mask = _padded_causal_mask()
        run = self.variant(functools.partial(attention.multihead_attention, position="xpos"))
        out, logits = run(q, k, v, pos, pos, mask=mask)
        self.assertTrue(np.all(np.isfinite(out)))
        self.assertTrue(np.all(np.isfinite(logits)))
        np.testing.assert_allclose(out[0, 4], v[0].mean(axis=0), rtol=1e-5, atol=1e-6)
        want_out, _ = _reference(q, k, v, pos, pos, "xpos", np.asarray(mask))
        np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=1e-5, atol=1e-5)

    def test_gradients_through_fully_masked_rows_are_finite(self):
        q, k, v = _qkv(3, TK, TK)
        pos, mask = _padded_causal_mask()

        def loss(q, k, v):
            out, _ = attention.multihead_attention(q, k, v, pos, pos, position="xpos", mask=mask)
            return jnp.sum(out)

        for grad in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v):
            self.assertTrue(np.all(np.isfinite(grad)))

    @parameterized.parameters("xpos", "rope", "alibi", "xpos_norotate", "none")
    def test_block_step_equals_blockwise_mask(self, position):
        # Paper §3.3 as the evaluation scan runs it: block b's queries attend to
        # [block b − 1, block b] at window-relative positions; this reproduces the full
        # sequence under blockwise_causal at absolute positions, because relative
        # encodings only see m − n.
        length, w = 12, 4
        rng = np.random.default_rng(4)
        q, k, v = (rng.standard_normal((1, length, H, D)).astype(np.float32) for _ in range(3))
        pos = np.arange(length, dtype=np.int32)
        run = jax.jit(functools.partial(attention.multihead_attention, position=position))
        full, _ = run(q, k, v, pos, pos, mask=masks.blockwise_causal(length, w)[None, None])
        for b in range(1, length // w):
            window = slice((b - 1) * w, (b + 1) * w)
            q_window_pos = np.arange(w, 2 * w, dtype=np.int32)
            k_window_pos = np.arange(2 * w, dtype=np.int32)
            step, _ = run(
                q[:, b * w : (b + 1) * w],
                k[:, window],
                v[:, window],
                q_window_pos,
                k_window_pos,
                mask=masks.causal_by_position(q_window_pos, k_window_pos),
            )
            np.testing.assert_allclose(
                step, full[:, b * w : (b + 1) * w], rtol=1e-5, atol=1e-5, err_msg=f"block {b}"
            )


class RopeScalingContextTest(chex.TestCase):
    """The shared Context applies an inference-time RoPE extension as its paper states it."""

    def _scores(self, q, k, q_pos, k_pos, position, **scaling):
        ctx = attention.context(
            q_pos, k_pos, num_heads=H, head_dim=D, position=position, scale_base=16.0, **scaling
        )
        return np.asarray(attention.attention_logits(*attention.encode(q, k, ctx)), np.float64)

    @parameterized.parameters("xpos", "rope")
    def test_each_scaling_gives_the_scores_of_its_formula(self, position):
        q, k, _ = _qkv(6, TQ, TK)
        k_pos = np.arange(TK, dtype=np.int32) * 9
        q_pos = k_pos[TK - TQ :]
        s, L = 3.0, 8
        b = 16.0 if position == "xpos" else math.inf

        def want(freqs, positions_scale=1.0, multiplier=1.0):
            qe = paper.xpos(q, q_pos / positions_scale, scale_base=b, freqs=freqs)
            ke = paper.xpos(k, k_pos / positions_scale, scale_base=b, freqs=freqs, downscale=True)
            return multiplier * paper.scores(qe, ke) / math.sqrt(D)

        base = paper.pi_frequencies(D, 1.0)
        # dynamic NTK: s = (largest query position + 1)/L = 46/8.
        n = int(q_pos.max()) + 1
        cases = {
            # PI divides every position by s: the rotation's and XPOS decay's.
            "pi": want(base, positions_scale=s),
            "ntk": want(paper.ntk_frequencies(D, s)),
            "dynamic_ntk": want(paper.dynamic_ntk_frequencies(D, n, L)),
            "yarn": want(
                paper.yarn_frequencies(D, s, L), multiplier=paper.yarn_score_multiplier(s)
            ),
        }
        for scaling, expected in cases.items():
            got = self._scores(
                q, k, q_pos, k_pos, position, rope_scaling=scaling, rope_factor=s, train_len=L
            )
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=scaling)
        unscaled = self._scores(q, k, q_pos, k_pos, position)
        np.testing.assert_array_equal(
            self._scores(q, k, q_pos, k_pos, position, rope_scaling="none", rope_factor=s), unscaled
        )
        self.assertGreater(np.abs(cases["pi"] - unscaled).max(), 0.05)


if __name__ == "__main__":
    absltest.main()
