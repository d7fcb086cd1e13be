"""Attention resolution (paper eq. 3, 11) and expected-score curves (eq. 8)."""

import math

import chex
import numpy as np
from absl.testing import absltest, parameterized

from lexjax import masks, resolution
from tests import paper


def _geometric_resolution(r, n):
    """R for e^{s[i]} = r^i, i = 0 … n: numerator Σ_{i<n} r^i (r^i − r^{i+1}) =
    (1 − r)·Σ_{i<n} r^{2i}, denominator (Σ_{i≤n} r^i)², both summed in closed form."""
    numerator = (1 - r) * (1 - r ** (2 * n)) / (1 - r**2)
    denominator = ((1 - r ** (n + 1)) / (1 - r)) ** 2
    return numerator / denominator


class AttentionResolutionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        # e = [1, 0]: numerator 1·(1 − 0) = 1, denominator 1² = 1.
        ("all_on_distance_zero", [0.0, -1e4], 1.0),
        # e = [1, 1]: numerator 1·(1 − 1) = 0.
        ("flat_pair", [0.0, 0.0], 0.0),
        # e = [2, 1]: numerator 2·(2 − 1) = 2, denominator (2 + 1)² = 9.
        ("halving", [math.log(2.0), 0.0], 2.0 / 9.0),
        # e = [1, 2]: numerator 1·(1 − 2) = −1, denominator 9: growing curves are negative.
        ("doubling", [0.0, math.log(2.0)], -1.0 / 9.0),
        # e = [3, 2, 1]: numerator 3·1 + 2·1 = 5, denominator 6² = 36.
        ("three_two_one", [math.log(3.0), math.log(2.0), 0.0], 5.0 / 36.0),
        # e = [1, 0, 1]: numerator 1·1 + 0·(0 − 1) = 1, denominator 2² = 4.
        ("dip", [0.0, -1e4, 0.0], 0.25),
    )
    def test_hand_computed(self, s, want):
        self.assertAlmostEqual(
            float(self.variant(resolution.attention_resolution)(s)), want, places=6
        )

    @parameterized.parameters(-3000.0, -1.5, 0.0, 7.0, 1000.0)
    def test_invariant_to_adding_a_constant(self, constant):
        # e^{s+c} = e^c·e^s: numerator and denominator both scale by e^{2c}. Adding
        # 1000 would overflow e^s computed naively.
        s = np.random.default_rng(0).standard_normal(50).astype(np.float32)
        np.testing.assert_allclose(
            resolution.attention_resolution(s + constant),
            resolution.attention_resolution(s),
            rtol=1e-4,
            atol=1e-6,
        )

    def test_flat_curve_has_zero_resolution(self):
        self.assertEqual(float(resolution.attention_resolution(np.full(1000, 3.25))), 0.0)

    @parameterized.parameters((0.01, 300), (0.1, 200), (1.0, 50), (10.0, 50))
    def test_geometric_decay_matches_closed_form(self, decay, n):
        # s[i] = −decay·i, so e^{s[i]} = r^i with r = e^{−decay}.
        s = -decay * np.arange(n + 1)
        np.testing.assert_allclose(
            resolution.attention_resolution(s),
            _geometric_resolution(math.exp(-decay), n),
            rtol=1e-4,
        )

    def test_sharp_decay_approaches_its_limit(self):
        # As n → ∞ the geometric R tends to (1 − r)²/(1 + r), which → 1 as r → 0: all
        # attention on distance 0 is the sharpest possible.
        s = -20.0 * np.arange(100)
        self.assertAlmostEqual(float(resolution.attention_resolution(s)), 1.0, places=6)
        r = math.exp(-0.5)
        self.assertAlmostEqual(
            float(resolution.attention_resolution(-0.5 * np.arange(2000))),
            (1 - r) ** 2 / (1 + r),
            places=5,
        )

    def test_over_the_last_axis(self):
        s = np.random.default_rng(1).standard_normal((3, 2, 9))
        got = resolution.attention_resolution(s)
        self.assertEqual(got.shape, (3, 2))
        for idx in np.ndindex(3, 2):
            e = np.exp(s[idx])
            want = np.sum(e[:-1] * (e[:-1] - e[1:])) / np.sum(e) ** 2
            self.assertAlmostEqual(float(got[idx]), want, places=5)

    def test_needs_two_distances(self):
        with self.assertRaisesRegex(ValueError, "at least 2 distances"):
            resolution.attention_resolution([1.0])


def _expected_scores_by_loop(scores, mask=None):
    """Paper eq. 11 by enumeration: s[n] = mean over (i, j) with i + k − q − j = n."""
    *lead, q_len, k_len = scores.shape
    out = np.full((*lead, k_len), np.nan)
    for idx in np.ndindex(*lead):
        for n in range(k_len):
            values = [
                scores[idx + (i, j)]
                for i in range(q_len)
                for j in range(k_len)
                if i + k_len - q_len - j == n and (mask is None or mask[idx + (i, j)])
            ]
            if values:
                out[idx + (n,)] = np.mean(values)
    return out


class ExpectedScoresTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("square", 6, 6), ("more_keys", 3, 7), ("one_query", 1, 5))
    def test_matches_loop(self, q_len, k_len):
        scores = np.random.default_rng(2).standard_normal((2, 3, q_len, k_len)).astype(np.float32)
        got = self.variant(resolution.expected_scores)(scores)
        self.assertEqual(got.shape, (2, 3, k_len))
        np.testing.assert_allclose(got, _expected_scores_by_loop(scores), rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_with_blockwise_mask(self):
        # Under blockwise attention with block 3 no pair is farther than 5 apart: those
        # distances have no pair and come back NaN.
        scores = np.random.default_rng(3).standard_normal((2, 9, 9)).astype(np.float32)
        mask = np.asarray(masks.blockwise_causal(9, 3))
        got = np.asarray(self.variant(resolution.expected_scores)(scores, mask))
        want = _expected_scores_by_loop(scores, np.broadcast_to(mask, scores.shape))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        self.assertTrue(np.all(np.isnan(got[:, 6:])))
        self.assertFalse(np.any(np.isnan(got[:, :6])))

    def test_with_per_example_mask_and_more_keys(self):
        rng = np.random.default_rng(4)
        scores = rng.standard_normal((3, 4, 8)).astype(np.float32)
        mask = rng.random((3, 4, 8)) < 0.6
        got = resolution.expected_scores(scores, mask)
        np.testing.assert_allclose(
            got, _expected_scores_by_loop(scores, mask), rtol=1e-5, atol=1e-6
        )

    def test_fewer_keys_than_queries(self):
        with self.assertRaisesRegex(ValueError, "k ≥ q"):
            resolution.expected_scores(np.zeros((5, 3)))

    def test_shapes_outside_the_contract_are_one_value_error_naming_them(self):
        # They were "not enough values to unpack", a broadcasting TypeError and, for
        # attention_resolution of a scalar, an IndexError.
        for call, message in (
            (lambda: resolution.expected_scores(np.zeros(5)), r"got shape \(5,\)"),
            (
                lambda: resolution.expected_scores(np.zeros((2, 4, 4)), np.ones((3, 3), bool)),
                r"mask of shape \(3, 3\) does not broadcast to the scores' \(2, 4, 4\)",
            ),
            (lambda: resolution.attention_resolution(3.0), r"got shape \(\)"),
        ):
            with self.assertRaisesRegex(ValueError, message):
                call()

    def test_a_mask_that_is_not_boolean_is_refused(self):
        # An additive 0/-inf mask (Flax's, PyTorch's) became True where it is -inf:
        # the means were over exactly the pairs it hides.
        additive = np.where(np.tril(np.ones((4, 4), bool)), 0.0, -np.inf)
        with self.assertRaisesRegex(ValueError, r"^the mask is float(32|64); give a boolean"):
            resolution.expected_scores(np.zeros((4, 4), np.float32), additive)

    @chex.variants(with_jit=True, without_jit=True)
    def test_no_query_has_no_pair_at_any_distance(self):
        # Was a ZeroDivisionError (integer modulo by zero) reshaping q·k = 0 scores.
        got = self.variant(resolution.expected_scores)(np.zeros((2, 0, 3), np.float32))
        self.assertEqual(got.shape, (2, 3))
        self.assertTrue(np.all(np.isnan(np.asarray(got))))


def _largest_rise(g):
    """max over n1 < n2 of g[n2] − g[n1]: how far a curve ever climbs back."""
    later_max = np.maximum.accumulate(g[::-1])[::-1][1:]
    return np.max(later_max - g[:-1])


class XposExpectationTest(chex.TestCase):
    @parameterized.parameters(64, 128)
    def test_matches_eq8_and_starts_at_half_the_head_dim(self, head_dim):
        n = np.arange(0, 4097, 7)
        for gamma in (0.4, None):
            got = np.asarray(resolution.xpos_expectation(n, head_dim, gamma=gamma))
            want = [paper.expected_xpos_score(d, head_dim, gamma=gamma) for d in n]
            # float32 angles up to 4096 rad round to ~2.4e-4 rad, summed over d/2 terms.
            np.testing.assert_allclose(got, want, atol=1e-3 * head_dim)
            # g[0] = Σ_i cos(0)·ζ_i^0 = d/2.
            self.assertEqual(float(got[0]), head_dim / 2)

    @parameterized.parameters(64, 128)
    def test_xpos_decays_smoothly_where_rope_oscillates(self, head_dim):
        # Figure 1 over distances 0 … 4095 (b = 512). Criteria:
        # XPOS: the envelope decays — the maximum over each window of b distances is
        #   below the maximum over the window before — and g stays positive.
        # RoPE: g is not monotone and dips well below later values: some g[n1] lies
        #   more than d/8 below a g[n2] with n2 > n1 (XPOS never climbs back that
        #   far), and g goes negative.
        n = np.arange(4096)
        xpos = np.asarray(resolution.xpos_expectation(n, head_dim))
        rope = np.asarray(resolution.xpos_expectation(n, head_dim, gamma=None))
        window_max = xpos.reshape(-1, 512).max(axis=-1)
        self.assertTrue(np.all(np.diff(window_max) < 0), window_max)
        self.assertGreater(xpos.min(), 0.0)
        self.assertGreater(_largest_rise(rope), head_dim / 8)
        self.assertLess(rope.min(), 0.0)
        # XPOS's local ripples (from the fast-rotating, fast-decaying pairs) stay smaller.
        self.assertLess(_largest_rise(xpos), head_dim / 8)

    def test_odd_head_dim(self):
        with self.assertRaisesRegex(ValueError, "head_dim must be even"):
            resolution.xpos_expectation(np.arange(3), 7)

    @parameterized.named_parameters(
        # Figure 1's curve took what lexjax.xpos refuses: NaN for these, zeros for
        # head_dim 0.
        ("zero_gamma", dict(gamma=0.0), "gamma must be positive"),
        ("negative_scale_base", dict(scale_base=-512.0), "scale_base must be positive"),
        ("zero_theta", dict(theta=0.0, gamma=None), "theta must be positive"),
        ("no_head_dim", dict(head_dim=0), "head_dim must be a positive integer, got 0"),
    )
    def test_parameters_outside_their_domain_are_refused(self, change, message):
        with self.assertRaisesRegex(ValueError, message):
            resolution.xpos_expectation(np.arange(3), **{"head_dim": 8, **change})


if __name__ == "__main__":
    absltest.main()
