"""Dot-product attention with position encodings, masks and an optional key/value cache.

Everything here is a pure function of arrays. Shapes: queries ``[B, Tq, H, Dh]``,
keys and values ``[B, Tk, H, Dh]``, positions ``[B, T]`` (or ``[T]``) integers,
masks boolean, broadcastable to ``[B, H, Tq, Tk]``.

A block step over cached keys is the same computation as a training forward:
the caller concatenates the cached keys/values (stored *before* position
encoding) in front of the current ones and passes the matching key
positions; :func:`lexjax.masks.causal_by_position` then yields the causal or
blockwise pattern from window-relative positions.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from lexjax import positions as pos_lib

__all__ = [
    "encode_qk",
    "logit_bias",
    "attention_logits",
    "attend",
    "multihead_attention",
    "fused_multihead_attention",
]

PositionKind = Literal["xpos", "rope", "alibi", "sinusoidal", "learned", "none"]


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
    """Applies the rotary encodings (XPOS or RoPE) to queries and keys.

    For XPOS both position sets are shifted by the same integer so they are
    centred around zero: scores depend only on ``m − n``, so the shift is exact
    and keeps every scale far inside XPOS's safe range
    (:func:`lexjax.positions.max_safe_position`). Other kinds pass q, k through.
    """
    if position == "xpos":
        shift = (jnp.min(k_positions) + jnp.max(q_positions)) // 2
        q = pos_lib.xpos(q, q_positions - shift, scale_base=scale_base, theta=theta)
        k = pos_lib.xpos(k, k_positions - shift, scale_base=scale_base, theta=theta, downscale=True)
    elif position == "rope":
        q = pos_lib.rope(q, q_positions, theta=theta)
        k = pos_lib.rope(k, k_positions, theta=theta)
    return q, k


def logit_bias(q_positions, k_positions, num_heads: int, *, position: PositionKind):
    """ALiBi's ``[B|1, H, Tq, Tk]`` float32 bias, or None for other encodings."""
    if position != "alibi":
        return None
    bias = pos_lib.alibi_bias(num_heads, q_positions, k_positions)
    return bias if bias.ndim == 4 else bias[None]


def attention_logits(q, k, *, bias=None):
    """Pre-softmax scores ``[B, H, Tq, Tk]`` in float32: ``q·k/√Dh (+ bias)``."""
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    logits = logits * scale
    if bias is not None:
        logits = logits + bias
    return logits


def attend(logits, v, mask=None):
    """Masked softmax over keys (float32) and the weighted sum of values.

    Rows with no visible key (padding queries) get uniform weights instead of
    NaN; callers give such tokens zero loss weight.
    """
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v, preferred_element_type=jnp.float32).astype(
        v.dtype
    )


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
    """Encodes positions, scores, masks and attends. Returns (out, logits).

    ``mask`` is combined by the caller (causal/blockwise by position, segment
    ids, cache validity). ``logits`` are the pre-softmax scores e_{ij} of paper
    eq. 11, for resolution measurements; XLA drops them when unused.
    """
    q_positions = jnp.broadcast_to(q_positions, q.shape[:2])
    k_positions = jnp.broadcast_to(k_positions, k.shape[:2])
    q, k = encode_qk(
        q, k, q_positions, k_positions, position=position, scale_base=scale_base, theta=theta
    )
    bias = logit_bias(q_positions, k_positions, q.shape[2], position=position)
    logits = attention_logits(q, k, bias=bias)
    return attend(logits, v, mask), logits


def fused_multihead_attention(
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
    """Same result as :func:`multihead_attention` through ``jax.nn.dot_product_attention``.

    Positions are encoded exactly as there (XPOS/RoPE on q and k, ALiBi as a
    bias); the fused kernel never materialises the ``[B, H, Tq, Tk]`` scores,
    so no logits are returned.
    """
    q_positions = jnp.broadcast_to(q_positions, q.shape[:2])
    k_positions = jnp.broadcast_to(k_positions, k.shape[:2])
    q, k = encode_qk(
        q, k, q_positions, k_positions, position=position, scale_base=scale_base, theta=theta
    )
    bias = logit_bias(q_positions, k_positions, q.shape[2], position=position)
    if bias is not None:
        bias = bias.astype(q.dtype)
    # JAX's automatic choice keeps XLA's unfused path even where cuDNN's
    # kernel applies (bf16/f16 on an NVIDIA GPU), so ask for it there.
    cudnn = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, implementation="cudnn" if cudnn else None
    )
