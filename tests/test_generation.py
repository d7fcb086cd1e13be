"""Generation: token-by-token decoding over the bounded cache equals the block scan."""

import dataclasses
import functools
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import data as data_lib
from lexjax import evaluation, generation, passkey
from lexjax.errors import ConfigError, EvaluationError
from lexjax.model import Decoder
from tests.helpers import SMALL_MODEL, TRAIN_LEN, small_config

W = TRAIN_LEN // 2
CONFIG = SMALL_MODEL
RUN_CONFIG = dataclasses.replace(small_config(), model=CONFIG)  # train_len 16: block W


@pytest.fixture(scope="module")
def model_params():
    model = Decoder(CONFIG)
    params = nn.unbox(model.init(jax.random.key(1), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    return model, params


def _teacher_forced(decode, params, logits, state, tokens, prompt_len):
    """The logits after the prefill's (``logits``, ``state``) and after each later token
    but the last fed through ``decode(params, state, token_B)``: ``[B, T − prompt_len, V]``,
    the logits after tokens prompt_len−1 … T−2."""
    decoded = [logits]
    for t in range(prompt_len, tokens.shape[1] - 1):
        logits, state = decode(params, state, tokens[:, t])
        decoded.append(logits)
    return jnp.stack(decoded, axis=1)


@pytest.mark.parametrize(
    "prompt_len,scaling",
    [(1, "none"), (W + 3, "none"), (2 * W, "none"), (W + 3, "yarn"), (W + 3, "dynamic_ntk")],
)
def test_token_by_token_decoding_gives_the_scan_logits(model_params, prompt_len, scaling):
    model, params = model_params
    if scaling != "none":  # an explicit factor: every step, the scan and the mask share it
        factor = 0.0 if scaling == "dynamic_ntk" else 3.0  # dynamic: s = 1 within the window
        model = Decoder(
            dataclasses.replace(
                CONFIG, rope_scaling=scaling, rope_factor=factor, rope_train_len=TRAIN_LEN
            )
        )
    tokens = jnp.asarray(
        np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 4 * W + 3)), jnp.int32
    )
    logits, state = generation.prefill(model, params, tokens[:, :prompt_len], block=W)
    decode = jax.jit(functools.partial(generation._decode, model, block=W))
    decoded = _teacher_forced(decode, params, logits, state, tokens, prompt_len)
    targets = tokens[:, prompt_len:]
    by_decoding = jnp.take_along_axis(jax.nn.log_softmax(decoded), targets[..., None], -1)[..., 0]
    by_scan = evaluation.block_scan_logprobs(model, params, tokens, W)[:, prompt_len - 1 :]
    np.testing.assert_allclose(by_decoding, by_scan, atol=2e-5, rtol=1e-5)
    if scaling == "dynamic_ntk":  # one forward of every token takes the s of its length
        return
    # Every logit, not only the target's: the explicit blockwise mask (the scan's equal).
    explicit, _ = model.apply({"params": params}, tokens[:, :-1], block=W)
    np.testing.assert_allclose(decoded, explicit[:, prompt_len - 1 :], atol=5e-5, rtol=1e-5)
    assert state["cache"].k.shape[2] == 2 * W  # bounded, whatever the length


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
@pytest.mark.parametrize("prompt_len", [1, W + 3, 2 * W + 3])
def test_bca_decoding_of_an_absolute_encoding_gives_the_explicit_masks_logits(position, prompt_len):
    """An absolute encoding is the one kind whose first block stands elsewhere (0 … w−1,
    later blocks at w … 2w−1), so the prefill's and each step's "first block" flag
    matter only here (a relative encoding overrides them). Every logit against one
    forward under the explicit blockwise mask, token t embedded at t in block 0 and
    at w + t mod w after it (the position the block scan gives it)."""
    config = dataclasses.replace(CONFIG, position=position)
    model = Decoder(config)
    params = nn.unbox(model.init(jax.random.key(4), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    tokens = np.random.default_rng(prompt_len).integers(0, CONFIG.vocab_size, (2, 4 * W + 3))
    tokens = jnp.asarray(tokens, jnp.int32)
    logits, state = generation.prefill(model, params, tokens[:, :prompt_len], block=W)
    decode = jax.jit(functools.partial(generation._decode, model, block=W))
    decoded = _teacher_forced(decode, params, logits, state, tokens, prompt_len)
    t = np.arange(tokens.shape[1] - 1)
    positions = jnp.asarray(np.where(t < W, t, W + t % W)[None], jnp.int32)
    explicit, _ = model.apply({"params": params}, tokens[:, :-1], positions, block=W)
    np.testing.assert_allclose(decoded, explicit[:, prompt_len - 1 :], atol=5e-5, rtol=1e-5)


def test_full_mode_prefill_with_dynamic_ntk_counts_the_prompt_not_its_padding():
    """One layer, where the chunked prefill is a dense forward over the prompt: a prompt
    padded to whole chunks took dynamic NTK's s from the padding's last position."""
    config = dataclasses.replace(
        CONFIG, num_layers=1, rope_scaling="dynamic_ntk", rope_train_len=TRAIN_LEN
    )
    model = Decoder(config)
    params = nn.unbox(model.init(jax.random.key(2), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    for length in (3 * W, 3 * W + 3):  # s = 1.5, and 1.6875 (padded: 2)
        prompt = np.random.default_rng(length).integers(0, CONFIG.vocab_size, (2, length))
        logits, _ = generation._dense_prefill(model, params, prompt.astype(np.int32), W, 1)
        dense, _ = model.apply({"params": params}, jnp.asarray(prompt, jnp.int32))
        np.testing.assert_allclose(logits, dense[:, -1], atol=2e-5, rtol=1e-5, err_msg=f"{length}")


def test_dynamic_ntk_with_bca_needs_a_rope_train_len_that_covers_the_window(model_params):
    """Below 2w, decoding's s followed its query positions (0 … 2w−1) while the scan's
    stood at 2w / rope_train_len in every block: the two gave other logits."""
    _, params = model_params
    short = dataclasses.replace(CONFIG, rope_scaling="dynamic_ntk", rope_train_len=2 * W - 1)
    model = Decoder(short)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (1, 3 * W)))
    message = rf"^BCA with dynamic NTK .* needs model.rope_train_len ≥ {2 * W}, not {2 * W - 1} "
    with pytest.raises(ConfigError, match=message):
        generation.prefill(model, params, tokens[:, :3], block=W)
    with pytest.raises(ConfigError, match=message):
        evaluation.block_scan_logprobs(model, params, tokens, W)
    assert evaluation.cell_problem(short, "bca", 2 * W, 2 * W, W).startswith("BCA with dynamic")
    assert passkey.cell_problem(short, "bca", 128, block=W).startswith("BCA with dynamic")
    assert evaluation.cell_problem(short, "full", 2 * W, 2 * W, W) is None


def test_sampling_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    draw = lambda **kw: np.asarray(
        jax.vmap(lambda k: generation.sample_logits(logits, k, **kw))(keys)
    )
    assert set(draw(temperature=0.0).ravel()) == {0}
    assert set(draw(top_k=2).ravel()) == {0, 1}
    assert set(draw(top_p=0.7).ravel()) == {0, 1}  # 0.5 < 0.7 ≤ 0.8
    assert set(draw(top_p=0.4).ravel()) == {0}
    assert len(set(draw(temperature=1.0).ravel())) >= 3


def _sampling_oracle(probs, temperature=1.0, top_k=0, top_p=1.0):
    """The distribution sampling draws from, by its definitions, in float64: the
    softmax of logits/temperature, cut to the top_k most likely ids, then to the
    smallest set of most likely ids whose mass reaches top_p (nucleus sampling,
    Holtzman et al. 2020), renormalized after each cut."""
    p = np.asarray(probs, np.float64) ** (1.0 / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_k:
        p[order[top_k:]] = 0.0
        p /= p.sum()
    mass_before = np.cumsum(p[order]) - p[order]
    p[order[mass_before >= top_p]] = 0.0
    return p / p.sum()


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=2.0, top_p=0.7),  # the temperature first: 3 ids reach 0.7, not 2
        dict(temperature=0.5, top_k=3, top_p=0.9),
        dict(temperature=1.5, top_k=2),
        dict(temperature=0.7),
    ],
)
def test_sampled_frequencies_follow_the_definitions(settings):
    """4,000 draws per setting: the ids drawn are exactly the oracle's support and each
    frequency is within 4.5 standard errors of its probability."""
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = jnp.log(jnp.asarray([probs], jnp.float32))
    keys = jax.random.split(jax.random.key(1), 4000)
    drawn = np.asarray(jax.vmap(lambda k: generation.sample_logits(logits, k, **settings))(keys))
    want = _sampling_oracle(probs, **settings)
    assert set(drawn.ravel()) == set(np.flatnonzero(want))
    got = np.bincount(drawn.ravel(), minlength=len(probs)) / drawn.size
    tolerance = 4.5 * np.sqrt(want * (1 - want) / drawn.size) + 1e-12
    assert np.all(np.abs(got - want) <= tolerance), (got, want)


@pytest.mark.parametrize("top_k", [1, 2, 3, 9])
def test_a_traced_top_k_below_its_compiled_room_follows_the_definition(top_k):
    """generate() compiles top-k for a power of two of ids (k_room) and passes top_k
    as a value: 4,000 draws with top_k 1 … 3 (and 9, past the vocabulary) against
    the oracle, as above."""
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = jnp.log(jnp.asarray([probs], jnp.float32))
    keys = jax.random.split(jax.random.key(2), 4000)

    @jax.jit
    def draw(key, k):
        return generation._sample(logits, key, 0.9, k, 1.0, greedy=False, nucleus=False, k_room=4)

    drawn = np.asarray(jax.vmap(draw, in_axes=(0, None))(keys, jnp.int32(min(top_k, 4))))
    want = _sampling_oracle(probs, temperature=0.9, top_k=top_k)
    assert set(drawn.ravel()) == set(np.flatnonzero(want))
    got = np.bincount(drawn.ravel(), minlength=len(probs)) / drawn.size
    tolerance = 4.5 * np.sqrt(want * (1 - want) / drawn.size) + 1e-12
    assert np.all(np.abs(got - want) <= tolerance), (got, want)


def test_a_prompt_samples_the_same_tokens_whatever_shares_its_batch(model_params):
    """Sampling at temperature 1: a row's tokens depend on the seed, the row's index
    and its prompt, not on how many rows follow it or what they hold. (JAX's
    partitionable threefry draws each element's bits from its own index.)"""
    model, params = model_params
    prompts = jnp.asarray([[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 8]], jnp.int32)
    run = lambda p, seed=7: np.asarray(
        generation.generate(
            model, params, p, block=W, max_new_tokens=3 * W, rng=jax.random.key(seed)
        )
    )
    alone, pair, three = run(prompts[:1]), run(prompts[:2]), run(prompts)
    np.testing.assert_array_equal(alone[0], three[0])
    np.testing.assert_array_equal(pair, three[:2])
    other = run(prompts[::2])  # row 1 holds the third prompt
    np.testing.assert_array_equal(other[0], three[0])
    # Not greedy in disguise: another seed samples other tokens for the same prompt.
    assert (run(prompts[:1], seed=8)[0] != alone[0]).any()


@pytest.mark.parametrize("temperature", [1e-30, 1e-37, 1e-38, 1e-39, 1e-44, 1e-46])
def test_a_tiny_temperature_samples_the_most_likely_token(temperature):
    """softmax(logits / T) tends to the argmax as T → 0: dividing by a T that float32
    holds as subnormal or zero must not send logits to ±inf or NaN."""
    rows = jnp.asarray([[5.0, 4, 3, 1, 0, -1], [-5, -4, -3, -6, -7, -9], [90, -90, 0, 89, 3, 1]])
    for key in jax.random.split(jax.random.key(0), 20):
        drawn = generation.sample_logits(rows, key, temperature=temperature)
        np.testing.assert_array_equal(drawn, [0, 2, 0])


def test_generation_runs_far_beyond_the_training_length(model_params):
    model, params = model_params
    prompt = jnp.ones((1, 3), jnp.int32)
    out = generation.generate(
        model,
        params,
        prompt,
        block=W,
        max_new_tokens=10 * TRAIN_LEN,
        rng=jax.random.key(0),
        temperature=0.0,
    )
    assert out.shape == (1, 10 * TRAIN_LEN)
    # Greedy generation continues exactly as greedy decoding over the scan would.
    tokens = jnp.concatenate([prompt, out[:, :W]], axis=1)
    logits, _ = model.apply({"params": params}, tokens[:, :-1], block=W)
    np.testing.assert_array_equal(jnp.argmax(logits[:, 2:], -1), out[:, :W])
    with pytest.raises(ConfigError, match="top_p"):
        generation.generate(
            model, params, prompt, block=W, max_new_tokens=2, rng=jax.random.key(0), top_p=0.0
        )


@pytest.mark.parametrize("position", ["xpos", "learned"])
@pytest.mark.parametrize("prompt_len", [1, 2 * W + 3])
def test_dense_generation_is_greedy_decoding_by_causal_forwards(position, prompt_len):
    """Mode full: every generated token is the argmax of one plain causal forward over
    the prompt and the tokens before it (no window: positions 0 … P+n−1)."""
    config = dataclasses.replace(CONFIG, position=position, max_len=8 * W)
    model = Decoder(config)
    params = nn.unbox(model.init(jax.random.key(2), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(0, CONFIG.vocab_size, (2, prompt_len)).astype(np.int32)
    new = 2 * W + 1
    out = generation.generate(
        model,
        params,
        prompt,
        block=W,
        max_new_tokens=new,
        rng=jax.random.key(0),
        temperature=0.0,
        mode="full",
    )
    # Causal: the zeros after token n change nothing before it, so one shape serves all.
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens)[0])
    tokens = np.zeros((2, prompt_len + new), np.int32)
    tokens[:, :prompt_len] = prompt
    for n in range(prompt_len, prompt_len + new):
        tokens[:, n] = np.argmax(forward(tokens)[:, n - 1], -1)
    np.testing.assert_array_equal(out, tokens[:, prompt_len:])


@pytest.mark.parametrize("position", ["xpos", "learned"])
@pytest.mark.parametrize("prompt_len", [1, 2 * W + 3])
def test_dense_decoding_gives_the_logits_of_one_causal_forward(position, prompt_len):
    """Mode full token by token, teacher-forced: after the prompt and after each token
    fed, every logit equals one plain causal forward's over all the tokens so far
    (positions 0 … n−1). The greedy test above compares argmaxes only, which this
    small random model keeps even when each decoded token stands a position too far."""
    config = dataclasses.replace(CONFIG, position=position, max_len=8 * W)
    model = Decoder(config)
    params = nn.unbox(model.init(jax.random.key(2), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"])
    new = 2 * W + 1
    tokens = np.random.default_rng(prompt_len).integers(0, CONFIG.vocab_size, (2, prompt_len + new))
    tokens = jnp.asarray(tokens, jnp.int32)
    logits, state = generation._dense_prefill(model, params, tokens[:, :prompt_len], W, new)
    decode = jax.jit(functools.partial(generation._dense_decode, model))
    decoded = _teacher_forced(decode, params, logits, state, tokens, prompt_len)
    dense, _ = model.apply({"params": params}, tokens[:, :-1])
    np.testing.assert_allclose(decoded, dense[:, prompt_len - 1 :], atol=5e-5, rtol=1e-5)


def test_dense_generation_refuses_positions_a_learned_table_lacks(model_params):
    model = Decoder(dataclasses.replace(CONFIG, position="learned"))
    prompt = jnp.ones((1, TRAIN_LEN - 2), jnp.int32)
    # 14 prompt tokens + 3 > 16: the message says what fits.
    said = "max_new_tokens=3 after 14 prompt tokens without BCA: learned absolute positions "
    said += "have a table of 16; generate with mode='bca', or at most 2 new tokens"
    with pytest.raises(EvaluationError, match=re.escape(said)):
        generation.generate(
            model,
            None,
            prompt,
            block=W,
            max_new_tokens=3,
            rng=jax.random.key(0),
            temperature=0.0,
            mode="full",
        )
    # A bad argument, as every other bad argument of generate is.
    with pytest.raises(ConfigError, match="mode='sinks': generation decodes in bca or full"):
        generation.generate(
            *model_params, prompt, block=W, max_new_tokens=3, rng=jax.random.key(0), mode="sinks"
        )


@pytest.mark.parametrize("mode", ["bca", "full"])
def test_a_long_generation_shows_progress_and_its_chunks_change_no_token(
    model_params, monkeypatch, capsys, mode
):
    model, params = model_params
    sampled = dict(block=W, max_new_tokens=20, rng=jax.random.key(3), mode=mode, progress=True)
    whole = generation.generate(model, params, jnp.ones((1, 3), jnp.int32), **sampled)
    assert capsys.readouterr().err == ""  # one chunk: no display
    monkeypatch.setattr(generation, "CHUNK", 8)
    chunked = generation.generate(model, params, jnp.ones((1, 3), jnp.int32), **sampled)
    np.testing.assert_array_equal(chunked, whole)
    lines = capsys.readouterr().err.splitlines()  # not a terminal: plain lines
    assert lines[0].startswith("generated 8/20 ") and lines[-1].startswith("generated 20/20 ")


def test_a_stop_token_ends_sampling_after_its_chunk_with_the_same_tokens(model_params, monkeypatch):
    model, params = model_params
    monkeypatch.setattr(generation, "CHUNK", 8)
    sampled = dict(block=W, max_new_tokens=40, rng=jax.random.key(5))
    for batch in (1, 2):
        prompt = jnp.ones((batch, 3), jnp.int32)
        whole = np.asarray(generation.generate(model, params, prompt, **sampled))
        # Sampling stops after the chunk in which the last row samples its first stop
        # token: with one row, the token at step 2 stops it after the first chunk.
        common = set(whole[0]).intersection(*whole[1:])
        firsts = {int(t): max(int(np.argmax(row == t)) for row in whole) for t in common}
        stop = min(firsts, key=firsts.get) if batch == 2 and firsts else int(whole[0, 2])
        kept = min(8 * (firsts[stop] // 8 + 1), 40) if stop in firsts else 40
        assert batch == 2 or kept == 8
        stopped = generation.generate(model, params, prompt, **sampled, stop_token=stop)
        np.testing.assert_array_equal(stopped, whole[:, :kept])


def test_a_stop_asked_on_process_0_alone_stops_every_process_after_its_chunk(
    model_params, monkeypatch
):
    """on_chunk (eval.py --generate's: process 0's reader went away) is true on
    process 0 only; process 1 (the agreement simulated, process 0's flag given)
    stops after the same chunk, or it would decode on alone while process 0 left."""
    from lexjax import distributed

    model, params = model_params
    monkeypatch.setattr(generation, "CHUNK", 8)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(distributed, "_gather_flags", lambda own: np.array([1, int(own)]))
    seen = []
    sampled = dict(block=W, max_new_tokens=24, rng=jax.random.key(5))
    out = generation.generate(
        model, params, jnp.ones((1, 3), jnp.int32), **sampled, on_chunk=lambda t: seen.append(t)
    )
    assert len(seen) == 1 and np.shape(out) == (1, 8)


def test_complete_decodes_in_the_mode_asked():
    config = small_config()  # train_len 16 (w = 8), the bytes tokenizer's vocabulary
    model = Decoder(config.model)
    params = nn.unbox(model.init(jax.random.key(2), jnp.zeros((1, 16), jnp.int32))["params"])
    prompt = "twenty bytes or so, more than train_len"
    ids = [data_lib.BYTES.bos, *data_lib.BYTES.encode(prompt)]
    greedy = dict(max_new_tokens=8, temperature=0.0)
    full = generation.complete(config, params, prompt, mode="full", **greedy)
    out = generation.generate(
        model, params, [ids], block=8, rng=jax.random.key(0), mode="full", **greedy
    )
    assert full == data_lib.BYTES.decode(np.asarray(out)[0])
    assert full != generation.complete(config, params, prompt, **greedy)  # bca's window differs


@pytest.mark.parametrize(
    "setting",
    [
        {"seed": -1},
        {"seed": 2**32},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": 1e38},  # finite in float32, yet sampled a ruled-out id
        {"top_p": float("nan")},
        {"max_new_tokens": generation.MAX_NEW_TOKENS + 1},
        {"prompt": "ab\udcff"},  # not UTF-8 text (a byte argv held that is not)
    ],
)
def test_sampling_settings_out_of_range_are_config_errors(model_params, setting):
    name = next(iter(setting))
    setting = {"prompt": "ab", "max_new_tokens": 2} | setting
    with pytest.raises(ConfigError, match=f"^(the )?{name}"):
        generation.complete(RUN_CONFIG, model_params[1], **setting)


def test_the_largest_temperature_never_samples_a_ruled_out_id():
    """Only id 9 is allowed. At 1e38 (accepted before) XLA:CPU's division, a multiply by
    the reciprocal flushed to zero, made the others' −inf NaN, which won every draw;
    at the largest accepted temperature the reciprocal is a normal number."""
    logits = jnp.full((64, 258), -jnp.inf).at[:, 9].set(0.0)
    rng = jax.random.key(1)
    top = generation._MAX_TEMPERATURE
    assert 1 / top > np.finfo(np.float32).tiny
    assert (generation.sample_logits(logits, rng, temperature=top) == 9).all()
    for top_k, top_p in ((5, 1.0), (0, 0.5)):
        ids = generation.sample_logits(logits, rng, temperature=top, top_k=top_k, top_p=top_p)
        assert (ids == 9).all(), (top_k, top_p)
    # A top_k past int32 keeps every id (it was an OverflowError once top_k was traced).
    assert (generation.sample_logits(logits, rng, temperature=top, top_k=2**40) == 9).all()


def test_a_ruled_out_id_is_never_drawn_whatever_its_logit():
    """A NaN or +inf logit plus the −inf of the allowed-ids mask was NaN, which won every
    draw, greedy or sampled: an id the tokenizer cannot decode came out."""
    logits = jnp.array([[1.0, jnp.nan, 0.5, 0.0], [1.0, jnp.inf, 0.5, 0.0]])
    ruled_out = jnp.array([0.0, -jnp.inf, 0.0, 0.0])
    keys = jax.random.split(jax.random.key(0), 256)
    for greedy in (True, False):
        settings = {"greedy": greedy, "nucleus": False, "k_room": 0, "bias_V": ruled_out}
        ids = np.asarray(
            jax.vmap(lambda k, s=settings: generation._sample(logits, k, 1.0, 0, 1.0, **s))(keys)
        )
        assert set(ids.ravel()) <= {0, 2, 3} and (ids == 0).any(), greedy


def test_sample_logits_refuses_what_generate_refuses():
    """A negative temperature sampled from softmax(-logits), top_k=-1 and top_p=NaN
    meant no limit: sample_logits is public, and checked nothing."""
    logits, rng = jnp.zeros((1, 4)), jax.random.key(0)
    for bad, name in (
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": float("nan")}, "top_p"),
    ):
        with pytest.raises(ConfigError, match=f"^{name}"):
            generation.sample_logits(logits, rng, **bad)


def test_other_token_counts_and_sampling_values_compile_nothing_new(model_params):
    """A notebook asking for 100, then 101 tokens, or sweeping temperature, top_k or
    top_p, paid a full compilation each time (seconds, against milliseconds of
    decoding); mode full's prefill too, for each token count."""
    model, params = model_params
    prompt = jnp.ones((1, 3), jnp.int32)
    generation._compiled_generate.cache_clear()
    calls = [(100, 1.0, 0, 1.0), (101, 1.0, 0, 1.0), (70, 0.7, 0, 1.0), (90, 1.3, 0, 0.9),
             (100, 1.0, 0, 0.5), (100, 1.0, 5, 1.0), (100, 1.0, 7, 1.0),
             (90, 0.8, 6, 1.0)]  # fmt: skip
    out = {}
    for n, temperature, top_k, top_p in calls:
        out[n, temperature, top_k, top_p] = generation.generate(
            model, params, prompt, block=W, max_new_tokens=n, rng=jax.random.key(0),
            temperature=temperature, top_k=top_k, top_p=top_p,
        )  # fmt: skip
        assert out[n, temperature, top_k, top_p].shape == (1, n)
    plain = generation._compiled_generate(model, W, False, 0, False, "bca")
    nucleus = generation._compiled_generate(model, W, False, 0, True, "bca")
    top_8 = generation._compiled_generate(model, W, False, 8, False, "bca")
    assert generation._compiled_generate.cache_info().currsize == 3
    assert (plain._cache_size(), nucleus._cache_size(), top_8._cache_size()) == (1, 1, 1)
    # The same keys: 101 tokens begin with the 100, and the values still matter.
    np.testing.assert_array_equal(out[101, 1.0, 0, 1.0][:, :100], out[100, 1.0, 0, 1.0])
    assert not np.array_equal(out[100, 1.0, 0, 0.5], out[100, 1.0, 0, 1.0])
    assert not np.array_equal(out[100, 1.0, 5, 1.0], out[100, 1.0, 7, 1.0])
    generation._compiled_dense_prefill.cache_clear()
    for n in (50, 60):
        generation.generate(model, params, prompt, block=W, max_new_tokens=n,
                            rng=jax.random.key(0), mode="full")  # fmt: skip
    assert generation._compiled_dense_prefill.cache_info().currsize == 1


def test_prompts_of_several_block_counts_share_one_prefill_compilation(model_params):
    """A compilation per number of prompt blocks: a server with prompts up to 32k
    tokens at w = 512 compiled up to 64 prefills. Padded to a power of two of blocks,
    prompts of 5 … 8 blocks share one, with the state and logits of their own length."""
    model, params = model_params
    generation._compiled_prefill.cache_clear()
    run = generation._compiled_prefill(model, W)
    prompt = jax.random.randint(jax.random.key(3), (1, 8 * W + 1), 0, CONFIG.vocab_size)
    for length in (4 * W + 1, 6 * W, 8 * W - 3, 8 * W):
        logits, state = generation.prefill(model, params, prompt[:, :length], block=W)
        # Against the block scan's own log-probabilities of the same prefix.
        scanned = evaluation.block_scan_logprobs(model, params, prompt[:, : length + 1], W)
        np.testing.assert_allclose(
            jax.nn.log_softmax(logits)[0, prompt[0, length]], scanned[0, -1], rtol=1e-5
        )
        assert int(state["filled"]) == length - (-(-length // W) - 1) * W
    assert run._cache_size() == 1


def test_a_servers_requests_of_one_bucket_compile_nothing_after_the_first(model_params):
    """Each new max_new_tokens compiled six small operations (its keys, their padding,
    the output's cut) and each prompt length a pad, every one kept for the process's
    life: a service's memory grew by ~9 MiB per token count it was asked for."""
    model, params = model_params
    compiles = []

    def count(name, *_, **__):
        compiles.append(name == "/jax/core/compile/backend_compile_duration")

    prompt = np.arange(1, W, dtype=np.int32)[None]  # a numpy prompt, as complete() makes
    ask = lambda n, p: generation.generate(
        model, params, prompt[:, :p], block=W, max_new_tokens=n, rng=jax.random.key(n)
    )
    first = ask(100, 5)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        out = {n: ask(n, p) for n, p in ((101, 7), (120, 3), (127, W - 1), (100, 5))}
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert sum(compiles) == 0
    assert {n: o.shape for n, o in out.items()} == {n: (1, n) for n in out}
    np.testing.assert_array_equal(out[100], first)


def test_keys_split_in_a_power_of_two_only_where_a_split_is_a_prefix_of_a_longer_one():
    """generate() splits a power of two of keys and uses the first max_new_tokens: the
    same keys as a split of max_new_tokens only under partitionable threefry (JAX's
    default), which this checks of JAX; rbg keys keep the split of max_new_tokens."""
    key = jax.random.key(7)
    short, long = jax.random.split(key, 100), jax.random.split(key, 128)
    assert generation._prefix_stable(key)
    np.testing.assert_array_equal(jax.random.key_data(short), jax.random.key_data(long)[:100])
    assert not generation._prefix_stable(jax.random.key(7, impl="rbg"))


def test_a_prompt_sharded_over_the_mesh_gives_tokens_sharded_as_it(model_params):
    """The tokens are joined on the host (no compilation per max_new_tokens) and put
    back as the chunks were: rows split over the devices, as the prompt's."""
    model, params = model_params
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    prompt = jax.device_put(jnp.arange(24, dtype=jnp.int32).reshape(8, 3) % 50, rows)
    out = generation.generate(model, params, prompt, block=W, max_new_tokens=21,
                              rng=jax.random.key(0))  # fmt: skip
    alone = generation.generate(model, params, np.asarray(prompt), block=W, max_new_tokens=21,
                                rng=jax.random.key(0))  # fmt: skip
    assert out.shape == (8, 21) and len(out.sharding.device_set) == 8
    assert {shard.data.shape for shard in out.addressable_shards} == {(1, 21)}
    np.testing.assert_array_equal(out, alone)


def test_only_allowed_ids_are_sampled(model_params):
    """The model's vocabulary is padded past the tokenizer's, and BOS is no text:
    sampling them gave fewer characters than asked, silently (decode drops them)."""
    model, params = model_params
    vocab = model.config.vocab_size
    allowed = np.zeros(vocab, bool)
    allowed[[5, 7]] = True
    for temperature in (0.0, 1.0, 5.0):
        tokens = generation.generate(
            model, params, jnp.ones((2, 3), jnp.int32), block=W, max_new_tokens=40,
            rng=jax.random.key(0), temperature=temperature, allowed_V=allowed,
        )  # fmt: skip
        assert set(np.unique(tokens)) <= {5, 7}, temperature
    sampleable = data_lib.BYTES.sampleable(320)  # a run's model: 258 ids padded to 320
    assert sampleable[:256].all() and sampleable[data_lib.EOS] and sampleable.sum() == 257
    # A mask allowing nothing sampled id 0 every time, silently; a wrong length
    # broadcast or failed deep in the compiled step.
    for bad in (np.zeros(vocab, bool), np.ones(vocab - 1, bool), np.ones((1, vocab), bool)):
        with pytest.raises(ConfigError, match=rf"allowed_V \(shape .*must be a bool \[{vocab}\]"):
            generation.generate(
                model, params, jnp.ones((1, 3), jnp.int32), block=W, max_new_tokens=4,
                rng=jax.random.key(0), allowed_V=bad,
            )  # fmt: skip


def _stream_in_pieces(tokenizer, ids, rng, most=3):
    """Feeds ``ids`` to a TextStream in random pieces of 1-6 ids. Returns the text
    given after each piece, all of it joined with the flush's, and how many ids had
    been fed after each piece."""
    stream, pieces = generation.TextStream(tokenizer), []
    cuts = np.cumsum(rng.integers(1, 7, size=len(ids)))
    cuts = [*cuts[cuts < len(ids)], len(ids)]
    for start, stop in zip([0, *cuts], cuts):
        pieces.append(stream.add(ids[start:stop]))
        assert len(stream.waiting) <= most  # at most an unfinished character waits
    return pieces, "".join(pieces) + stream.flush(), cuts


def test_a_text_stream_joins_to_the_decoded_text_however_the_ids_are_split():
    """The oracle is each tokenizer's decoding of the ids (up to the first EOS)."""
    text = "naïve café, 東京 and 🙂 ok\n" * 3  # characters of 1, 2, 3 and 4 UTF-8 bytes
    lines = [f"plain ascii line {i} with words and numbers {i * 7}" for i in range(300)]
    subword = data_lib.tokenizer.train_sentencepiece(lines, 300)  # 東, 🙂: byte pieces
    rng = np.random.default_rng(0)
    for tokenizer in (data_lib.BYTES, subword):
        ids = tokenizer.encode(text).astype(np.int64)
        assert len(ids) > 20
        assert tokenizer.utf8(ids) == text.encode() and tokenizer.num_bytes(ids) == len(
            text.encode()
        )
        for _ in range(20):
            pieces, joined, cuts = _stream_in_pieces(tokenizer, ids, rng)
            assert joined == tokenizer.decode(ids) == text
            for k, cut in enumerate(cuts):  # a character is given as soon as it is whole
                assert "".join(pieces[: k + 1]) == tokenizer.decode(ids[:cut]).rstrip("\ufffd")
        # An EOS ends the text; what follows it is never given.
        with_eos = np.concatenate([ids[:7], [tokenizer.eos], ids[7:]])
        _, joined, _ = _stream_in_pieces(tokenizer, with_eos, rng)
        assert joined == tokenizer.decode(ids[:7])
    # Bytes that are not UTF-8 (a stray continuation byte, 0xFF, a cut sequence) are
    # U+FFFD as in the whole decoding, also where a piece ends with them.
    ids = np.array([104, 105, 0x80, 0xFF, 0xE6, 0x9D, 104, 0xE6, 0x9D, 0xB1, 0xC3], np.int64)
    for _ in range(20):
        _, joined, _ = _stream_in_pieces(data_lib.BYTES, ids, rng)
        assert joined == data_lib.BYTES.decode(ids) == "hi\ufffd\ufffd\ufffdh東\ufffd"
    # Ids without bytes (BOS, past the vocabulary) inside a character do not cut it.
    for ids in ([0xF0, 0x9F, 0x99, 256, 0x82, 104], [0xE6, 300, 300, 300, 0x9D, 0xB1]):
        ids = np.array(ids, np.int64)
        for _ in range(10):
            _, joined, _ = _stream_in_pieces(data_lib.BYTES, ids, rng, most=len(ids))
            assert joined == data_lib.BYTES.decode(ids)
    # A byte that never starts a character is U+FFFD at once; a cut one waits.
    assert generation.TextStream(data_lib.BYTES).add([104, 0xFF]) == "h\ufffd"
    assert generation.TextStream(data_lib.BYTES).add([104, 0xE6, 0x9D]) == "h"
    # Long runs of such bytes (as an untrained model writes) stream too, in both
    # tokenizers (the subword one's byte-fallback pieces, among whole-text pieces).
    some = [0xC3, 0xE6, 0xF0, 0x80, 0x9D, 0xB1, 0xA9, 0xFF, 104]
    pieces_of = {b: subword._sp.piece_to_id(f"<0x{b:02X}>") for b in some}
    for tokenizer, choices in (
        (data_lib.BYTES, some),
        (subword, [*pieces_of.values(), *subword.encode("plain line 7 é")]),
    ):
        ids = rng.choice(choices, size=500).astype(np.int64)
        for _ in range(5):
            _, joined, _ = _stream_in_pieces(tokenizer, ids, rng)
            assert joined == tokenizer.decode(ids)


def test_text_handed_on_as_it_comes_draws_no_progress_over_it(capsys):
    """`run.generate(..., on_text=functools.partial(print, end=""))` on a terminal: the
    progress display's line, redrawn from column 0 every 64 tokens, wrote over the text
    printed on it, though the docstring promised a display only past 1024 tokens. The
    text is its own progress; progress=True still asks for the display (eval.py's
    --generate into a file)."""
    config = small_config()
    model = Decoder(config.model)
    params = nn.unbox(model.init(jax.random.key(2), jnp.zeros((1, 16), jnp.int32))["params"])
    sampled = dict(max_new_tokens=100, seed=0, temperature=0.0)
    pieces = []
    text = generation.complete(config, params, "ab", on_text=pieces.append, **sampled)
    assert "".join(pieces) == text
    assert capsys.readouterr().err == ""
    generation.complete(config, params, "ab", on_text=pieces.append, progress=True, **sampled)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("generated 64/100 ") and lines[-1].startswith("generated 100/100 ")


def test_complete_hands_on_the_text_chunk_by_chunk(monkeypatch):
    config = small_config()
    model = Decoder(config.model)
    params = nn.unbox(model.init(jax.random.key(2), jnp.zeros((1, 16), jnp.int32))["params"])
    monkeypatch.setattr(generation, "CHUNK", 8)
    for seed in range(3):
        pieces = []
        sampled = dict(max_new_tokens=40, seed=seed, progress=False)
        text = generation.complete(config, params, "ab", on_text=pieces.append, **sampled)
        assert "".join(pieces) == text == generation.complete(config, params, "ab", **sampled)
        assert 1 < len(pieces) <= 40 // 8 + 1  # at most one per chunk, and the flush's

    # A true return (a reader that went away) ends the writing after that chunk.
    calls = []

    def went_away(piece: str) -> bool:
        calls.append(piece)
        return True

    cut = generation.complete(config, params, "ab", on_text=went_away, **sampled)
    assert cut == "".join(calls) and text.startswith(cut), (cut, text)
    assert len(cut.encode()) <= 2 * 8 < len(text.encode()), (cut, text)  # a piece, a flush
    # numpy's True stops too (a vectorised check of the text).
    calls.clear()
    stopped = generation.complete(
        config, params, "ab", on_text=lambda piece: calls.append(piece) or np.True_, **sampled
    )
    assert stopped == cut == "".join(calls)
    # A writer's count is not a stop: sys.stdout.write or a file's write streamed only
    # the first chunk and returned it as the whole text.
    written = io.StringIO()
    assert generation.complete(config, params, "ab", on_text=written.write, **sampled) == text
    assert written.getvalue() == text


@pytest.mark.parametrize("mode", ["bca", "full"])
def test_each_chunk_writes_its_state_into_the_buffers_of_the_one_it_replaces(model_params, mode):
    """Mode full's cache grows with the text: a chunk that kept the old state beside
    the new one would hold it twice. XLA's account of the compiled chunk shows the
    logits and the state aliased to their inputs (donated)."""
    model, params = model_params
    prompt = jnp.ones((2, 3), jnp.int32)
    if mode == "bca":
        logits, state = generation.prefill(model, params, prompt, block=W)
    else:
        logits, state = generation._dense_prefill(model, params, prompt, W, 64)
    run = generation._compiled_generate(model, W, False, 0, False, mode)
    zeros_V = jnp.zeros(CONFIG.vocab_size, jnp.float32)
    sampling = jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0), zeros_V  # temperature … bias
    keys = jax.random.split(jax.random.key(0), 16)
    compiled = run.lower(params, logits, state, keys, *sampling).compile()
    carried = sum(x.nbytes for x in jax.tree.leaves((logits, state)))
    assert compiled.memory_analysis().alias_size_in_bytes >= carried
