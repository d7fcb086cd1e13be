"""Attention masks as pure functions returning boolean ``[q, k]`` arrays.

True means "query i may attend to key j". Sizes are static Python ints, so
the masks are built once per compiled shape.
"""

from __future__ import annotations

import jax.numpy as jnp

from lexjax.positions import as_positions, positive_int

__all__ = ["causal", "blockwise_causal", "same_segment", "causal_by_position"]


def causal(q_len: int, k_len: int | None = None):
    """Bottom-right aligned causal mask ``[q_len, k_len]``.

    Query i sees key j iff ``j ≤ i + (k_len − q_len)``: the queries are the
    last ``q_len`` of the ``k_len`` keys, which serves a block of queries over
    cached keys.
    """
    q_len = positive_int("q_len", q_len)
    k_len = q_len if k_len is None else positive_int("k_len", k_len)
    if k_len < q_len:
        raise ValueError(
            f"k_len ({k_len}) must be ≥ q_len ({q_len}): the queries are the last q_len keys"
        )
    i = jnp.arange(q_len)[:, None]
    j = jnp.arange(k_len)[None, :]
    return j <= i + (k_len - q_len)


def blockwise_causal(length: int, block: int):
    """Blockwise causal mask ``[length, length]`` (paper §3.3).

    Query i sees key j iff ``j ≤ i`` and ``j ≥ (⌊i/block⌋ − 1)·block``: its own
    block and the one before. ``block`` is half the training length, so no
    query ever sees a key farther than the training length.
    """
    length = positive_int("length", length)
    block = positive_int("block", block)
    i = jnp.arange(length)[:, None]
    j = jnp.arange(length)[None, :]
    return (j <= i) & (j >= (i // block - 1) * block)


def same_segment(q_segment_ids, k_segment_ids):
    """``[..., q, k]``: True where both tokens are in the same packed document.

    Segment id 0 marks padding, which attends to nothing and is seen by nothing.
    """
    # A scalar is one token, as a scalar position is in attention.context (it was an
    # IndexError).
    q_segment_ids = jnp.atleast_1d(jnp.asarray(q_segment_ids))
    k_segment_ids = jnp.atleast_1d(jnp.asarray(k_segment_ids))
    same = q_segment_ids[..., :, None] == k_segment_ids[..., None, :]
    return same & (q_segment_ids[..., :, None] > 0)


def causal_by_position(q_positions, k_positions, window: int | None = None):
    """``[..., q, k]``: True where the key's position is not after the query's
    and, with ``window``, fewer than ``window`` positions before it
    (``0 ≤ q − k < window``: a sliding window of ``window`` keys, itself included).

    With window-relative positions this is how a block step over cached keys
    expresses the causal, blockwise and sliding-window patterns without
    materialising them.
    """
    # Unsigned: q − k wrapped. A scalar is one position (it was an IndexError).
    q_positions = jnp.atleast_1d(as_positions(q_positions, "q_positions"))
    k_positions = jnp.atleast_1d(as_positions(k_positions, "k_positions"))
    distance = q_positions[..., :, None] - k_positions[..., None, :]
    if window is None:
        return distance >= 0
    return (distance >= 0) & (distance < positive_int("window", window))
