"""Masks against direct enumeration of the paper's rules (True = may attend)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from lexjax import masks


def _enumerate(rows, cols, sees):
    return np.array([[sees(i, j) for j in range(cols)] for i in range(rows)], bool)


class CausalTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((1, 1), (5, 5), (3, 7), (1, 6), (4, None))
    def test_matches_enumeration(self, q_len, k_len):
        got = self.variant(masks.causal, static_argnums=(0, 1))(q_len, k_len)
        k_len = q_len if k_len is None else k_len
        # The queries are the last q_len of the k_len tokens: query i stands at
        # token i + (k_len − q_len) and sees every token up to and including itself.
        want = _enumerate(q_len, k_len, lambda i, j: j <= i + (k_len - q_len))
        np.testing.assert_array_equal(got, want)
        self.assertEqual(got.dtype, bool)

    @parameterized.parameters((1, 6), (3, 6), (6, 6))
    def test_bottom_right_aligned(self, q_len, k_len):
        # A block of q_len queries over k_len cached keys equals the last q_len rows of
        # the full causal mask.
        np.testing.assert_array_equal(
            masks.causal(q_len, k_len), np.asarray(masks.causal(k_len))[k_len - q_len :]
        )


class BlockwiseCausalTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((8, 4), (10, 4), (7, 3), (5, 8), (6, 1), (1, 1), (12, 6))
    def test_matches_enumeration(self, length, block):
        got = self.variant(masks.blockwise_causal, static_argnums=(0, 1))(length, block)
        # Paper §3.3: query i sees key j iff j ≤ i and j lies in i's block or the one
        # before it.
        want = _enumerate(
            length, length, lambda i, j: j <= i and j // block in (i // block, i // block - 1)
        )
        np.testing.assert_array_equal(got, want)

    @parameterized.parameters((16, 4), (13, 5))
    def test_no_query_sees_farther_than_two_blocks(self, length, block):
        # With block w = l/2 no distance exceeds the training length l.
        mask = np.asarray(masks.blockwise_causal(length, block))
        i, j = np.nonzero(mask)
        self.assertLess(np.max(i - j), 2 * block)
        # ... while every query still sees itself and the w tokens before it (or all).
        for query in range(length):
            self.assertGreaterEqual(mask[query].sum(), min(query + 1, block + 1))

    def test_sequences_within_two_blocks_are_plain_causal(self):
        np.testing.assert_array_equal(masks.blockwise_causal(6, 6), masks.causal(6))
        np.testing.assert_array_equal(masks.blockwise_causal(6, 3), masks.causal(6))


class SameSegmentTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_enumeration_with_padding(self):
        # Two rows of packed documents; 0 is padding.
        q_ids = np.array([[1, 1, 2, 2, 2, 0], [3, 0, 3, 4, 0, 0]], np.int32)
        k_ids = np.array([[1, 1, 2, 2, 2, 0, 0], [3, 3, 0, 4, 4, 0, 5]], np.int32)
        got = self.variant(masks.same_segment)(q_ids, k_ids)
        self.assertEqual(got.shape, (2, 6, 7))
        for row in range(2):
            want = _enumerate(6, 7, lambda i, j, r=row: q_ids[r, i] == k_ids[r, j] != 0)
            np.testing.assert_array_equal(got[row], want)
        # Padding attends to nothing and is seen by nothing.
        self.assertFalse(np.asarray(got)[q_ids == 0].any())
        self.assertFalse(np.asarray(got).transpose(0, 2, 1)[k_ids == 0].any())


class CausalByPositionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_enumeration(self):
        q_pos = np.array([[2, 3], [0, 5]], np.int32)
        k_pos = np.array([[0, 1, 2, 3, 4], [5, 4, 3, 2, 1]], np.int32)
        got = self.variant(masks.causal_by_position)(q_pos, k_pos)
        for row in range(2):
            np.testing.assert_array_equal(
                got[row], _enumerate(2, 5, lambda i, j, r=row: k_pos[r, j] <= q_pos[r, i])
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_a_scalar_is_one_query_or_key(self):
        # One decoding query at position 5, as attention.context takes it; a scalar
        # was an IndexError here and in same_segment.
        got = self.variant(masks.causal_by_position)(jnp.int32(5), jnp.arange(8))
        np.testing.assert_array_equal(got, masks.causal_by_position(jnp.array([5]), jnp.arange(8)))
        got = self.variant(masks.causal_by_position)(jnp.arange(3), 1)
        np.testing.assert_array_equal(got, [[False], [True], [True]])
        segments = self.variant(masks.same_segment)(jnp.int32(2), jnp.array([1, 2, 0]))
        np.testing.assert_array_equal(segments, [[False, True, False]])

    def test_unsigned_positions_mask_as_signed_ones(self):
        # q − k wrapped for unsigned positions: every key was visible, future ones too.
        q_pos = np.array([[2, 3], [0, 5]], np.uint32)
        k_pos = np.array([[0, 1, 2, 3, 4], [5, 4, 3, 2, 1]], np.uint32)
        want = masks.causal_by_position(q_pos.astype(np.int32), k_pos.astype(np.int32))
        np.testing.assert_array_equal(masks.causal_by_position(q_pos, k_pos), want)
        self.assertFalse(np.asarray(want).all())

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(1, 3, 9)
    def test_sliding_window_keeps_the_last_window_positions(self, window):
        q_pos = np.array([[5, 6, 7, 8], [0, 2, 4, 6]], np.int32)
        k_pos = np.array([np.arange(9), np.arange(9)[::-1]], np.int32)
        got = self.variant(masks.causal_by_position, static_argnums=2)(q_pos, k_pos, window)
        for row in range(2):
            want = _enumerate(4, 9, lambda i, j, r=row: 0 <= q_pos[r, i] - k_pos[r, j] < window)
            np.testing.assert_array_equal(got[row], want)

    @parameterized.parameters((16, 4), (14, 4), (9, 3), (5, 2), (3, 4))
    def test_window_relative_positions_reproduce_blockwise(self, length, w):
        # The block step: block b's queries attend to the window [block b − 1, block b]
        # with window-relative positions — keys 0 … 2w−1, queries w … — and the mask
        # must be blockwise_causal's rows of block b restricted to the window's keys.
        # Block 0 has no previous block: its first w key slots are empty cache, removed
        # by a validity mask.
        full = np.asarray(masks.blockwise_causal(length, w))
        for b in range(-(-length // w)):
            queries = np.arange(b * w, min((b + 1) * w, length))
            keys = np.arange((b - 1) * w, (b + 1) * w)  # absolute; < 0 is empty cache
            keys_in_range = (keys >= 0) & (keys < length)
            q_window_pos = w + np.arange(len(queries))
            k_window_pos = np.arange(2 * w)
            got = np.asarray(masks.causal_by_position(q_window_pos, k_window_pos))
            got = got & (keys >= 0)[None, :]
            self.assertEqual(got.shape, (len(queries), 2 * w))
            want = np.zeros((len(queries), 2 * w), bool)
            want[:, keys_in_range] = full[queries][:, keys[keys_in_range]]
            # Keys of the window past the end of the sequence are never visible.
            np.testing.assert_array_equal(got, want, err_msg=f"block {b}")
            self.assertFalse(got[:, keys >= length].any())


class BadSizesTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("causal_zero", lambda: masks.causal(0), "q_len must be a positive integer"),
        ("causal_negative_k", lambda: masks.causal(2, -1), "k_len must be a positive integer"),
        ("causal_float", lambda: masks.causal(2.0), "q_len must be a positive integer"),
        ("causal_bool", lambda: masks.causal(True), "q_len must be a positive integer"),
        ("causal_k_shorter", lambda: masks.causal(5, 3), r"k_len \(3\) must be ≥ q_len \(5\)"),
        (
            "blockwise_zero_length",
            lambda: masks.blockwise_causal(0, 4),
            "length must be a positive integer",
        ),
        (
            "blockwise_zero_block",
            lambda: masks.blockwise_causal(8, 0),
            "block must be a positive integer",
        ),
        (
            "blockwise_negative_block",
            lambda: masks.blockwise_causal(8, -4),
            "block must be a positive integer",
        ),
        # A size traced by jax.jit: it said only "got JitTracer(~int32[])".
        (
            "blockwise_traced",
            lambda: jax.jit(masks.blockwise_causal)(8, 4),
            r"^length must be a positive integer, got .*Tracer.*; it is a size: pass a "
            r"Python int \(under jax.jit, mark it static\)$",
        ),
    )
    def test_raises_value_error(self, call, message):
        with self.assertRaisesRegex(ValueError, message):
            call()


if __name__ == "__main__":
    absltest.main()
