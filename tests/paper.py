"""The paper's equations written directly, in numpy float64, as test oracles.

Nothing here imports lexjax: each function is a loop over the symbols of an
equation (Sun et al. 2022, arXiv 2212.10554; docs/design.md "The math"), so a test
that compares a kernel with it compares two independent computations.
"""

from __future__ import annotations

import cmath
import math

import numpy as np

THETA = 10000.0
GAMMA = 0.4


def xpos(x, positions, *, scale_base=512.0, downscale=False, gamma=GAMMA, theta=THETA, freqs=None):
    """XPOS token by token: pair i, read as the complex number x[2i] + i·x[2i+1], is
    multiplied by e^{i·p·θ_i} · ζ_i^{±p/b}, with θ_i = theta^(-2i/d) and
    ζ_i = (2i/d + γ)/(1 + γ); + for queries, − for keys (``downscale``).

    ``scale_base=math.inf`` gives ζ_i^0 = 1, i.e. RoPE. ``freqs``: other θ_i
    (a RoPE extension's; zeros: no rotation). Positions may be fractional.
    """
    x = np.asarray(x, np.float64)
    *lead, seq, heads, head_dim = x.shape
    positions = np.broadcast_to(np.asarray(positions), (*lead, seq))
    sign = -1.0 if downscale else 1.0
    out = np.empty_like(x)
    for token in np.ndindex(*lead, seq):
        p = float(positions[token])
        for h in range(heads):
            for i in range(head_dim // 2):
                theta_i = theta ** (-2.0 * i / head_dim) if freqs is None else freqs[i]
                zeta_i = (2.0 * i / head_dim + gamma) / (1.0 + gamma)
                z = complex(x[token + (h, 2 * i)], x[token + (h, 2 * i + 1)])
                z *= cmath.exp(1j * p * theta_i) * zeta_i ** (sign * p / scale_base)
                out[token + (h, 2 * i)] = z.real
                out[token + (h, 2 * i + 1)] = z.imag
    return out


def rope(x, positions, *, theta=THETA, freqs=None):
    """RoPE is XPOS with ζ = 1."""
    return xpos(x, positions, scale_base=math.inf, theta=theta, freqs=freqs)


# Inference-time RoPE extensions, each from its own publication (not the LEX paper).


def pi_frequencies(head_dim, s, *, theta=THETA):
    """Position interpolation (Chen et al. 2023): f'(x, m) = f(x, m·L/L'), i.e.
    position m is read as m/s; as frequencies, θ_i/s."""
    return [theta ** (-2.0 * i / head_dim) / s for i in range(head_dim // 2)]


def ntk_frequencies(head_dim, s, *, theta=THETA):
    """NTK-aware scaling (bloc97 2023): the base b becomes b·s^(d/(d−2)); θ_i = b'^(−2i/d)."""
    new_base = theta * s ** (head_dim / (head_dim - 2))
    return [new_base ** (-2.0 * i / head_dim) for i in range(head_dim // 2)]


def dynamic_ntk_frequencies(head_dim, seq_len, train_len, *, theta=THETA):
    """Dynamic NTK as its common implementation computes it for a sequence of
    ``seq_len`` positions: the NTK base with s = seq_len/train_len when longer, else θ."""
    if seq_len <= train_len:
        return [theta ** (-2.0 * i / head_dim) for i in range(head_dim // 2)]
    return ntk_frequencies(head_dim, seq_len / train_len, theta=theta)


def yarn_frequencies(head_dim, s, train_len, *, theta=THETA, alpha=1.0, beta=32.0):
    """YaRN (Peng et al. 2023, §3.2 "NTK-by-parts"): for dimension d with wavelength
    λ_d = 2π/θ_d and r(d) = L/λ_d, h(θ_d) = (1 − γ(r))·θ_d/s + γ(r)·θ_d with the ramp
    γ(r) = 0 if r < α, 1 if r > β, else (r − α)/(β − α)."""
    out = []
    for i in range(head_dim // 2):
        theta_d = theta ** (-2.0 * i / head_dim)
        r = train_len / (2 * math.pi / theta_d)
        if r < alpha:
            ramp = 0.0
        elif r > beta:
            ramp = 1.0
        else:
            ramp = (r - alpha) / (beta - alpha)
        out.append((1 - ramp) * theta_d / s + ramp * theta_d)
    return out


def yarn_score_multiplier(s):
    """YaRN §3.4: softmax(q·k/(t·√d)) with √(1/t) = 0.1·ln(s) + 1; scores × 1/t."""
    return (0.1 * math.log(s) + 1.0) ** 2


def scores(q, k):
    """``[..., H, q, k]`` dot products q'_m · k'_n (no 1/√d) in float64."""
    return np.einsum("...qhd,...khd->...hqk", np.asarray(q, np.float64), np.asarray(k, np.float64))


def expected_xpos_score(n, head_dim, *, scale_base=512.0, gamma=GAMMA, theta=THETA):
    """Paper eq. 8: g[n] = Σ_i cos(n·θ_i)·ζ_i^(n/b); ``gamma=None`` is RoPE (ζ = 1)."""
    total = 0.0
    for i in range(head_dim // 2):
        theta_i = theta ** (-2.0 * i / head_dim)
        zeta_i = 1.0 if gamma is None else (2.0 * i / head_dim + gamma) / (1.0 + gamma)
        total += math.cos(n * theta_i) * zeta_i ** (n / scale_base)
    return total


def alibi_slopes(n):
    """ALiBi slopes as in the ALiBi paper's reference code (Press et al. 2022):
    a geometric sequence starting at 2^(-8/n) with that same ratio; for n not a power
    of two, those of the nearest lower power of two followed by every other slope
    of the next power of two."""

    def power_of_2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


def attention(q, k, v, logit_bias=None, mask=None):
    """softmax_j(q_i·k_j/√d + bias_ij over visible j) · v, head by head, row by row.

    ``mask`` and ``logit_bias`` broadcast to ``[B, H, Tq, Tk]``. A row with no
    visible key is given uniform weights (lexjax's documented choice).
    Returns (out ``[B, Tq, H, D]``, logits ``[B, H, Tq, Tk]``).
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, q_len, heads, head_dim = q.shape
    k_len = k.shape[1]
    shape = (batch, heads, q_len, k_len)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask, bool), shape)
    if logit_bias is not None:
        logit_bias = np.broadcast_to(np.asarray(logit_bias, np.float64), shape)
    logits = np.zeros(shape)
    out = np.zeros((batch, q_len, heads, v.shape[-1]))
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                row = np.array([q[b, i, h] @ k[b, j, h] for j in range(k_len)])
                row = row / math.sqrt(head_dim)
                if logit_bias is not None:
                    row = row + logit_bias[b, h, i]
                logits[b, h, i] = row
                visible = np.ones(k_len, bool) if mask is None else mask[b, h, i]
                if visible.any():
                    weights = np.where(visible, np.exp(row - row[visible].max()), 0.0)
                    weights /= weights.sum()
                else:
                    weights = np.full(k_len, 1.0 / k_len)
                out[b, i, h] = weights @ v[b, :, h]
    return out, logits
