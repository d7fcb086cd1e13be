"""Dot-product attention with position encodings, masks and an optional key/value cache.

Everything here is a pure function of arrays. Shapes: queries ``[B, Tq, H, Dh]``,
keys and values ``[B, Tk, H, Dh]``, positions ``[B, T]`` (or ``[T]``) integers,
masks boolean, broadcastable to ``[B, H, Tq, Tk]``.

What depends only on positions and masks — the XPOS/RoPE cos/sin/decay
tables, ALiBi's bias, the mask — is a :class:`Context`, built once per
forward (or block step) by :func:`context` and shared by every layer.
:func:`attention` then runs one of three implementations on it: ``explicit``
(scores materialised; the reference, and the only one that returns them),
``fused`` (``jax.nn.dot_product_attention``; cuDNN on NVIDIA GPUs) and
``splash`` (Pallas splash attention on TPUs).

A block step over cached keys is the same computation as a training forward:
the caller concatenates the cached keys/values (stored *before* position
encoding) in front of the current ones and passes the matching key
positions; :func:`lexjax.masks.causal_by_position` then yields the causal or
blockwise pattern from window-relative positions.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lexjax import positions as pos_lib
from lexjax.config import DECAYING_ENCODINGS, PAIRED_ENCODINGS
from lexjax.errors import ConfigError

__all__ = [
    "Context",
    "context",
    "encode",
    "encode_qk",
    "logit_bias",
    "attention_logits",
    "attend",
    "attention",
    "multihead_attention",
    "splash_attention",
]

PositionKind = Literal["xpos", "rope", "alibi", "xpos_norotate", "sinusoidal", "learned", "none"]


@struct.dataclass
class Context:
    """What every layer's attention shares in one forward (a pytree; see :func:`context`).

    ``q_rotary``/``k_rotary``: XPOS/RoPE ``(cos, sin)`` float32 ``[B, T|S, 1, Dh/2]``
    or None; ``bias``: ALiBi float32 ``[B|1, H, T, S]`` or None; ``mask``: bool
    broadcastable to ``[B, H, T, S]`` or None. ``q_segment_ids``/``kv_segment_ids``
    (int32 ``[B, T]``/``[B, S]``, or None) and ``block`` (static) describe the
    same mask for :func:`splash_attention`: bottom-right causal, limited to the
    blockwise window of ``block`` when set, between equal segment ids.
    ``sinks``: the context of a second key group (StreamingLLM's attention sinks)
    with its own query and key positions and mask, or None (see :func:`attention`).
    ``halves`` (static): queries and keys hold each rotated pair as ``(x_i,
    x_i+Dh/2)`` rather than interleaved (see :func:`context`).
    """

    q_rotary: tuple | None = None
    k_rotary: tuple | None = None
    bias: jax.Array | None = None
    mask: jax.Array | None = None
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    block: int | None = struct.field(pytree_node=False, default=None)
    sinks: Context | None = None
    halves: bool = struct.field(pytree_node=False, default=False)


def context(
    q_positions,
    k_positions,
    *,
    num_heads: int,
    head_dim: int,
    position: PositionKind,
    mask=None,
    scale_base: float = 512.0,
    theta: float = 10000.0,
    segment_ids=None,
    block: int | None = None,
    rope_scaling: str = "none",
    rope_factor=1.0,
    train_len: int | None = None,
    rope_length=None,
    halves: bool = False,
) -> Context:
    """Builds the shared :class:`Context` of one forward (pure).

    For XPOS and RoPE both position sets are shifted by the same integer per
    row so they are centred around zero: scores depend only on ``m − n``, so
    the shift is exact, keeps every XPOS scale far inside its safe range
    (:func:`lexjax.positions.max_safe_position`) and RoPE's angles small.
    ``segment_ids``: ``(q, kv)`` int32 for the splash kernel's mask (see
    :class:`Context`), or None.

    ``rope_scaling`` (xpos and rope only): an inference-time extension of
    :func:`lexjax.positions.rope_scaling` with factor ``rope_factor`` (≥ 1)
    from training length ``train_len``; ``dynamic_ntk`` ignores the factor and
    takes s = max(1, n/train_len) with n = the largest query position + 1 (the
    positions processed so far), before XPOS's centring, or ``rope_length`` where
    given (a chunk padded past the real tokens: their count). Every key, cached ones
    too (they are cached before encoding), is rotated with this call's
    frequencies, so a chunk's queries and all earlier keys share one s.
    ``xpos_norotate``: XPOS tables with θ_i = 0 (decay only).

    ``halves``: the queries and keys this context encodes come in the layout of
    :func:`lexjax.positions.to_halves` (the model's: its query and key
    projections emit it), where a CPU rotates pairs about twice as fast as
    interleaved ones; scores are unchanged, since both sides share the layout.
    """
    if position not in get_args(PositionKind):
        known = ", ".join(get_args(PositionKind))
        raise ValueError(f"position={position!r} is unknown; use one of {known}")
    q_positions = jnp.atleast_1d(pos_lib.as_positions(q_positions, "q_positions"))
    k_positions = jnp.atleast_1d(pos_lib.as_positions(k_positions, "k_positions"))
    q_rotary = k_rotary = bias = None
    if position in PAIRED_ENCODINGS:
        extension, decay_base = {}, scale_base
        if position == "xpos_norotate":
            extension = dict(inv_freq=jnp.zeros(head_dim // 2, jnp.float32))
        elif rope_scaling != "none":
            if rope_scaling == "dynamic_ntk":
                # initial=0: no query (a zero-length call) is s = 1, as is n ≤ L.
                seen = jnp.max(q_positions, initial=0) + 1 if rope_length is None else rope_length
                rope_factor = pos_lib.length_factor(seen, train_len)
            scaled = pos_lib.rope_scaling(
                rope_scaling, rope_factor, head_dim, theta=theta, train_len=train_len
            )
            extension = dict(inv_freq=scaled.inv_freq)
            if not (isinstance(scaled.qk_scale, float) and scaled.qk_scale == 1.0):
                extension["scale"] = scaled.qk_scale
            decay_base = scale_base * scaled.decay_base_scale
        # Both position sets are shifted by one integer per row, which changes no
        # score (they depend on m − n): XPOS's scales stay far inside their safe
        # range, and the rotary angles keep positions.angles' accuracy (|p| ≤ 2^24)
        # for twice as many tokens. Per row, since rows may sit at different
        # offsets; written so that no int32 sum overflows.
        shift = _centre(q_positions, k_positions)
        if position == "rope":  # a new paired kind needs its own branch (tested)
            q_rotary = pos_lib.rotary_tables(
                q_positions - shift, head_dim, theta=theta, **extension
            )
            k_rotary = pos_lib.rotary_tables(
                k_positions - shift, head_dim, theta=theta, **extension
            )
        elif position in DECAYING_ENCODINGS:  # XPOS and its decay-only ablation
            tables = functools.partial(
                pos_lib.xpos_tables,
                head_dim=head_dim,
                scale_base=decay_base,
                theta=theta,
                **extension,
            )
            q_rotary = tables(q_positions - shift)
            k_rotary = tables(k_positions - shift, downscale=True)
        else:  # not XPOS's tables by default: a new kind would silently decay
            raise NotImplementedError(f"position={position!r} has no rotary tables in context")
    elif position == "alibi":
        bias = logit_bias(q_positions, k_positions, num_heads, position=position)
    q_segments, kv_segments = (None, None) if segment_ids is None else segment_ids
    return Context(q_rotary, k_rotary, bias, mask, q_segments, kv_segments, block, halves=halves)


def _centre(q_positions, k_positions):
    """The integer per row that :func:`context` subtracts from both position sets:
    midway between the lowest key and the highest query. A side with no positions
    (zero tokens) takes the other's ends, and neither gives 0: a reduction over
    nothing has no value."""
    lows = k_positions if k_positions.shape[-1] else q_positions
    highs = q_positions if q_positions.shape[-1] else k_positions
    if not highs.shape[-1]:
        return 0
    low = jnp.min(lows, axis=-1, keepdims=True)
    return low + (jnp.max(highs, axis=-1, keepdims=True) - low) // 2


def encode(q, k, ctx: Context):
    """Applies the context's rotary tables (if any) to queries and keys."""
    if ctx.q_rotary is not None:
        q = pos_lib.apply_rotary(q, *ctx.q_rotary, halves=ctx.halves)
        k = pos_lib.apply_rotary(k, *ctx.k_rotary, halves=ctx.halves)
    return q, k


def _context_of(q, k, q_positions, k_positions, v=None, **kwargs) -> Context:
    """The context of ``[B, T, H, D]`` queries and keys (and values), their shapes
    and positions checked first: a mismatch is one ValueError naming both shapes,
    not a broadcasting error from inside the computation."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is not None and jnp.ndim(x) != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {x.shape}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"q {q.shape} and k {k.shape} must share batch, heads and head_dim ([B, T, H, D])"
        )
    if v is not None and v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {v.shape} must share batch, seq and heads with k {k.shape}")
    positions = []
    for name, p, x in (("q_positions", q_positions, q), ("k_positions", k_positions, k)):
        p = jnp.asarray(p)
        try:
            positions.append(jnp.broadcast_to(p, x.shape[:2]))
        except (TypeError, ValueError):
            raise ValueError(
                f"{name} of shape {p.shape} do not broadcast to [batch, seq] = {x.shape[:2]}"
            ) from None
    q_positions, k_positions = positions
    return context(q_positions, k_positions, num_heads=q.shape[2], head_dim=q.shape[3], **kwargs)


def encode_qk(
    q,
    k,
    q_positions,
    k_positions,
    *,
    position: PositionKind,
    scale_base: float = 512.0,
    theta: float = 10000.0,
):
    """Applies the rotary encodings (XPOS, RoPE, or XPOS's decay alone) to queries and
    keys, positions centred as in :func:`context`. Other kinds pass q, k through."""
    ctx = _context_of(
        q, k, q_positions, k_positions, position=position, scale_base=scale_base, theta=theta
    )
    return encode(q, k, ctx)


def logit_bias(q_positions, k_positions, num_heads: int, *, position: PositionKind):
    """ALiBi's ``[B|1, H, Tq, Tk]`` float32 bias, or None for other encodings."""
    if position != "alibi":
        return None
    bias = pos_lib.alibi_bias(num_heads, q_positions, k_positions)
    return bias if bias.ndim == 4 else bias[None]


def attention_logits(q, k, *, bias=None):
    """Pre-softmax scores ``[B, H, Tq, Tk]`` in float32 (float64 for float64 q,
    k under x64): ``q·k/√Dh (+ bias)``."""
    scale = q.shape[-1] ** -0.5
    accumulate = jnp.promote_types(jnp.result_type(q, k), jnp.float32)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=accumulate)
    logits = logits * scale
    if bias is not None:
        logits = logits + bias
    return logits


def attend(logits, v, mask=None):
    """Masked softmax over keys (float32) and the weighted sum of values.

    Rows with no visible key (padding queries) get uniform weights instead of
    NaN; callers give such tokens zero loss weight.
    """
    _check_boolean(mask)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    accumulate = jnp.promote_types(v.dtype, jnp.float32)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v, preferred_element_type=accumulate).astype(
        v.dtype
    )


def attention(q, k, v, ctx: Context, *, impl: str = "explicit", sinks=None):
    """Attention of un-encoded ``q``, ``k``, ``v`` under ``ctx``. Returns ``(out, logits)``.

    ``impl``: ``explicit`` returns the pre-softmax scores ``[B, H, Tq, Tk]`` of
    paper eq. 11 as ``logits`` (XLA drops them when unused); ``fused`` and
    ``splash`` never materialise them and return None. All three give the same
    ``out`` for every query that sees at least one key (tested). Splash needs
    query and key lengths that are multiples of 128 (its tiles); other shapes
    (one-token decoding steps) take the fused path.

    ``sinks``: ``(k_s, v_s)`` ``[B, S, H, Dh]``, un-encoded keys and values of a
    second group scored under ``ctx.sinks`` — the same queries encoded at that
    context's own positions — in one softmax with the others; the sinks come
    first in ``logits`` (``[B, H, Tq, S + Tk]``). Always explicit: a fused
    kernel encodes each query once.
    """
    _check_context(q, k, ctx)
    if sinks is not None:
        if ctx.sinks is None:
            raise ValueError(
                "sinks need ctx.sinks, the context of the queries against the sinks' "
                "positions: ctx.replace(sinks=context(q_positions, sink_positions, ...))"
            )
        _check_context(q, sinks[0], ctx.sinks)
        return _attention_with_sinks(q, k, v, ctx, *sinks)
    q, k = encode(q, k, ctx)
    if impl == "explicit":
        logits = attention_logits(q, k, bias=ctx.bias)
        return attend(logits, v, ctx.mask), logits
    if impl == "fused":
        return _fused(q, k, v, ctx.bias, ctx.mask), None
    if impl == "splash":
        if q.shape[1] % 128 or k.shape[1] % 128:
            # The kernel tiles by 128 tokens; single-token decoding steps do not.
            return _fused(q, k, v, ctx.bias, ctx.mask), None
        return splash_attention(q, k, v, ctx), None
    raise ValueError(f"attention impl {impl!r}: use explicit, fused or splash")


def _check_boolean(mask) -> None:
    """An additive 0/−inf mask was taken as True where it is −inf: queries attended
    only to the keys it hides."""
    if mask is not None and jnp.result_type(mask) != jnp.bool_:
        raise ValueError(
            f"the mask is {jnp.result_type(mask)}; give a boolean mask, True where a "
            "query may attend (an additive 0/-inf mask m: m == 0)"
        )


def _check_context(q, k, ctx: Context) -> None:
    """One ValueError where ``ctx`` was built for other shapes than ``q`` ``[B, T, H, D]``
    and ``k`` ``[B, S, H, D]`` (another length, head_dim or head count), or its mask
    is ``[B, T, S]``, whose batch axis would broadcast against the heads."""
    B, T, H, D = q.shape
    S = k.shape[1]
    if ctx.q_rotary is not None:
        for name, (cos, _), length in (("q", ctx.q_rotary, T), ("k", ctx.k_rotary, S)):
            if cos.shape[-3] != length or 2 * cos.shape[-1] != D:
                raise ValueError(
                    f"the context's {name} tables hold {cos.shape[-3]} positions of head_dim "
                    f"{2 * cos.shape[-1]} and {name} {(q if name == 'q' else k).shape} "
                    f"has {length} of {D}; build the context from this call's positions"
                )
    if ctx.bias is not None and ctx.bias.shape[-3] != H:
        raise ValueError(
            f"the context's ALiBi bias has {ctx.bias.shape[-3]} heads and q "
            f"{q.shape} has {H}; build the context with num_heads={H}"
        )
    _check_boolean(ctx.mask)
    for name, x in (("mask", ctx.mask), ("ALiBi bias", ctx.bias)):
        shape = () if x is None else jnp.shape(x)
        fits = all(a in (1, b) for a, b in zip(shape[::-1], (B, H, T, S)[::-1]))
        if len(shape) == 3 or len(shape) > 4 or not fits:
            raise ValueError(
                f"the context's {name} of shape {shape} does not broadcast to "
                f"[B, H, T, S] = {(B, H, T, S)}; give [T, S] or [B, H, T, S] "
                "(x[:, None] adds the heads axis to a [B, T, S] mask)"
            )


def _attention_with_sinks(q, k, v, ctx: Context, sink_k, sink_v):
    q_sinks, sink_k = encode(q, sink_k, ctx.sinks)
    q, k = encode(q, k, ctx)
    logits = jnp.concatenate(
        [
            attention_logits(q_sinks, sink_k, bias=ctx.sinks.bias),
            attention_logits(q, k, bias=ctx.bias),
        ],
        axis=-1,
    )
    shape = logits.shape[:-1]
    visible = lambda mask: True if mask is None else mask  # None: every key
    mask = jnp.concatenate(
        [
            jnp.broadcast_to(visible(ctx.sinks.mask), (*shape, sink_k.shape[1])),
            jnp.broadcast_to(visible(ctx.mask), (*shape, k.shape[1])),
        ],
        axis=-1,
    )
    return attend(logits, jnp.concatenate([sink_v.astype(v.dtype), v], axis=1), mask), logits


def multihead_attention(
    q,
    k,
    v,
    q_positions,
    k_positions,
    *,
    position: PositionKind,
    mask=None,
    scale_base: float = 512.0,
    theta: float = 10000.0,
):
    """Encodes positions, scores, masks and attends explicitly. Returns (out, logits).

    ``mask`` is combined by the caller (causal/blockwise by position, segment
    ids, cache validity). ``logits`` are the pre-softmax scores e_{ij} of paper
    eq. 11, for resolution measurements; XLA drops them when unused.
    """
    ctx = _context_of(
        q,
        k,
        q_positions,
        k_positions,
        v,
        position=position,
        mask=mask,
        scale_base=scale_base,
        theta=theta,
    )
    return attention(q, k, v, ctx)


def _fused(q, k, v, bias, mask):
    if bias is not None:
        bias = bias.astype(q.dtype)
    # JAX's automatic choice keeps XLA's unfused path even where cuDNN's
    # kernel applies (bf16/f16 on an NVIDIA GPU), so ask for it there.
    cudnn = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, implementation="cudnn" if cudnn else None
    )


# --------------------------------------------------------------------------- splash (TPU)


def _splash_mask(q_len: int, k_len: int, block: int | None) -> np.ndarray:
    """bool ``[T, S]``: bottom-right causal (the queries are the last T keys), and
    with ``block`` (T = S only) the blockwise window of masks.blockwise_causal."""
    i = np.arange(q_len)[:, None]
    j = np.arange(k_len)[None, :]
    mask = j <= i + (k_len - q_len)
    if block is not None:
        mask &= j >= (i // block - 1) * block
    return mask


@functools.cache
def _splash_kernel(q_len: int, k_len: int, heads: int, block: int | None, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.NumpyMask(_splash_mask(q_len, k_len, block))
    bq, bk = math.gcd(q_len, 512), math.gcd(k_len, 512)  # multiples of 128 (attention())
    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    # Cached across traces: its mask tables must be constants, not the caller's tracers.
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(
            sm.MultiHeadMask([mask] * heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def splash_attention(q, k, v, ctx: Context, *, interpret: bool | None = None):
    """Pallas splash attention (TPU) of encoded ``q``, ``k``, ``v``: ``[B, T, H, Dh]`` out.

    The mask is the static pattern of ``ctx`` (bottom-right causal, blockwise
    with ``ctx.block``) between equal segment ids (``ctx.q_segment_ids``,
    ``ctx.kv_segment_ids``; all one when None): in training the packed
    documents (causal within each), in a block step or chunked evaluation the
    valid cache slots (segment 1) against the rest (0) — the same visible keys
    as ``ctx.mask`` for every query that sees one. No bias (ALiBi): the config
    refuses that combination. ``interpret`` (default: off a TPU) runs the
    kernel in Pallas interpret mode, for tests on CPU; ``lexjax.model``
    refuses splash off a TPU instead of running it that slowly.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    if ctx.bias is not None:
        raise ConfigError("splash attention takes no logit bias; use alibi with explicit or fused")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    B, T, H, K = q.shape
    S = k.shape[1]
    kernel = _splash_kernel(T, S, H, ctx.block, interpret)
    q_seg = ctx.q_segment_ids
    kv_seg = ctx.kv_segment_ids
    q_seg = jnp.ones((B, T), jnp.int32) if q_seg is None else jnp.broadcast_to(q_seg, (B, T))
    kv_seg = jnp.ones((B, S), jnp.int32) if kv_seg is None else jnp.broadcast_to(kv_seg, (B, S))
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, H, T, K]: the kernel's layout
    one = lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sk.SegmentIds(q=qs, kv=ks))
    out_BxHxTxK = jax.vmap(one)(
        heads_first(q * jnp.asarray(K**-0.5, q.dtype)),
        heads_first(k),
        heads_first(v),
        q_seg.astype(jnp.int32),
        kv_seg.astype(jnp.int32),
    )
    return heads_first(out_BxHxTxK).astype(v.dtype)
