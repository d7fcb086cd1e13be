"""Small configs and batches shared by the tests (JAX compile time dominates: keep shapes small)."""

from __future__ import annotations

import numpy as np

from lexjax import config as cfg


def small_config(**overrides):
    """A 2-layer, d_model-32 model at train_len 16; ``overrides`` use dotted keys."""
    values = {
        "model": dict(
            num_layers=2, d_model=32, num_heads=4, mlp_dim=64, vocab_size=264, max_len=16
        ),
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "train_len": 16,
        "batch_size": 8,
        "num_train_steps": 4,
        "checkpoint_every": 2,
        "eval_every": 2,
        "eval_batches": 1,
        "log_every": 1,
    }
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        (values.setdefault(section, {}) if section else values)[name] = value
    return cfg.from_configdict(values)


def packed_batch(rng: np.random.Generator, batch: int, length: int, vocab: int = 258):
    """Rows of 1-3 packed documents each, in the data pipeline's format."""
    rows = {
        k: np.zeros((batch, length), np.int32)
        for k in ("inputs", "targets", "segment_ids", "positions")
    }
    for r in range(batch):
        cuts = np.sort(rng.choice(np.arange(2, length - 1), size=rng.integers(0, 3), replace=False))
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), length - int(rng.integers(0, 3))]
        for seg, (a, b) in enumerate(zip(starts, ends), start=1):
            doc = rng.integers(0, vocab, b - a + 1)
            rows["inputs"][r, a:b] = doc[:-1]
            rows["targets"][r, a:b] = doc[1:]
            rows["segment_ids"][r, a:b] = seg
            rows["positions"][r, a:b] = np.arange(b - a)
    return rows


# A 2-layer model at train_len 16 (block w = 8) for the evaluation and generation tests.
TRAIN_LEN = 16
SMALL_MODEL = cfg.ModelConfig(
    position="xpos",
    num_layers=2,
    d_model=32,
    num_heads=2,
    mlp_dim=64,
    vocab_size=40,
    scale_base=16.0,
    max_len=TRAIN_LEN,
)


def np_layer_norm(x, p):
    """LayerNorm in numpy with Flax's ε = 1e-6 (docs/design.md, "The decoder's blocks")."""
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def np_gelu(x):
    """GELU's tanh approximation (Flax's default) in numpy."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def np_nll(logits, targets):
    """−log softmax(logits)[target] at every position, in float64."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1)
    log_z = np.log(np.sum(np.exp(logits - top[..., None]), -1)) + top
    return log_z - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]


def leaves(tree: dict, prefix=""):
    """``(dotted name, value)`` of every leaf of a nested dict (a config as a dict)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value
