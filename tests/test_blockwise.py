"""The BCA window: its cache operations, positions and masks against the explicit mask."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.profile_step import computations
from lexjax import generation, masks
from lexjax.blockwise import (
    KVCache,
    block_step,
    pad_to,
    scan_blocks,
    scan_prefix,
    scan_sinks,
    window_mask,
    window_positions,
)
from lexjax.config import Config, ModelConfig
from lexjax.errors import ConfigError
from lexjax.model import Decoder

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


def test_a_write_past_the_cache_or_a_step_of_another_block_size_is_refused():
    cache = KVCache.empty(CONFIG, 1, W)
    # A Python start past the end wrote over the last slots (XLA clamps it).
    with pytest.raises(ValueError, match=f"cannot write 1 tokens at slot {W} of a {W}-slot"):
        cache.write(W, _kv(1.0, 1), jnp.full((1, 1), W))
    with pytest.raises(ValueError, match=f"cannot write {W + 1} tokens at slot 0"):
        cache.write(0, _kv(1.0, W + 1), jnp.arange(W + 1)[None])
    model = Decoder(CONFIG)
    tokens = jnp.ones((1, W - 1), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    with pytest.raises(
        ValueError, match=f"holds 1 rows of {W} slots for 1 rows of a block of {W - 1}"
    ):
        block_step(model, params, cache, tokens, False)
    # Another batch, or tokens that are not whole blocks: were reshape/concatenate TypeErrors.
    with pytest.raises(ValueError, match=rf"KVCache.empty\(config, 2, {W}\)$"):
        block_step(model, params, cache, jnp.ones((2, W), jnp.int32), False)
    with pytest.raises(ValueError, match=f"{3 * W - 1} tokens are not whole blocks of {W}; pad"):
        scan_blocks(model, params, jnp.ones((1, 3 * W - 1), jnp.int32), W)
    # A block of 0 was a ZeroDivisionError in each of them.
    tokens = jnp.ones((1, 2 * W), jnp.int32)
    with pytest.raises(ConfigError, match="^multiple=0 must be a positive integer$"):
        pad_to(tokens, 0)
    # The whole Config (a run's .config, not its .model) was an AttributeError.
    with pytest.raises(ConfigError, match=r"^KVCache.empty takes a ModelConfig .* give config"):
        KVCache.empty(Config(model=CONFIG), 1, W)
    for run in (
        lambda: scan_blocks(model, params, tokens, 0),
        lambda: scan_sinks(model, params, tokens, 0, 0),
        lambda: generation.generate(
            model, params, tokens, block=0, max_new_tokens=1, rng=jax.random.key(0)
        ),
    ):
        with pytest.raises(ConfigError, match="^block=0 must be a positive integer$"):
            run()


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


def test_sink_scan_keeps_the_first_tokens_once_and_slides_the_window():
    """After block 0 the sinks hold its first S keys/values, which the window marks
    invalid (seen once); the window cache always holds the last two blocks."""
    model = Decoder(CONFIG)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 2 * W), jnp.int32))["params"])
    S = 3
    tokens = jnp.arange(1, 3 * W + 1, dtype=jnp.int32)[None]
    (sinks, window), _ = scan_sinks(model, params, tokens[:, :W], W, S)
    assert window.valid.tolist() == [[False] * W + [False] * S + [True] * (W - S)]
    assert sinks.valid.tolist() == [[True] * S] and sinks.positions.tolist() == [[0, 1, 2]]
    np.testing.assert_array_equal(sinks.k, window.k[:, :, W : W + S])
    np.testing.assert_array_equal(sinks.v, window.v[:, :, W : W + S])
    (later, window), _ = scan_sinks(model, params, tokens, W, S)
    np.testing.assert_allclose(later.k, sinks.k, rtol=1e-6, atol=1e-6)  # from block 0 only
    assert window.valid.tolist() == [[True] * 2 * W]
    assert window.positions.tolist() == [list(range(2 * W))]
    (none, window), _ = scan_sinks(model, params, tokens[:, :W], W, 0)
    assert none is None and window.valid.tolist() == [[False] * W + [True] * W]


def test_every_loop_over_the_model_permutes_the_kernels_once_before_it(monkeypatch):
    """XLA left the per-call kernel permutation inside the block scan's loop body
    (a transpose per layer and block); each loop takes for_loop's permuted kernels,
    so tracing one never reaches the per-call permutation, while a plain call does."""
    from lexjax import evaluation, generation
    from lexjax import model as model_lib

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return jax.lax.dot_general(*args, **kwargs)

    monkeypatch.setattr(model_lib, "_halves_projection", counted)
    model = Decoder(CONFIG)  # xpos
    tokens = jnp.ones((1, 4 * W), jnp.int32)
    params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens[:, :W]))["params"]
    calls.clear()  # init's forward permutes on the spot
    loops = {
        "scan_blocks": lambda p: scan_blocks(model, p, tokens, W),
        "scan_sinks": lambda p: scan_sinks(model, p, tokens, W, 1),
        "scan_prefix": lambda p: scan_prefix(model, p, tokens, W, 2),
        "full_logprobs": lambda p: evaluation.full_logprobs(model, p, tokens, chunk=W),
        "prefill": lambda p: generation.prefill(model, p, tokens[:, :5], block=W),
    }
    for name, loop in loops.items():
        jax.eval_shape(loop, params)
        assert not calls, name
    jax.eval_shape(lambda p: model.apply({"params": p}, tokens), params)
    assert calls  # the plain call permutes on the spot


def _called(bodies: dict[str, list[str]], roots) -> set[str]:
    """The computations that ``roots`` call, directly or not, themselves included."""
    found, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in found or name not in bodies:
            continue
        found.add(name)
        for line in bodies[name]:
            todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
    return found


def test_a_relative_encodings_tables_are_computed_once_before_the_block_scans_loop():
    """Each block step built XPOS's cos/sin tables (and the centring shift) again inside
    the scan's loop, for positions that are the same at every step but the first; with
    every block at the same window positions XLA computes them once, before the loop.
    (An absolute encoding keeps the first block at 0 … w−1: test_evaluation.py checks
    every kind against the explicit mask.)"""
    model = Decoder(CONFIG)  # xpos
    tokens = jnp.ones((2, 4 * W), jnp.int32)
    params = nn.unbox(model.init(jax.random.key(0), tokens[:, :W]))["params"]
    scan = jax.jit(lambda p, t: scan_blocks(model, p, t, W, lambda logits, *_: logits)[1])
    bodies = computations(scan.lower(params, tokens).compile().as_text())
    roots = [
        b
        for lines in bodies.values()
        for line in lines
        for b in re.findall(r"while\(.*?body=%?([\w.\-]+)", line)
    ]
    loops = _called(bodies, roots)
    assert loops, "no loop in the compiled scan"
    trig = lambda line: " sine(" in line or " cosine(" in line
    inside = [line for name in loops for line in bodies[name] if trig(line)]
    assert not inside, inside
    assert any(trig(line) for lines in bodies.values() for line in lines)  # before the loop
