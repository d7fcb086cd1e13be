"""Position encodings as pure functions of (x, positions).

Shapes follow JAX's attention convention: ``x`` is ``[..., seq, heads,
head_dim]`` and ``positions`` are integers broadcastable to ``[..., seq]``.
Angles and scales are computed in float32 whatever the input dtype; results
come back in the input's dtype.

XPOS (Sun et al. 2022, arXiv 2212.10554, §3.2, eq. 5-6) rotates the pair
``(2i, 2i+1)`` of a query at position m by ``m·θ_i`` and multiplies it by
``ζ_i^(m/b)``; a key at position n is rotated by ``n·θ_i`` and multiplied by
``ζ_i^(-n/b)``. Then ``q'_m · k'_n`` depends only on ``m - n`` and, for
``m ≥ n``, decays with the distance. The pair layout is the interleaved one of
the reference implementation (microsoft/torchscale), so the same q, k and
positions give the same attention scores there and here.

Decay without rotation (the paper's Table 4 ablation, θ_i = 0) is
:func:`xpos_tables` with ``inv_freq`` zero: pair i is only scaled by ζ_i^(±p/b).

**Inference-time RoPE extensions** (:func:`rope_scaling`) change a trained
rotary model's frequencies θ_i without retraining, for a factor s ≥ 1
(the evaluated length over the training length L, by default):

- ``pi``, position interpolation (Chen et al. 2023): positions p → p/s, i.e.
  θ'_i = θ_i/s. On XPOS the decay's positions are divided too (b' = s·b): PI
  is "every position divided by s", so the model sees exactly the scores of
  a sequence s times shorter.
- ``ntk``, NTK-aware scaling (bloc97 2023): the base θ → θ·s^(d/(d−2)), so
  θ'_i = θ_i·s^(−2i/(d−2)): the highest frequency is kept, the lowest is
  divided by s.
- ``dynamic_ntk`` (YaRN §3.3; the common implementation's base
  θ·(n/L)^(d/(d−2))): ``ntk`` with s = max(1, n/L) for the n positions
  processed so far (:func:`length_factor`), recomputed per forward or chunk.
- ``yarn`` (Peng et al. 2023, "YaRN": the ramp of §3.2, the temperature of
  §3.4): per pair, the
  ratio r_i = L/λ_i of the training length to its wavelength λ_i = 2π/θ_i
  sets a ramp γ(r) = 0 below α = 1, 1 above β = 32, linear between; θ'_i =
  (1 − γ)·θ_i/s + γ·θ_i (interpolate the long wavelengths, keep the short),
  and the scores are multiplied by 1/t = (0.1·ln s + 1)², applied as
  √(1/t) on the query and key tables each.

NTK, dynamic NTK and YaRN change frequencies only: XPOS's decay keeps the raw
positions (its ζ^(Δ/b) was trained per distance and has no aliasing to undo).
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ROPE_SCALINGS",
    "RotaryScaling",
    "rope_scaling",
    "rotary_frequencies",
    "length_factor",
    "xpos",
    "rope",
    "angles",
    "rotary_tables",
    "xpos_tables",
    "apply_rotary",
    "to_halves",
    "alibi_slopes",
    "alibi_bias",
    "sinusoidal",
    "xpos_decay_base",
    "max_safe_position",
]

# The inference-time extensions of rope_scaling (lexjax.config.ROPE_SCALINGS lists the same).
ROPE_SCALINGS = ("none", "pi", "ntk", "dynamic_ntk", "yarn")
# YaRN's ramp bounds on r = L/λ (Peng et al. 2023, §3.2; their values for LLaMA).
YARN_ALPHA, YARN_BETA = 1.0, 32.0

# ln of the largest finite value of each result dtype; see max_safe_position.
_LOG_MAX = {
    jnp.dtype(jnp.float16): math.log(65504.0),
    jnp.dtype(jnp.bfloat16): math.log(3.38e38),
    jnp.dtype(jnp.float32): math.log(3.40e38),
}


def xpos_decay_base(head_dim: int, gamma: float = 0.4) -> np.ndarray:
    """ζ_i = (2i/d + γ) / (1 + γ) for i = 0 … d/2 − 1 (float32, shape [d/2])."""
    _check_head_dim(head_dim)
    i = np.arange(head_dim // 2, dtype=np.float64)
    return ((2.0 * i / head_dim + gamma) / (1.0 + gamma)).astype(np.float32)


def max_safe_position(
    scale_base: float = 512.0, gamma: float = 0.4, dtype=jnp.float32, margin: float = 1e3
) -> float:
    """Largest |position| at which a key scale ζ_0^(-|p|/b) stays finite in ``dtype``.

    The key scale grows as ``(1/ζ_0)^(p/b)`` with ``1/ζ_0 = (1+γ)/γ`` (3.5 for
    γ = 0.4); ``margin`` leaves room for the magnitude of the key itself. For
    b = 512 this is about 1,700 (3.3·b) for float16 and 33,000 (65·b) for
    float32/bfloat16 —
    and because only ``m − n`` matters, callers keep positions small (window
    relative or centred) so they never get near it.
    """
    dtype = jnp.dtype(dtype)
    log_growth = math.log((1.0 + gamma) / gamma)
    return (
        (_LOG_MAX.get(dtype, _LOG_MAX[jnp.dtype(jnp.float32)]) - math.log(margin))
        * scale_base
        / log_growth
    )


def positive_int(name: str, value) -> int:
    """``value`` as an int, if it is a positive Python, NumPy or concrete JAX integer
    (not a bool or a float); else a ValueError naming ``name``, which says to mark
    it static where it is traced (a size a jitted function cannot take as data)."""
    traced = False
    try:
        size = None if isinstance(value, bool) else operator.index(value)
    except TypeError as e:
        size, traced = None, isinstance(e, jax.errors.TracerIntegerConversionError)
    if size is None or size < 1:
        hint = "; it is a size: pass a Python int (under jax.jit, mark it static)" * traced
        raise ValueError(f"{name} must be a positive integer, got {value!r}{hint}")
    return size


def check_positive(**values) -> None:
    """ValueError naming the first of ``values`` (scalars) that is not positive, NaN
    included; a traced one (under jax.jit, vmap or grad) is not checked."""
    for name, value in values.items():
        try:
            bad = not value > 0
        except jax.errors.ConcretizationTypeError:
            bad = False
        if bad:
            raise ValueError(f"{name} must be positive, got {value}")


def _check_head_dim(head_dim: int) -> None:
    if head_dim % 2:
        raise ValueError(
            f"head_dim must be even for rotary encodings, got {head_dim}; "
            "choose d_model/num_heads even"
        )


def as_positions(positions, name: str = "positions") -> jax.Array:
    """``positions`` as a signed integer array: unsigned ones become int32, whose
    differences are the same, where theirs wrapped (``q − k`` < 0 in ALiBi, the
    centring shift of :func:`lexjax.attention.context`). Raises ValueError for any
    other dtype."""
    positions = jnp.asarray(positions)
    if jnp.issubdtype(positions.dtype, jnp.unsignedinteger):
        return positions.astype(jnp.int32)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be integers, got dtype {positions.dtype}; "
            "pass token indices, e.g. jnp.arange(seq)"
        )
    return positions


def _check_positions(x, positions):
    x, positions = jnp.asarray(x), as_positions(positions)
    if x.ndim < 3:
        raise ValueError(f"x must be [..., seq, heads, head_dim], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be floating point, got dtype {x.dtype}; cast it first")
    lead = x.shape[:-2]
    try:
        ok = np.broadcast_shapes(positions.shape, lead) == lead
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"positions of shape {positions.shape} do not broadcast to x's "
            f"[..., seq] = {lead}; give one position per token"
        )
    return x, positions


def _materialize(table):
    """Returns ``table`` unchanged, computed once rather than inside its consumer.

    XLA's CPU fuser pulls the cos/sin tables (``[..., seq, 1, d/2]``) into the
    rotation's loop, recomputing each transcendental for every head and both
    outputs of a pair: 8× the work, most of XPOS's cost on a CPU (``bench/``,
    xpos_overhead). A dot is never fused into an elementwise loop, so a
    product with the identity (exact at HIGHEST precision) makes XLA compute
    the table by itself. Accelerators fuse well and keep the plain path.
    """
    if jax.default_backend() != "cpu":
        return table
    eye = jnp.eye(table.shape[-1], dtype=table.dtype)
    return jnp.einsum("...i,ij->...j", table, eye, precision=jax.lax.Precision.HIGHEST)


def rotary_frequencies(head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """θ_i = theta^(−2i/d) for i = 0 … d/2 − 1 (float64, shape [d/2])."""
    _check_head_dim(head_dim)
    check_positive(theta=theta)  # 0 or less: inf or NaN frequencies, NaN encodings
    return theta ** (-2.0 * np.arange(head_dim // 2) / head_dim)


def length_factor(length, train_len: int):
    """s = max(1, length/train_len): the factor that stretches ``train_len`` to ``length``.

    The default factor of the static scalings (each evaluated length) and
    dynamic NTK's factor for the positions processed so far. ``length`` may be
    a traced scalar (then so is the result, float32).
    """
    if train_len is None or not train_len >= 1:
        raise ValueError(f"train_len must be positive, got {train_len}")
    if isinstance(length, (int, float, np.integer, np.floating)):
        return max(1.0, float(length) / train_len)
    return jnp.maximum(1.0, jnp.asarray(length, jnp.float32) / train_len)


class RotaryScaling(NamedTuple):
    """What an inference-time extension changes in :func:`rotary_tables`/:func:`xpos_tables`.

    ``inv_freq``: float32 ``[d/2]``, the frequencies θ'_i (their ``inv_freq``);
    ``decay_base_scale``: multiplies XPOS's scale base b (s for PI, whose decay
    sees the positions p/s; 1 otherwise); ``qk_scale``: multiplies queries and
    keys each (their ``scale``: YaRN's √(1/t) = 0.1·ln s + 1; 1 otherwise).
    """

    inv_freq: jax.Array
    decay_base_scale: float | jax.Array
    qk_scale: float | jax.Array


def rope_scaling(
    scaling: str, factor, head_dim: int, *, theta: float = 10000.0, train_len: int | None = None
) -> RotaryScaling:
    """The frequencies and scales of one inference-time RoPE extension (module docstring).

    Args:
      scaling: one of :data:`ROPE_SCALINGS`.
      factor: s ≥ 1; for ``dynamic_ntk`` the one of the positions processed so
        far (:func:`length_factor`). A Python number is computed in float64;
        a traced scalar (dynamic NTK inside a jit) in float32.
      head_dim: d, even.
      theta: the trained base; θ_i = theta^(−2i/d).
      train_len: L, the training length (YaRN's wavelength ratio r = L/λ).

    Returns:
      a :class:`RotaryScaling`; ``none`` gives θ_i and unit scales.
    """
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope scaling {scaling!r}: choose one of {', '.join(ROPE_SCALINGS)}")
    static = isinstance(factor, (int, float, np.integer, np.floating))
    try:  # a traced factor (dynamic NTK inside a jit) is not checked
        bad = not (math.isfinite(factor) and factor >= 1)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError):
        bad = False
    if bad:
        raise ValueError(f"the rope scaling factor must be finite and ≥ 1, got {factor}")
    xp = np if static else jnp
    s = float(factor) if static else jnp.asarray(factor, jnp.float32)
    base = rotary_frequencies(head_dim, theta)
    if not static:
        base = jnp.asarray(base, jnp.float32)
    decay, qk = 1.0, 1.0
    if scaling == "none":
        inv_freq = base
    elif scaling == "pi":
        inv_freq, decay = base / s, s
    elif scaling in ("ntk", "dynamic_ntk"):
        # θ'_i = (theta·s^(d/(d−2)))^(−2i/d) = θ_i·s^(−2i/(d−2)); d = 2 has only θ_0 = 1.
        i = np.arange(head_dim // 2)
        exponent = -2.0 * i / (head_dim - 2) if head_dim > 2 else np.zeros(1)
        inv_freq = base * xp.exp(exponent * xp.log(s))
    else:  # yarn
        if train_len is None or not train_len >= 1:
            raise ValueError(f"yarn needs the training length, got train_len={train_len}")
        ratio = train_len * rotary_frequencies(head_dim, theta) / (2 * math.pi)  # r = L/λ
        ramp = np.clip((ratio - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA), 0.0, 1.0)
        inv_freq = (1.0 - ramp) * base / s + ramp * base
        qk = 0.1 * xp.log(s) + 1.0
    return RotaryScaling(jnp.asarray(inv_freq, jnp.float32), decay, qk)


# 2π as C1 + C2 + C3 (Cody and Waite's reduction): C1 and C2 have 8 and 10 significant
# bits, so n·C1 and n·C2 are exact in float32 for whole n < 2^14 wraps; C3 is the rest.
_TWO_PI_PARTS = (6.28125, 0.0019359588623046875, -6.516827397717861e-07)


def _wrapped(x):
    """``x mod 2π``, in about [−π, π], for float32 ``0 ≤ x ≤ 2^16``: the n wraps
    taken off in the three parts of 2π, exactly but for the last (|error| ≲ 2⁻²²)."""
    n = jnp.round(x / (2 * math.pi))
    c1, c2, c3 = (jnp.float32(c) for c in _TWO_PI_PARTS)
    return ((x - n * c1) - n * c2) - n * c3


def angles(positions, inv_freq):
    """float32 ``[..., seq, d/2]``: the angles ``p·θ_i`` of integer ``positions``, as
    accurate at a position of millions as near 0.

    ``p·θ_i`` formed in float32 is rounded to half a unit in its last place (up to
    2⁻⁶ radians at p = 5·10⁵ for θ_0 = 1, a whole radian at 2^24), and a rotary
    score depends on the difference of two such angles. Here |p| = h·2^16 + m·2^8
    + l with bytes m, l, and ``|p|·θ = h·w(2^16·θ) + m·w(2^8·θ) + l·θ``, where
    ``w`` wraps modulo 2π (:func:`_wrapped`; ``2^k·θ`` is exact): each term is
    below 256·2π, so the angle is within 2·10⁻⁴ radians of ``p·θ`` (θ as its
    float32 value) for |p| ≤ 2^24, and is the plain product, bit for bit, for
    |p| < 256.
    """
    p = as_positions(positions)
    p = p.astype(jnp.promote_types(p.dtype, jnp.int32))
    a = jnp.abs(p)  # split |p|: the bytes of a small negative p would be large
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    term = lambda part, freq: part.astype(jnp.float32)[..., None] * freq
    angle = (
        term(a >> 16, _wrapped(inv_freq * 65536.0))
        + term((a >> 8) & 0xFF, _wrapped(inv_freq * 256.0))
    ) + term(a & 0xFF, inv_freq)
    return jnp.where((p < 0)[..., None], -angle, angle)


def rotary_tables(
    positions, head_dim: int, *, theta: float = 10000.0, log_scale=None, inv_freq=None, scale=None
):
    """The tables of a rotation by ``positions·θ_i``, for :func:`apply_rotary`.

    Args:
      positions: integers ``[..., seq]``.
      head_dim: d, even.
      log_scale: optional float32 ``[d/2]``; pair i is also multiplied by
        ``exp(positions · log_scale[i])`` (XPOS's ζ_i^(±p/b)).
      inv_freq: optional float32 ``[d/2]`` frequencies replacing θ_i (an
        inference-time extension's, :func:`rope_scaling`; zeros: no rotation).
      scale: optional scalar multiplying every entry (YaRN's √(1/t)).

    Returns:
      ``(cos, sin)``, float32 ``[..., seq, 1, d/2]`` (broadcast over heads):
      ``c_i`` and ``s_i`` of pair i, times its scale. They depend only on the
      positions, so a forward computes them once and every layer reuses them.
    """
    _check_head_dim(head_dim)
    positions = as_positions(positions)
    if inv_freq is None:
        inv_freq = jnp.asarray(rotary_frequencies(head_dim, theta), jnp.float32)
    pos = positions.astype(jnp.float32)[..., None, None]  # [..., seq, 1, 1]
    angle = angles(positions, inv_freq)[..., None, :]  # [..., seq, 1, d/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if log_scale is not None:
        scale_p = jnp.exp(pos * log_scale)
        cos, sin = cos * scale_p, sin * scale_p
    if scale is not None:
        cos, sin = cos * scale, sin * scale
    return _materialize(cos), _materialize(sin)


def apply_rotary(x, cos, sin, *, halves: bool = False):
    """Rotates the interleaved pairs ``(a, b) = (x_2i, x_2i+1)`` of ``x`` by the
    tables of :func:`rotary_tables`: ``(a·c_i − b·s_i, b·c_i + a·s_i)``.
    ``halves``: the pairs are ``(x_i, x_i+d/2)`` instead, ``x`` in the layout
    :func:`to_halves` gives (the model's queries and keys: see ``halves`` in
    :func:`lexjax.attention.context`).
    Computed in float32 (float64 for a float64 ``x``, under x64: XPOS is linear
    in ``x``, so a float64 gradient check sees exact derivatives of the
    float32-rounded tables); returns ``x``'s shape ``[..., seq, heads, d]`` and dtype.

    The tables stay half width and each pair is split into its two halves,
    rather than widening the tables to ``d`` and rotating ``x·cos + swap(x)·sin``,
    which needed a swapped copy of ``x``. On a CPU the two forms measured the
    same XPOS overhead, within the noise (docs/benchmarks.md §16); splitting
    interleaved pairs there costs about twice the rotation of contiguous
    halves (§17), hence ``halves``.
    """
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if halves:
        a, b = jnp.split(x32, 2, axis=-1)
        rotated = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
        return rotated.astype(x.dtype)
    pairs = x32
    pairs = pairs.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def to_halves(x):
    """``x`` ``[..., d]`` with its interleaved pairs ``(x_2i, x_2i+1)`` moved to
    ``(x_i, x_i+d/2)``: the even entries, then the odd ones. A permutation of the
    last axis, so scores ``q·k`` are the same when both sides take it."""
    _check_head_dim(x.shape[-1])
    return x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2).swapaxes(-1, -2).reshape(x.shape)


def xpos_tables(
    positions,
    head_dim: int,
    *,
    scale_base: float = 512.0,
    theta: float = 10000.0,
    gamma: float = 0.4,
    downscale: bool = False,
    inv_freq=None,
    scale=None,
):
    """:func:`rotary_tables` of XPOS (eq. 5-6): scale ``ζ_i^(p/b)``, or ``ζ_i^(−p/b)``
    with ``downscale`` (keys). ``inv_freq`` and ``scale`` as there: zero
    frequencies give the decay without rotation (Table 4's θ_i = 0)."""
    _check_head_dim(head_dim)
    check_positive(scale_base=scale_base, gamma=gamma)
    log_zeta = jnp.log(jnp.asarray(xpos_decay_base(head_dim, gamma))) / scale_base
    return rotary_tables(
        positions,
        head_dim,
        theta=theta,
        log_scale=-log_zeta if downscale else log_zeta,
        inv_freq=inv_freq,
        scale=scale,
    )


def xpos(
    x,
    positions,
    *,
    scale_base: float = 512.0,
    theta: float = 10000.0,
    gamma: float = 0.4,
    downscale: bool = False,
):
    """XPOS (paper eq. 5-6): rotary encoding with per-dimension exponential decay.

    Args:
      x: ``[..., seq, heads, head_dim]``, any float dtype; head_dim even.
      positions: integers broadcastable to ``[..., seq]``.
      scale_base: b; queries are scaled by ``ζ_i^(p/b)``, keys by ``ζ_i^(-p/b)``.
        Must match between training and inference. ``inf`` gives RoPE (ζ^0 = 1).
      theta: rotation base; θ_i = theta^(-2i/d).
      gamma: ζ_i = (2i/d + γ)/(1 + γ).
      downscale: False for queries, True for keys; a Python bool (under
        ``jax.jit``, mark it static: ``static_argnames="downscale"``).
        ``scale_base``, ``theta`` and ``gamma`` may be traced.

    Returns:
      ``x`` encoded, same shape and dtype.

    Safe range: the key scale grows like ``3.5^(|p|/b)`` (γ = 0.4), so |p| must
    stay below ``max_safe_position(scale_base, gamma, dtype)`` — about 3.3·b for
    float16 results and 65·b for float32/bfloat16 (keys of magnitude ≤ 1000). Scores depend only on
    ``m − n``, so callers shift both position sets to keep |p| small: lexjax's
    model uses window-relative positions under blockwise attention and centred
    positions otherwise. Concrete positions whose scale overflows ``x``'s dtype
    (|p| > ``max_safe_position(scale_base, gamma, x.dtype, margin=1)``, about 70·b
    in float32, 8.9·b in float16) raise ValueError; traced ones are not checked.
    """
    try:  # 1, np.True_ and a concrete jnp bool work as before; "False" and 0.5 do not
        flag = np.ndim(downscale) == 0 and not isinstance(downscale, str)
        flag = flag and downscale in (True, False)
    except jax.errors.TracerBoolConversionError:
        raise ValueError(
            f"downscale must be a Python bool, got {downscale!r}; pass one (under jax.jit, "
            'mark it static: static_argnames="downscale")'
        ) from None
    if not flag:
        raise ValueError(f"downscale must be a bool (True for keys), got {downscale!r}")
    downscale = bool(downscale)
    x, positions = _check_positions(x, positions)
    tables = xpos_tables(
        positions, x.shape[-1], scale_base=scale_base, theta=theta, gamma=gamma, downscale=downscale
    )
    _check_xpos_range(positions, scale_base, gamma, x.dtype)
    return apply_rotary(x, *tables)


def _check_xpos_range(positions, scale_base, gamma, dtype) -> None:
    """ValueError where concrete positions put XPOS's scale ζ_0^(±p/b) out of the
    result dtype's range (inf, or 0 for a query far ahead): the encoding is then
    NaN, inf or zero. Traced values are not checked (the model centres its positions)."""
    try:
        limit = max_safe_position(scale_base, gamma, dtype, margin=1.0)
        flat = np.asarray(positions, np.int64).ravel()
        farthest = int(flat[np.argmax(np.abs(flat))]) if flat.size else 0
        beyond = bool(abs(farthest) > limit)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if beyond:
        raise ValueError(
            f"position {farthest} is beyond XPOS's range in {jnp.dtype(dtype).name} (|p| ≤ "
            f"{int(limit)} with this scale_base: ζ^(±p/b) overflows); scores depend only on "
            "m − n, so subtract one offset from both the query and the key positions"
        )


def rope(x, positions, *, theta: float = 10000.0):
    """Rotary position embedding (Su et al. 2021): XPOS with ζ = 1.

    Same shapes, pair layout and numerics as :func:`xpos`; no decay, so no
    position overflows. The angles ``p·θ_i`` are within 2·10⁻⁴ radians of the
    exact product for |p| ≤ 2^24 (:func:`angles`); beyond, within |p|·2⁻³⁷
    radians.
    """
    x, positions = _check_positions(x, positions)
    _check_head_dim(x.shape[-1])
    return apply_rotary(x, *rotary_tables(positions, x.shape[-1], theta=theta))


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes m_h = 2^(-8h/H), h = 1..H (Press et al. 2022).

    When H is not a power of two, the first 2^⌊log2 H⌋ slopes are those of that
    power of two and the rest are every other slope of the next power of two,
    as in the ALiBi paper's reference code.
    """
    num_heads = positive_int("num_heads", num_heads)  # not 4.5, which gave 4 heads

    def power_of_two(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    base = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(base)
    if base < num_heads:
        slopes += power_of_two(2 * base)[0::2][: num_heads - base]
    return np.asarray(slopes, np.float32)


def alibi_bias(num_heads: int, q_positions, k_positions):
    """ALiBi logit bias ``-m_h · (i − j)`` → ``[..., heads, q, k]`` float32.

    ``q_positions`` ``[..., q]`` and ``k_positions`` ``[..., k]`` are integers.
    Only meaningful under a causal mask (for j > i the bias is positive).
    """
    q_positions = as_positions(q_positions, "q_positions")
    k_positions = as_positions(k_positions, "k_positions")
    distance = (q_positions[..., :, None] - k_positions[..., None, :]).astype(jnp.float32)
    slopes = jnp.asarray(alibi_slopes(num_heads))
    return -slopes[:, None, None] * distance[..., None, :, :]


def sinusoidal(positions, dim: int):
    """Absolute sinusoidal embedding (Vaswani et al. 2017) → ``[..., dim]`` float32.

    Interleaved: ``PE[p, 2i] = sin(p·10000^(-2i/d))``, ``PE[p, 2i+1] = cos(…)``.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal embedding dim must be even, got {dim}")
    positions = as_positions(positions)
    inv_freq = jnp.asarray(10000.0 ** (-2.0 * np.arange(dim // 2) / dim), jnp.float32)
    angle = angles(positions, inv_freq)  # accurate at large positions, as RoPE's
    return jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1).reshape(*positions.shape, dim)
