"""Every attention implementation gives the explicit path's results on every path.

The explicit path (scores materialised, masked softmax) is the reference; the
fused one is ``jax.nn.dot_product_attention`` (XLA here, cuDNN on GPUs) and
splash is the Pallas TPU kernel, run here in Pallas interpret mode. Paths:
training on packed documents (forward and gradients), training with the
explicit blockwise mask, the BCA block scan, the chunked dense evaluation
and generation.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lexjax import attention, blockwise, evaluation, generation, masks
from lexjax import model as model_lib
from lexjax.config import ConfigError
from lexjax.model import Decoder
from tests.helpers import packed_batch, small_config

IMPLS = ["fused", "splash"]


@pytest.fixture(autouse=True)
def _splash_in_interpret_mode(monkeypatch):
    """Lets the model use splash on this CPU (attention.splash_attention interprets it)."""
    monkeypatch.setattr(model_lib, "_check_splash_backend", lambda: None)


# Splash tiles by 128 tokens: train_len 256, so a BCA block is one tile.
SMALL = {
    "model.num_layers": 1,
    "model.d_model": 16,
    "model.num_heads": 2,
    "model.max_len": 256,
    "train_len": 256,
}


def _models(impl, **overrides):
    base = {**SMALL, **overrides}
    explicit = small_config(**base)
    other = small_config(**base, **{"model.attention_impl": impl})
    model = Decoder(explicit.model)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"])
    return explicit, model, Decoder(other.model), params


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("position", ["xpos", "rope", "none"])
def test_training_on_packed_documents_forward_and_gradients(impl, position):
    _, reference, model, params = _models(impl, **{"model.position": position})
    batch = {k: jnp.asarray(v) for k, v in packed_batch(np.random.default_rng(3), 2, 128).items()}

    def loss(m, p):
        logits, _ = m.apply(
            {"params": p}, batch["inputs"], batch["positions"], batch["segment_ids"]
        )
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(nll * (batch["segment_ids"] > 0)), logits

    (want, want_logits), want_grads = jax.value_and_grad(loss, 1, has_aux=True)(reference, params)
    (got, got_logits), got_grads = jax.value_and_grad(loss, 1, has_aux=True)(model, params)
    real = np.asarray(batch["segment_ids"]) > 0
    _close(np.asarray(got_logits)[real], np.asarray(want_logits)[real])
    _close(got, want)
    jax.tree.map(lambda g, w: _close(g, w, 1e-4), got_grads, want_grads)


@pytest.mark.parametrize("impl", IMPLS)
def test_training_with_the_explicit_blockwise_mask(impl):
    _, reference, model, params = _models(impl)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 258, (1, 256)), jnp.int32)
    want, _ = reference.apply({"params": params}, tokens, block=128)
    got, _ = model.apply({"params": params}, tokens, block=128)
    _close(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_block_scan_and_dense_evaluation(impl):
    config, reference, model, params = _models(impl)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 258, (1, 385)), jnp.int32)
    for run in (
        lambda m: evaluation.block_scan_logprobs(m, params, tokens, config.block),
        lambda m: evaluation.full_logprobs(m, params, tokens, chunk=config.block),
    ):
        _close(run(model), run(reference))


@pytest.mark.parametrize("impl", IMPLS)
def test_generation_greedy_tokens_match(impl):
    config, _, _, params = _models(impl)
    other = small_config(**SMALL, **{"model.attention_impl": impl})
    prompt = "def f(x):\n    return 0\n" * 20  # 260 bytes: a prefill of 3 blocks
    want = generation.complete(config, params, prompt, max_new_tokens=4, temperature=0.0)
    got = generation.complete(other, params, prompt, max_new_tokens=4, temperature=0.0)
    assert got == want


@pytest.mark.parametrize("impl", IMPLS)
def test_the_sink_scan_without_sinks_keeps_its_sliding_window(impl):
    """Sinks 0: the window group alone, a call with a cache and ``window`` but no
    sinks. Splash's static mask (bottom-right causal) has no window, so from the
    third block on its queries saw keys up to 3w back, where the window is 2w."""
    config, reference, model, params = _models(impl)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 258, (1, 384)), jnp.int32)
    emit = lambda logits, _, __: logits
    _, want = blockwise.scan_sinks(reference, params, tokens, config.block, 0, emit)
    _, got = blockwise.scan_sinks(model, params, tokens, config.block, 0, emit)
    _close(got, want)


def test_splash_kernel_against_an_explicit_mask_with_segments_and_cache_validity():
    """The kernel alone: bottom-right causal over [cache, current], invalid slots as segment 0."""
    rng = np.random.default_rng(6)
    B, T, S, H, K = 2, 128, 384, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, n, H, K)), jnp.float32) for n in (T, S, S))
    valid = jnp.asarray(rng.random((B, S)) < 0.7).at[:, S - T :].set(True)
    ctx = attention.Context(
        q_segment_ids=jnp.ones((B, T), jnp.int32), kv_segment_ids=valid.astype(jnp.int32)
    )
    got = attention.splash_attention(q, k, v, ctx, interpret=True)
    mask = (masks.causal(T, S)[None] & valid[:, None, :])[:, None]
    want = attention.attend(attention.attention_logits(q, k), v, mask)
    _close(got, want)


def test_splash_is_refused_off_a_tpu_and_with_alibi(monkeypatch):
    monkeypatch.undo()  # the real backend check
    config = small_config(**{"model.attention_impl": "splash"})
    with pytest.raises(ConfigError, match="splash is a TPU kernel and this backend is cpu"):
        Decoder(config.model).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ConfigError, match="no model.position=alibi"):
        small_config(**{"model.attention_impl": "splash", "model.position": "alibi"})


def test_a_run_trained_with_splash_is_evaluated_off_a_tpu(tmp_path, monkeypatch, capfd):
    """eval.py refused it ("splash is a TPU kernel … use fused or explicit") and has
    no flag to choose either: how attention is computed is not part of the model."""
    import lexjax
    from tests.processes import write_corpus

    files = write_corpus(tmp_path / "corpus", count=12)
    config = {
        "model": {"num_layers": 1, "d_model": 16, "num_heads": 2, "attention_impl": "splash"},
        "train_len": 256,
        "batch_size": 8,  # a row for each of the suite's 8 simulated devices
        "num_train_steps": 1,
        "eval_batches": 1,
        "data": {"name": "textfiles", "files": files, "data_dir": str(tmp_path / "tfds")},
    }
    lexjax.train(config, str(tmp_path / "run"), progress=False)  # splash, interpreted
    monkeypatch.undo()  # the real backend check: this CPU cannot run splash
    capfd.readouterr()
    run = lexjax.load(tmp_path / "run")
    assert run.config.model.attention_impl == "fused"
    assert "trained with model.attention_impl=splash" in capfd.readouterr().err
    (result,) = run.evaluate([256], modes="bca", max_length=256, max_docs=1)
    assert np.isfinite(result.perplexity)
