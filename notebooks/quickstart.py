# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # lexjax quickstart: a length-extrapolatable transformer in a few minutes
#
# [lexjax](https://arxiv.org/abs/2212.10554) trains a causal language model on short
# sequences and evaluates and generates on sequences many times longer, with XPOS
# (rotary embedding with a per-dimension decay) and blockwise causal attention (BCA).
#
# This notebook uses the public Python API (`import lexjax`):
#
# 1. XPOS as a pure function: the paper's Figure 1;
# 2. train the tiny byte-level model on the Python standard library's own source;
# 3. evaluate it at 1×–16× its training length, with and without BCA;
# 4. generate text far beyond the training length.
#
# It runs on a Colab CPU, GPU or TPU runtime (*Runtime → Change runtime type*).

# %%
# Install lexjax and the JAX build for this runtime; skipped when lexjax already
# imports (a local checkout, CI). Set LEXJAX_SOURCE to the repository this notebook
# comes from: the OWNER/REPO of its Colab link.
import importlib.util
import os
import shutil
import subprocess
import sys

LEXJAX_SOURCE = "git+https://github.com/OWNER/REPO"
if importlib.util.find_spec("lexjax") is None:
    if os.path.exists("/dev/accel0") or "COLAB_TPU_ADDR" in os.environ:
        jax_package = "jax[tpu]"
    elif shutil.which("nvidia-smi"):
        jax_package = "jax[cuda12]"
    else:
        jax_package = "jax"
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-U", jax_package], check=True)
    subprocess.run([*pip, LEXJAX_SOURCE], check=True)

# %%
import jax

print(f"JAX {jax.__version__}: {jax.device_count()} × {jax.devices()[0].device_kind}")
# Training lays a data × fsdp × tensor mesh with Auto axes over every device (by
# default all on "data"): a Colab TPU shows its 8 cores here.
auto = (jax.sharding.AxisType.Auto,) * 3
print(jax.make_mesh((jax.device_count(), 1, 1), ("data", "fsdp", "tensor"), axis_types=auto))

# %% tags=["parameters"]
# Parameters. LEXJAX_SMOKE=1 shrinks every stage to seconds (CI runs it so).
SMOKE = os.environ.get("LEXJAX_SMOKE") == "1"
WORKDIR = os.path.abspath("runs/quickstart-smoke" if SMOKE else "runs/quickstart")
if SMOKE:
    OVERRIDES = {
        "model": {"num_layers": 1, "d_model": 32, "num_heads": 2, "mlp_dim": 64},
        "train_len": 32,
        "batch_size": 8,
        "num_train_steps": 10,
        "eval_every": 10,
        "eval_batches": 1,
        "log_every": 2,
    }
    EVAL_DOCS = 2
else:
    OVERRIDES = {}  # configs/tiny.py: 4.8 M parameters, train_len 256, 200 steps
    EVAL_DOCS = 20

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import numpy as np

import lexjax

# %% [markdown]
# ## 1. XPOS as a pure function
#
# `lexjax.xpos(x, positions)` encodes queries (and, with `downscale=True`, keys) of shape
# `[..., seq, heads, head_dim]`; the score `q'·k'` then depends only on the distance.
# Its expected value by distance (paper eq. 8) is `lexjax.resolution.xpos_expectation`:
# RoPE's oscillates, XPOS's decays smoothly (Figure 1).

# %%
x_1xTx1xK = jax.random.normal(jax.random.key(0), (1, 8, 1, 64))
positions_1xT = np.arange(8)[None]


def scores(positions):
    q = lexjax.xpos(x_1xTx1xK, positions)  # queries: scaled up with position
    k = lexjax.xpos(x_1xTx1xK, positions, downscale=True)  # keys: scaled down
    return np.einsum("bqhd,bkhd->bhqk", q, k)


# Scores depend on the distance only: shifting every position changes none.
print(
    "same scores at positions + 100:",
    np.allclose(scores(positions_1xT), scores(positions_1xT + 100), rtol=1e-4, atol=1e-4),
)

distances = np.arange(0, 4096)
xpos_curve = lexjax.resolution.xpos_expectation(distances, head_dim=64, scale_base=512)
rope_curve = lexjax.resolution.xpos_expectation(distances, head_dim=64, gamma=None)
plt.figure(figsize=(7, 3.5))
plt.plot(distances, rope_curve, label="RoPE", lw=0.8)
plt.plot(distances, xpos_curve, label="XPOS (b = 512)", lw=1.5)
plt.xlabel("relative distance")
plt.ylabel("expected score")
plt.title("Figure 1: expected attention score by distance (head_dim 64)")
plt.legend()
plt.show()

# %% [markdown]
# ## 2. Train the tiny model
#
# `lexjax.train(config, workdir)` is what `train.py` runs: it writes orbax checkpoints,
# `metrics.jsonl` and TensorBoard logs into the workdir and shows a progress bar.
# Running the cell again resumes (or finds the run complete). Interrupting the kernel
# finishes the current step and saves.

# %%
config = lexjax.make_config(OVERRIDES)
summary = lexjax.train(config, WORKDIR)

# %%
run = lexjax.load(WORKDIR)  # parameters, config and tokenizer of the newest good checkpoint
records = run.metrics()
train_points = [(r["step"], r["loss"]) for r in records if "loss" in r]
val_points = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
plt.figure(figsize=(7, 3.5))
plt.plot(*zip(*train_points), label="training loss")
plt.plot(*zip(*val_points), "o", label="validation loss")
plt.xlabel("step")
plt.ylabel("loss (nats per byte)")
plt.title(f"{run.config.model.position}, train_len {run.config.train_len}")
plt.legend()
plt.show()

# %% [markdown]
# ## 3. Perplexity at 1×–16× the training length, with and without BCA
#
# `run.evaluate` is `eval.py`'s evaluation: every length scores the same tokens (the
# first 16 × train_len of each held-out document), with blockwise causal attention
# (`bca`) and with plain causal attention over the whole length (`full`).

# %%
train_len = run.config.train_len
lengths = [m * train_len for m in (1, 2, 4, 8, 16)]
results = run.evaluate(lengths, max_docs=EVAL_DOCS)

plt.figure(figsize=(7, 3.5))
for mode, label in (("bca", "with BCA"), ("full", "without BCA")):
    points = sorted((r.length, r.perplexity) for r in results if r.mode == mode)
    plt.plot(*zip(*points), "o-", label=f"{run.config.model.position} {label}")
plt.axvline(train_len, color="gray", ls=":", label="training length")
plt.xscale("log", base=2)
plt.xlabel("evaluation length (tokens)")
plt.ylabel("perplexity per byte")
plt.legend()
plt.show()

# %% [markdown]
# ## 4. Generate far beyond the training length
#
# Decoding keeps a key/value cache of one training length (the BCA window), so memory
# per token is constant however long the text.

# %%
new_tokens = 16 * train_len
text = run.generate("def ", max_new_tokens=new_tokens, temperature=0.8, top_k=40, seed=0)
print(f"{len(text)} characters after the prompt (train_len {train_len} bytes):\n")
print("def " + text)

# %% [markdown]
# ## Next
#
# - The same from the command line: `python train.py --workdir=runs/tiny` and
#   `python eval.py --workdir=runs/tiny --resolution --figure`.
# - The paper's comparison at small scale (sinusoidal, ALiBi, RoPE, XPOS; with and
#   without BCA), the numbers in the README:
#   `python -m lexjax.experiments.extrapolation --out=runs/extrapolation`.
# - Paper scale on accelerators: `python train.py --config=configs/paper.py --workdir=DIR`
#   (`configs/paper.py`; `--config=configs/extrapolation.py:paper` for the comparison).
