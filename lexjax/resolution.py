"""Attention resolution (paper §3.1, eq. 3 and 11) and expected-score curves (eq. 8)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lexjax.positions import check_positive, positive_int, rotary_frequencies, xpos_decay_base

__all__ = ["attention_resolution", "expected_scores", "xpos_expectation"]


def attention_resolution(s):
    """R(s) of paper eq. 3 over the last axis of ``s`` (expected scores by distance).

    ``R(s) = Σ_i e^{s[i]} (e^{s[i]} − e^{s[i+1]}) / (Σ_i e^{s[i]})²``.

    Convention at the last term: s[N+1] does not exist, so the numerator runs
    over i = 0 … N−1 (the differences that are defined) while the denominator
    runs over all i = 0 … N. R is invariant to adding a constant to s, which is
    used to compute it without overflow.
    """
    s = jnp.asarray(s, jnp.float32)
    if s.ndim == 0 or s.shape[-1] < 2:  # a scalar was an IndexError
        raise ValueError(
            f"attention_resolution needs at least 2 distances on the last axis, got shape {s.shape}"
        )
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    numerator = jnp.sum(e[..., :-1] * (e[..., :-1] - e[..., 1:]), axis=-1)
    return numerator / jnp.square(jnp.sum(e, axis=-1))


def expected_scores(scores, mask=None):
    """Mean pre-softmax score at each distance n = i − j (paper eq. 11).

    Args:
      scores: ``[..., q, k]``; query i stands at key position ``i + k − q``
        (bottom-right aligned, as :func:`lexjax.masks.causal`).
      mask: optional boolean ``[..., q, k]``; only True entries are averaged
        (e.g. the blockwise pattern, or padding removed).

    Returns:
      ``[..., k]`` float32: entry n is the mean of ``scores[i, j]`` over pairs
      with ``i + k − q − j = n``; NaN where no pair has that distance.
    """
    scores = jnp.asarray(scores, jnp.float32)
    # A 1-D array was "not enough values to unpack"; a mask of another shape a
    # broadcasting TypeError, and no query a ZeroDivisionError.
    if scores.ndim < 2 or scores.shape[-1] < scores.shape[-2]:
        raise ValueError(f"scores must be [..., q, k] with k ≥ q, got shape {scores.shape}")
    q_len, k_len = scores.shape[-2:]
    if mask is not None:
        # An additive 0/−inf mask became True where it is −inf: the pairs it hides.
        if jnp.result_type(mask) != jnp.bool_:
            raise ValueError(
                f"the mask is {jnp.result_type(mask)}; give a boolean mask, True where a pair "
                "counts (an additive 0/-inf mask m: m == 0)"
            )
        mask = jnp.asarray(mask)
        try:
            fits = jnp.broadcast_shapes(mask.shape, scores.shape) == scores.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"the mask of shape {mask.shape} does not broadcast to the scores' {scores.shape}"
            )
    if q_len == 0:  # no pair at any distance
        return jnp.full(scores.shape[:-2] + (k_len,), jnp.nan, jnp.float32)
    distance = (jnp.arange(q_len)[:, None] + (k_len - q_len)) - jnp.arange(k_len)[None, :]
    valid = distance >= 0
    if mask is not None:
        valid = valid & mask
    valid = jnp.broadcast_to(valid, scores.shape)
    flat_distance = jnp.broadcast_to(jnp.where(distance >= 0, distance, k_len), scores.shape)
    lead = scores.shape[:-2]
    flat_scores = jnp.where(valid, scores, 0.0).reshape(-1, q_len * k_len)
    flat_valid = valid.reshape(-1, q_len * k_len).astype(jnp.float32)
    flat_distance = flat_distance.reshape(-1, q_len * k_len)

    def per_row(values, weights, ids):
        total = jax.ops.segment_sum(values, ids, num_segments=k_len + 1)[:k_len]
        count = jax.ops.segment_sum(weights, ids, num_segments=k_len + 1)[:k_len]
        return jnp.where(count > 0, total / jnp.maximum(count, 1.0), jnp.nan)

    means = jax.vmap(per_row)(flat_scores, flat_valid, flat_distance)
    return means.reshape(*lead, k_len)


def xpos_expectation(
    distances,
    head_dim: int,
    *,
    scale_base: float = 512.0,
    theta: float = 10000.0,
    gamma: float | None = 0.4,
):
    """Expected XPOS score at each distance (paper eq. 8), the curves of Figure 1.

    ``g[n] = Σ_i cos(n·θ_i) · ζ_i^(n/b)`` with θ_i = theta^(-2i/d),
    ζ_i = (2i/d + γ)/(1 + γ). ``gamma=None`` (ζ = 1) gives RoPE's curve, which
    oscillates; XPOS's decays smoothly.
    """
    distances = jnp.asarray(distances, jnp.float32)
    # As xpos refuses them: a gamma or scale_base ≤ 0 gave NaN, head_dim ≤ 0 zeros.
    head_dim = positive_int("head_dim", head_dim)
    check_positive(scale_base=scale_base, **({} if gamma is None else {"gamma": gamma}))
    inv_freq = jnp.asarray(rotary_frequencies(head_dim, theta), jnp.float32)
    terms = jnp.cos(distances[..., None] * inv_freq)
    if gamma is not None:
        log_zeta = jnp.log(jnp.asarray(xpos_decay_base(head_dim, gamma)))
        terms = terms * jnp.exp(distances[..., None] / scale_base * log_zeta)
    return jnp.sum(terms, axis=-1)
