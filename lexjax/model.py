"""Decoder-only Transformer (Flax Linen): one forward for training and block steps.

Letters in names: B batch, T tokens of this call, S cached keys, L layers,
D d_model, H heads, K head_dim, F mlp_dim, V vocabulary.

Training calls ``Decoder.apply(params, tokens_BxT, positions_BxT,
segment_ids_BxT)``: causal attention within each packed document, positions
restarting at each document.

Inference (the block scan, generation) passes ``cache``: keys and values of
earlier tokens *before* position encoding (keys with rotated pairs in the
halves layout of ``positions.to_halves``, as the key projection emits them),
with their positions and a validity flag. Each query then sees every valid
cached or current key whose position is not after its own
(``masks.causal_by_position``); with window-relative positions that is exactly
the blockwise-causal pattern, and the same module serves every length with no
mask bigger than the window.
The sink + sliding-window mode adds a distance limit (``window``) and a second
cache of attention sinks seen from their own query positions (``sinks``).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lexjax import attention as attn_lib
from lexjax import masks
from lexjax import positions as pos_lib
from lexjax.config import PAIRED_ENCODINGS, ModelConfig, check_dtypes, check_int
from lexjax.errors import ConfigError
from lexjax.sharding import split_axes

__all__ = ["Decoder", "count_params", "remat_policy"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _as_array(name: str, value) -> jax.Array:
    """``value`` (an array, or nested lists of numbers) as an array, else a ValueError."""
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an array of integers, got {value!r:.80}") from None


def _rows(name: str, value, B: int, T: int) -> jax.Array:
    """Per-token ``value`` as ``[B, T]``: ``[T]`` or ``[1, T]`` serve every row. Only
    the batch axis broadcasts: a scalar or ``[B, 1]`` put every token at one position
    (with a cache, each query then saw the tokens after it)."""
    value = _as_array(name, value)
    try:
        if not 1 <= value.ndim <= 2 or value.shape[-1] != T:
            raise ValueError
        return jnp.broadcast_to(value, (B, T))
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} of shape {value.shape} do not broadcast to tokens' [batch, seq] = "
            f"{(B, T)}; give one per token: [seq] or [1, seq] serve every row"
        ) from None


def _check_cache(name: str, cache, c: ModelConfig, B: int) -> None:
    """One ValueError where ``cache`` is not a KVCache of this model for ``B`` rows: its
    layer axis was indexed per layer, so fewer layers than the model's read the last
    one again (JAX clamps the index) and more were ignored, with no error; another
    batch or head count was a concatenation TypeError inside attention."""
    fields = ("k", "v", "positions", "valid")
    if not all(hasattr(cache, f) for f in fields):
        raise ValueError(f"{name} must be a lexjax.blockwise.KVCache, got {type(cache).__name__}")
    k, v, positions, valid = (jnp.shape(getattr(cache, f)) for f in fields)
    S = valid[-1] if len(valid) == 2 else None
    want = (c.num_layers, B, S, c.num_heads, c.head_dim)
    if S is None or k != want or v != want or positions != (B, S):
        raise ValueError(
            f"the {name} holds k {k}, v {v}, positions {positions}, valid {valid}; this "
            f"model and batch need k, v [layers, batch, slots, heads, head_dim] = [{c.num_layers}"
            f", {B}, S, {c.num_heads}, {c.head_dim}] and positions, valid [{B}, S]: "
            f"KVCache.empty(config, {B}, S)"
        )


def _check_config(c) -> None:
    """A ModelConfig built by hand (not by :func:`lexjax.make_config`, which
    checks everything) fails here with one line, not deep inside Flax (an unknown
    ``position`` fails in :func:`lexjax.attention.context`)."""
    if not isinstance(c, ModelConfig):
        given = "the whole Config: give config.model" if hasattr(c, "model") else type(c).__name__
        raise ConfigError(f"Decoder takes a ModelConfig (a Config's .model), got {given}")
    check_dtypes(c)
    # 0 was a ZeroDivisionError, or a TypeError from jax.tree.map for no layers.
    for name in ("num_layers", "d_model", "num_heads", "mlp_dim"):
        check_int(f"model.{name}", getattr(c, name))
    if not c.theta > 0:  # 0 gave infinite frequencies: NaN logits everywhere
        raise ConfigError(f"model.theta={c.theta} must be positive")
    if c.position == "learned":  # None was a TypeError comparing it with the length
        check_int("model.max_len", c.max_len, bound="a positive integer, the learned table's size")
    if not isinstance(c.vocab_size, int) or c.vocab_size < 1:
        raise ConfigError(
            f"model.vocab_size={c.vocab_size!r}: give a positive int, or build the config "
            "with lexjax.make_config (it sets the tokenizer's)"
        )
    if c.d_model % c.num_heads:  # else head_dim's message blames an odd quotient
        raise ConfigError(
            f"model.d_model={c.d_model} is not a multiple of model.num_heads={c.num_heads}"
        )


def _init(axes, scale=1.0):
    return nn.with_logical_partitioning(
        nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal"), axes
    )


# Names of the activations the ``dots_except_mlp`` remat policy keeps (``checkpoint_name``):
# every matmul output of the attention; the MLP's (``mlp_in``, ``mlp_out``) are recomputed.
_SAVED_BY_DOTS_EXCEPT_MLP = ("query_proj", "key_proj", "value_proj", "attention", "out_proj")


def _pin(x, rules, *names):
    """``x`` constrained to the mesh axes the logical ``names`` map to in ``rules``
    (``sharding.rules``: an activation name no rule names stays unsharded); a
    no-op without rules or outside a mesh (``jax.set_mesh``).

    A batch the mesh axes of its rule cannot split (one prompt's row on data × fsdp
    = 4) is replicated instead: pinned, XLA's partitioner rematerialised it,
    warning at every layer."""
    if rules is None:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    axes = dict(rules).get("batch")
    if "batch" in names and axes and not mesh.empty:
        parts = math.prod(mesh.shape[a] for a in split_axes(axes))
        if x.shape[names.index("batch")] % parts:
            rules = tuple((k, None if k == "batch" else v) for k, v in rules)
    return nn.with_logical_constraint(x, names, rules=rules)


def _lookup(embed: nn.Embed, ids_BxT, rules, rows: str, dtype) -> jax.Array:
    """``embed``'s rows at ``ids_BxT`` in ``dtype``, read from its table pinned like the
    activations (rows on logical ``rows``; under FSDP gathered, as every other weight),
    so the batch stays sharded: looked up in the table's embed shards, XLA gathered the
    whole batch's embeddings (a rematerialisation warning at every compile)."""
    table = _pin(embed.embedding, rules, rows, "act_embed")
    return jnp.take(table, ids_BxT, axis=0).astype(dtype)


def _check_auto_axes(tokens, rules) -> None:
    """A ValueError, saying what to change, where the tokens are sharded over Explicit
    mesh axes, or ``rules`` would pin activations under a mesh with Explicit axes
    (``jax.make_mesh``'s default): the Decoder shards by constraints, which Explicit
    axes read as assertions (and its embedding lookup needs an out_sharding there)."""
    sharding = jax.typeof(tokens).sharding
    meshes = [(sharding.mesh, {a for part in sharding.spec for a in split_axes(part)})]
    if rules is not None:
        mesh = jax.sharding.get_abstract_mesh()
        meshes.append((mesh, set(mesh.axis_names)))
    for mesh, used in meshes:
        kinds = dict(zip(mesh.axis_names, mesh.axis_types))
        if explicit := sorted(a for a in used if kinds.get(a) == jax.sharding.AxisType.Explicit):
            raise ValueError(
                f"mesh axes {', '.join(explicit)} are Explicit (jax.make_mesh's default), "
                "which the Decoder does not support: make the mesh with axis_types="
                f"(jax.sharding.AxisType.Auto,) * {len(kinds)}, as lexjax.sharding.make_mesh does"
            )


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of ``model.remat_policy`` (config.REMAT_POLICIES).

    ``full`` saves nothing inside a layer (its input only: least memory, the
    forward computed twice); ``dots_except_mlp`` also saves the attention's
    matmul outputs, so the backward recomputes only LayerNorms, the MLP and
    elementwise ops (MaxText's ``save_dot_except_mlp``).
    """
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots_except_mlp":
        return jax.checkpoint_policies.save_only_these_names(*_SAVED_BY_DOTS_EXCEPT_MLP)
    raise ValueError(f"no remat policy {name!r}")


def _check_splash_backend() -> None:
    """Splash is a TPU kernel; elsewhere only Pallas interpret mode runs it, far
    too slowly to train or evaluate with (tests replace this check to use it)."""
    if jax.default_backend() != "tpu":
        raise ConfigError(
            f"model.attention_impl=splash is a TPU kernel and this backend is "
            f"{jax.default_backend()}; use fused (cuDNN on GPUs) or explicit"
        )


def _halves_projection(x, kernel, dimension_numbers, precision=None, **kwargs):
    """``lax.dot_general`` of a query or key projection, its kernel's head_dim axis
    (the last) permuted to :func:`lexjax.positions.to_halves`'s layout first: the
    parameters keep the interleaved pairs of the paper's equations (and of
    checkpoints and the reference), while the activations come out in the layout
    a CPU rotates fastest. Permuting the small kernel costs a transpose of
    D·H·K entries per call; permuting the activations would cost B·T·H·K."""
    return jax.lax.dot_general(
        x, pos_lib.to_halves(kernel), dimension_numbers, precision=precision, **kwargs
    )


# The projections whose outputs XPOS and RoPE rotate (Attention's module names).
_ROTATED_PROJECTIONS = ("query", "key")


def _rotated_kernel(path) -> bool:
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return len(names) >= 2 and names[-1] == "kernel" and names[-2] in _ROTATED_PROJECTIONS


def halve_kernels(config: ModelConfig, params):
    """``params`` with the query and key kernels permuted as :func:`_halves_projection`
    does on every call, for a :class:`Decoder` with ``kernels_halved=True``: a loop
    calling the model many times with the same parameters (the block scan,
    generation) permutes them once, outside it. Unchanged for position kinds
    that rotate nothing."""
    if config.position not in PAIRED_ENCODINGS:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, x: pos_lib.to_halves(x) if _rotated_kernel(path) else x, params
    )


class Attention(nn.Module):
    config: ModelConfig
    return_scores: bool = False
    rules: tuple | None = None
    kernels_halved: bool = False

    @nn.compact
    def __call__(self, x_BxTxD, ctx: attn_lib.Context, kv_cache=None):
        """Returns ``(out_BxTxD, (k, v) of this call, scores_BxHxTxS or None)``.

        ``kv_cache``: ``(k, v)`` of earlier tokens, or ``(k, v, sink_k, sink_v)``
        when ``ctx.sinks`` scores a group of attention sinks too."""
        c = self.config
        dtype, pdtype = _DTYPES[c.dtype], _DTYPES[c.param_dtype]

        def proj(name):
            rotated = name in _ROTATED_PROJECTIONS and c.position in PAIRED_ENCODINGS
            rotated = rotated and not self.kernels_halved
            y_BxTxHxK = nn.DenseGeneral(
                (c.num_heads, c.head_dim),
                use_bias=False,
                dtype=dtype,
                param_dtype=pdtype,
                name=name,
                kernel_init=_init(("embed", "heads", "kv")),
                dot_general=_halves_projection if rotated else None,
            )(x_BxTxD)
            y_BxTxHxK = _pin(y_BxTxHxK, self.rules, "batch", "length", "act_heads", "act_kv")
            return checkpoint_name(y_BxTxHxK, f"{name}_proj")

        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = proj("query"), proj("key"), proj("value")
        new_kv = (k_BxTxHxK, v_BxTxHxK)
        sinks = None
        if kv_cache is not None:
            cache_k, cache_v, *sinks = kv_cache
            k_BxTxHxK = jnp.concatenate([cache_k.astype(dtype), k_BxTxHxK], axis=1)
            v_BxTxHxK = jnp.concatenate([cache_v.astype(dtype), v_BxTxHxK], axis=1)
            sinks = tuple(x.astype(dtype) for x in sinks) or None
        # Explicit scores whenever the caller wants them (resolution measurements).
        impl = "explicit" if self.return_scores else c.attention_impl
        out_BxTxHxK, scores_BxHxTxS = attn_lib.attention(
            q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, ctx, impl=impl, sinks=sinks
        )
        out_BxTxHxK = checkpoint_name(out_BxTxHxK, "attention")
        out_BxTxD = nn.DenseGeneral(
            c.d_model,
            axis=(-2, -1),
            use_bias=False,
            dtype=dtype,
            param_dtype=pdtype,
            name="out",
            kernel_init=_init(("heads", "kv", "embed")),
        )(out_BxTxHxK)
        out_BxTxD = checkpoint_name(out_BxTxD, "out_proj")
        return out_BxTxD, new_kv, scores_BxHxTxS if self.return_scores else None


class Block(nn.Module):
    """Pre-LayerNorm Transformer block: x + attn(LN(x)), then x + MLP(LN(x)).

    Returns ``(x_BxTxD, ((k, v), scores or None))``: the carry of a layer scan
    and what it stacks per layer."""

    config: ModelConfig
    return_scores: bool = False
    rules: tuple | None = None
    kernels_halved: bool = False

    @nn.compact
    def __call__(self, x_BxTxD, layer_cache, ctx: attn_lib.Context):
        c = self.config
        dtype, pdtype = _DTYPES[c.dtype], _DTYPES[c.param_dtype]

        def norm(name):
            return nn.LayerNorm(
                dtype=dtype,
                param_dtype=pdtype,
                name=name,
                scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            )

        attention = Attention(
            c, self.return_scores, self.rules, self.kernels_halved, name="attention"
        )
        h, new_kv, scores = attention(norm("ln_attention")(x_BxTxD), ctx, layer_cache)
        x_BxTxD = x_BxTxD + h
        h = nn.Dense(
            c.mlp_dim,
            dtype=dtype,
            param_dtype=pdtype,
            name="mlp_in",
            kernel_init=_init(("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        )(norm("ln_mlp")(x_BxTxD))
        h = _pin(h, self.rules, "batch", "length", "act_mlp")
        h = nn.gelu(checkpoint_name(h, "mlp_in"))
        h = nn.Dense(
            c.d_model,
            dtype=dtype,
            param_dtype=pdtype,
            name="mlp_out",
            kernel_init=_init(("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        )(h)
        x_BxTxD = x_BxTxD + checkpoint_name(h, "mlp_out")
        return _pin(x_BxTxD, self.rules, "batch", "length", "act_embed"), (new_kv, scores)


class Decoder(nn.Module):
    """Causal language model over byte tokens.

    ``__call__(tokens_BxT, positions_BxT=None, segment_ids_BxT=None, *,
    cache=None, block=None, window=None, sinks=None, sink_positions_BxT=None,
    rope_length=None, return_scores=False)`` returns ``(logits_BxTxV
    float32, new_kv)`` where ``new_kv = (k, v): [L, B, T, H, K]`` are this
    call's keys and values before position encoding (XLA removes them when
    unused; with xpos, rope or xpos_norotate each key's rotated pairs are in
    ``positions.to_halves``'s layout, the order the key projection emits them);
    with ``return_scores`` a third value, the pre-softmax scores ``[L, B, H, T,
    S]`` of every layer (paper eq. 11), computed explicitly.

    - no cache: query i sees key j iff ``j ≤ i`` (index order) and both are in
      the same segment; ``block`` (optional) adds the blockwise-causal limit
      ``j ≥ (⌊i/block⌋ − 1)·block`` — the explicit-mask form of BCA.
    - ``cache`` (a :class:`lexjax.blockwise.KVCache`: ``k``, ``v`` ``[L, B, S,
      H, K]``, ``positions`` ``[B, S]`` int32, ``valid`` ``[B, S]`` bool): keys
      are ``[cache, current]``; a query sees a key iff it is valid and its
      position is not after the query's, and with ``window`` less than
      ``window`` positions before it (segment ids and ``block`` are refused: the
      cache's positions and validity say it all). A call with ``window`` is the sink + window
      mode's, whose cache positions stay below the training length: dynamic NTK
      takes s = 1 there; splash, whose static mask has no window, gives way to fused.
    - ``sinks`` (with ``cache``; another ``KVCache``): attention sinks scored in
      the same softmax, before the cache, with the queries at
      ``sink_positions_BxT`` (int32 ``[B, T]``) instead of ``positions_BxT``; a
      query sees every valid sink whose position is not after its sink
      position. Attention is then explicit whatever ``attention_impl`` says.

    ``config.rope_scaling`` (xpos/rope) applies an inference-time RoPE extension
    to every layer's shared tables (:func:`lexjax.attention.context`); its
    factor 0 is this call's length / ``rope_train_len`` without a cache and 1
    with one (:func:`lexjax.evaluation.at_length` resolves it per evaluated length).
    ``dynamic_ntk``'s n is the largest query position + 1, or ``rope_length`` (int32
    scalar, may be traced) where given: a chunk padded past the real tokens passes
    their count, so padding does not set the factor.

    ``rules`` (``sharding.rules(config)``; optional): under a mesh, the embedding
    output, every layer's output, q/k/v, the MLP's activations and the logits are
    constrained to the batch axes (``act_heads``/``act_mlp``/``act_vocab`` to the
    axes those rules name), and the embedding table is read gathered like every
    other weight, so FSDP moves weights and gradients, never activations; without
    a mesh they change nothing.

    Token ids must lie in ``[0, vocab_size)``: the embedding is read with
    ``jnp.take``, which gives NaN for a larger id and wraps a negative one (ids
    are traced values, so no error can be raised for them).

    ``block``, ``window`` and ``return_scores`` are Python values: under
    ``jax.jit`` make them static (``static_argnames``, or ``functools.partial``).

    ``init`` creates only ``params``, each array boxed with its logical axes
    (``nn.LogicallyPartitioned``, for sharding); ``flax.linen.unbox`` gives plain
    arrays, the layout :func:`lexjax.load`'s ``run.params`` has. Tests that
    differentiate with respect to each token's input vector pass
    ``{"perturbations": {"embedded": zeros_BxTxD}}`` to ``apply`` (a no-op otherwise).

    ``kernels_halved``: the params' query and key kernels were permuted by
    :func:`halve_kernels` (a loop's, once before it) instead of on every call.
    """

    config: ModelConfig
    rules: tuple | None = None
    kernels_halved: bool = False

    @nn.compact
    def __call__(
        self,
        tokens_BxT,
        positions_BxT=None,
        segment_ids_BxT=None,
        *,
        cache=None,
        block: int | None = None,
        window: int | None = None,
        sinks=None,
        sink_positions_BxT=None,
        rope_length=None,
        return_scores: bool = False,
    ):
        c = self.config
        _check_config(c)
        if (window is not None or sinks is not None) and cache is None:
            raise ValueError("window and sinks apply to a call with a cache")
        if cache is not None and (segment_ids_BxT is not None or block is not None):
            raise ValueError(
                "segment ids and block apply to a call without a cache; with one, the "
                "cache's positions and validity choose the keys each query sees"
            )
        dtype, pdtype = _DTYPES[c.dtype], _DTYPES[c.param_dtype]
        tokens_BxT = _as_array("tokens", tokens_BxT)
        if jnp.ndim(tokens_BxT) != 2 or not jnp.issubdtype(
            jnp.result_type(tokens_BxT), jnp.integer
        ):
            raise ValueError(
                f"tokens must be integer ids of shape [batch, seq], got {jnp.shape(tokens_BxT)} "
                f"{jnp.result_type(tokens_BxT)}"
            )
        _check_auto_axes(tokens_BxT, self.rules)
        B, T = tokens_BxT.shape
        if T == 0:  # was "q_len must be a positive integer, got 0", from the causal mask
            raise ValueError(f"tokens of shape {(B, T)} hold no token; give at least one per row")
        if positions_BxT is None:
            if c.position == "learned" and c.max_len < T:
                raise ValueError(
                    f"{T} tokens need positions beyond the learned table of max_len="
                    f"{c.max_len}; pass at most {c.max_len} tokens or explicit positions"
                )
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        else:  # floats were refused as "q_positions must be integers", a name not the caller's
            positions_BxT = pos_lib.as_positions(_rows("positions", positions_BxT, B, T))
        if segment_ids_BxT is not None:
            segment_ids_BxT = _rows("segment ids", segment_ids_BxT, B, T)
        for name, kv_cache in (("cache", cache), ("sinks", sinks)):
            if kv_cache is not None:
                _check_cache(name, kv_cache, c, B)
        if (sinks is None) != (sink_positions_BxT is None):
            # Sinks alone were "None is not a valid value for jnp.array"; positions
            # alone were ignored.
            raise ValueError("sinks and sink_positions_BxT come together: give both or neither")
        if sinks is not None:  # was "the context's q tables hold 3 positions …"
            sink_positions_BxT = pos_lib.as_positions(
                _rows("sink positions", sink_positions_BxT, B, T), "sink positions"
            )

        embed = nn.Embed(
            c.vocab_size,
            c.d_model,
            dtype=dtype,
            param_dtype=pdtype,
            name="embed",
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(1.0), ("vocab", "embed")
            ),
        )
        x_BxTxD = _lookup(embed, tokens_BxT, self.rules, "act_vocab", dtype)
        if c.position == "sinusoidal":
            x_BxTxD = x_BxTxD + pos_lib.sinusoidal(positions_BxT, c.d_model).astype(dtype)
        elif c.position == "learned":
            table = nn.Embed(
                c.max_len,
                c.d_model,
                dtype=dtype,
                param_dtype=pdtype,
                name="position_embed",
                embedding_init=nn.with_logical_partitioning(
                    nn.initializers.normal(0.02), ("positions", "embed")
                ),
            )
            x_BxTxD = x_BxTxD + _lookup(table, positions_BxT, self.rules, "length", dtype)
        # Not at init, so that init returns parameters only and its variables
        # apply to any input shape.
        if not self.is_initializing():
            x_BxTxD = self.perturb("embedded", x_BxTxD)
        x_BxTxD = _pin(x_BxTxD, self.rules, "batch", "length", "act_embed")

        splash = c.attention_impl == "splash" and not return_scores and sinks is None
        layer_config = c
        if splash and window is not None:
            # Splash's static mask has no sliding window (it saw keys up to 3w back in
            # the sink scan without sinks); the fused kernel takes ctx.mask, which has.
            splash, layer_config = False, dataclasses.replace(c, attention_impl="fused")
        if splash:
            _check_splash_backend()
        if cache is None:
            mask = masks.causal(T)
            if block is not None:
                mask = mask & masks.blockwise_causal(T, block)
            mask = mask[None, None]
            if segment_ids_BxT is not None:
                mask = mask & masks.same_segment(segment_ids_BxT, segment_ids_BxT)[:, None]
            k_pos_BxS = positions_BxT
            segments = None if segment_ids_BxT is None else (segment_ids_BxT, segment_ids_BxT)
            layer_caches = None
        else:
            k_pos_BxS = jnp.concatenate([cache.positions, positions_BxT], axis=1)
            valid = jnp.concatenate([cache.valid, jnp.ones((B, T), bool)], axis=1)
            mask = masks.causal_by_position(positions_BxT, k_pos_BxS, window)
            mask = (mask & valid[:, None, :])[:, None]
            # Cached keys come before the current ones and valid ones are never after
            # a query, so splash's static bottom-right causal mask plus validity as a
            # segment id selects the same keys (attention.splash_attention).
            segments = (jnp.ones((B, T), jnp.int32), valid.astype(jnp.int32))
            layer_caches = (cache.k, cache.v)
            if sinks is not None:
                layer_caches += (sinks.k, sinks.v)
        # Tables, bias and mask depend on positions only: built once for all layers.
        ctx = attn_lib.context(
            positions_BxT,
            k_pos_BxS,
            num_heads=c.num_heads,
            head_dim=c.head_dim,
            position=c.position,
            mask=mask,
            scale_base=c.scale_base,
            theta=c.theta,
            halves=True,
            segment_ids=segments if splash else None,
            block=block if splash else None,
            **_rope_extension(
                c, T, cached=cache is not None, streaming=window is not None, seen=rope_length
            ),
        )
        if sinks is not None:
            sink_mask = masks.causal_by_position(sink_positions_BxT, sinks.positions)
            sink_ctx = attn_lib.context(
                sink_positions_BxT,
                sinks.positions,
                num_heads=c.num_heads,
                head_dim=c.head_dim,
                position=c.position,
                mask=(sink_mask & sinks.valid[:, None, :])[:, None],
                scale_base=c.scale_base,
                theta=c.theta,
                halves=True,
                # The sinks share the window's softmax, so the same frequencies.
                **_rope_extension(c, T, cached=True, streaming=True),
            )
            ctx = ctx.replace(sinks=sink_ctx)

        block_cls = Block
        if c.remat_policy != "none":
            block_cls = nn.remat(
                Block, policy=remat_policy(c.remat_policy), prevent_cse=not c.scan_layers
            )
        if c.scan_layers:
            stack = nn.scan(
                block_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast),
                length=c.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x_BxTxD, (new_kv, scores_LxBxHxTxS) = stack(
                layer_config, return_scores, self.rules, self.kernels_halved, name="layers"
            )(x_BxTxD, layer_caches, ctx)
        else:
            per_layer = []
            for layer in range(c.num_layers):
                layer_cache = None
                if layer_caches is not None:
                    layer_cache = tuple(x[layer] for x in layer_caches)
                layer_module = block_cls(
                    layer_config,
                    return_scores,
                    self.rules,
                    self.kernels_halved,
                    name=f"layer_{layer}",
                )
                x_BxTxD, out = layer_module(x_BxTxD, layer_cache, ctx)
                per_layer.append(out)
            new_kv, scores_LxBxHxTxS = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)

        x_BxTxD = nn.LayerNorm(
            dtype=dtype,
            param_dtype=pdtype,
            name="ln_final",
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        )(x_BxTxD)
        x_BxTxD = x_BxTxD.astype(jnp.float32)
        if c.tie_embeddings:
            table_VxD = jnp.asarray(embed.embedding, jnp.float32)
            logits_BxTxV = jnp.einsum("btd,vd->btv", x_BxTxD, table_VxD) * (c.d_model**-0.5)
        else:
            logits_BxTxV = nn.Dense(
                c.vocab_size,
                use_bias=False,
                dtype=jnp.float32,
                param_dtype=pdtype,
                name="unembed",
                kernel_init=_init(("embed", "vocab")),
            )(x_BxTxD)
        logits_BxTxV = _pin(
            logits_BxTxV.astype(jnp.float32), self.rules, "batch", "length", "act_vocab"
        )
        if return_scores:
            return logits_BxTxV, new_kv, scores_LxBxHxTxS
        return logits_BxTxV, new_kv


def _rope_extension(
    c: ModelConfig, length: int, *, cached: bool, streaming: bool = False, seen=None
) -> dict:
    """:func:`lexjax.attention.context`'s RoPE-extension arguments for this call.

    ``rope_factor`` 0 means the evaluated length / ``rope_train_len``: here the
    length of a call without a cache; a call with one (a block step, a chunk,
    a decoding step) cannot know it and takes s = 1 (its window stays within
    the training length), so :mod:`lexjax.evaluation` resolves the factor of
    each evaluated length before it runs the model.

    ``streaming`` (sinks + window): dynamic NTK takes s = 1, as StreamingLLM's
    cache positions never pass l − 1; the scan's window positions 0 … 3w−1 gave
    the window group s = 1.5 and the sinks s = 1, at every length.
    """
    if c.rope_scaling == "none" or (streaming and c.rope_scaling == "dynamic_ntk"):
        return {}
    if c.rope_train_len is None:
        raise ConfigError(
            f"model.rope_scaling={c.rope_scaling} needs model.rope_train_len; build the "
            "config with lexjax.make_config (it defaults to train_len)"
        )
    factor = c.rope_factor
    if not factor:
        factor = 1.0 if cached else pos_lib.length_factor(length, c.rope_train_len)
    return dict(
        rope_scaling=c.rope_scaling,
        rope_factor=factor,
        train_len=c.rope_train_len,
        rope_length=seen,
    )


def count_params(params) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(params))
