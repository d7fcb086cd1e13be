"""lexjax: the Length-Extrapolatable Transformer (Sun et al. 2022) in JAX/Flax.

The public API is what this module exports; every other module is internal and
may change between versions.

**Pure functions** (jnp in, jnp out; shapes in each docstring):
`xpos`, `rope`, `alibi_bias`, the attention masks in `masks`, and attention
resolution and expected-score curves (Figure 1) in `resolution`.

**The model**: `Decoder`, a Flax Linen module over token ids (UTF-8 bytes, or a
run's SentencePiece pieces), and `blockwise`: its key/value cache (`KVCache`) and
the block step and scan of blockwise causal attention, for loops of your own.

**Verbs** (what ``train.py`` and ``eval.py`` run):

    config = lexjax.make_config({"train_len": 64, "num_train_steps": 200})
    lexjax.train(config, "runs/nb")        # checkpoints, metrics.jsonl, progress
    run = lexjax.load("runs/nb")           # params, config, tokenizer
    run.evaluate([64, 256, 1024])          # perplexity with and without BCA
    run.generate("def ", max_new_tokens=1000)

Errors a user can cause through the programs and this API (configs, files,
workdirs, evaluation settings) are `LexjaxError`s with a one-line message; the
pure functions (`xpos`, the masks, `attention`) raise a plain `ValueError` for
an argument outside their domain (a shape, an odd head_dim), as jax.numpy does.

``import lexjax`` loads nothing else: each name imports its module (and JAX)
when first used.
"""

import importlib

__version__ = "0.1.0"

# name → the module that defines it (None: the name is a submodule).
_EXPORTS = {
    "xpos": "lexjax.positions",
    "rope": "lexjax.positions",
    "alibi_bias": "lexjax.positions",
    "masks": None,
    "attention": None,
    "resolution": None,
    "Decoder": "lexjax.model",
    "blockwise": None,
    "Config": "lexjax.config",
    "make_config": "lexjax.api",
    "train": "lexjax.api",
    "load": "lexjax.api",
    "Run": "lexjax.api",
    "Tokenizer": "lexjax.data",
    "LexjaxError": "lexjax.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lexjax' has no attribute {name!r}")
    module = _EXPORTS[name]
    if module is None:
        return importlib.import_module(f"lexjax.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted({*globals(), *__all__})
