"""The BCA window: its cache operations, positions and masks against the explicit mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import masks
from lexjax.blockwise import KVCache, window_mask, window_positions
from lexjax.config import ModelConfig

W = 4
CONFIG = ModelConfig(num_layers=2, d_model=8, num_heads=2, mlp_dim=16, vocab_size=40, max_len=8)


def _kv(value, T):
    shape = (CONFIG.num_layers, 1, T, CONFIG.num_heads, CONFIG.head_dim)
    return jnp.full(shape, value, jnp.float32), jnp.full(shape, -value, jnp.float32)


def test_window_positions_put_the_current_block_after_the_previous():
    np.testing.assert_array_equal(window_positions(W, first=True), np.arange(W))
    np.testing.assert_array_equal(window_positions(W, first=False), np.arange(W, 2 * W))
    assert int(window_positions(W, first=False, offsets=jnp.asarray(2))) == W + 2


def test_write_then_rotate_moves_the_current_block_to_the_previous_half():
    cache = KVCache.empty(CONFIG, 1, 2 * W)
    cache = cache.write(0, _kv(1.0, W), jnp.arange(W)[None])
    cache = cache.write(W, _kv(2.0, 3), jnp.arange(W, W + 3)[None])
    assert cache.valid.tolist() == [[True] * (W + 3) + [False]]
    assert cache.positions.tolist() == [[*range(W + 3), 0]]
    rotated = cache.rotate(W)
    assert rotated.valid.tolist() == [[True] * 3 + [False] * (W + 1)]
    assert rotated.positions[0, :W].tolist() == list(range(W))
    np.testing.assert_array_equal(rotated.k[:, :, :3], 2.0)
    np.testing.assert_array_equal(rotated.v[:, :, :3], -2.0)


@pytest.mark.parametrize("length", [W, 3 * W, 3 * W - 1])
def test_window_masks_tile_the_explicit_blockwise_causal_mask(length):
    full = np.asarray(masks.causal(length) & masks.blockwise_causal(length, W))
    covered = np.zeros_like(full)
    for b in range(-(-length // W)):
        mask = window_mask(b, W, length)
        for q, k in zip(*np.nonzero(mask)):
            i, j = b * W + q, (b - 1) * W + k
            assert full[i, j], (b, q, k)
            covered[i, j] = True
    np.testing.assert_array_equal(covered, full)  # every attending pair in exactly one window
