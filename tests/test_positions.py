"""Position encodings against the paper's equations (tests/paper.py, float64)."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from lexjax import attention, positions
from tests import paper


def _normal(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _pair_norms(x):
    """|x| of each rotated pair (2i, 2i+1): ``[..., d/2]``."""
    x = np.asarray(x, np.float64)
    return np.linalg.norm(x.reshape(*x.shape[:-1], -1, 2), axis=-1)


def _encode(kind, q, k, q_pos, k_pos, scale_base=512.0):
    if kind == "rope":
        return positions.rope(q, q_pos), positions.rope(k, k_pos)
    return (
        positions.xpos(q, q_pos, scale_base=scale_base),
        positions.xpos(k, k_pos, scale_base=scale_base, downscale=True),
    )


class XposEquationTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("query", False), ("key", True))
    def test_matches_equations_in_float64(self, downscale):
        # Small b so the decay ζ_i^(±p/b) is far from 1 at these positions.
        x = _normal(0, (2, 5, 3, 8))
        pos = np.random.default_rng(1).integers(-40, 41, size=(2, 5)).astype(np.int32)
        encode = self.variant(
            functools.partial(positions.xpos, scale_base=64.0, downscale=downscale)
        )
        got = encode(x, pos)
        want = paper.xpos(x, pos, scale_base=64.0, downscale=downscale)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rope_matches_equations_in_float64(self):
        x = _normal(2, (2, 6, 2, 16))
        pos = np.arange(6, dtype=np.int32) * 37
        got = self.variant(positions.rope)(x, pos)
        np.testing.assert_allclose(
            np.asarray(got, np.float64), paper.rope(x, pos), rtol=1e-5, atol=1e-5
        )

    @parameterized.named_parameters(("query", False), ("key", True))
    def test_the_halves_layout_rotates_the_permuted_pairs_as_the_equations_do(self, downscale):
        # The model's projections emit q and k with each pair (2i, 2i+1) moved to
        # (i, i + d/2); rotated in that layout they are the paper's rotation, permuted.
        x = _normal(3, (2, 5, 3, 8))
        pos = np.random.default_rng(4).integers(-40, 41, size=(2, 5)).astype(np.int32)
        tables = positions.xpos_tables(pos, 8, scale_base=64.0, downscale=downscale)
        got = positions.apply_rotary(positions.to_halves(x), *tables, halves=True)
        want = paper.xpos(x, pos, scale_base=64.0, downscale=downscale)
        order = [0, 2, 4, 6, 1, 3, 5, 7]  # even entries, then odd ones
        np.testing.assert_array_equal(positions.to_halves(x), x[..., order])
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want[..., order], rtol=1e-5, atol=1e-5
        )
        with self.assertRaisesRegex(ValueError, "even"):
            positions.to_halves(np.ones((2, 5)))

    def test_a_traced_downscale_says_to_mark_it_static(self):
        # It was a bare TracerBoolConversionError from inside xpos_tables.
        x, pos = jnp.ones((4, 1, 2)), jnp.arange(4)
        with self.assertRaisesRegex(ValueError, "^downscale must be a Python bool, got .*static"):
            jax.jit(positions.xpos)(x, pos, downscale=True)
        keys = jax.jit(positions.xpos, static_argnames="downscale")(x, pos, downscale=True)
        # Concrete values that are not bools still work, as they did.
        for concrete in (1, np.True_, jnp.asarray(True)):
            np.testing.assert_array_equal(positions.xpos(x, pos, downscale=concrete), keys)
        for wrong in ("False", 0.5, [0]):  # truthy, and taken as True
            with self.assertRaisesRegex(ValueError, r"^downscale must be a bool \(True for keys\)"):
                positions.xpos(x, pos, downscale=wrong)

    def test_infinite_scale_base_is_rope(self):
        # ζ_i^(p/∞) = ζ_i^0 = 1 for every pair and position: no decay at all.
        x = _normal(3, (2, 7, 2, 16))
        pos = np.arange(-3, 4, dtype=np.int32) * 100
        rope = positions.rope(x, pos)
        np.testing.assert_array_equal(positions.xpos(x, pos, scale_base=math.inf), rope)
        np.testing.assert_array_equal(
            positions.xpos(x, pos, scale_base=math.inf, downscale=True), rope
        )


class RelativePositionTest(chex.TestCase):
    """q'_m · k'_n depends only on m − n (paper §3.2), and for XPOS decays with it."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(("xpos", 1000), ("xpos", -1000), ("rope", 1000), ("rope", -5000))
    def test_scores_depend_only_on_distance(self, kind, shift):
        q, k = _normal(4, (1, 8, 2, 16)), _normal(5, (1, 8, 2, 16))
        q_pos, k_pos = np.arange(8, dtype=np.int32), np.arange(8, dtype=np.int32)[::-1] * 3
        encode = self.variant(functools.partial(_encode, kind))
        scores = paper.scores(*encode(q, k, q_pos, k_pos))
        shifted = paper.scores(*encode(q, k, q_pos + shift, k_pos + shift))
        # The float32 angle p·θ_i is rounded to half an ulp: ≤ 2.5e-4 rad at |p·θ_i| ≤
        # 5000 (the XPOS scales ζ^(±p/b) round to ~1e-7 relative). A score is a sum over
        # pairs of |q_i||k_i|·cos(…)·scale, so we allow 5e-4·Σ_i |q_i||k_i| (the
        # scores' own scale) between the two; observed: ≤ 2.2e-5.
        bound = 5e-4 * np.einsum("bqhi,bkhi->bhqk", _pair_norms(q), _pair_norms(k))
        self.assertTrue(
            np.all(np.abs(scores - shifted) <= bound),
            f"max |Δ| / bound = {np.max(np.abs(scores - shifted) / bound):.3g}",
        )
        # And both equal the float64 scores of the paper's equations.
        if kind == "xpos":
            want = paper.scores(paper.xpos(q, q_pos), paper.xpos(k, k_pos, downscale=True))
        else:
            want = paper.scores(paper.rope(q, q_pos), paper.rope(k, k_pos))
        self.assertTrue(np.all(np.abs(scores - want) <= bound))

    @parameterized.parameters(500_000, -3_000_000, 2**24 - 32)
    def test_rope_scores_at_millions_of_positions_keep_their_distances(self, shift):
        """Dense evaluation over L tokens encodes positions up to ±L/2. Angles p·θ_i
        formed in float32 were rounded to half an ulp (2⁻⁶ rad at p·θ = 5·10⁵, 1 rad at
        2^24), and the scores drifted from those of the same distances near 0."""
        q, k = _normal(4, (1, 8, 2, 16)), _normal(5, (1, 8, 2, 16))
        q_pos, k_pos = np.arange(8, dtype=np.int32), np.arange(8, dtype=np.int32)[::-1] * 3
        want = paper.scores(paper.rope(q, q_pos), paper.rope(k, k_pos))  # float64
        got = paper.scores(*_encode("rope", q, k, q_pos + shift, k_pos + shift))
        bound = 5e-4 * np.einsum("bqhi,bkhi->bhqk", _pair_norms(q), _pair_norms(k))
        self.assertTrue(
            np.all(np.abs(got - want) <= bound),
            f"max |Δ| / bound = {np.max(np.abs(got - want) / bound):.3g}",
        )

    def test_xpos_scores_stay_under_a_decaying_envelope(self):
        # Pair i of q'_m · k'_n is |q_i||k_i|·cos(…)·ζ_i^((m−n)/b): for m ≥ n every
        # score is bounded by E(m−n) = Σ_i |q_i||k_i| ζ_i^((m−n)/b), which decreases
        # strictly with the distance (every ζ_i < 1).
        d, b, length = 16, 64.0, 400
        q, k = _normal(6, (1, 1, 1, d)), _normal(7, (1, length, 1, d))
        q_pos, k_pos = np.array([length - 1], np.int32), np.arange(length, dtype=np.int32)
        q_enc, k_enc = _encode("xpos", q, k, q_pos, k_pos, scale_base=b)
        distance = (length - 1) - np.arange(length)
        score = paper.scores(q_enc, k_enc)[0, 0, 0]
        zeta = (2.0 * np.arange(d // 2) / d + paper.GAMMA) / (1.0 + paper.GAMMA)
        envelope = np.sum(
            _pair_norms(q)[0, 0, 0] * _pair_norms(k)[0, :, 0] * zeta ** (distance[:, None] / b),
            axis=-1,
        )
        self.assertTrue(np.all(np.abs(score) <= envelope * (1 + 1e-5)))
        # The envelope at distance 399 = 6.2·b is a small fraction of the one at 0.
        self.assertLess(envelope[0] / envelope[-1], 0.35)

    def test_xpos_scores_of_ones_are_the_expected_curve_and_decay(self):
        # With q = k = 1 each pair contributes 2·cos(nθ_i)·ζ_i^(n/b), so the score at
        # distance n is exactly 2·g[n] of paper eq. 8, and decays like Figure 1: the
        # maximum over each window of b distances is below that of the window before.
        d, b, length = 128, 512.0, 4096
        ones_q, ones_k = np.ones((1, 1, 1, d), np.float32), np.ones((1, length, 1, d), np.float32)
        q_enc, k_enc = _encode(
            "xpos",
            ones_q,
            ones_k,
            np.array([length - 1], np.int32),
            np.arange(length, dtype=np.int32),
            scale_base=b,
        )
        score = paper.scores(q_enc, k_enc)[0, 0, 0][::-1]  # index = distance m − n
        want = np.array([2 * paper.expected_xpos_score(n, d, scale_base=b) for n in range(length)])
        np.testing.assert_allclose(score, want, rtol=1e-4, atol=1e-3)
        window_max = score.reshape(-1, int(b)).max(axis=-1)
        self.assertTrue(np.all(np.diff(window_max) < 0), window_max)
        self.assertGreater(score.min(), 0.0)


class XposBroadcastTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_positions_seq_and_batch_seq(self):
        x = _normal(8, (3, 5, 2, 8))
        pos = np.array([4, -2, 0, 9, 30], np.int32)
        encode = self.variant(positions.xpos)
        by_seq = encode(x, pos)
        by_batch_seq = encode(x, np.tile(pos, (3, 1)))
        by_one_seq = encode(x, pos[None])
        np.testing.assert_array_equal(by_seq, by_batch_seq)
        np.testing.assert_array_equal(by_seq, by_one_seq)
        np.testing.assert_allclose(
            np.asarray(by_seq, np.float64), paper.xpos(x, pos), rtol=1e-5, atol=1e-5
        )

    def test_batch_positions_differ_per_row(self):
        x = _normal(9, (2, 4, 1, 8))
        pos = np.array([[0, 1, 2, 3], [10, 20, 30, 40]], np.int32)
        got = positions.xpos(x, pos, downscale=True)
        for row in range(2):
            np.testing.assert_array_equal(
                got[row], positions.xpos(x[row], pos[row], downscale=True)
            )
        np.testing.assert_allclose(
            np.asarray(got, np.float64), paper.xpos(x, pos, downscale=True), rtol=1e-5, atol=1e-5
        )


class LowPrecisionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        # Unit roundoff u of the result dtype (8 and 11 significand bits).
        ("bfloat16", jnp.bfloat16, 2.0**-8),
        ("float16", jnp.float16, 2.0**-11),
    )
    def test_finite_and_close_to_float32_inside_the_safe_range(self, dtype, unit_roundoff):
        b = 512.0
        limit = int(positions.max_safe_position(b, dtype=dtype))
        # Both signs: queries grow for p < 0 and keys for p > 0.
        pos = np.array([-limit, -limit // 2, -1, 0, 1, limit // 3, limit], np.int32)
        q = jnp.asarray(_normal(10, (2, 7, 2, 32)), dtype)
        k = jnp.asarray(_normal(11, (2, 7, 2, 32)), dtype)
        encode = self.variant(functools.partial(_encode, "xpos", scale_base=b))
        q_low, k_low = encode(q, k, pos, pos)
        self.assertEqual(q_low.dtype, dtype)
        self.assertEqual(k_low.dtype, dtype)
        self.assertTrue(np.all(np.isfinite(np.asarray(q_low, np.float32))))
        self.assertTrue(np.all(np.isfinite(np.asarray(k_low, np.float32))))
        # Reference: the same (already rounded) inputs encoded in float32.
        q32, k32 = encode(q.astype(jnp.float32), k.astype(jnp.float32), pos, pos)
        # Each output element is the float32 value rounded once, |δ| ≤ u, so the score
        # error is ≤ Σ |q_j||k_j|·(2u + u²) ≤ |q'||k'|·(2u + u²) (Cauchy–Schwarz);
        # we allow |q'||k'|·4u, plus 1e-6 for float16 subnormals.
        low, ref = paper.scores(q_low, k_low), paper.scores(q32, k32)
        bound = (
            4
            * unit_roundoff
            * np.einsum(
                "bqh,bkh->bhqk",
                np.linalg.norm(np.asarray(q32, np.float64), axis=-1),
                np.linalg.norm(np.asarray(k32, np.float64), axis=-1),
            )
            + 1e-6
        )
        self.assertTrue(
            np.all(np.abs(low - ref) <= bound),
            f"max |Δ| / bound = {np.max(np.abs(low - ref) / bound):.3g}",
        )

    @parameterized.parameters(jnp.float32, jnp.bfloat16, jnp.float16)
    def test_result_dtype_is_input_dtype(self, dtype):
        x = jnp.ones((1, 3, 1, 4), dtype)
        pos = jnp.arange(3)
        self.assertEqual(positions.xpos(x, pos).dtype, dtype)
        self.assertEqual(positions.xpos(x, pos, downscale=True).dtype, dtype)
        self.assertEqual(positions.rope(x, pos).dtype, dtype)

    @parameterized.parameters(jnp.float16, jnp.bfloat16, jnp.float32)
    def test_safe_range_holds_keys_up_to_magnitude_1000(self, dtype):
        # max_safe_position leaves a margin of 1000 for the key itself: a pair of norm
        # ≤ 1000 (elements 700) stays finite at ± the limit, for queries and keys.
        limit = int(positions.max_safe_position(512.0, dtype=dtype))
        x = jnp.full((1, 2, 1, 8), 700.0, dtype)
        pos = np.array([-limit, limit], np.int32)
        for downscale in (False, True):
            encoded = np.asarray(positions.xpos(x, pos, downscale=downscale), np.float32)
            self.assertTrue(np.all(np.isfinite(encoded)), (dtype, downscale, encoded))

    def test_positions_beyond_float32s_range_are_refused(self):
        # Far from the origin XPOS's float32 scale overflows (keys) or underflows
        # (queries): jitted, where positions are not checked, the encoding is NaN.
        x, far = jnp.ones((1, 2, 1, 8)), jnp.array([0, 200_000])
        jitted = jax.jit(functools.partial(positions.xpos, downscale=True))
        self.assertTrue(np.isnan(np.asarray(jitted(x, far))).any())
        for downscale in (False, True):
            with self.assertRaisesRegex(
                ValueError, "position 200000 is beyond XPOS's range in float32"
            ):
                positions.xpos(x, far, downscale=downscale)
        with self.assertRaisesRegex(ValueError, "^position -200000 is beyond"):  # its sign too
            positions.xpos(x, -far)
        # Up to the limit the scale itself stays finite, and so does a key whose pairs
        # have norm below 1 (the refusal is of the scale, not of large keys).
        limit = int(positions.max_safe_position(512.0, margin=1.0))
        near = jnp.array([-limit, limit])
        for downscale in (False, True):
            encoded = positions.xpos(x / 2, near, downscale=downscale)
            self.assertTrue(np.isfinite(np.asarray(encoded)).all())

    def test_float16_overflows_beyond_the_safe_range(self):
        # 3.5^(p/b) itself overflows float16 near p ≈ 8.9·b, so the limit is real: jitted
        # (unchecked) the key is inf; called eagerly it is refused, float16's limit named.
        x, far = jnp.ones((1, 1, 1, 8), jnp.float16), jnp.array([9 * 512])
        jitted = jax.jit(functools.partial(positions.xpos, downscale=True))
        self.assertTrue(np.isinf(np.asarray(jitted(x, far), np.float32)).any())
        with self.assertRaisesRegex(ValueError, "position 4608 is beyond XPOS's range in float16"):
            positions.xpos(x, far, downscale=True)


class AlibiTest(chex.TestCase):
    def test_slopes_power_of_two(self):
        np.testing.assert_array_equal(positions.alibi_slopes(8), [2.0**-h for h in range(1, 9)])

    @parameterized.parameters(1, 2, 3, 4, 6, 12, 16, 24)
    def test_slopes_match_reference_interpolation(self, num_heads):
        np.testing.assert_allclose(
            positions.alibi_slopes(num_heads), paper.alibi_slopes(num_heads), rtol=1e-6
        )

    def test_slopes_six_heads_by_hand(self):
        # The 4 slopes of H = 4 (2^-2, 2^-4, 2^-6, 2^-8), then every other slope of
        # H = 8 (2^-1, 2^-3, …): the first two of those.
        np.testing.assert_array_equal(
            positions.alibi_slopes(6), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_bias_is_minus_slope_times_distance(self):
        q_pos, k_pos = np.array([3, 4, 5], np.int32), np.array([0, 1, 2, 3, 4, 5], np.int32)
        bias = self.variant(positions.alibi_bias, static_argnums=0)(4, q_pos, k_pos)
        self.assertEqual(bias.shape, (4, 3, 6))
        self.assertEqual(bias.dtype, jnp.float32)
        bias = np.asarray(bias)
        slopes = paper.alibi_slopes(4)
        for h in range(4):
            for i in range(3):
                for j in range(6):
                    self.assertAlmostEqual(
                        float(bias[h, i, j]), -slopes[h] * (q_pos[i] - k_pos[j]), places=6
                    )

    def test_bias_with_batch_positions(self):
        q_pos = np.array([[0, 1], [10, 11]], np.int32)
        k_pos = np.array([[0, 1, 2], [9, 10, 11]], np.int32)
        bias = positions.alibi_bias(3, q_pos, k_pos)
        self.assertEqual(bias.shape, (2, 3, 2, 3))
        for row in range(2):
            np.testing.assert_array_equal(
                bias[row], positions.alibi_bias(3, q_pos[row], k_pos[row])
            )


class SinusoidalTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_values(self):
        pos, dim = np.array([[0, 1, 7], [100, 2000, 3]], np.int32), 10
        got = self.variant(positions.sinusoidal, static_argnums=1)(pos, dim)
        self.assertEqual(got.shape, (2, 3, dim))
        want = np.zeros((2, 3, dim))
        for idx in np.ndindex(2, 3):
            for i in range(dim // 2):
                angle = pos[idx] / 10000.0 ** (2.0 * i / dim)
                want[idx + (2 * i,)] = math.sin(angle)
                want[idx + (2 * i + 1,)] = math.cos(angle)
        # float32 angles near 2000 rad are off by ~1e-4 rad.
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=3e-4)

    def test_values_at_millions_of_positions(self):
        """Absolute, never centred: a long dense sequence reaches these positions."""
        pos, dim = np.array([3_000_000, 2**24 - 1], np.int32), 16
        # The frequencies 10000^(−2i/d) rounded once to float32 (a float32 power can be an
        # ulp off, 0.1 rad at 2^24), then the exact product with them.
        inv_freq = (10000.0 ** (-2.0 * np.arange(dim // 2) / dim)).astype(np.float32)
        angle = pos[:, None] * inv_freq.astype(np.float64)
        want = np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(2, dim)
        got = np.asarray(positions.sinusoidal(pos, dim), np.float64)
        np.testing.assert_allclose(got, want, atol=3e-4)


class AnglesTest(chex.TestCase):
    """``positions.angles``: p·θ_i for the float32 θ_i, against the exact product."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("none", "yarn")
    def test_within_2e_4_radians_up_to_2_to_the_24(self, scaling):
        rng = np.random.default_rng(0)
        edges = [255, 256, 65535, 65536, 2**24 - 1, 2**24, 500_000]
        p = np.concatenate(
            [np.arange(-300, 301), edges, np.negative(edges), rng.integers(-(2**24), 2**24, 500)]
        ).astype(np.int32)
        inv_freq = positions.rope_scaling(scaling, 16.0, 64, train_len=128).inv_freq
        angles = self.variant(positions.angles)

        def off(p):
            """The computed angles and their distance (modulo 2π) from the exact product."""
            got = np.asarray(angles(p, inv_freq), np.float64)
            exact = p[:, None].astype(np.float64) * np.asarray(inv_freq, np.float64)
            return got, np.abs(np.angle(np.exp(1j * (got - exact))))

        got, error = off(p)
        self.assertLess(error.max(), 2e-4)
        # Beyond 2^24 the error grows with |p|, within |p|·2^-37 (rope's docstring).
        far = np.array([2**26, -(2**28) - 3, 2**31 - 1], np.int32)
        _, error_far = off(far)
        self.assertTrue(np.all(error_far <= np.abs(far[:, None]) * 2.0**-37), error_far)
        # Near 0 it is the plain float32 product, bit for bit.
        small = np.abs(p) < 256
        plain = p[small, None].astype(np.float32) * np.asarray(inv_freq)
        np.testing.assert_array_equal(got[small], plain)


class BadArgumentsTest(parameterized.TestCase):
    @parameterized.named_parameters(
        (
            "xpos_odd_head_dim",
            lambda: positions.xpos(jnp.ones((1, 2, 1, 5)), jnp.arange(2)),
            "head_dim must be even",
        ),
        (
            "rope_odd_head_dim",
            lambda: positions.rope(jnp.ones((1, 2, 1, 7)), jnp.arange(2)),
            "head_dim must be even",
        ),
        ("decay_base_odd_head_dim", lambda: positions.xpos_decay_base(3), "head_dim must be even"),
        # gamma ≤ 0 made ζ_0 ≤ 0: NaN at every position.
        (
            "zero_gamma",
            lambda: positions.xpos(jnp.ones((1, 3, 1, 4)), jnp.arange(3), gamma=0.0),
            "gamma must be positive",
        ),
        (
            "negative_gamma",
            lambda: positions.xpos_tables(jnp.arange(3), 4, gamma=-0.5),
            "gamma must be positive",
        ),
        (
            "float_positions",
            lambda: positions.xpos(jnp.ones((1, 2, 1, 4)), jnp.arange(2.0)),
            "positions must be integers",
        ),
        (
            "rope_float_positions",
            lambda: positions.rope(jnp.ones((1, 2, 1, 4)), np.array([0.0, 1.0])),
            "positions must be integers",
        ),
        (
            "positions_too_long",
            lambda: positions.xpos(jnp.ones((2, 3, 1, 4)), jnp.arange(4)),
            r"positions of shape \(4,\) do not broadcast",
        ),
        (
            "positions_wrong_batch",
            lambda: positions.xpos(jnp.ones((2, 3, 1, 4)), jnp.zeros((3, 3), jnp.int32)),
            r"positions of shape \(3, 3\) do not broadcast",
        ),
        (
            "positions_extra_axis",
            lambda: positions.rope(jnp.ones((3, 1, 4)), jnp.zeros((2, 3), jnp.int32)),
            "do not broadcast",
        ),
        (
            "x_without_heads",
            lambda: positions.xpos(jnp.ones((3, 4)), jnp.arange(3)),
            r"x must be \[..., seq, heads, head_dim\]",
        ),
        (
            "zero_scale_base",
            lambda: positions.xpos(jnp.ones((1, 2, 1, 4)), jnp.arange(2), scale_base=0.0),
            "scale_base must be positive",
        ),
        (
            "negative_scale_base",
            lambda: positions.xpos(jnp.ones((1, 2, 1, 4)), jnp.arange(2), scale_base=-512.0),
            "scale_base must be positive",
        ),
        (
            "nan_scale_base",
            lambda: positions.xpos(jnp.ones((1, 2, 1, 4)), jnp.arange(2), scale_base=math.nan),
            "scale_base must be positive",
        ),
        # theta ≤ 0 gave inf or NaN frequencies: NaN at every position, where the
        # other parameters ≤ 0 were refused.
        (
            "zero_theta",
            lambda: positions.xpos(jnp.ones((1, 2, 1, 4)), jnp.arange(2), theta=0.0),
            "theta must be positive",
        ),
        (
            "negative_theta",
            lambda: positions.rope(jnp.ones((1, 2, 1, 4)), jnp.arange(2), theta=-1e4),
            "theta must be positive",
        ),
        # An int x came back as truncated ints (3 → [0, 4]), not rotated floats.
        (
            "integer_x",
            lambda: positions.rope(jnp.ones((1, 2, 1, 4), jnp.int32), jnp.arange(2)),
            "x must be floating point, got dtype int32",
        ),
        ("sinusoidal_odd_dim", lambda: positions.sinusoidal(jnp.arange(3), 5), "dim must be even"),
        (
            "sinusoidal_float_positions",
            lambda: positions.sinusoidal(jnp.arange(3.0), 4),
            "positions must be integers",
        ),
        (
            "alibi_no_heads",
            lambda: positions.alibi_slopes(0),
            "num_heads must be a positive integer",
        ),
        # 6.0 was "slice indices must be integers"; 4.5 silently gave 4 heads.
        (
            "alibi_float_heads",
            lambda: positions.alibi_bias(4.5, jnp.arange(2), jnp.arange(2)),
            "num_heads must be a positive integer, got 4.5",
        ),
        (
            "alibi_float_positions",
            lambda: positions.alibi_bias(2, jnp.arange(2.0), jnp.arange(2)),
            "q_positions must be integers",
        ),
    )
    def test_raises_value_error(self, call, message):
        with self.assertRaisesRegex(ValueError, message):
            call()

    def test_integers_of_numpy_and_jax_count_heads(self):
        want = positions.alibi_slopes(4)
        for heads in (np.int64(4), jnp.int32(4)):
            np.testing.assert_array_equal(positions.alibi_slopes(heads), want)

    def test_lists_and_a_traced_scale_base_are_taken(self):
        """A list x was an AttributeError ('list' object has no attribute 'ndim'), and a
        vmapped or jitted scale_base a TracerBoolConversionError in the range check."""
        x = np.random.default_rng(0).normal(size=(1, 3, 1, 4)).astype(np.float32)
        want = positions.xpos(jnp.asarray(x), jnp.arange(3), scale_base=64.0)
        np.testing.assert_array_equal(positions.xpos(x.tolist(), [0, 1, 2], scale_base=64.0), want)
        bases = jnp.array([64.0, 256.0])
        swept = jax.vmap(lambda b: positions.xpos(x, jnp.arange(3), scale_base=b))(bases)
        for i, b in enumerate((64.0, 256.0)):
            np.testing.assert_allclose(
                swept[i], positions.xpos(x, jnp.arange(3), scale_base=b), rtol=1e-6
            )
        jitted = jax.jit(lambda b: positions.xpos(x, jnp.arange(3), scale_base=b))(64.0)
        np.testing.assert_allclose(jitted, want, rtol=1e-6)
        # rope read x.shape before converting a list; a traced gamma is taken as well.
        np.testing.assert_array_equal(
            positions.rope(x.tolist(), [0, 1, 2]), positions.rope(jnp.asarray(x), jnp.arange(3))
        )
        gammas = jax.jit(lambda g: positions.xpos(x, jnp.arange(3), gamma=g))(0.4)
        np.testing.assert_allclose(gammas, positions.xpos(x, jnp.arange(3)), rtol=1e-6)

    def test_no_tokens_give_no_tokens(self):
        # An empty sequence was a ZeroDivisionError from a reshape with −1.
        for encode in (positions.xpos, positions.rope):
            self.assertEqual(encode(jnp.ones((1, 0, 2, 4)), jnp.arange(0)).shape, (1, 0, 2, 4))


class RopeScalingTest(chex.TestCase):
    """Inference-time RoPE extensions against their publications' formulas (tests/paper.py)."""

    @parameterized.product(
        head_dim=[8, 64], factor=[1.0, 2.5, 16.0], train_len=[16, 1024], theta=[1e4, 5e5]
    )
    def test_frequencies_match_the_published_formulas(self, head_dim, factor, train_len, theta):
        want = {
            "none": [theta ** (-2.0 * i / head_dim) for i in range(head_dim // 2)],
            "pi": paper.pi_frequencies(head_dim, factor, theta=theta),
            "ntk": paper.ntk_frequencies(head_dim, factor, theta=theta),
            "yarn": paper.yarn_frequencies(head_dim, factor, train_len, theta=theta),
        }
        for scaling, freqs in want.items():
            got = positions.rope_scaling(
                scaling, factor, head_dim, theta=theta, train_len=train_len
            )
            np.testing.assert_allclose(got.inv_freq, freqs, rtol=1e-6, err_msg=scaling)
            want_qk = math.sqrt(paper.yarn_score_multiplier(factor)) if scaling == "yarn" else 1
            self.assertAlmostEqual(float(got.qk_scale), want_qk, places=12)
            self.assertEqual(got.decay_base_scale, factor if scaling == "pi" else 1.0)

    @parameterized.parameters(8, 12, 16, 100)
    def test_dynamic_ntk_follows_the_length_processed(self, seq_len):
        # s = max(1, n/L): no change up to the training length, the NTK base beyond it.
        head_dim, train_len = 16, 12
        factor = positions.length_factor(seq_len, train_len)
        self.assertEqual(factor, max(1.0, seq_len / train_len))
        got = positions.rope_scaling("dynamic_ntk", factor, head_dim, train_len=train_len)
        want = paper.dynamic_ntk_frequencies(head_dim, seq_len, train_len)
        np.testing.assert_allclose(got.inv_freq, want, rtol=1e-6)
        # Inside a jit the factor is traced (the largest query position + 1): float32.
        traced = jax.jit(
            lambda n: (
                positions.rope_scaling(
                    "dynamic_ntk", positions.length_factor(n, train_len), head_dim
                ).inv_freq
            )
        )(jnp.int32(seq_len))
        np.testing.assert_allclose(traced, want, rtol=2e-6)

    def test_hand_checked_values(self):
        # d = 8, base 10^4: θ = 1, 0.1, 0.01, 0.001; s = 4, L = 16.
        s, d, L = 4.0, 8, 16
        ntk = positions.rope_scaling("ntk", s, d).inv_freq
        # base' = 10^4·4^(8/6): θ'_1 = base'^(−1/4) = 0.1·4^(−1/3); θ'_3 = 0.001/4 exactly.
        np.testing.assert_allclose(ntk, [1.0, 0.1 / 4 ** (1 / 3), 0.01 / 4 ** (2 / 3), 2.5e-4])
        self.assertAlmostEqual(float(ntk[1]), 0.0629961, places=6)
        yarn = positions.rope_scaling("yarn", s, d, train_len=L)
        # r_0 = 16/(2π) = 2.546 lies on the ramp: γ = (2.546 − 1)/31 = 0.04988, so
        # θ'_0 = 0.95012/4 + 0.04988 = 0.28741; r_1 … r_3 < 1: plain interpolation θ/4.
        self.assertAlmostEqual(float(yarn.inv_freq[0]), 0.287415, places=5)
        np.testing.assert_allclose(yarn.inv_freq[1:], [0.025, 0.0025, 0.00025], rtol=1e-6)
        # √(1/t) = 0.1·ln 4 + 1 = 1.138629.
        self.assertAlmostEqual(float(yarn.qk_scale), 1.1386294, places=6)
        pi = positions.rope_scaling("pi", s, d)
        np.testing.assert_allclose(pi.inv_freq, [0.25, 0.025, 0.0025, 0.00025], rtol=1e-7)

    def test_pi_on_xpos_divides_every_position_by_the_factor(self):
        # PI reads position p as p/s, for the rotation and for XPOS's decay: the tables
        # with θ/s and b·s encode exactly the oracle's XPOS at the positions p/s.
        x = _normal(20, (1, 6, 2, 8))
        pos = np.array([-30, -7, 0, 5, 17, 40], np.int32)
        s, b = 2.5, 16.0
        pi = positions.rope_scaling("pi", s, 8)
        for downscale in (False, True):
            tables = positions.xpos_tables(
                pos,
                8,
                scale_base=b * pi.decay_base_scale,
                inv_freq=pi.inv_freq,
                downscale=downscale,
            )
            got = positions.apply_rotary(x, *tables)
            want = paper.xpos(x, pos / s, scale_base=b, downscale=downscale)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)

    def test_yarn_tables_rotate_by_its_frequencies_and_scale_scores_by_1_over_t(self):
        d, s, L = 16, 6.0, 64
        q, k = _normal(21, (1, 5, 2, d)), _normal(22, (1, 7, 2, d))
        q_pos, k_pos = np.arange(200, 205, dtype=np.int32), np.arange(7, dtype=np.int32) * 31
        yarn = positions.rope_scaling("yarn", s, d, train_len=L)
        encode = lambda x, p: positions.apply_rotary(
            x, *positions.rotary_tables(p, d, inv_freq=yarn.inv_freq, scale=yarn.qk_scale)
        )
        got = paper.scores(encode(q, q_pos), encode(k, k_pos))
        freqs = paper.yarn_frequencies(d, s, L)
        want = paper.yarn_score_multiplier(s) * paper.scores(
            paper.rope(q, q_pos, freqs=freqs), paper.rope(k, k_pos, freqs=freqs)
        )
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    def test_decay_without_rotation_is_the_decay_alone(self):
        # Table 4's xPos with θ_i = 0: pair i of q'_m · k'_n is
        # (q_2i k_2i + q_2i+1 k_2i+1)·ζ_i^((m−n)/b), with no dependence on the angle.
        d, b = 8, 8.0
        q, k = _normal(23, (1, 4, 1, d)), _normal(24, (1, 6, 1, d))
        q_pos, k_pos = np.arange(10, 14, dtype=np.int32), np.arange(6, dtype=np.int32) * 2
        zero = jnp.zeros(d // 2, jnp.float32)
        q_enc = positions.apply_rotary(
            q, *positions.xpos_tables(q_pos, d, scale_base=b, inv_freq=zero)
        )
        k_enc = positions.apply_rotary(
            k, *positions.xpos_tables(k_pos, d, scale_base=b, inv_freq=zero, downscale=True)
        )
        zeta = np.array([(2 * i / d + 0.4) / 1.4 for i in range(d // 2)])
        want = np.zeros((4, 6))
        for m in range(4):
            for n in range(6):
                pairs = (np.asarray(q[0, m, 0], np.float64) * k[0, n, 0]).reshape(-1, 2).sum(-1)
                want[m, n] = np.sum(pairs * zeta ** ((q_pos[m] - k_pos[n]) / b))
        np.testing.assert_allclose(paper.scores(q_enc, k_enc)[0, 0], want, rtol=1e-5, atol=1e-5)

    def test_none_leaves_the_tables_bit_identical(self):
        pos = np.arange(-50, 50, 7, dtype=np.int32)
        none = positions.rope_scaling("none", 1.0, 16)
        for got, want in zip(
            positions.xpos_tables(pos, 16, inv_freq=none.inv_freq), positions.xpos_tables(pos, 16)
        ):
            np.testing.assert_array_equal(got, want)

    @parameterized.named_parameters(
        ("unknown", lambda: positions.rope_scaling("linear", 2.0, 8), "choose one of"),
        ("below_one", lambda: positions.rope_scaling("pi", 0.5, 8), "≥ 1"),
        ("nan", lambda: positions.rope_scaling("ntk", math.nan, 8), "≥ 1"),
        ("yarn_without_len", lambda: positions.rope_scaling("yarn", 2.0, 8), "training length"),
        ("no_train_len", lambda: positions.length_factor(10, 0), "train_len must be positive"),
        ("train_len_none", lambda: positions.length_factor(10, None), "train_len must be posi"),
        (
            "dynamic_ntk_context_without_len",
            lambda: attention.context(
                jnp.arange(4),
                jnp.arange(4),
                num_heads=1,
                head_dim=8,
                position="xpos",
                rope_scaling="dynamic_ntk",
            ),
            "train_len must be positive, got None",
        ),
        # A concrete JAX scalar is checked as a Python number is (no NaN frequencies).
        ("jax_below_one", lambda: positions.rope_scaling("pi", jnp.float32(0.5), 8), "≥ 1"),
        ("jax_zero", lambda: positions.rope_scaling("ntk", jnp.float32(0.0), 8), "≥ 1"),
    )
    def test_bad_arguments_raise(self, call, message):
        with self.assertRaisesRegex(ValueError, message):
            call()


if __name__ == "__main__":
    absltest.main()
