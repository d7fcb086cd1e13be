"""Passkey retrieval: samples, the scorer, the training mix, the evaluation and its files."""

import json
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import data as data_lib
from lexjax import generation, passkey, training
from lexjax.config import ConfigError
from lexjax.errors import EvaluationError
from lexjax.model import Decoder
from tests.helpers import small_config
from tests.processes import write_corpus

# The format as the task states it, written out here rather than read from the module.
KEY_LINE = "\nThe pass key is {}.\n"
QUESTION = "\nWhat is the pass key? The pass key is "
SENTENCE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
FORMAT_BYTES = 1 + len(KEY_LINE.format("12345")) + len(QUESTION) + 5  # BOS, key line, question, key


# 98 and 100: 29 and 31 filler bytes, so depth 0.5 cuts at 14.5 and 15.5; at 14.5 halves
# rounded up (15) and to even (14, Python's round) differ, at 15.5 (and 465.5) they agree.
@pytest.mark.parametrize("length", [FORMAT_BYTES, 98, 100, 257, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_a_byte_sample_is_exact_deterministic_and_hides_the_key_at_its_depth(length, depth):
    sample = passkey.make_sample([7, 3], length, depth)
    again = passkey.make_sample([7, 3], length, depth)
    np.testing.assert_array_equal(sample.prompt, again.prompt)
    np.testing.assert_array_equal(sample.answer, again.answer)
    assert len(sample.prompt) + len(sample.answer) == length
    assert sample.prompt.dtype == np.int32 and sample.prompt[0] == data_lib.BOS
    assert len(sample.key) == 5 and sample.key.isdigit() and sample.key[0] != "0"
    assert data_lib.decode(sample.answer) == sample.key

    text = data_lib.decode(sample.prompt)
    assert text.endswith(QUESTION)
    line = KEY_LINE.format(sample.key)
    assert text.count(line) == 1
    before, after = text[: -len(QUESTION)].split(line)
    filler = length - FORMAT_BYTES
    assert len(before) + len(after) == filler
    # round(depth · F) filler bytes before the key line (halves rounded up).
    assert len(before) == int(np.floor(depth * filler + 0.5))
    assert before + after == (SENTENCE * (filler // len(SENTENCE) + 1))[:filler]


def test_seeds_draw_keys_and_the_same_seed_gives_the_same_key_at_every_length_and_depth():
    keys = {passkey.make_sample([0, t], 128, 0.5).key for t in range(50)}
    assert len(keys) > 45
    assert {passkey.make_sample([0, 4], n, d).key for n in (80, 300) for d in (0, 1)} == {
        passkey.make_sample([0, 4], 128, 0.5).key
    }


def test_a_token_stream_filler_is_read_cyclically_from_a_seeded_offset():
    stream = np.arange(1000, 1037, dtype=np.int32)  # ids that are not bytes: easy to find
    sample = passkey.make_sample(5, 200, 0.25, filler=stream)
    assert len(sample.prompt) + len(sample.answer) == 200
    fill = sample.prompt[(sample.prompt >= 1000)]
    assert len(fill) == 200 - FORMAT_BYTES
    start = int(fill[0] - 1000)
    np.testing.assert_array_equal(fill, 1000 + (start + np.arange(len(fill))) % 37)
    cut = int(np.floor(0.25 * len(fill) + 0.5))
    assert np.all(sample.prompt[1 : 1 + cut] >= 1000) and sample.prompt[1 + cut] < 256


def test_a_sentencepiece_sample_is_exact_in_its_tokens():
    lines = [f"{SENTENCE}{i} {i * 7} what is the pass key" for i in range(300)]
    tok = data_lib.tokenizer.train_sentencepiece(lines, 300)
    for seed in range(5):
        for depth in (0.0, 0.5, 1.0):
            sample = passkey.make_sample(seed, 150, depth, tok)
            assert len(sample.prompt) + len(sample.answer) == 150
            assert tok.decode(sample.answer) == sample.key
            text = tok.decode(sample.prompt)
            assert text.count(KEY_LINE.format(sample.key)) == 1 and text.endswith(QUESTION)
            before = text.split(KEY_LINE.format(sample.key))[0]
            filler = len(before) + len(text.split(KEY_LINE.format(sample.key))[1]) - len(QUESTION)
            assert abs(len(before) / filler - depth) < 0.1
    assert passkey.min_length(tok) <= passkey.min_length()
    row = passkey.copy_document(0, 0, 150, tok)  # copy documents too are exact in tokens
    assert len(row) == 151 and row[0] == tok.bos and row[-1] == tok.eos
    *units, _ = tok.decode(row[1:-1]).split("\n")
    assert units and all(u.split("|")[0] == u.split("|")[1] for u in units)


def test_lengths_below_the_format_and_depths_outside_zero_one_are_refused():
    with pytest.raises(EvaluationError, match="at least 69"):
        passkey.make_sample(0, 60, 0.5)
    with pytest.raises(EvaluationError, match="depth"):
        passkey.make_sample(0, 100, 1.5)


@pytest.mark.parametrize(
    "continuation,right",
    [
        ("12345", True),
        ("12345. The grass", True),  # text after the key
        ("12345\n", True),
        ("12346", False),  # a wrong digit
        ("02345", False),
        ("1234", False),  # truncated
        ("1234.", False),
        ("123456", False),  # a longer number is another number
        (" 12345", False),  # the key must come first
        ("x12345", False),
        ("", False),
    ],
)
def test_the_scorer_wants_exactly_the_key(continuation, right):
    assert passkey.is_correct(continuation, "12345") is right


def test_a_continuation_ends_at_its_first_eos():
    ids = [*data_lib.encode("12345"), data_lib.EOS, *data_lib.encode("6")]
    assert passkey.continuation_text(ids) == "12345"
    assert passkey.is_correct(passkey.continuation_text(ids), "12345")
    assert not passkey.is_correct(data_lib.decode(ids), "12345")  # without the cut: 123456


# --------------------------------------------------------------------------- the training mix


def _documents(count=300, seed=0):
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghij \n", np.uint8)
    return [rng.choice(letters, int(rng.integers(20, 600))).tobytes() for _ in range(count)]


def test_the_mix_adds_passkey_documents_and_leaves_the_source_unchanged():
    source = _documents()
    mix = passkey.PasskeyMix(source, fraction=0.2, length=80, seed=3)
    again = passkey.PasskeyMix(source, fraction=0.2, length=80, seed=3)
    assert len(mix) == len(source) + mix.count and mix.count > 0
    for i in range(len(source)):
        assert mix[i] is source[i]
    for i in range(len(source), len(mix)):
        document = mix[i]
        np.testing.assert_array_equal(document, again[i])
        assert len(document) == 81 and document[0] == data_lib.BOS and document[-1] == data_lib.EOS
        text = data_lib.decode(document)
        key = text[-5:]
        assert text.count(KEY_LINE.format(key)) == 1 and text.endswith(QUESTION + key)
    other = passkey.PasskeyMix(source, fraction=0.2, length=80, seed=4)
    assert not np.array_equal(mix[len(source)], other[len(source)])
    assert len(passkey.PasskeyMix(source, fraction=0.0, length=80)) == len(source)
    with pytest.raises(IndexError):
        mix[len(mix)]


@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_the_fraction_is_of_training_rows(fraction):
    source = _documents(400)
    mix = passkey.PasskeyMix(source, fraction=fraction, length=80)
    it = data_lib.make_train_iterator(mix, seq_len=80, batch_size=16, seed=0, num_epochs=1)
    rows = passkey_rows = 0
    for batch in it:
        for row in batch["inputs"]:
            rows += 1
            passkey_rows += "What is the pass key?" in data_lib.decode(row)
    assert rows > 500
    assert abs(passkey_rows / rows - fraction) < 0.03, (passkey_rows, rows)


def test_copy_documents_repeat_each_random_string_once_and_fill_one_row():
    rows = [passkey.copy_document(3, i, 80) for i in range(20)]
    assert all(r.dtype == np.int32 and len(r) == 81 for r in rows)
    assert all(r[0] == data_lib.BOS and r[-1] == data_lib.EOS for r in rows)
    np.testing.assert_array_equal(rows[0], passkey.copy_document(3, 0, 80))
    assert len({r.tobytes() for r in rows}) == 20
    assert not np.array_equal(rows[0], passkey.copy_document(4, 0, 80))
    spans, characters = [], set()
    for row in rows:
        *units, cut = data_lib.decode(row[1:-1]).split("\n")
        first, _, second = cut.partition("|")  # the unit the row's end cuts
        assert first.startswith(second)
        for unit in units:
            first, second = unit.split("|")
            assert first == second and set(first) <= set(passkey.COPY_ALPHABET)
            spans.append(len(first))
            characters |= set(first)
    assert min(spans) >= passkey.COPY_SPAN[0] and max(spans) < passkey.COPY_SPAN[1]
    assert len(set(spans)) > 10  # no fixed offset predicts the copy
    assert characters == set("abcdefghijklmnopqrstuvwxyz0123456789")  # a key's digits too


def test_passkey_and_copy_fractions_are_of_training_rows():
    source = _documents(400)
    mix = passkey.PasskeyMix(source, fraction=0.2, copy_fraction=0.3, length=80)
    assert mix.count > 0 and mix.copies > 0
    it = data_lib.make_train_iterator(mix, seq_len=80, batch_size=16, seed=0, num_epochs=1)
    rows = passkey_rows = copy_rows = 0
    for batch in it:
        for row in batch["inputs"]:
            rows += 1
            text = data_lib.decode(row)
            passkey_rows += "What is the pass key?" in text
            copy_rows += "|" in text
    assert rows > 500
    assert abs(passkey_rows / rows - 0.2) < 0.03, (passkey_rows, rows)
    assert abs(copy_rows / rows - 0.3) < 0.03, (copy_rows, rows)


def test_copy_fraction_out_of_range_or_leaving_no_text_is_a_config_error():
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="data.copy_fraction"):
            small_config(**{"data.copy_fraction": bad})
    with pytest.raises(ConfigError, match="sum to less than 1"):
        small_config(**{"data.copy_fraction": 0.5, "data.passkey_fraction": 0.5})
    with pytest.raises(ConfigError, match="sum to less than 1"):
        passkey.PasskeyMix(_documents(10), fraction=0.6, copy_fraction=0.4, length=80)
    # A negative passkey fraction got past both checks: a negative count of documents.
    with pytest.raises(ConfigError, match="must each be ≥ 0"):
        passkey.PasskeyMix(_documents(10), fraction=-0.1, copy_fraction=0.2, length=80)


def test_passkey_fraction_out_of_range_or_a_train_len_too_short_is_a_config_error():
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="data.passkey_fraction"):
            small_config(**{"data.passkey_fraction": bad})
    with pytest.raises(ConfigError, match="train_len=32 is below the 69 tokens") as short:
        passkey.PasskeyMix(_documents(10), fraction=0.5, length=32)
    # train_len must also be even (the block is train_len/2): the advice is 70, not 69.
    assert "use train_len ≥ 70 (even)" in str(short.value)
    small_config(**{"train_len": 70, "model.max_len": 70})  # a valid train_len


def test_training_reads_the_mix_and_validation_stays_plain(tmp_path):
    files = write_corpus(tmp_path / "corpus")
    overrides = {
        "data.name": "textfiles",
        "data.files": files,
        "data.data_dir": str(tmp_path / "tfds"),
        "train_len": 80,
        "model.max_len": 80,
    }
    plain = small_config(**overrides)
    mixed = small_config(**overrides, **{"data.passkey_fraction": 0.25})
    source = training._train_source(mixed, data_lib.BYTES)
    assert isinstance(source, passkey.PasskeyMix) and source.count > 0
    assert source.copies == 0
    assert len(source.source) == len(training._train_source(plain, data_lib.BYTES))
    copying = small_config(**overrides, **{"data.copy_fraction": 0.25})
    source = training._train_source(copying, data_lib.BYTES)
    assert isinstance(source, passkey.PasskeyMix) and source.count == 0 and source.copies > 0
    assert not isinstance(training._source(mixed, "validation"), passkey.PasskeyMix)


# --------------------------------------------------------------------------- evaluation

TRAIN_LEN = 48


@pytest.fixture(scope="module")
def model_params():
    config = small_config(train_len=TRAIN_LEN, **{"model.max_len": 4 * TRAIN_LEN})
    model = Decoder(config.model)
    params = model.init(jax.random.key(0), jnp.zeros((1, TRAIN_LEN), jnp.int32))["params"]
    return config, model, nn.unbox(params)


def test_accuracy_counts_the_keys_decoding_gives(model_params, monkeypatch):
    """A stand-in for generation that answers the key it reads in the prompt when the
    key is even, a wrong digit otherwise: the accuracy is the share of even keys."""
    config, model, params = model_params
    calls = []

    def answer(model, params, prompts, *, max_new_tokens, mode, **_):
        calls.append((mode, prompts.shape))
        out = []
        for row in np.asarray(prompts):
            key = data_lib.decode(row).split("The pass key is ")[1][:5]
            said = key if int(key) % 2 == 0 else key[:4] + str((int(key[4]) + 1) % 10)
            out.append(data_lib.encode((said + ". The grass")[:max_new_tokens]))
        return jnp.asarray(np.stack(out))

    monkeypatch.setattr(generation, "generate", answer)
    trials, depths = 7, [0.0, 0.5, 1.0]
    results = passkey.passkey_accuracy(
        model,
        params,
        block=config.block,
        lengths=[96, 144],
        depths=depths,
        trials=trials,
        seed=11,
        tokens_per_batch=4 * 96,  # 4 rows per call: the last call of a length is padded
    )
    even = sum(int(passkey.make_sample([11, t], 96, 0).key) % 2 == 0 for t in range(trials))
    assert 0 < even < trials
    assert [(r.mode, r.length, r.depth) for r in results] == [
        (m, n, d) for m in ("bca", "full") for n in (96, 144) for d in depths
    ]
    for r in results:
        assert r.trials == trials and r.accuracy == pytest.approx(even / trials)
    assert all(shape[0] == 4 for _, shape in calls if shape[1] == 96 - 5)


def test_greedy_answers_hold_only_ids_that_write_text(model_params, monkeypatch):
    """A model whose every position's logits favour the last id of its vocabulary, one
    the byte tokenizer never writes (the vocabulary is padded past its 258 ids). The
    scorer drops ids that write no text, so such ids in an answer would let '1234<id>5'
    count as key 12345: greedy decoding must keep to the ids that write text (and EOS)."""
    config, model, params = model_params
    unused = config.model.vocab_size - 1
    assert unused >= 258
    bias = np.random.default_rng(0).normal(size=config.model.d_model).astype(np.float32)
    params = jax.tree.map(np.array, params)
    params["ln_final"]["scale"][:] = 0.0  # the final features are `bias` at every position
    params["ln_final"]["bias"][:] = bias
    params["embed"]["embedding"][unused] = bias * 100.0 / (bias @ bias)  # logit 100
    logits, _ = model.apply({"params": params}, jnp.zeros((1, 8), jnp.int32))
    assert (np.asarray(logits).argmax(-1) == unused).all()
    answers = []

    def recording(*args, **kwargs):
        answers.append(np.asarray(real(*args, **kwargs)))
        return answers[-1]

    real = generation.generate
    monkeypatch.setattr(generation, "generate", recording)
    passkey.passkey_accuracy(
        model, params, block=config.block, lengths=[96], depths=[0.5], trials=2
    )
    writes_text = data_lib.BYTES.sampleable(config.model.vocab_size)
    assert len(answers) == 2 and all(writes_text[a].all() for a in answers)


def test_answer_nats_is_the_keys_negative_log_likelihood_under_a_dense_forward(model_params):
    """Without BCA, answer_nats equals −log p(key | prompt) from one plain forward pass
    of the whole sample (the model's own causal mask, no cache, no chunks); with BCA,
    from one forward under the explicit blockwise mask (``block``: no scan, no cache)."""
    config, model, params = model_params
    depths, trials = [0.0, 0.6], 3
    results = passkey.passkey_accuracy(
        model,
        params,
        block=config.block,
        lengths=[96],
        depths=depths,
        trials=trials,
        modes=("full", "bca"),
        seed=5,
    )
    for depth in depths:
        nats = {"full": [], "bca": []}
        for t in range(trials):
            sample = passkey.make_sample([5, t], 96, depth)
            tokens = jnp.asarray(np.concatenate([sample.prompt, sample.answer])[None, :-1])
            for mode, block in (("full", None), ("bca", config.block)):
                logits = model.apply({"params": params}, tokens, block=block)[0]
                logp = jax.nn.log_softmax(np.asarray(logits[0], np.float64), axis=-1)
                k = len(sample.prompt)
                nll = -sum(logp[k - 1 + i, a] for i, a in enumerate(sample.answer))
                nats[mode].append(float(nll))
        for mode in nats:
            (cell,) = [r for r in results if (r.mode, r.depth) == (mode, depth)]
            assert cell.answer_nats == pytest.approx(np.mean(nats[mode]), rel=1e-4), mode
        assert nats["bca"] != pytest.approx(nats["full"], rel=1e-3)  # 96 > train_len
    assert pytest.approx(np.log(90000)) == passkey.CHANCE_NATS


def test_cells_generation_cannot_decode_are_skipped_with_a_reason(model_params, monkeypatch):
    config, model, params = model_params
    monkeypatch.setattr(passkey.evaluation, "MODES", ("bca", "full", "sinks"))
    notes = []
    results = passkey.passkey_accuracy(
        model,
        params,
        block=config.block,
        lengths=[48, 96],
        depths=[1.0],
        trials=1,
        modes=("bca", "sinks"),
        strict=False,
        say=notes.append,
    )
    assert [(r.mode, r.length) for r in results] == [("bca", 96)]
    assert any("sinks" in n and "cannot decode" in n for n in notes)
    assert any("length 48 is below the 69 tokens" in n for n in notes)
    with pytest.raises(EvaluationError, match="mode 'nope'"):
        passkey.passkey_accuracy(model, params, block=24, lengths=[96], modes=("nope",))
    # Modes from a generator, read once: checked and then evaluated.
    once = passkey.passkey_accuracy(
        model, params, block=24, lengths=[96], depths=[0.5], trials=1, modes=iter(["bca"])
    )
    assert [(r.mode, r.length) for r in once] == [("bca", 96)]
    # The grid perplexity refuses is refused here too (no mode gave no results).
    for lengths, modes, said in (([96], (), "no mode to evaluate"), ([0, 96], ("bca",), "posi")):
        with pytest.raises(EvaluationError, match=said):
            passkey.passkey_accuracy(model, params, block=24, lengths=lengths, modes=modes)


def test_the_passkey_title_counts_one_key_as_one(model_params, tmp_path, capsys):
    """`--passkey_trials=1` printed "1 keys per cell"."""
    config, _, params = model_params
    for trials, said in ((1, "1 key per cell"), (2, "2 keys per cell")):
        passkey.evaluate_passkey(
            config, params, 5, str(tmp_path), lengths=[96], depths=[0.0], trials=trials,
            modes=["bca"],
        )  # fmt: skip
        assert f"train_len={TRAIN_LEN}): {said}, filler: " in capsys.readouterr().out


def test_evaluate_passkey_writes_the_json_the_heat_maps_and_a_table(model_params, tmp_path, capsys):
    config, _, params = model_params
    workdir = str(tmp_path / "run")
    results, written = passkey.evaluate_passkey(
        config, params, 5, workdir, lengths=[48, 96], depths=[0.0, 1.0], trials=2
    )
    out = capsys.readouterr().out
    eval_dir = os.path.join(workdir, "eval")
    names = sorted(os.path.basename(p) for p in written)
    # passkey.json, and the same under a name of its settings (step, modes, longest length).
    assert re.fullmatch(r"passkey-step5-bca\+full-budget96-[0-9a-f]{8}\.json", names[2]), names
    assert names[:2] + names[3:] == ["passkey-bca.png", "passkey-full.png", "passkey.json"]
    with open(os.path.join(eval_dir, names[2])) as a, open(os.path.join(eval_dir, names[3])) as b:
        assert json.load(a) == json.load(b)
    for name in ("passkey-bca.png", "passkey-full.png"):
        assert os.path.getsize(os.path.join(eval_dir, name)) > 1000
    with open(os.path.join(eval_dir, "passkey.json")) as f:
        summary = json.load(f)
    assert summary["train_len"] == TRAIN_LEN and summary["step"] == 5
    rows = summary["results"]
    assert {(r["mode"], r["length"], r["depth"]) for r in rows} == {
        (m, n, d) for m in ("bca", "full") for n in (96,) for d in (0.0, 1.0)
    }
    for r in rows:
        assert set(r) == {"mode", "length", "depth", "accuracy", "trials", "answer_nats"}
        assert r["trials"] == 2 and 0 <= r["accuracy"] <= 1 and r["answer_nats"] > 0
    assert {(s["mode"], s["length"]) for s in summary["skipped"]} == {("bca", 48), ("full", 48)}
    assert "| xpos with BCA: depth | 48 | 96 |" in out
    assert "| xpos without BCA: depth | 48 | 96 |" in out
    assert "— bca 48: length 48 is below the 69 tokens of the format" in out
    assert len(results) == len(rows)

    other = str(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"of the format; use lengths of at least 69$"):
        passkey.evaluate_passkey(config, params, 5, other, lengths=[48, 64], trials=1)
    with pytest.raises(ConfigError, match=r"seed=-1 must be an integer in \[0, 2\*\*32\)"):
        passkey.evaluate_passkey(config, params, 5, other, lengths=[96], trials=1, seed=-1)
    with pytest.raises(ConfigError, match=r"^trials=2.5 must be a positive integer"):
        passkey.evaluate_passkey(config, params, 5, other, lengths=[96], trials=2.5)
    with pytest.raises(ConfigError, match=r"depths must be in \[0, 1\]"):  # NaN sorts anywhere
        passkey.evaluate_passkey(config, params, 5, other, lengths=[96], depths=[0, np.nan, 1])
    assert not os.path.exists(other)
