"""Runs the reference implementation (microsoft/torchscale) and writes golden fixtures.

The fixtures, ``tests/golden/xpos_reference.npz``, hold small fixed inputs and
what torchscale computes from them: XPOS-encoded queries/keys and their
scores ``q'·k'``, and the outputs and attention probabilities of torchscale's
``MultiheadAttention`` with XPOS (a full causal forward and one incremental
decoding step). ``tests/test_reference.py`` compares lexjax against them
without torch; its live tests (``-m reference``) import this module and run
the reference directly.

Regenerate (torch CPU wheel + torchscale without its dependencies; lexjax is
not needed here):

    python3 -m venv /tmp/venv-ref
    bash tests/reference/install.sh /tmp/venv-ref/bin/python
    /tmp/venv-ref/bin/python tests/reference/make_golden.py

The fixtures were made with torch 2.13.0 (CPU) and torchscale 0.3.0; both
versions are stored in the file (``meta.torch``, ``meta.torchscale``).

Layout: keys are ``<kind>.<case>.<array>``.

* ``xpos.<case>``: ``q`` ``[BH, Lq, d]`` and ``k`` ``[BH, Lk, d]`` (float16 on
  disk, exact: the inputs were rounded to float16 before the reference saw
  them), ``scale_base``, ``q_offset`` (the ``offset`` torchscale's
  ``XPOS.forward`` got for the queries; keys always get 0, as in its decoding
  step, and ``Lq + q_offset == Lk``), ``scores`` ``[BH, Lq, Lk]`` =
  ``XPOS(q, offset) @ XPOS(k, downscale=True)ᵀ``, and for the small cases
  ``q_enc``/``k_enc``, the encoded vectors themselves.
* ``mha.<case>``: ``x`` ``[B, T, E]``, projection weights ``wq bq wk bk wv bv
  wo bo`` (torch ``nn.Linear`` layout: ``y = x @ w.T + b``), ``num_heads``,
  ``scale_base``, ``out`` ``[B, Tq, E]`` and ``probs`` ``[B, H, Tq, Tk]``.
  Causal cases run the whole sequence with a causal mask (``Tq = Tk = T``);
  ``step`` cases run the first ``T − 1`` tokens as torchscale's first decoding
  step, then the last token alone against the cached keys, and store that
  last step (``Tq = 1``, ``Tk = T``).

Positions, as torchscale defines them: token j of a call with ``offset`` o is
rotated by ``(o + j)·θ_i`` but scaled by ``ζ_i^((o + j + c)/b)`` with the
centring shift ``c = ⌊−(L + o)/2⌋``. Only the scores are comparable with
lexjax's (which use one position for both), and they are equal because the
shift is the same for queries and keys whenever ``Lq + q_offset == Lk``.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch
from torchscale.architecture.config import DecoderConfig
from torchscale.component.multihead_attention import MultiheadAttention
from torchscale.component.xpos_relative_position import XPOS

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden" / "xpos_reference.npz"
WEIGHT_NAMES = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")


def _torch(a):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _numpy(t):
    return t.detach().to(torch.float32).numpy()


@torch.no_grad()
def reference_xpos(q, k, *, scale_base: float, q_offset: int = 0):
    """torchscale XPOS on queries ``[BH, Lq, d]`` (with ``offset=q_offset``) and keys
    ``[BH, Lk, d]`` (offset 0, ``downscale=True``) → ``(q_enc, k_enc, scores)``.

    Float32 throughout; ``scores[b] = q_enc[b] @ k_enc[b].T``.
    """
    q, k = np.asarray(q), np.asarray(k)
    if q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"q {q.shape} and k {k.shape} differ in batch or head_dim")
    if q.shape[1] + q_offset != k.shape[1]:
        raise ValueError(
            "torchscale centres queries and keys alike only when "
            f"Lq + q_offset == Lk; got {q.shape[1]} + {q_offset} != {k.shape[1]}"
        )
    module = XPOS(q.shape[-1], scale_base)
    q_enc = module(_torch(q), offset=q_offset, downscale=False)
    k_enc = module(_torch(k), offset=0, downscale=True)
    scores = torch.bmm(q_enc, k_enc.transpose(1, 2))
    return _numpy(q_enc), _numpy(k_enc), _numpy(scores)


def _attention_module(weights, num_heads: int, scale_base: float):
    embed_dim = weights["wq"].shape[0]
    args = DecoderConfig(
        decoder_embed_dim=embed_dim,
        decoder_attention_heads=num_heads,
        xpos_rel_pos=True,
        xpos_scale_base=scale_base,
    )
    module = MultiheadAttention(args, embed_dim, num_heads, dropout=0.0, self_attention=True)
    for proj in ("q", "k", "v", "o"):
        layer = getattr(module, "out_proj" if proj == "o" else f"{proj}_proj")
        layer.weight.copy_(_torch(weights[f"w{proj}"]))
        layer.bias.copy_(_torch(weights[f"b{proj}"]))
    return module.eval()


def _causal_mask(length: int):
    # torchscale's Decoder passes an additive float mask: -inf above the diagonal.
    return torch.triu(torch.full((length, length), float("-inf")), 1)


@torch.no_grad()
def reference_attention(x, weights, *, num_heads: int, scale_base: float):
    """torchscale ``MultiheadAttention`` (self-attention, XPOS, causal) on ``x`` ``[B, T, E]``
    → ``(out [B, T, E], probs [B, H, T, T])``."""
    module = _attention_module(weights, num_heads, scale_base)
    xt = _torch(x)
    with torch.no_grad():
        out, probs = module(xt, xt, xt, attn_mask=_causal_mask(x.shape[1]))
    return _numpy(out), _numpy(probs.transpose(0, 1))  # torchscale returns [H, B, T, T]


@torch.no_grad()
def reference_attention_step(x, weights, *, num_heads: int, scale_base: float):
    """torchscale's decoding: the first ``T − 1`` tokens of ``x`` ``[B, T, E]`` as the first
    step (causal, filling the key/value cache), then token ``T − 1`` alone.

    Returns the last step: ``(out [B, 1, E], probs [B, H, 1, T])``.
    """
    module = _attention_module(weights, num_heads, scale_base)
    prefix, last = _torch(x[:, :-1]), _torch(x[:, -1:])
    state = {}
    module(
        prefix,
        prefix,
        prefix,
        incremental_state=state,
        attn_mask=_causal_mask(prefix.shape[1]),
        is_first_step=True,
    )
    out, probs = module(last, last, last, incremental_state=state, is_first_step=False)
    return _numpy(out), _numpy(probs.transpose(0, 1))


def random_inputs(rng, shape):
    """Standard normal values rounded to float16, as float32 (so float16 storage is exact)."""
    return rng.standard_normal(shape).astype(np.float16).astype(np.float32)


def random_weights(rng, embed_dim: int):
    std = embed_dim**-0.5
    weights = {}
    for name in WEIGHT_NAMES:
        shape = (embed_dim, embed_dim) if name[0] == "w" else (embed_dim,)
        weights[name] = (std * rng.standard_normal(shape)).astype(np.float16).astype(np.float32)
    return weights


# (name, head_dim, Lq, Lk, q_offset, scale_base, batch*heads, store encoded vectors)
XPOS_CASES = [
    (f"d{d}_L{length}_b{b}", d, length, length, 0, float(b), 2 if length <= 17 else 1, length <= 17)
    for d in (8, 16, 64)
    for length in (16, 64)
    for b in (512, 128)
] + [
    ("d16_L17_b512_odd", 16, 17, 17, 0, 512.0, 2, True),
    ("d16_step_L64_b128", 16, 1, 64, 63, 128.0, 2, True),  # one decoding step
    ("d64_step_L40_b512", 64, 1, 40, 39, 512.0, 2, True),
    ("d16_chunk4_L24_b128", 16, 4, 24, 20, 128.0, 2, True),  # last 4 queries of 24
]

# (name, kind, batch, seq, heads, head_dim, scale_base)
MHA_CASES = [
    ("causal_b2_t16_h2_d16_b512", "causal", 2, 16, 2, 16, 512.0),
    ("causal_b1_t32_h4_d8_b128", "causal", 1, 32, 4, 8, 128.0),
    ("step_b2_t24_h2_d16_b128", "step", 2, 24, 2, 16, 128.0),
]


def make_golden(seed: int = 0) -> dict[str, np.ndarray]:
    from importlib.metadata import version

    import torchscale  # noqa: F401  (version lookup below)

    rng = np.random.default_rng(seed)
    arrays = {
        "meta.torch": np.array(torch.__version__),
        "meta.torchscale": np.array(version("torchscale")),
        "meta.seed": np.array(seed),
    }
    for name, d, lq, lk, offset, b, bh, store_enc in XPOS_CASES:
        q, k = random_inputs(rng, (bh, lq, d)), random_inputs(rng, (bh, lk, d))
        q_enc, k_enc, scores = reference_xpos(q, k, scale_base=b, q_offset=offset)
        case = {
            "q": q.astype(np.float16),
            "k": k.astype(np.float16),
            "scale_base": np.array(b),
            "q_offset": np.array(offset),
            "scores": scores,
        }
        if store_enc:
            case.update(q_enc=q_enc, k_enc=k_enc)
        arrays.update({f"xpos.{name}.{key}": value for key, value in case.items()})
    for name, kind, batch, seq, heads, head_dim, b in MHA_CASES:
        x = random_inputs(rng, (batch, seq, heads * head_dim))
        weights = random_weights(rng, heads * head_dim)
        run = reference_attention if kind == "causal" else reference_attention_step
        out, probs = run(x, weights, num_heads=heads, scale_base=b)
        case = {
            "x": x.astype(np.float16),
            "num_heads": np.array(heads),
            "scale_base": np.array(b),
            "out": out,
            "probs": probs,
        }
        case.update({key: w.astype(np.float16) for key, w in weights.items()})
        arrays.update({f"mha.{name}.{key}": value for key, value in case.items()})
    return arrays


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=GOLDEN)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    arrays = make_golden(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB, {len(arrays)} arrays; "
        f"torch {arrays['meta.torch']}, torchscale {arrays['meta.torchscale']})"
    )


if __name__ == "__main__":
    main()
