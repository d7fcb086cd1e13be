"""The decoder: causality (also across packed documents), caches, layer options, over-fitting."""

import dataclasses
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import blockwise, sharding
from lexjax import config as cfg_lib
from lexjax.blockwise import KVCache
from lexjax.model import Decoder
from tests import paper
from tests.helpers import np_gelu, np_layer_norm, packed_batch, small_config

POSITIONS = cfg_lib.POSITION_KINDS  # every kind, a new one included


def _init(config, length=16):
    model = Decoder(config.model)
    params = model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
    return model, nn.unbox(params)


def _input_jacobian(model, params, batch, t, row=0):
    """d logits[row, t, :] / d (input vector of every token), summed over features."""
    tokens = jnp.asarray(batch["inputs"][row : row + 1])
    positions = jnp.asarray(batch["positions"][row : row + 1])
    segments = jnp.asarray(batch["segment_ids"][row : row + 1])
    zeros_1xTxD = jnp.zeros((*tokens.shape, model.config.d_model))

    def logit_sum(embedded):
        variables = {"params": params, "perturbations": {"embedded": embedded}}
        logits, _ = model.apply(variables, tokens, positions, segments)
        return jnp.sum(logits[0, t] * jnp.arange(logits.shape[-1]))

    grads = jax.grad(logit_sum)(zeros_1xTxD)
    return np.asarray(jnp.sum(jnp.abs(grads[0]), axis=-1))


@pytest.mark.parametrize("position", POSITIONS)
def test_no_gradient_from_future_or_other_documents(position):
    config = small_config(**{"model.position": position})
    model, params = _init(config)
    batch = packed_batch(np.random.default_rng(3), 1, 16)
    batch["segment_ids"][0] = [1] * 6 + [2] * 7 + [3] * 3  # a boundary at 6 and at 13
    batch["positions"][0] = [*range(6), *range(7), *range(3)]
    for t in (3, 6, 10, 15):
        influence = _input_jacobian(model, params, batch, t)
        seg = batch["segment_ids"][0]
        allowed = (np.arange(16) <= t) & (seg == seg[t])
        assert np.all(influence[~allowed] == 0.0), (t, influence)
        assert np.all(influence[allowed] > 0.0), (t, influence)


@pytest.mark.parametrize("position", ["xpos", "alibi", "learned"])
def test_cached_block_step_equals_full_forward(position):
    """Tokens T/2..T−1 attending to cached keys of 0..T/2−1 give the full forward's logits."""
    config = small_config(**{"model.position": position})
    model, params = _init(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 258, (2, 16)), jnp.int32)
    full, (k, v) = model.apply({"params": params}, tokens)
    cache = KVCache(
        k[:, :, :8], v[:, :, :8], jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), bool)
    )
    second, _ = model.apply(
        {"params": params}, tokens[:, 8:], jnp.broadcast_to(jnp.arange(8, 16), (2, 8)), cache=cache
    )
    np.testing.assert_allclose(second, full[:, 8:], rtol=1e-5, atol=1e-5)
    empty = KVCache.empty(config.model, 2, 8)
    first, _ = model.apply(
        {"params": params}, tokens[:, :8], jnp.broadcast_to(jnp.arange(8), (2, 8)), cache=empty
    )
    np.testing.assert_allclose(first, full[:, :8], rtol=1e-5, atol=1e-5)


def test_segment_ids_or_a_block_with_a_cache_are_refused_not_ignored():
    """With a cache the mask comes from the cache's positions and validity: segment ids
    and block were dropped without a word (two documents attended to each other)."""
    config = small_config()
    model, params = _init(config)
    tokens = jnp.zeros((1, 8), jnp.int32)
    cache = KVCache.empty(config.model, 1, 8)
    for extra in ({"segment_ids_BxT": jnp.asarray([[1] * 4 + [2] * 4])}, {"block": 2}):
        with pytest.raises(ValueError, match="segment ids and block apply to a call without"):
            model.apply({"params": params}, tokens, jnp.arange(8)[None], cache=cache, **extra)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("position", ["xpos", "rope", "xpos_norotate", "alibi"])
def test_kernels_halved_once_for_a_loop_give_the_same_outputs(position, scan_layers):
    # A loop permutes the query and key kernels once (blockwise.for_loop) instead of
    # in every call: same logits and the same cached keys and values, for every
    # layer layout; a second for_loop changes nothing.
    config = small_config(**{"model.position": position, "model.scan_layers": scan_layers})
    model, params = _init(config)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 258, (2, 16)), jnp.int32)
    want_logits, want_kv = model.apply({"params": params}, tokens)
    loop_model, loop_params = blockwise.for_loop(model, params)
    assert loop_model.kernels_halved
    got_logits, got_kv = loop_model.apply({"params": loop_params}, tokens)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-6, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got_kv, want_kv
    )
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), loop_params, params)
    assert any(jax.tree.leaves(moved)) == (position != "alibi")
    again = blockwise.for_loop(loop_model, loop_params)
    assert again[0] is loop_model and again[1] is loop_params


def test_scan_and_remat_match_the_unrolled_layers():
    base = small_config()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 258, (2, 16)), jnp.int32)
    model, params = _init(base)
    expected, _ = model.apply({"params": params}, tokens)
    for overrides in (
        {"model.scan_layers": True},
        {"model.scan_layers": True, "model.remat": True},
        {"model.remat": True},
    ):
        config = small_config(**overrides)
        m = Decoder(config.model)
        p = params
        if config.model.scan_layers:  # same weights, stacked on a leading layer axis
            layers = [params[f"layer_{i}"] for i in range(config.model.num_layers)]
            p = {k: v for k, v in params.items() if not k.startswith("layer_")}
            p["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
        got, _ = m.apply({"params": p}, tokens)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_keeps_float32_logits_and_params():
    config = small_config(**{"model.dtype": "bfloat16"})
    model, params = _init(config)
    chex.assert_trees_all_equal_dtypes(
        params, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
    )
    logits, _ = model.apply({"params": params}, jnp.zeros((1, 16), jnp.int32))
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("position", ["xpos", "alibi"])
def test_fused_attention_matches_explicit_logits(position):
    """jax.nn.dot_product_attention (cuDNN on GPUs) gives the explicit path's logits."""
    explicit = small_config(**{"model.position": position})
    fused = small_config(**{"model.position": position, "model.attention_impl": "fused"})
    model, params = _init(explicit)
    batch = packed_batch(np.random.default_rng(5), 2, 16)
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    want, _ = model.apply({"params": params}, *args)
    got, _ = Decoder(fused.model).apply({"params": params}, *args)
    real = batch["segment_ids"] > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_init_gives_params_only_and_they_apply_to_any_shape(scan_layers):
    """Standard Flax init/apply: variables from a [1, 16] init serve a [2, 40] batch."""
    config = small_config(**{"model.scan_layers": scan_layers, "model.max_len": 64})
    model = Decoder(config.model)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    assert set(variables) == {"params"}
    logits, (k, _) = model.apply(variables, jnp.zeros((2, 40), jnp.int32))
    assert logits.shape == (2, 40, config.model.vocab_size)
    assert k.shape[:3] == (config.model.num_layers, 2, 40)


@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_return_scores_gives_each_layers_scores_whatever_the_attention_impl(impl):
    """return_scores adds [L, B, H, T, T] pre-softmax scores and leaves the logits as they
    are. The first layer's are paper eq. 11's q'_m·k'_n/√d, computed here in float64
    from the parameters: layer norm, the q/k projections, XPOS by tests/paper.py."""
    config = small_config(**{"model.attention_impl": impl})
    model, params = _init(config)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 258, (2, 16)), jnp.int32)
    want, _ = model.apply({"params": params}, tokens)
    logits, _, scores = model.apply({"params": params}, tokens, return_scores=True)
    m = config.model
    assert scores.shape == (m.num_layers, 2, m.num_heads, 16, 16)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(params))
    layer = p["layer_0"]
    x = p["embed"]["embedding"][np.asarray(tokens)]
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    h = (x - mean) / np.sqrt(var + 1e-6) * layer["ln_attention"]["scale"]
    h = h + layer["ln_attention"]["bias"]
    q, k = (
        np.einsum("btd,dhk->bthk", h, layer["attention"][n]["kernel"]) for n in ("query", "key")
    )
    at = np.arange(16)
    q = paper.xpos(q, at, scale_base=m.scale_base)
    k = paper.xpos(k, at, scale_base=m.scale_base, downscale=True)
    first = paper.scores(q, k) / np.sqrt(m.head_dim)
    np.testing.assert_allclose(scores[0], first, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_policies_keep_the_gradients_and_save_what_they_name(scan_layers, capsys):
    """Same gradients under every policy; dots_except_mlp keeps the attention's
    matmul outputs for the backward and recomputes the MLP's, full keeps neither."""
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 258, (2, 16)), jnp.int32)
    config = small_config(**{"model.scan_layers": scan_layers})
    _, params = _init(config)

    def loss_of(policy):
        model = Decoder(
            small_config(**{"model.scan_layers": scan_layers, "model.remat_policy": policy}).model
        )
        return lambda p: jnp.sum(model.apply({"params": p}, tokens)[0] ** 2)

    want = jax.grad(loss_of("none"))(params)
    saved = {}
    for policy in ("full", "dots_except_mlp"):
        got = jax.grad(loss_of(policy))(params)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), got, want)
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(loss_of(policy), params)
        saved[policy] = capsys.readouterr().out
    if scan_layers:
        return  # a layer scan stacks its residuals under no name
    for name in ("query_proj", "key_proj", "value_proj", "attention", "out_proj"):
        assert f"named '{name}'" in saved["dots_except_mlp"]
        assert f"named '{name}'" not in saved["full"]
    assert "named 'mlp" not in saved["dots_except_mlp"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"position": "XPOS"}, "position='XPOS' is unknown"),
        ({"dtype": "fp16"}, "model.dtype='fp16'"),
        ({"vocab_size": None}, "model.vocab_size=None"),
        # It said "head_dim must be even ... got 7": the heads do not divide d_model.
        ({"d_model": 30}, "model.d_model=30 is not a multiple of model.num_heads=4"),
        # A ZeroDivisionError, a TypeError from jax.tree.map, one from Flax's reshape
        # and one comparing None with the length.
        ({"num_heads": 0}, "model.num_heads=0 must be a positive integer"),
        ({"num_layers": 0}, "model.num_layers=0 must be a positive integer"),
        ({"num_heads": 4.0}, "model.num_heads=4.0 must be a positive integer"),
        ({"position": "learned", "max_len": None}, "model.max_len=None must be a positive"),
        ({"theta": 0.0}, "model.theta=0.0 must be positive"),  # NaN logits
    ],
)
def test_a_model_config_made_by_hand_is_checked(change, message):
    """An unknown position encoded no position at all (the logits of position
    'none'); a bad dtype was a KeyError, vocab_size None a TypeError deep in Flax."""
    config = small_config()
    model = Decoder(dataclasses.replace(config.model, **change))
    with pytest.raises(ValueError, match=message):
        model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


def test_inputs_of_the_wrong_shape_or_beyond_the_learned_table_are_value_errors():
    """They were an unpacking error, a broadcasting TypeError deep in attention, and
    for learned positions past max_len NaN logits at every position (the table read
    out of range, and attention spread the NaN to the positions before it)."""
    config = small_config(**{"model.position": "learned", "model.max_len": 16})
    model, params = _init(config)
    variables = {"params": params}
    for tokens, positions, message in (
        (jnp.zeros((8,), jnp.int32), None, r"tokens must be integer ids of shape \[batch, seq\]"),
        (jnp.zeros((1, 8)), None, r"got \(1, 8\) float32"),
        (jnp.zeros((1, 8), jnp.int32), jnp.arange(7)[None], r"positions of shape \(1, 7\) do"),
        # A list was refused with its own shape: "positions of shape (1, 8) do not
        # broadcast to tokens' [batch, seq] = (1, 8)".
        ([[1, 2], [3]], None, r"tokens must be an array of integers, got \[\[1, 2\], \[3\]\]"),
        (jnp.zeros((1, 17), jnp.int32), None, "17 tokens need positions beyond the learned"),
        # One position for a whole row (a scalar, [B, 1]) put every token at it.
        (jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 1), jnp.int32), r"shape \(2, 1\) do not"),
        (jnp.zeros((1, 8), jnp.int32), 3, r"positions of shape \(\) do not broadcast"),
        # Zero tokens were refused as "q_len must be a positive integer, got 0".
        (jnp.zeros((2, 0), jnp.int32), None, r"tokens of shape \(2, 0\) hold no token"),
        # Float positions were refused as "q_positions must be integers".
        (jnp.zeros((1, 8), jnp.int32), jnp.arange(8.0), r"^positions must be integers"),
    ):
        with pytest.raises(ValueError, match=message):
            model.apply(variables, tokens, positions)
    # With a cache, positions [B, 1] let each query see the tokens after it.
    cache = KVCache.empty(config.model, 2, 4)
    with pytest.raises(ValueError, match=r"positions of shape \(2, 1\) do not broadcast"):
        model.apply(
            variables, jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 1), jnp.int32), cache=cache
        )
    # A cache of another model or batch: fewer layers than the model's read the last
    # one again (JAX clamps the index), more were ignored, both with no error; another
    # batch or head count was a concatenation TypeError inside attention.
    tokens = jnp.zeros((2, 4), jnp.int32)
    for other, rows in (({"num_layers": 1}, 2), ({"num_layers": 3}, 2), ({}, 1)):
        other = dataclasses.replace(config.model, **other)
        with pytest.raises(ValueError, match=r"^the cache holds k .* need k, v \[layers,"):
            model.apply(variables, tokens, jnp.arange(4), cache=KVCache.empty(other, rows, 4))
    with pytest.raises(ValueError, match="^sinks must be a lexjax.blockwise.KVCache, got tuple"):
        model.apply(variables, tokens, jnp.arange(4), cache=cache, window=2, sinks=(1, 2))
    # Sinks without their query positions, or these without sinks, or of another shape.
    sinks = KVCache.empty(config.model, 2, 2)
    for sink_positions, message in (
        (None, "^sinks and sink_positions_BxT come together"),
        (jnp.arange(3), r"^sink positions of shape \(3,\) do not broadcast"),
        (jnp.arange(4.0), "^sink positions must be integers"),
    ):
        with pytest.raises(ValueError, match=message):
            model.apply(
                variables,
                tokens,
                jnp.arange(4),
                cache=cache,
                window=2,
                sinks=sinks,
                sink_positions_BxT=sink_positions,
            )
    with pytest.raises(ValueError, match="^sinks and sink_positions_BxT come together"):
        model.apply(variables, tokens, jnp.arange(4), cache=cache, sink_positions_BxT=[0] * 4)
    # Segment ids of another shape were a TypeError from jnp's `and` of the masks.
    with pytest.raises(ValueError, match=r"segment ids of shape \(1, 7\) do not broadcast"):
        model.apply(variables, jnp.zeros((1, 8), jnp.int32), None, jnp.ones((1, 7), jnp.int32))
    logits, _ = model.apply(variables, jnp.zeros((1, 16), jnp.int32))
    assert np.all(np.isfinite(logits))
    # Positions of one row serve every row, as [T] or [1, T]; lists are arrays.
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 8)), jnp.int32)
    positions = jnp.arange(3, 11, dtype=jnp.int32)
    want, _ = model.apply(variables, tokens, jnp.broadcast_to(positions, (2, 8)))
    for shared in (positions, positions[None], positions.tolist()):
        np.testing.assert_array_equal(model.apply(variables, tokens, shared)[0], want)
    np.testing.assert_array_equal(model.apply(variables, tokens.tolist(), positions)[0], want)


def test_a_mesh_with_explicit_axes_is_refused_with_what_to_change():
    """jax.make_mesh's default axes are Explicit, under which the Decoder's sharding
    constraints are assertions: it failed deep in JAX (a with_sharding_constraint
    AssertionError, or "use .at[...].get(out_sharding=)" from the embedding lookup)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from lexjax import sharding

    config = small_config()
    model, params = _init(config)
    tokens = jnp.zeros((8, 16), jnp.int32)
    said = r"^mesh axes {} are Explicit \(jax.make_mesh's default\), .* \* 3, as lexjax"
    for kinds, rules, spec, explicit in (
        ((AxisType.Explicit,) * 3, None, ("data", "fsdp"), "data, fsdp"),
        ((AxisType.Explicit,) * 3, sharding.rules(config), None, "data, fsdp, tensor"),
        ((AxisType.Auto,) * 3, sharding.rules(config), ("data", "fsdp"), None),
        ((AxisType.Explicit,) * 3, None, None, None),  # nothing sharded: nothing to refuse
    ):
        mesh = jax.make_mesh((4, 2, 1), sharding.MESH_AXES, axis_types=kinds)
        with jax.set_mesh(mesh):
            placed = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec(spec)))
            run = jax.jit(Decoder(config.model, rules).apply)
            if explicit is None:
                assert np.isfinite(run({"params": params}, placed)[0]).all()
            else:
                with pytest.raises(ValueError, match=said.format(explicit)):
                    run({"params": params}, placed)


def test_the_decoder_runs_as_an_nnx_module_as_documented():
    """flax.nnx.bridge.ToNNX shards each boxed parameter eagerly by default, which asks
    for a mesh; the one setting docs/api.md gives turns that off."""
    import flax
    from flax import nnx

    config = small_config()
    tokens = jnp.zeros((2, 8), jnp.int32)
    model, params = _init(config)
    before = flax.config.flax_always_shard_variable
    flax.config.update("flax_always_shard_variable", False)
    try:
        module = nnx.bridge.ToNNX(model, rngs=nnx.Rngs(0))
        nnx.bridge.lazy_init(module, tokens)
        logits, _ = module(tokens)
    finally:
        flax.config.update("flax_always_shard_variable", before)
    # The Decoder's parameter tree, and the Decoder's logits with them.
    held = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    assert jax.tree.structure(held) == jax.tree.structure(params)
    np.testing.assert_allclose(logits, model.apply({"params": held}, tokens)[0], rtol=1e-6)
    assert logits.shape == (2, 8, config.model.vocab_size) and np.isfinite(logits).all()


# --------------------------------------------------------------------------- numpy oracle


def _numpy_forward(m, params, tokens, positions, segments, block=None):
    """The decoder of docs/design.md in float64, token by token where it matters:
    pre-LayerNorm blocks ``x + attn(LN(x))`` then ``x + MLP(LN(x))`` (tanh GELU), a
    final LayerNorm, logits ``LN(x)·Eᵀ·d_model^(−½)`` when tied. Attention is
    tests/paper.py's: XPOS/RoPE on the interleaved pairs of the projections,
    ALiBi's bias, softmax over the keys j ≤ i of the query's own packed document
    (with ``block`` w, only those with j ≥ (⌊i/w⌋ − 1)·w: paper §3.3)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    layers = (
        [p[f"layer_{i}"] for i in range(m.num_layers)]
        if "layers" not in p
        else [jax.tree.map(lambda a, i=i: a[i], p["layers"]) for i in range(m.num_layers)]
    )
    x = p["embed"]["embedding"][tokens]
    if m.position == "sinusoidal":  # Vaswani et al., interleaved (positions.sinusoidal)
        i = np.arange(m.d_model // 2)
        angle = positions[..., None] * 10000.0 ** (-2.0 * i / m.d_model)
        x = x + np.stack([np.sin(angle), np.cos(angle)], -1).reshape(x.shape)
    elif m.position == "learned":
        x = x + p["position_embed"]["embedding"][positions]
    T = tokens.shape[1]
    j, i = np.meshgrid(np.arange(T), np.arange(T))
    mask = (j <= i)[None] & (segments[:, :, None] == segments[:, None, :])
    if block is not None:
        mask = mask & (j >= (i // block - 1) * block)[None]
    mask = (mask & (segments[:, :, None] > 0))[:, None]
    bias = None
    if m.position == "alibi":
        slopes = np.asarray(paper.alibi_slopes(m.num_heads))
        distance = positions[:, :, None] - positions[:, None, :]
        bias = -slopes[None, :, None, None] * distance[:, None]
    for layer in layers:
        a = layer["attention"]
        h = np_layer_norm(x, layer["ln_attention"])
        q, k, v = (np.einsum("btd,dhk->bthk", h, a[n]["kernel"]) for n in ("query", "key", "value"))
        if m.position in ("xpos", "rope"):
            base = m.scale_base if m.position == "xpos" else math.inf
            q = np.stack([paper.xpos(q[r], positions[r], scale_base=base) for r in range(len(q))])
            k = np.stack(
                [
                    paper.xpos(k[r], positions[r], scale_base=base, downscale=True)
                    for r in range(len(k))
                ]
            )
        out, _ = paper.attention(q, k, v, logit_bias=bias, mask=mask)
        x = x + np.einsum("bthk,hkd->btd", out, a["out"]["kernel"])
        h = np_layer_norm(x, layer["ln_mlp"])
        h = np_gelu(h @ layer["mlp_in"]["kernel"] + layer["mlp_in"]["bias"])
        x = x + h @ layer["mlp_out"]["kernel"] + layer["mlp_out"]["bias"]
    x = np_layer_norm(x, p["ln_final"])
    if m.tie_embeddings:
        return x @ p["embed"]["embedding"].T / math.sqrt(m.d_model)
    return x @ p["unembed"]["kernel"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"model.position": "xpos"},
        {"model.position": "xpos", "model.scan_layers": True, "model.tie_embeddings": False},
        {"model.position": "rope"},
        {"model.position": "alibi", "model.attention_impl": "fused"},
        {"model.position": "sinusoidal"},
        {"model.position": "learned", "model.tie_embeddings": False},
        {"model.position": "none", "model.scan_layers": True, "model.remat_policy": "full"},
        # Embeddings of variance 1e-6, where LayerNorm's ε (1e-6, not PyTorch's 1e-5) counts.
        {"model.position": "xpos", "model.tie_embeddings": False, "embed_scale": 1e-3},
        {"model.position": "alibi", "block": 4},  # the explicit-mask form of BCA
    ],
)
def test_logits_are_the_design_equations_computed_in_numpy(overrides):
    """The whole forward against docs/design.md's equations in float64 (a pre-LN
    block swapped for post-LN, a residual or the final LayerNorm dropped, the tied
    logits' d_model^(−½), exact GELU, XPOS's key decay or a mask changed each moved
    the logits by more than the tolerance), on packed documents whose positions
    restart (padding, segment 0, included: its logits are not compared)."""
    overrides = dict(overrides)
    embed_scale = overrides.pop("embed_scale", 1.0)
    block = overrides.pop("block", None)
    config = small_config(**overrides)
    model, params = _init(config)
    scale = jax.tree.map(lambda a: a * 3.0, params)  # larger weights: sharper attention
    params = {**params, **{k: v for k, v in scale.items() if k.startswith("layer")}}
    params["embed"] = {"embedding": params["embed"]["embedding"] * embed_scale}
    batch = packed_batch(np.random.default_rng(7), 2, 16)
    batch["segment_ids"][1, -3:] = 0
    batch["segment_ids"][0], batch["positions"][0] = 1, np.arange(16)  # 16 > 2 blocks of 4
    args = [np.asarray(batch[k]) for k in ("inputs", "positions", "segment_ids")]
    got, _ = model.apply({"params": params}, *args, block=block)
    want = _numpy_forward(config.model, params, *args, block=block)
    real = args[2] > 0
    np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=2e-4, atol=2e-4)
    assert np.max(np.abs(want[real])) > 1.0  # logits of a size the tolerance resolves


def test_logits_are_float32_from_the_final_layer_norm_whatever_the_compute_dtype():
    """With bfloat16 compute, the logits are the bfloat16 final LayerNorm's output
    times the float32 embedding, accumulated in float32 (docs: logits float32): a
    bfloat16 product rounded them to 8 bits (errors of about 1e-2)."""
    config = small_config(**{"model.dtype": "bfloat16"})
    model, params = _init(config)
    tokens = np.random.default_rng(8).integers(0, 258, (2, 16))
    (logits, _), state = model.apply(
        {"params": params}, tokens, capture_intermediates=True, mutable=["intermediates"]
    )
    (final,) = state["intermediates"]["ln_final"]["__call__"]
    assert final.dtype == jnp.bfloat16
    embedding = np.asarray(params["embed"]["embedding"], np.float64)
    want = np.asarray(final, np.float64) @ embedding.T / math.sqrt(config.model.d_model)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_each_layer_is_initialised_with_its_own_weights(scan_layers):
    """A scan that shared the init's random key between layers began training from
    identical layers (and a broadcast parameter tree, one layer for all)."""
    config = small_config(**{"model.scan_layers": scan_layers})
    _, params = _init(config)
    if scan_layers:
        layers = [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(2)]
    else:
        layers = [params["layer_0"], params["layer_1"]]
    kernel = lambda layer: np.asarray(layer["attention"]["query"]["kernel"])
    assert kernel(layers[0]).shape == (32, 4, 8)
    assert not np.allclose(kernel(layers[0]), kernel(layers[1]))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_parameter_axis_is_named_for_its_size(scan_layers):
    """The sharding rules split weights by their logical axis names, so each name
    must sit on a dimension of its own size (sizes all differ here: d_model 32,
    4 heads, head_dim 8, mlp_dim 64, vocab 264, 2 layers, max_len 16): a query
    kernel named (heads, embed, kv) was sharded along d_model as if it were heads."""
    config = small_config(
        **{
            "model.scan_layers": scan_layers,
            "model.position": "learned",
            "model.num_layers": 3,
            "model.tie_embeddings": False,
        }
    )
    m = config.model
    sizes = {
        "embed": m.d_model,
        "heads": m.num_heads,
        "kv": m.head_dim,
        "mlp": m.mlp_dim,
        "vocab": m.vocab_size,
        "layers": m.num_layers,
        "positions": m.max_len,
    }
    assert len(set(sizes.values())) == len(sizes)
    boxed = Decoder(m).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    for leaf in leaves:
        assert [sizes[name] for name in leaf.names] == list(leaf.value.shape), leaf.names


def test_every_pinned_activation_axis_is_named_for_its_size(monkeypatch):
    """Under a mesh the rules shard activations by these names (act_heads over the
    tensor axis): q/k/v pinned as (…, act_kv, act_heads) were split along head_dim
    instead, still correct but moved between devices at every layer. Checked where
    each name is given (no mesh needed): every name on a dimension of its size."""
    config = small_config(**{"sharding": "tensor", "model.tie_embeddings": False})
    m = config.model
    sizes = {
        "batch": 2,
        "act_embed": m.d_model,
        "act_heads": m.num_heads,
        "act_kv": m.head_dim,
        "act_mlp": m.mlp_dim,
        "act_vocab": m.vocab_size,
    }
    assert len(set(sizes.values())) == len(sizes)
    seen = []
    constrain = nn.with_logical_constraint

    def spy(x, names, **kwargs):
        seen.append((names, x.shape))
        return constrain(x, names, **kwargs)

    monkeypatch.setattr(nn, "with_logical_constraint", spy)
    model = Decoder(m, rules=sharding.rules(config))
    params = model.init(jax.random.key(0), jnp.zeros((2, 16), jnp.int32))["params"]
    seen.clear()
    model.apply({"params": params}, jnp.zeros((2, 16), jnp.int32))
    named = {name for names, _ in seen for name in names}
    assert {"batch", "act_heads", "act_kv", "act_mlp", "act_vocab"} <= named
    for names, shape in seen:
        for name, size in zip(names, shape):
            assert sizes.get(name, size) == size, (names, shape)
