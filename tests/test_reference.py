"""lexjax's XPOS and attention against the reference implementation, microsoft/torchscale.

Two kinds of test:

* default (no torch needed): compare lexjax with the golden fixtures in
  ``tests/golden/xpos_reference.npz``, made by ``tests/reference/make_golden.py``;
* live, marked ``reference`` (deselected by default; run with
  ``python -m pytest -q -m reference tests`` after
  ``bash tests/reference/install.sh <python>``): run torchscale on fresh inputs.

What is compared. torchscale's ``XPOS`` rotates token j of a call with
``offset`` o by ``(o + j)·θ`` but scales it by ``ζ^((o + j + c)/b)`` with a
centring shift ``c = ⌊−(L + o)/2⌋``; lexjax uses one position for both. So
single encoded vectors differ by the per-dimension constant ``ζ^(c/b)``
(checked explicitly below), while the scores ``q'·k'`` — all that attention
sees — must agree as they are.

Tolerances, float32 against the float32 reference (both sides compute angles
and scales in float32):

* scores: ``|Δs| ≤ 1e-5 · Σ_i |q'_i k'_i|`` elementwise. A score is a sum of d
  products of either sign, so its rounding error scales with that sum, not
  with ``|s|`` (a score near 0 from cancelling terms is no more accurate
  than its terms). Observed: at most 1.3e-6 of the sum (about 2e-5 absolute
  for d = 64..128, scores up to 50). Still tight: perturbing lexjax's γ by
  0.01, θ by 0.1 %, b by 0.2 % or the query positions by 1 fails every
  fixture case.
* encoded vectors, attention probabilities and outputs: ``rtol = atol = 1e-5``.

Bfloat16 inputs against the float32 reference (live): ``|Δs| ≤ 2⁻⁶ · Σ_i
|q'_i k'_i|`` — four bfloat16 roundings (q, k, q', k') of unit roundoff 2⁻⁸
each, a worst-case bound (observed: at most 4.6e-3 of the sum).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import attention, masks, positions

HERE = pathlib.Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "xpos_reference.npz"
RUNNER = HERE / "reference" / "make_golden.py"
RTOL = ATOL = 1e-5
SCORE_TOL = 1e-5
BF16_SCORE_TOL = 2.0**-6


def assert_scores_close(scores, expected, q_enc, k_enc, tol):
    """``|scores − expected| ≤ tol · Σ_i |q'_i k'_i|`` for every score ``[BH, Lq, Lk]``.

    ``q_enc``/``k_enc`` are either side's encoded vectors: the products
    ``|q'_i k'_i|`` are the same for both (torchscale's centring factors cancel).
    """
    bound = tol * np.einsum("bqd,bkd->bqk", np.abs(q_enc), np.abs(k_enc))
    excess = np.abs(np.asarray(scores) - expected) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert np.all(excess <= 0), (
        f"{np.sum(excess > 0)} of {excess.size} scores off by more than {tol:g}·Σ|q'k'|; "
        f"worst at {worst}: got {scores[worst]}, expected {expected[worst]}, "
        f"allowed ±{bound[worst]:.3g}"
    )


# ---------------------------------------------------------------- lexjax side
# Inputs arrive in torchscale's layouts: XPOS takes [batch*heads, seq, head_dim],
# MultiheadAttention takes [batch, seq, embed] with nn.Linear weights.


def _to_lexjax(x, dtype):
    """[BH, L, d] → [1, L, BH, d]: heads become lexjax's head axis."""
    return jnp.asarray(np.asarray(x, np.float32).transpose(1, 0, 2)[None], dtype)


def lexjax_xpos(q, k, *, scale_base, q_offset, dtype=jnp.float32, via="xpos"):
    """lexjax's XPOS on torchscale-layout q ``[BH, Lq, d]``, k ``[BH, Lk, d]``.

    Queries are at positions ``q_offset + j``, keys at ``j``. ``via="xpos"``
    calls :func:`lexjax.positions.xpos` with those positions; ``via="encode_qk"``
    goes through the attention layer's encoder (which centres the positions).
    Returns ``(q_enc [BH, Lq, d], k_enc [BH, Lk, d], scores [BH, Lq, Lk])``,
    scores in float32.
    """
    xq, xk = _to_lexjax(q, dtype), _to_lexjax(k, dtype)
    q_pos = q_offset + np.arange(xq.shape[1])
    k_pos = np.arange(xk.shape[1])
    q_enc, k_enc, scores = _encode_and_score(xq, xk, q_pos, k_pos, scale_base=scale_base, via=via)
    assert q_enc.dtype == dtype and k_enc.dtype == dtype
    q_enc, k_enc = (np.asarray(e.astype(jnp.float32))[0].transpose(1, 0, 2) for e in (q_enc, k_enc))
    return q_enc, k_enc, np.asarray(scores)[0]


@functools.partial(jax.jit, static_argnames=("scale_base", "via"))
def _encode_and_score(xq, xk, q_pos, k_pos, *, scale_base, via):
    # One compiled program per shape: much faster on CPU than op-by-op dispatch.
    if via == "xpos":
        q_enc = positions.xpos(xq, q_pos, scale_base=scale_base)
        k_enc = positions.xpos(xk, k_pos, scale_base=scale_base, downscale=True)
    elif via == "encode_qk":
        q_enc, k_enc = attention.encode_qk(
            xq, xk, q_pos, k_pos, position="xpos", scale_base=scale_base
        )
    else:
        raise ValueError(via)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q_enc, k_enc, preferred_element_type=jnp.float32)
    return q_enc, k_enc, scores


def lexjax_attention(x, weights, *, num_heads, scale_base, step):
    """lexjax's ``multihead_attention`` with torchscale's projections done in numpy.

    ``step=False``: causal self-attention over all of ``x`` ``[B, T, E]``.
    ``step=True``: only the last token queries, against keys of all T tokens
    (torchscale's incremental decoding step). Returns ``(out [B, Tq, E],
    probs [B, H, Tq, T])``.
    """
    x = np.asarray(x, np.float32)
    batch, seq, embed = x.shape
    w = {name: np.asarray(a, np.float32) for name, a in weights.items()}

    def project(name, rows):
        y = rows @ w[f"w{name}"].T + w[f"b{name}"]
        return jnp.asarray(y.reshape(batch, rows.shape[1], num_heads, embed // num_heads))

    q = project("q", x[:, -1:] if step else x)
    k, v = project("k", x), project("v", x)
    k_pos = np.arange(seq)
    q_pos = k_pos[-1:] if step else k_pos
    out, probs = _attend(q, k, v, q_pos, k_pos, scale_base=scale_base)
    out = np.asarray(out).reshape(batch, q.shape[1], embed) @ w["wo"].T + w["bo"]
    return out, np.asarray(probs)


@functools.partial(jax.jit, static_argnames=("scale_base",))
def _attend(q, k, v, q_pos, k_pos, *, scale_base):
    mask = masks.causal_by_position(q_pos, k_pos)
    out, logits = attention.multihead_attention(
        q, k, v, q_pos, k_pos, position="xpos", mask=mask, scale_base=scale_base
    )
    return out, jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)


def torchscale_centring(length, offset):
    """torchscale's shift c between the scale position and the rotation position."""
    return -(length + offset) // 2


def zeta(head_dim, gamma=0.4):
    """ζ_i = (2i/d + γ)/(1 + γ) in float64, each repeated for the pair (2i, 2i+1)."""
    i = np.arange(head_dim // 2)
    return np.repeat((2 * i / head_dim + gamma) / (1 + gamma), 2)


# ------------------------------------------------------------- golden fixtures


@functools.cache
def golden():
    """{kind: {case: {array: value}}} from the fixture file, and {"meta": {name: value}}."""
    if not GOLDEN.exists():
        raise FileNotFoundError(
            f"{GOLDEN} is missing; regenerate it with {RUNNER} (see its docstring)"
        )
    cases = {}
    with np.load(GOLDEN) as z:
        for key in z.files:
            if key.startswith("meta."):
                cases.setdefault("meta", {})[key[5:]] = z[key][()]
                continue
            kind, case, name = key.split(".")
            cases.setdefault(kind, {}).setdefault(case, {})[name] = z[key]
    return cases


XPOS_GOLDEN = sorted(golden()["xpos"])
MHA_GOLDEN = sorted(golden()["mha"])


def _case(kind, name):
    c = golden()[kind][name]
    return {
        key: (value.astype(np.float32) if value.dtype == np.float16 else value)
        for key, value in c.items()
    }


def test_golden_fixture_is_small_and_complete():
    assert GOLDEN.stat().st_size < 500 * 1024
    assert {"torch", "torchscale", "seed"} <= set(golden()["meta"])
    assert {8, 16, 64} <= {int(_case("xpos", n)["q"].shape[-1]) for n in XPOS_GOLDEN}
    assert {16, 64} <= {int(_case("xpos", n)["k"].shape[1]) for n in XPOS_GOLDEN}
    assert {128.0, 512.0} <= {float(_case("xpos", n)["scale_base"]) for n in XPOS_GOLDEN}
    assert any(int(_case("xpos", n)["q_offset"]) > 0 for n in XPOS_GOLDEN)
    assert {"causal", "step"} == {n.split("_")[0] for n in MHA_GOLDEN}


@pytest.mark.parametrize("via", ["xpos", "encode_qk"])
@pytest.mark.parametrize("name", XPOS_GOLDEN)
def test_xpos_scores_match_golden(name, via):
    c = _case("xpos", name)
    q_enc, k_enc, scores = lexjax_xpos(
        c["q"], c["k"], scale_base=float(c["scale_base"]), q_offset=int(c["q_offset"]), via=via
    )
    assert_scores_close(scores, c["scores"], q_enc, k_enc, SCORE_TOL)


@pytest.mark.parametrize("name", [n for n in XPOS_GOLDEN if "q_enc" in golden()["xpos"][n]])
def test_xpos_vectors_match_golden_up_to_torchscale_centring(name):
    c = _case("xpos", name)
    b, offset = float(c["scale_base"]), int(c["q_offset"])
    q_enc, k_enc, _ = lexjax_xpos(c["q"], c["k"], scale_base=b, q_offset=offset)
    d = q_enc.shape[-1]
    c_q = torchscale_centring(q_enc.shape[1], offset)
    c_k = torchscale_centring(k_enc.shape[1], 0)
    np.testing.assert_allclose(q_enc * zeta(d) ** (c_q / b), c["q_enc"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(k_enc * zeta(d) ** (-c_k / b), c["k_enc"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", MHA_GOLDEN)
def test_attention_matches_golden(name):
    c = _case("mha", name)
    weights = {key: c[key] for key in ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")}
    out, probs = lexjax_attention(
        c["x"],
        weights,
        num_heads=int(c["num_heads"]),
        scale_base=float(c["scale_base"]),
        step=name.startswith("step"),
    )
    np.testing.assert_allclose(probs, c["probs"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out, c["out"], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ live tests


@functools.cache
def _runner():
    spec = importlib.util.spec_from_file_location("lexjax_torchscale_runner", RUNNER)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        pytest.fail(
            f"the live reference tests need torch and torchscale ({err}); install them "
            f"with `bash tests/reference/install.sh <python>`",
            pytrace=False,
        )
    return module


@pytest.fixture
def ref():
    return _runner()


# (head_dim, Lq, Lk, q_offset, scale_base, batch*heads): fresh shapes, not in the fixtures.
XPOS_LIVE = [
    (32, 17, 17, 0, 512.0, 3),
    (128, 33, 33, 0, 64.0, 2),
    (16, 1, 300, 299, 128.0, 2),  # a decoding step 300 tokens in
    (16, 8, 40, 32, 256.0, 2),  # the last 8 queries of 40
    (8, 5, 5, 0, 16.0, 1),  # strong decay
]


@pytest.mark.reference
@pytest.mark.parametrize("via", ["xpos", "encode_qk"])
@pytest.mark.parametrize("case", XPOS_LIVE, ids=lambda c: "d{}_q{}_k{}_o{}_b{:g}".format(*c[:5]))
def test_live_xpos_scores_float32(ref, case, via):
    d, lq, lk, offset, b, bh = case
    rng = np.random.default_rng(1000 + XPOS_LIVE.index(case))
    q = rng.standard_normal((bh, lq, d)).astype(np.float32)
    k = rng.standard_normal((bh, lk, d)).astype(np.float32)
    q_ref, k_ref, scores_ref = ref.reference_xpos(q, k, scale_base=b, q_offset=offset)
    q_enc, k_enc, scores = lexjax_xpos(q, k, scale_base=b, q_offset=offset, via=via)
    assert_scores_close(scores, scores_ref, q_ref, k_ref, SCORE_TOL)
    if via == "xpos":
        factor_q = zeta(d) ** (torchscale_centring(lq, offset) / b)
        factor_k = zeta(d) ** (-torchscale_centring(lk, 0) / b)
        np.testing.assert_allclose(q_enc * factor_q, q_ref, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(k_enc * factor_k, k_ref, rtol=RTOL, atol=ATOL)


@pytest.mark.reference
@pytest.mark.parametrize("case", XPOS_LIVE, ids=lambda c: "d{}_q{}_k{}_o{}_b{:g}".format(*c[:5]))
def test_live_xpos_scores_bfloat16_inputs(ref, case):
    d, lq, lk, offset, b, bh = case
    rng = np.random.default_rng(2000 + XPOS_LIVE.index(case))
    q = rng.standard_normal((bh, lq, d)).astype(np.float32)
    k = rng.standard_normal((bh, lk, d)).astype(np.float32)
    q_ref, k_ref, scores_ref = ref.reference_xpos(q, k, scale_base=b, q_offset=offset)
    _, _, scores = lexjax_xpos(
        q, k, scale_base=b, q_offset=offset, dtype=jnp.bfloat16, via="encode_qk"
    )
    assert_scores_close(scores, scores_ref, q_ref, k_ref, BF16_SCORE_TOL)


# (kind, batch, seq, heads, head_dim, scale_base)
MHA_LIVE = [
    ("causal", 2, 20, 3, 8, 256.0),
    ("causal", 1, 48, 2, 32, 512.0),
    ("step", 1, 50, 2, 32, 512.0),
    ("step", 2, 33, 4, 16, 64.0),
]


@pytest.mark.reference
@pytest.mark.parametrize("case", MHA_LIVE, ids=lambda c: "{}_b{}_t{}_h{}_d{}_b{:g}".format(*c))
def test_live_attention(ref, case):
    kind, batch, seq, heads, head_dim, b = case
    rng = np.random.default_rng(3000 + MHA_LIVE.index(case))
    x = rng.standard_normal((batch, seq, heads * head_dim)).astype(np.float32)
    weights = ref.random_weights(rng, heads * head_dim)
    run = ref.reference_attention if kind == "causal" else ref.reference_attention_step
    out_ref, probs_ref = run(x, weights, num_heads=heads, scale_base=b)
    out, probs = lexjax_attention(x, weights, num_heads=heads, scale_base=b, step=kind == "step")
    np.testing.assert_allclose(probs, probs_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out, out_ref, rtol=RTOL, atol=ATOL)


@pytest.mark.reference
def test_live_golden_fixture_is_reproducible(ref):
    """The committed fixtures are what the installed reference computes today."""
    fresh = ref.make_golden(int(golden()["meta"]["seed"]))
    with np.load(GOLDEN) as stored:
        assert sorted(fresh) == sorted(stored.files)
        for key in stored.files:
            if key.startswith("meta."):
                continue
            np.testing.assert_allclose(
                np.asarray(fresh[key], np.float32),
                stored[key].astype(np.float32),
                rtol=RTOL,
                atol=ATOL,
                err_msg=key,
            )
