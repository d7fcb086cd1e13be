"""The public API in one process: train → load → evaluate → generate on a tiny config,
checked against forward passes computed here, and `import lexjax` stays light."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lexjax
from lexjax import checkpoint, cli, errors
from lexjax.errors import CheckpointError, ConfigError, DataError
from tests.processes import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "model": {"num_layers": 1, "d_model": 32, "num_heads": 2, "mlp_dim": 64},
    "train_len": 16,
    "batch_size": 8,
    "num_train_steps": 6,
    "checkpoint_every": 3,
    "eval_every": 3,
    "eval_batches": 1,
    "log_every": 1,
    "warmup_steps": 2,
    "data": {"name": "textfiles", "shuffle_rows": 64},  # the default 1,024: slower to fill
}


def test_import_lexjax_loads_no_jax():
    heavy = ["jax", "flax", "orbax", "grain", "tensorflow_datasets", "matplotlib", "numpy"]
    code = f"import sys, lexjax; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_public_names_resolve_and_nothing_else_does():
    for name in lexjax.__all__:
        assert getattr(lexjax, name) is not None, name
    assert lexjax.xpos is lexjax.positions.xpos and lexjax.masks.blockwise_causal
    # The package's docstring names `attention` among the pure functions' modules; it
    # resolved only once something else had imported lexjax.attention.
    assert "attention" in lexjax.__all__ and lexjax.attention.multihead_attention
    assert lexjax.blockwise.KVCache and lexjax.blockwise.block_step  # the Decoder's cache
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lexjax.nope  # noqa: B018


def test_make_config_names_an_unknown_field():
    with pytest.raises(ConfigError, match="train_lne; did you mean train_len"):
        lexjax.make_config({"train_lne": 64})
    # A key that is no str was a TypeError: "can only concatenate str (not "int") to str".
    with pytest.raises(ConfigError, match="^unknown config field 1; known: model, "):
        lexjax.make_config({1: 2})
    with pytest.raises(ConfigError, match="^unknown config field model.b'd_model'; did you"):
        lexjax.make_config({"model": {b"d_model": 2}})


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"model": 5}, "model=5: expected a mapping of fields"),
        ({"sharding_rules": 5}, "sharding_rules=5: expected a table"),
        ("train_len=32", "config='train_len=32': expected a mapping of fields"),
        # A falsy non-mapping was taken for "no overrides": the defaults, silently.
        ("", "config='': expected a mapping of fields"),
        ([], r"config=\[\]: expected a mapping of fields"),
        (0, "config=0: expected a mapping of fields"),
        ({"model": 0}, "model=0: expected a mapping of fields"),
        ({"data": ""}, "data='': expected a mapping of fields"),
        ({"model": False, "model.num_layers": 2}, "model=False: expected a mapping of fields"),
    ],
)
def test_make_config_rejects_what_is_no_mapping_with_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        lexjax.make_config(overrides)


def test_make_config_takes_a_config_and_shows_a_long_value_short():
    """A loaded run's config (run.config) was refused by a message of 1,100 characters,
    its whole repr; train() took it."""
    config = lexjax.make_config({"train_len": 64})
    assert lexjax.make_config(config) == config
    with pytest.raises(ConfigError) as e:
        lexjax.make_config(list(range(1000)))
    assert len(str(e.value)) < 160 and str(e.value).startswith("config=[0, 1, 2")


def test_a_value_whose_repr_spans_lines_is_refused_in_one_line(tmp_path):
    """A JAX key passed as a seed, or a 2-D NumPy array where a number goes: the
    message showed the value's repr, which spans lines (``Array((), dtype=key<fry>)
    overlaying:`` then its data), so the error was two lines or more."""
    with pytest.raises(ConfigError) as e:
        lexjax.make_config({"seed": jax.random.key(0)})
    assert "\n" not in str(e.value) and str(e.value).endswith("expected an integer")
    with pytest.raises(ConfigError) as e:
        config = {**TINY, "data": {**TINY["data"], "files": str(tmp_path / "*.txt")}}
        lexjax.train(config, str(tmp_path / "run"), stop_after=np.ones((2, 20), np.int32))
    assert "\n" not in str(e.value) and "must be a positive integer or None" in str(e.value)
    assert not (tmp_path / "run").exists()


def test_textfiles_without_files_names_the_api_setting_not_the_flag():
    """make_config({"data": {"name": "textfiles"}}) said to pass
    '--config.data.files=/path/*.txt', a train.py flag, in a notebook."""
    with pytest.raises(ConfigError) as e:
        lexjax.make_config({"data": {"name": "textfiles"}})
    assert str(e.value).endswith("a glob such as data.files='/path/*.txt'")
    with errors.naming_flags(), pytest.raises(ConfigError) as e:  # train.py's wording
        lexjax.make_config({"data": {"name": "textfiles"}})
    assert str(e.value).endswith("a glob such as '--config.data.files=/path/*.txt'")


def test_a_run_shows_itself_without_its_parameters(tmp_path):
    """A notebook cell ending in ``run`` printed the repr of every parameter array."""
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "run_v1"), tmp_path / "run")
    run = lexjax.load(tmp_path / "run")
    shown = repr(run)
    assert shown.startswith(f"Run(workdir={str(tmp_path / 'run')!r}, config=Config(")
    assert "params" not in shown and "Array(" not in shown and "\n" not in shown
    assert f"step={run.step}," in shown


def test_make_config_takes_numpy_numbers_and_train_takes_a_dict(tmp_path):
    config = lexjax.make_config({"train_len": np.int64(32), "learning_rate": np.float32(0.5)})
    assert (config.train_len, config.learning_rate) == (32, 0.5)
    assert type(config.train_len) is int and type(config.learning_rate) is float
    # JAX's scalars were "train_len=Array(32, dtype=int32): expected an integer".
    from lexjax import api

    assert api._listed(list(jnp.array([16, 32]))) == [16, 32]  # JAX scalars inside a list
    assert type(api._listed((np.int64(16),))[0]) is int and api._listed(None) is None
    assert api._elements(list(jnp.array([0.0, 0.5]))) == [0.0, 0.5]  # passkey depths
    assert api._elements("0.5") == "0.5"  # a string stays one, refused as depths
    config = lexjax.make_config({"train_len": jnp.int32(32), "learning_rate": jnp.float32(0.5)})
    assert (config.train_len, config.learning_rate) == (32, 0.5)
    assert type(config.train_len) is int and type(config.learning_rate) is float
    with pytest.raises(ConfigError, match="train_len=33 must be an even integer"):
        lexjax.train({"train_len": 33}, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="^log=None must be a function of one str"):
        lexjax.train({}, str(tmp_path / "run"), log=None)  # was a TypeError, later
    for verb in (lambda: lexjax.train({}, ""), lambda: lexjax.load(" ")):
        with pytest.raises(ConfigError, match="^workdir is empty; give a path$"):
            verb()  # was "cannot create workdir : No such file or directory"
    assert not os.path.exists(tmp_path / "run")


def test_train_checks_a_config_built_by_hand(tmp_path):
    """A Config made with dataclasses.replace is checked as make_config checks one: an
    unknown position trained silently as no position encoding, and the run could not
    be loaded afterwards."""
    config = lexjax.make_config({"train_len": 32})
    bad = dataclasses.replace(config, model=dataclasses.replace(config.model, position="XPOS"))
    with pytest.raises(ConfigError, match="model.position='XPOS'"):
        lexjax.train(bad, str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="train_len=33"):
        lexjax.train(dataclasses.replace(config, train_len=33), str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="workdir must be a path"):
        lexjax.train(config, 5)
    assert not os.path.exists(tmp_path / "run")
    assert len(dir(lexjax)) == len(set(dir(lexjax)))


@pytest.mark.parametrize(
    "setup",
    ["", "logging.getLogger('absl').addFilter(lambda record: True)"],
    ids=["plain", "a_users_absl_filter"],
)
def test_loading_prints_no_orbax_notices_in_a_plain_process(setup):
    """Outside pytest (whose log capture hides them) orbax's "read only" warnings
    showed on every load once a user's filter sat on the "absl" logger: lexjax knew
    orbax's records by their file, which absl then reported as its own. And on every
    resume (training looks at its checkpoints read-only first), filter or not."""
    fixture = os.path.join(ROOT, "tests", "fixtures", "run_v1")
    code = (
        f"import logging, lexjax\n{setup}\nfrom lexjax import checkpoint\n"
        f"checkpoint.Checkpointer({fixture + '/checkpoints'!r}, read_only=True).close()\n"
        f"lexjax.load({fixture!r})\n"
        "logging.getLogger('absl').warning('a warning of the user')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.splitlines() == [
        "note: ignoring config field poison_step of an older lexjax",
        "WARNING:absl:a warning of the user",
    ], out.stderr


def test_load_without_checkpoints_is_a_checkpoint_error(tmp_path):
    """In the API's terms: it advised "python train.py --workdir=…" in a notebook."""
    with pytest.raises(CheckpointError, match="no checkpoint in") as e:
        lexjax.load(tmp_path)
    assert str(e.value).endswith("; train first: lexjax.train(config, workdir)")
    # A training that has not saved yet (its directory made, a step still being written):
    # it said only "no complete checkpoint in …".
    (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint in .* yet") as e:
        lexjax.load(tmp_path)
    assert str(e.value).endswith("saves its first at step checkpoint_every: read it then")
    # A file: its advice was to train into it, which is refused as well.
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match=r"workdir .*a_file is not a directory; give the"):
        lexjax.load(tmp_path / "a_file")
    # One level too deep (the run's checkpoints/), or a study's --out: the advice made a
    # new run in there; it names the directory meant.
    run = tmp_path / "run_v1"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "run_v1"), run)
    with pytest.raises(CheckpointError) as e:
        lexjax.load(run / "checkpoints")
    assert str(e.value) == (
        f"no checkpoint in {run / 'checkpoints'}: {run / 'checkpoints'} is a run's "
        f"checkpoint directory; the run is {run}"
    )
    # A step's own directory: the run is read at its newest step, which the user who
    # asked for step 2 was not told (and evaluated step 6 believing it step 2).
    shutil.copytree(run / "checkpoints" / "6", run / "checkpoints" / "2")
    with pytest.raises(CheckpointError) as e:
        lexjax.load(run / "checkpoints" / "2")
    assert str(e.value) == (
        f"no checkpoint in {run / 'checkpoints' / '2'}: {run / 'checkpoints'} is a run's "
        f"checkpoint directory; the run is {run} (read at its newest good step; step 2 "
        "cannot be chosen)"
    )
    (tmp_path / "study" / "runs" / "rope_s0" / "checkpoints").mkdir(parents=True)
    (tmp_path / "study" / "runs" / "xpos_s0" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"is a study's output with runs rope_s0, xpos_s0; "):
        lexjax.load(tmp_path / "study")
    # Runs named by number are not mistaken for a checkpoint directory's steps.
    (tmp_path / "numbered" / "1" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="train first"):
        lexjax.load(tmp_path / "numbered" / "2")
    # The run's tokenizer alone is read through the same door: it said "no checkpoint"
    # of the file, with no advice.
    with pytest.raises(CheckpointError, match=r"workdir .*a_file is not a directory; give the"):
        checkpoint.load_tokenizer(tmp_path / "a_file")
    with pytest.raises(CheckpointError, match="train first: lexjax.train"):
        checkpoint.load_tokenizer(tmp_path / "none")


def test_another_users_run_that_cannot_be_read_says_so(tmp_path, monkeypatch):
    """A run of another user's (umask 077) was "no checkpoint … does not exist; train
    first", or, with only its directories shared, every step "damaged", with the advice
    to move the directory aside. (As root, os.access and getuid stand in for the modes.)"""
    import pwd

    run = tmp_path / "run_v1"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "run_v1"), run)
    uid = os.getuid()
    owner = pwd.getpwuid(uid).pw_name
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # not the owner
    real_access = os.access
    step = run / "checkpoints" / "6"

    def denied(hidden, mode=os.R_OK | os.X_OK):  # `hidden` refuses `mode`'s bits
        return lambda p, m: not (str(p) == str(hidden) and m & mode) and real_access(p, m)

    for access, said in (
        (denied(run, os.X_OK), f"cannot read {run} (Permission denied: user {owner}'s); ask"),
        (denied(step), f"cannot read checkpoint step 6 in {run / 'checkpoints'} (Permission"),
    ):
        monkeypatch.setattr(os, "access", access)
        with pytest.raises(CheckpointError) as e:
            lexjax.load(run)
        assert str(e.value).startswith(said) and "chmod -R a+rX" in str(e.value), str(e.value)
    # A workdir that may be entered but not listed (711) is read as before.
    monkeypatch.setattr(os, "access", denied(run, os.R_OK))
    assert lexjax.load(run).step == 6
    # Directories shared, files not: a read's PermissionError is not damage either.
    monkeypatch.setattr(os, "access", real_access)
    real_read = checkpoint.Checkpointer._read_integrity

    def unreadable(self, s):
        try:
            raise PermissionError(13, "Permission denied", str(step / "integrity"))
        except PermissionError as cause:
            raise checkpoint._Damaged("integrity record unreadable (Permission denied)") from cause

    monkeypatch.setattr(checkpoint.Checkpointer, "_read_integrity", unreadable)
    with pytest.raises(CheckpointError, match=r"^cannot read checkpoint step 6 in .*a\+rX\)$"):
        lexjax.load(run)
    monkeypatch.setattr(checkpoint.Checkpointer, "_read_integrity", real_read)
    assert lexjax.load(run).step == 6


def _direct_nll(run, rows_BxN):
    """Mean NLL of ``rows[:, 1:]`` given ``rows[:, :-1]``: one plain causal forward pass."""
    logits, _ = run.model.apply({"params": run.params}, jnp.asarray(rows_BxN[:, :-1]))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.asarray(rows_BxN[:, 1:, None]), axis=-1)
    return -float(jnp.mean(picked))


def test_train_load_evaluate_generate(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(checkpoint, "quiet_background_errors", lambda: None)  # process-wide hooks
    files = write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)  # the data paths relative to it, as a notebook gives them
    data = {"files": os.path.relpath(files, tmp_path), "data_dir": "tfds"}
    overrides = {**TINY, "data": {**TINY["data"], **data}}
    config = lexjax.make_config(overrides)
    assert (config.data.files, config.data.data_dir) == (files, str(tmp_path / "tfds"))
    workdir = str(tmp_path / "run")

    summary = lexjax.train(overrides, workdir)  # a dict goes through make_config
    assert summary["step"] == 6 and summary["start_step"] == 0
    # A plain str, as when a run stops before its first step (it was an etils path).
    assert json.loads(json.dumps(summary))["checkpoint_dir"] == os.path.join(workdir, "checkpoints")
    out = capfd.readouterr().out
    assert "step 6/6 loss" in out  # the progress display of train.py

    run = lexjax.load(workdir)
    err = capfd.readouterr().err
    assert "read only" not in err and "read_only" not in err, err  # orbax's notices
    assert run.step == 6 and run.config == config and run.workdir == workdir
    shapes = jax.tree.map(jnp.shape, run.params)
    assert shapes["embed"]["embedding"] == (config.model.vocab_size, 32)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert run.metrics() == [json.loads(line) for line in f]
    assert [r["step"] for r in run.metrics() if "loss" in r] == [1, 2, 3, 4, 5, 6]
    # On several devices the run spans them all; code of one's own mixing its params with
    # arrays on one device failed ("incompatible devices") with no way to choose.
    assert run.params["embed"]["embedding"].sharding.device_set == set(jax.devices())
    one = lexjax.load(workdir, devices=jax.devices()[:1])
    assert dict(one.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    here = jax.device_put(jnp.ones((2, 4), jnp.int32), jax.devices()[0])
    logits = jax.jit(one.model.apply)({"params": one.params}, here)[0]
    assert logits.shape == (2, 4, config.model.vocab_size)
    # One device as itself (it was "must be a non-empty list").
    assert lexjax.load(workdir, devices=jax.devices()[-1]).mesh.devices.flat[0] == jax.devices()[-1]
    for bad in ([], "cpu", 3):
        with pytest.raises(ConfigError, match="^devices must be a non-empty list of jax devices"):
            lexjax.load(workdir, devices=bad)
    with pytest.raises(ConfigError, match="^devices names a device twice"):  # was "damaged"
        lexjax.load(workdir, devices=jax.devices()[:1] * 2)

    text = "λ-calculus\n"
    ids = run.tokenizer.encode(text)
    assert ids.dtype == np.int32 and len(ids) == len(text.encode()) and ids.max() < 256
    assert run.tokenizer.decode([run.tokenizer.bos, *ids, run.tokenizer.eos]) == text

    # Perplexity: at the training length blockwise attention sees the whole
    # segment, so both modes must equal one plain causal forward per segment.
    docs = tmp_path / "eval"
    docs.mkdir()
    for i in range(2):
        (docs / f"d{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 4)
    # The verbs check their arguments as eval.py checks its flags, before any work.
    for verb, args, kwargs, message in [
        (run.evaluate, ([16],), {"max_docs": 0}, "max_docs=0 must be a positive integer"),
        (run.evaluate, ([],), {}, "lengths is empty"),
        (run.evaluate, ([64.5],), {}, "lengths=64.5 must be a positive integer"),
        (run.evaluate, ([16],), {"max_length": 0}, "max_length=0"),
        (run.evaluate, ([16],), {"sinks": -1}, "sinks=-1"),
        (run.evaluate, ([16],), {"sinks": 2}, "sinks=2 is the sink count of mode sinks"),
        (run.evaluate, ([16],), {"modes": []}, "modes=: use some of bca, full, sinks"),
        (run.evaluate, ([16],), {"modes": ["bca", "dense"]}, "modes=bca,dense: use some of"),
        (run.passkey, ([80],), {"modes": ()}, "modes=: use some of bca, full$"),
        (run.passkey, ([80],), {"modes": "sinks"}, "modes=sinks: use some of bca, full$"),
        (run.passkey, ([2**24 + 1],), {}, "lengths=16777217: give passkey lengths of at most"),
        (run.passkey, ([80.5],), {}, "lengths=80.5"),
        (run.generate, (123,), {}, "prompt must be text"),
        (run.generate, ("x",), {"max_new_tokens": 2.7}, "max_new_tokens=2.7"),
        (run.generate, ("x",), {"top_k": 1.5}, "top_k=1.5"),
        (run.generate, ("x",), {"temperature": "1"}, "temperature must be ≥ 0"),
        (run.evaluate, ("32",), {}, "lengths='32' must be a positive integer"),
        (lexjax.load, (None,), {}, "workdir must be a path"),
        # The API's argument names, not eval.py's flags; one depth needs no list.
        (
            run.evaluate,
            ([64],),
            {"max_length": 32},
            "max_length=32 is below the largest length 64; raise it or ask for shorter lengths$",
        ),
        (run.passkey, ([80],), {"depths": 1.5}, r"depths must be in \[0, 1\], got \[1.5\]"),
    ]:
        with pytest.raises(ConfigError, match=f"^{message}"):
            verb(*args, **kwargs)
    missing = str(tmp_path / "none" / "*.txt")
    with pytest.raises(
        DataError, match=f"^eval_files='{re.escape(missing)}' matches no files; .* eval_files="
    ):
        run.evaluate([16], eval_files=missing)
    assert not os.path.exists(os.path.join(workdir, "eval"))
    numpy = dict(max_length=np.int64(64), max_docs=np.int32(2))  # numpy integers are integers
    twice = ("bca", "full", "bca")  # a mode given twice is evaluated once
    from lexjax import evaluation

    read_up_to, read = [], evaluation.file_document
    monkeypatch.setattr(
        evaluation, "file_document", lambda *a: read_up_to.append(a[-1]) or read(*a)
    )
    results = run.evaluate(np.array([16, 32]), eval_files=str(docs / "*.txt"), modes=twice, **numpy)
    assert set(read_up_to) == {64 + 1}  # each file read no further than the budget + 1
    assert sorted((r.mode, r.length) for r in results) == [
        (m, n) for m in ("bca", "full") for n in (16, 32)
    ]
    encoded = [
        np.concatenate([[run.tokenizer.bos], run.tokenizer.encode(p.read_text())])
        for p in sorted(docs.glob("*.txt"))
    ]
    rows = np.stack([d[s : s + 17] for d in encoded for s in range(0, 64, 16)]).astype(np.int32)
    expected = _direct_nll(run, rows)
    for r in results:
        assert r.tokens == 2 * 64
        if r.length == 16:
            np.testing.assert_allclose(r.nll, expected, rtol=1e-5)
            np.testing.assert_allclose(r.perplexity, np.exp(expected), rtol=1e-5)
    assert os.path.exists(os.path.join(workdir, "eval", "perplexity.json"))
    # One length and one mode need no list.
    # JAX's scalars too: they were "lengths=Array(16, dtype=int32) must be a positive
    # integer", and a 0-d one "iteration over a 0-d array".
    jax_numbers = dict(max_length=jnp.int32(64), max_docs=jnp.int32(2))
    (one,) = run.evaluate(jnp.int32(16), modes="bca", eval_files=str(docs / "*.txt"), **jax_numbers)
    assert (one.mode, one.length) == ("bca", 16)
    # The run's own held-out text after a %cd: its corpus and build where they were
    # (relative paths were kept as given: its files "matched no files now", its
    # data_dir got a second build in the new directory).
    monkeypatch.chdir(docs)
    capfd.readouterr()
    (own,) = run.evaluate(16, modes="bca", max_length=16, max_docs=1)
    assert own.tokens == 16 and "building dataset" not in capfd.readouterr().out
    assert not os.path.exists(docs / "tfds")

    # Generation starts from BOS by itself: greedy tokens within one training
    # length equal greedy decoding by full forward passes over [BOS, prompt, ...].
    prompt = "def "
    # max_new_tokens=jnp.int32(40) was refused: "must be an integer in [1, 16,777,216]".
    sample = run.generate(prompt, max_new_tokens=jnp.int32(40), temperature=jnp.float32(0))
    forward = jax.jit(lambda tokens_1xT: run.model.apply({"params": run.params}, tokens_1xT)[0])
    tokens = np.zeros((1, config.train_len), np.int32)  # causal: the zeros after n change nothing
    tokens[0, :5] = [run.tokenizer.bos, *run.tokenizer.encode(prompt)]
    for n in range(5, config.train_len):
        tokens[0, n] = int(jnp.argmax(forward(tokens)[0, n - 1]))
    greedy = tokens[0, 5:]
    if run.tokenizer.eos in greedy:
        greedy = greedy[: list(greedy).index(run.tokenizer.eos)]
        assert sample == run.tokenizer.decode(greedy)
    else:
        assert sample.startswith(run.tokenizer.decode(greedy))

    # eval.py runs the same verbs: its continuation is the API's.
    capfd.readouterr()
    code = cli.main(
        cli.run_eval, workdir, generate=True, prompt=prompt, max_new_tokens=40, temperature=0.0
    )
    assert code == 0 and capfd.readouterr().out == prompt + sample + "\n"

    # Without BCA (--bca=off): past train_len the two modes attend differently.
    long_prompt = "def f0(x):\n    return x + 0\n"
    sampled = dict(max_new_tokens=40, temperature=1.0, seed=1)
    full = run.generate(long_prompt, mode="full", **sampled)
    assert full != run.generate(long_prompt, **sampled)
    code = cli.main(cli.run_eval, workdir, generate=True, bca="off", prompt=long_prompt, **sampled)
    assert code == 0 and capfd.readouterr().out == long_prompt + full + "\n"

    # eval.py --passkey with held-out text for filler reads --max_docs documents of it.
    def passkey_with_text():
        return cli.main(
            cli.run_eval,
            workdir,
            passkey_run=True,
            lengths=["80"],
            bca="on",
            passkey_depths=["0"],
            passkey_trials=1,
            passkey_filler="text",
            eval_files=str(docs / "*.txt"),
            max_docs=1,
        )

    named = lambda: {f for f in os.listdir(os.path.join(workdir, "eval")) if "passkey-step" in f}
    assert passkey_with_text() == 0 and "filler: 1 document of" in capfd.readouterr().out
    # That text edited: the same settings, other filler, so a file of another name.
    before = named()
    sorted(docs.glob("*.txt"))[0].write_text("other words in the filler now " * 20)
    assert passkey_with_text() == 0 and len(named() - before) == 1


def test_running_out_of_memory_is_one_line_naming_what_to_lower(monkeypatch, tmp_path):
    """An allocation XLA cannot make (a long length without BCA) was its traceback,
    and eval.py's exit 1. The failure is injected where the work runs: the message
    XLA gives (RESOURCE_EXHAUSTED on GPU/TPU, "Out of memory" on CPU)."""
    from lexjax import api, evaluation, generation, passkey
    from lexjax.errors import EvaluationError, naming_flags

    config = lexjax.make_config({**TINY, "data": {**TINY["data"], "files": "/none/*.txt"}})
    run = api.Run(str(tmp_path), config, None, 1, None, jax.make_mesh((1,), ("data",)))

    def fail(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 2^40 B")

    monkeypatch.setattr(evaluation, "evaluate_run", fail)
    monkeypatch.setattr(passkey, "evaluate_passkey", fail)
    monkeypatch.setattr(generation, "complete", fail)
    said = "out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 2^40 B); lower "
    for call, lower in [
        (run.evaluate, "lengths and max_length, or use mode 'bca'"),
        (run.passkey, "lengths, or use mode 'bca'"),
        (run.generate, "max_new_tokens, or use mode 'bca'"),
    ]:
        with pytest.raises(EvaluationError, match=f"^{re.escape(said + lower)}, whose memory"):
            call()
    with (
        naming_flags(),
        pytest.raises(EvaluationError, match="lower --max_new_tokens, or use --bca=on"),
    ):
        run.generate()
    monkeypatch.setattr(generation, "complete", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # any other failure passes through
        run.generate()


def test_what_a_notebook_passes_is_taken_or_refused_in_one_line(tmp_path, monkeypatch):
    """Arguments as a notebook passes them: numpy numbers, paths, a relative workdir
    and a %cd after load, a corpus changed since training, extreme sampling values.
    Each works as documented or is one ConfigError/DataError before any work (each
    was a crash after the work, a raw Python error, or a silently wrong result)."""
    monkeypatch.setattr(checkpoint, "quiet_background_errors", lambda: None)  # process-wide
    corpus = tmp_path / "corpus"
    files = write_corpus(corpus)
    data = {**TINY["data"], "files": files, "data_dir": str(tmp_path / "tfds")}
    for bad, message in [
        ({"stop_after": 0}, "stop_after=0 must be a positive integer or None"),
        ({"stop_after": 1.5}, "stop_after=1.5 must be a positive integer or None"),
        ({"peak_flops": "x"}, "peak_flops='x' must be a positive number"),
        # It ended the lease's heartbeat thread at once (its waits overflowed).
        ({"lease_timeout_s": float("inf")}, "lease_timeout_s=inf must be a number of seconds"),
        # A string or a number was read as a switch: "no" showed the progress.
        ({"progress": "no"}, "progress='no' must be True or False"),
    ]:
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            lexjax.train({**TINY, "data": data}, str(tmp_path / "refused"), **bad)
    assert not (tmp_path / "refused").exists()
    monkeypatch.chdir(tmp_path)
    lexjax.train({**TINY, "data": data, "model": {**TINY["model"], "remat": np.bool_(True)}}, "run")
    run = lexjax.load("run")
    monkeypatch.chdir(corpus)  # a notebook's %cd: the run's files stay where they are
    assert run.workdir == str(tmp_path / "run") and len(run.metrics()) > 6

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(2):
        (docs / f"d{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 4)
    for verb, args, kwargs, message in [
        (run.evaluate, (True,), {}, "lengths=True must be a sequence of lengths"),
        (run.evaluate, ([16],), {"modes": None}, "modes=None: use some of"),
        # A PRNG key where a Flax habit puts one: "iteration over a 0-d key array".
        (run.evaluate, (jax.random.key(0),), {}, "lengths=Array((), dtype=key"),
        (run.evaluate, ([16],), {"modes": jax.random.key(0)}, "modes=Array((), dtype=key"),
        (run.passkey, (jax.random.key(0),), {}, "lengths=Array((), dtype=key"),
        (run.passkey, ([80],), {"depths": jax.random.key(0)}, "depths must be a sequence of"),
        (run.evaluate, ([16],), {"rope_scaling": "pi", "rope_factor": "2"}, "rope_factor=2 must"),
        (run.passkey, ([80],), {"depths": "0.5"}, "depths must be a sequence of numbers"),
        (run.passkey, ([80],), {"depths": ["x"]}, "depths must be numbers in [0, 1]"),
        (run.passkey, ([80],), {"eval_files": str(docs)}, "passkey with filler=repeat does not"),
        # eval.py refused --max_docs with the repeated filler; the API ignored it.
        (run.passkey, ([80],), {"max_docs": 5}, "passkey with filler=repeat does not use max_docs"),
        (lexjax.load, ("run",), {"check": 5}, "check must be a function"),  # was a TypeError
        (run.passkey, ([80],), {"trials": 1.5}, "trials=1.5 must be a positive integer"),  # no --
        (run.generate, ("x",), {"temperature": 1e39}, "temperature must be ≥ 0 (0 = greedy)"),
        (run.generate, ("x",), {"on_text": 5}, "on_text must be a function"),
        # "no" measured the resolution; 0 or "off" were taken as switches too.
        (run.evaluate, ([16],), {"resolution": "no"}, "resolution='no' must be True or False"),
        (run.evaluate, ([16],), {"figure": 1}, "figure=1 must be True or False"),
        (run.generate, ("x",), {"progress": "off"}, "progress='off' must be True or False"),
    ]:
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}") as refused:
            verb(*args, **kwargs)
        assert "\n" not in str(refused.value)
    assert not (tmp_path / "run" / "eval").exists()

    glob = docs / "*.txt"  # a pathlib.Path, numpy integers, lengths from a generator
    results = run.evaluate(
        (n for n in (16, 32)),
        modes=["sinks"],
        sinks=np.int64(2),
        eval_files=glob,
        max_docs=2,
        max_length=64,
    )
    assert sorted(r.length for r in results) == [16, 32]
    written = json.loads((tmp_path / "run" / "eval" / "perplexity.json").read_text())
    assert written["sinks"] == 2
    run.passkey([80], depths=[0.5], trials=np.int64(2), seed=np.int64(1), modes=["bca", "full"])
    eval_dir = tmp_path / "run" / "eval"
    latest = json.loads((eval_dir / "passkey.json").read_text())
    assert latest["seed"] == 1 and latest["settings"]["modes"] == ["bca", "full"]  # was none
    assert (eval_dir / "passkey-full.png").exists()
    (one,) = run.passkey([80], depths=0.5, trials=1, modes="bca")  # one depth, no list
    assert one.depth == 0.5
    # A 0-d numpy array is one value too ("iteration over a 0-d array" before).
    (zero_d,) = run.passkey(np.array(80), depths=np.array(0.5), trials=1, modes="bca")
    assert (zero_d.length, zero_d.depth) == (80, 0.5)
    assert not (eval_dir / "passkey-full.png").exists()  # not of the latest run's modes
    named = sorted(p.name for p in eval_dir.glob("passkey-step*.json"))
    assert [n[: n.rindex("-")] for n in named] == [
        "passkey-step6-bca+full-budget80",
        "passkey-step6-bca-budget80",
    ]

    # top_p below float32's range keeps the most likely id (it kept none: id 0 each time).
    greedy = run.generate("def ", max_new_tokens=20, temperature=0, progress=np.bool_(False))
    assert run.generate("def ", max_new_tokens=20, top_p=1e-46, progress=False) == greedy

    # A corpus changed since training is refused from its files, before it is built.
    (corpus / "extra.txt").write_text("alpha beta gamma " * 40)
    builds = sorted((tmp_path / "tfds" / "textfiles").iterdir())
    with pytest.raises(DataError, match="^the textfiles corpus changed since this run trained"):
        run.evaluate([16])
    assert sorted((tmp_path / "tfds" / "textfiles").iterdir()) == builds


def test_load_on_chosen_devices_is_refused_in_a_multi_process_job(tmp_path, monkeypatch):
    """devices= names some devices of one process; in a job of 2 (simulated) a mesh of
    them would leave the other process out of every collective: a one-line refusal."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    said = "^devices= is for one process; a multi-process job loads on all$"
    with pytest.raises(ConfigError, match=said):
        lexjax.load(tmp_path, devices=jax.devices()[:1])


def test_a_run_moved_after_loading_is_not_evaluated_into_a_new_directory(tmp_path):
    """A notebook loads a run, then the run is renamed (mv runs/a runs/b): evaluating
    made a fresh runs/a/eval with the results, beside no run; it now says the run is
    gone before computing anything; out_dir= still writes where it is asked."""
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "run_v1"), tmp_path / "a")
    run = lexjax.load(tmp_path / "a")
    os.rename(tmp_path / "a", tmp_path / "b")
    calls = (
        lambda: run.evaluate([32], max_length=64, max_docs=1, modes=["bca"]),
        lambda: run.passkey([128], depths=[0.5], trials=1, modes=["bca"]),
    )
    for evaluate in calls:
        with pytest.raises(CheckpointError) as e:
            evaluate()
        assert str(e.value) == (
            f"workdir {tmp_path / 'a'} is gone (moved or deleted since its run was loaded); "
            "lexjax.load the run again where it is now, or pass out_dir=DIR"
        )
    assert not (tmp_path / "a").exists()
    run.evaluate([32], max_length=64, max_docs=1, modes=["bca"], out_dir=tmp_path / "out")
    assert (tmp_path / "out" / "perplexity.json").exists()
    # Its loss curve, read from where the run was, used to be [] in silence, as if the run
    # had trained nothing.
    with pytest.raises(CheckpointError) as e:
        run.metrics()
    assert str(e.value) == (
        f"workdir {tmp_path / 'a'} is gone (moved or deleted since its run was loaded); "
        "lexjax.load the run again where it is now"
    )


def test_a_run_copied_without_its_metrics_says_so(tmp_path, caplog):
    """rsync --exclude='*.jsonl' (or only checkpoints/ copied): run.metrics() was [] in
    silence, and the quickstart's loss plot failed on it in the user's own code."""
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "run_v1"), tmp_path / "a")
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    caplog.clear()
    assert lexjax.load(tmp_path / "a").metrics() == [{"step": 1, "loss": 5.0}]
    assert not [r for r in caplog.records if "metrics" in r.getMessage()]
    (tmp_path / "a" / "metrics.jsonl").unlink()
    caplog.clear()
    assert lexjax.load(tmp_path / "a").metrics() == []
    assert [r.getMessage() for r in caplog.records if "metrics" in r.getMessage()] == [
        f"note: {tmp_path / 'a'} has no metrics.jsonl (copied without it?): no records"
    ]
