"""Training: over-fitting, sharded meshes equal one device, resume equals uninterrupted."""

import dataclasses
import errno
import glob
import json
import logging
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lexjax import checkpoint as ckpt_lib
from lexjax import config as cfg
from lexjax import data as data_lib
from lexjax import metrics
from lexjax.errors import CheckpointError, ConfigError, DataError
from lexjax.optim import learning_rate_schedule, make_optimizer
from lexjax.steps import TrainSetup
from lexjax.training import train
from tests.helpers import np_nll, packed_batch, small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_steps(setup, batches):
    state = setup.init_state()
    losses = []
    with jax.set_mesh(setup.mesh):
        for b in batches:
            state, metrics = setup.train_step(state, setup.global_batch(b))
            losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses


def test_tiny_model_overfits_one_batch():
    config = small_config(
        **{"num_train_steps": 80, "warmup_steps": 5, "learning_rate": 1e-2, "mesh.data": 1}
    )
    batch = packed_batch(np.random.default_rng(0), 8, 16)
    _, losses = _run_steps(TrainSetup(config, jax.devices()[:1]), [batch] * 80)
    assert losses[-1] < 0.25 * losses[0], losses[::10]


def test_the_loss_is_the_mean_over_real_tokens_and_padding_changes_nothing():
    """loss_fn against numpy float64: the cross-entropy of each target under the
    model's logits, averaged over tokens whose segment id is > 0 (the padding at row
    ends, segment 0, is not text). Other targets on the padding change neither the
    loss nor a gradient."""
    from lexjax.model import Decoder
    from lexjax.steps import loss_fn

    config = small_config()
    model = Decoder(config.model)
    batch = packed_batch(np.random.default_rng(3), 4, 16, vocab=config.model.vocab_size)
    batch["segment_ids"][:, -3:] = 0  # a padded tail in every row
    params = model.init(jax.random.key(0), batch["inputs"][:1])["params"]
    logits, _ = model.apply(
        {"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    nll = np_nll(logits, batch["targets"])
    real = batch["segment_ids"] > 0
    loss, weight = loss_fn(params, model, batch)
    assert float(weight) == real.sum()
    np.testing.assert_allclose(float(loss), nll[real].mean(), rtol=1e-5)

    other = dict(batch, targets=np.where(real, batch["targets"], 1 + batch["targets"] % 7))
    grad = jax.grad(lambda p, b: loss_fn(p, model, b)[0])
    assert float(loss_fn(params, model, other)[0]) == float(loss)
    jax.tree_util.tree_map(np.testing.assert_array_equal, grad(params, other), grad(params, batch))


def test_gradient_accumulation_equals_one_big_batch():
    """2 micro-batches of 4 rows == one batch of 8: token-weighted, so equal up to float32
    summation order (1e-5)."""
    batches = [packed_batch(np.random.default_rng(s), 8, 16) for s in range(2)]
    one = TrainSetup(small_config(**{"mesh.data": 1}), jax.devices()[:1])
    two = TrainSetup(
        small_config(**{"mesh.data": 1, "optim.grad_accum_steps": 2}), jax.devices()[:1]
    )
    (p1, l1), (p2, l2) = _run_steps(one, batches), _run_steps(two, batches)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p2, p1
    )


def test_a_scale_base_too_small_for_train_len_is_refused_before_any_work(tmp_path, monkeypatch):
    """It trained until "non-finite loss at step 1" (exit 5): at ±train_len/2 XPOS's
    key scale overflowed float32."""
    from lexjax import training
    from lexjax.errors import TrainingError

    config = _train_config(tmp_path, **{"model.scale_base": 0.1})
    said = (
        "model.scale_base=0.1 lets XPOS's scale overflow float32 beyond positions ±6.9, and "
        "train_len=16 trains at ±8; use model.scale_base ≥ 0.13 or a shorter train_len"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
        train(config, str(tmp_path / "run"), log=lambda _: None, progress=False)
    assert not (tmp_path / "run").exists()
    # What trains is not refused (a review found these refused by a first version with
    # a margin): float16 at scale_base 2 (its scale reaches 3.5^4 = 150 at ±8), and the
    # paper's 512 at train_len 4096 in float16.
    for dtype, scale_base, train_len in (("float16", 2.0, 16), ("float16", 512.0, 4096)):
        model = dataclasses.replace(config.model, dtype=dtype, scale_base=scale_base)
        training._check_xpos_range(dataclasses.replace(config, model=model, train_len=train_len))
    # PI with s = 2 trains at 0.1 (its decay base is b·s); the other scalings, and PI
    # whose factor 0 means s = 1 at the training length, keep b and are refused.
    scaled = lambda **kw: dataclasses.replace(config, model=dataclasses.replace(config.model, **kw))
    training._check_xpos_range(scaled(rope_scaling="pi", rope_factor=2.0))
    for scaling, factor in (("pi", 0.0), ("ntk", 2.0), ("yarn", 2.0)):
        with pytest.raises(ConfigError, match="^model.scale_base=0.1 lets XPOS's scale"):
            training._check_xpos_range(scaled(rope_scaling=scaling, rope_factor=factor))
    # With no room for the keys' magnitude, b = 8 at train_len 1130 (±565, a scale
    # within 1.3× of float32's largest) was accepted and every logit row was NaN.
    with pytest.raises(ConfigError, match="^model.scale_base=8 lets XPOS's scale"):
        training._check_xpos_range(dataclasses.replace(scaled(scale_base=8.0), train_len=1130))
    # Without the check, the first step is indeed not finite; the advised 0.13 trains.
    # (The refusal keeps a room of 10, the advice 1e3: 1.81, advised at train_len 256
    # with no room, was non-finite at step 1.)
    monkeypatch.setattr(training, "_check_xpos_range", lambda config: None)
    with pytest.raises(TrainingError, match="step 1"):
        train(config, str(tmp_path / "run"), log=lambda _: None, progress=False)
    fits = dataclasses.replace(
        config, num_train_steps=1, model=dataclasses.replace(config.model, scale_base=0.13)
    )
    monkeypatch.undo()
    assert train(fits, str(tmp_path / "fits"), log=lambda _: None, progress=False)["step"] == 1

    # Following the advice trains: at train_len 256 it said 1.81, on the edge of the
    # overflow, and the first step was not finite.
    def long(scale_base):
        model = dataclasses.replace(config.model, max_len=256, scale_base=scale_base)
        return dataclasses.replace(config, train_len=256, num_train_steps=1, model=model)

    with pytest.raises(ConfigError, match="use model.scale_base ≥ ") as refused:
        train(long(1.0), str(tmp_path / "r"))
    advised = float(re.search(r"≥ ([0-9.]+) ", str(refused.value)).group(1))
    advice = long(advised)
    assert train(advice, str(tmp_path / "advised"), log=lambda _: None, progress=False)["step"] == 1


@pytest.mark.parametrize("devices", [1, 8])
def test_micro_batches_take_less_memory_and_move_no_rows_between_devices(devices):
    """Validation ran the whole batch in one pass whatever optim.grad_accum_steps: a
    run that fit memory by accumulating ran out of it at its first validation, with
    the steps since its last checkpoint. And on a data mesh a micro-batch was a
    contiguous block of rows, which XLA moved between devices with all-to-alls at
    every step (4 per step here). Compiled under the mesh, as training runs them:
    sums equal the one-pass sums, XLA's temporaries shrink with 8 micro-batches,
    and no row changes device."""
    batch = packed_batch(np.random.default_rng(0), 64, 16)
    setups = [
        TrainSetup(
            small_config(**{"mesh.data": devices, "batch_size": 64, "optim.grad_accum_steps": k}),
            jax.devices()[:devices],
        )
        for k in (1, 8)
    ]
    state = setups[0].init_state()
    with jax.set_mesh(setups[0].mesh):
        sums = [np.asarray(s.eval_step(state.params, s.global_batch(batch))) for s in setups]
        np.testing.assert_allclose(sums[1], sums[0], rtol=1e-5)
        assert sums[0][1] == (batch["segment_ids"] > 0).sum()
        compiled = [
            (s.eval_step.lower(state.params, b).compile(), s.train_step.lower(state, b).compile())
            for s in setups
            for b in [s.global_batch(batch)]
        ]
    temp = [[c.memory_analysis().temp_size_in_bytes for c in pair] for pair in compiled]
    # The logits of an eighth of the rows (and their softmax): at least 4× less.
    assert temp[1][0] * 4 < temp[0][0] and temp[1][1] * 2 < temp[0][1], temp
    assert [c.as_text().count("all-to-all(") for c in compiled[1]] == [0, 0]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_weight_decay_spares_biases_and_layernorm_with_and_without_scanned_layers(scan_layers):
    """AdamW with zero gradients moves a parameter by its weight decay alone: kernels
    and embeddings shrink, biases and LayerNorm scales stay. Scanned layers stack every
    parameter on a layer axis, which must not change which ones decay."""
    config = small_config(
        **{
            "model.scan_layers": scan_layers,
            "optim.weight_decay": 0.5,
            "optim.schedule": "constant",
            "warmup_steps": 0,
            "learning_rate": 0.1,
        }
    )
    setup = TrainSetup(config, jax.devices()[:1])
    params = jax.tree.map(lambda p: p + 0.5, setup.init_state().params)  # biases start at 0
    zeros = jax.tree.map(np.zeros_like, params)
    updates, _ = setup.tx.update(zeros, setup.tx.init(params), params)
    moved = {
        jax.tree_util.keystr(path): bool(np.abs(u).max() > 0)
        for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]
    }
    expected = {name: name.endswith(("['kernel']", "['embedding']")) for name in moved}
    assert moved == expected
    assert sum(expected.values()) >= 6 and not all(expected.values())


def test_train_step_compiler_options_are_cpu_only_and_change_no_number(monkeypatch):
    """The CPU train step's XLA options (YNNPACK for reductions only) select other
    kernels, not other math: three steps equal XLA's defaults to float32 rounding.
    Never on other platforms, and a user's own YNNPACK flag in XLA_FLAGS wins."""
    from lexjax.steps import train_step_compiler_options

    cpu = jax.devices()[:1]
    options = train_step_compiler_options(cpu)
    reduce_only = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
    assert options in ({}, reduce_only)  # {}: jaxlib lacks the option
    gpu = type("Device", (), {"platform": "gpu"})()
    assert train_step_compiler_options([gpu]) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=reduce")
    assert train_step_compiler_options(cpu) == {}
    monkeypatch.undo()

    batches = [packed_batch(np.random.default_rng(s), 8, 16) for s in range(3)]
    config = small_config(**{"mesh.data": 1})
    tuned = TrainSetup(config, cpu)
    assert tuned.compiler_options == options
    (p1, l1), (p2, l2) = (
        _run_steps(tuned, batches),
        _run_steps(TrainSetup(config, cpu, compiler_options={}), batches),
    )
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p2
    )
    if options:  # the option took effect: YNNPACK runs reductions and nothing else
        with jax.set_mesh(tuned.mesh):
            hlo = (
                tuned.train_step.lower(tuned.abstract_state, tuned.global_batch(batches[0]))
                .compile()
                .as_text()
            )
        ops = re.findall(r'op_name="[^"]*/(\w+)"[^\n]*"__ynn_fusion"', hlo)
        assert ops and set(ops) <= {"reduce_sum", "reduce_max"}, sorted(set(ops))


MESHES = [((8, 1, 1), "data"), ((2, 4, 1), "fsdp"), ((2, 2, 2), "tensor"), ((1, 2, 4), "tensor")]


@pytest.fixture(scope="module")
def one_device_run():
    batches = [packed_batch(np.random.default_rng(s), 8, 16) for s in range(3)]
    config = small_config(**{"mesh.data": 1})
    return batches, _run_steps(TrainSetup(config, jax.devices()[:1]), batches)


@pytest.mark.parametrize("shape,preset", MESHES)
def test_sharded_meshes_match_one_device(one_device_run, shape, preset):
    """Same losses and parameters after 3 steps, up to float32 summation order (1e-5)."""
    batches, (params_1, losses_1) = one_device_run
    config = small_config(
        **{
            "mesh.data": shape[0],
            "mesh.fsdp": shape[1],
            "mesh.tensor": shape[2],
            "sharding": preset,
        }
    )
    setup = TrainSetup(config)
    assert dict(setup.mesh.shape) == dict(zip(("data", "fsdp", "tensor"), shape))
    params_n, losses_n = _run_steps(setup, batches)
    np.testing.assert_allclose(losses_n, losses_1, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params_n, params_1
    )


def test_optimizer_state_is_sharded_like_the_params():
    setup = TrainSetup(small_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}))
    state = setup.init_state()
    adam = state.opt_state[1][0]
    kernel = state.params["layer_0"]["mlp_in"]["kernel"]
    assert adam.mu["layer_0"]["mlp_in"]["kernel"].sharding == kernel.sharding
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


def _textfiles(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", ":", "\n"]
    for i in range(40):
        text = " ".join(rng.choice(words, size=int(rng.integers(20, 200))))
        (corpus / f"doc{i}.txt").write_text(text)
    return str(corpus / "*.txt")


def _train_config(tmp_path, **overrides):
    values = {
        "data.name": "textfiles",
        "data.files": _textfiles(tmp_path),
        "data.data_dir": str(tmp_path / "tfds"),
        "num_train_steps": 6,
        "checkpoint_every": 3,
        "eval_every": 3,
    }
    values.update(overrides)
    return small_config(**values)


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _final_params(workdir, config):
    setup = TrainSetup(config)
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    state, _, step = ckpt.restore(abstract_state=setup.abstract_state)
    ckpt.close()
    return jax.device_get(state.params), step


def test_a_sentencepiece_run_saves_its_tokenizer_with_every_checkpoint(tmp_path):
    config = _train_config(
        tmp_path,
        **{
            "data.tokenizer": "sentencepiece",
            "data.vocab_size": 280,
            "model.vocab_size": None,
            "num_train_steps": 2,
            "checkpoint_every": 1,
        },
    )
    assert config.model.vocab_size == 320  # 280 ids, padded to a multiple of 64
    workdir = str(tmp_path / "run")
    train(config, workdir, log=lambda _: None, progress=False)
    built = data_lib.load_tokenizer(
        "sentencepiece", 280, "textfiles", config.data.data_dir, config.data.files
    )
    for step in (1, 2):
        saved = ckpt_lib.load_tokenizer(workdir, step)
        assert saved.kind == "sentencepiece" and saved.fingerprint == built.fingerprint
    stored, _, step = ckpt_lib.load_params(workdir)
    assert (stored.model.vocab_size, stored.data.tokenizer, step) == (320, "sentencepiece", 2)


def test_the_committed_older_run_resumes_under_its_own_settings(tmp_path):
    """tests/fixtures/run_v1 predates the RoPE-scaling fields: its stored model has no
    rope_scaling, rope_factor or rope_train_len, which came back as None and were
    refused as "another model (differs in model.rope_factor, …)" with no setting that
    could match them. Its own settings resume it, its data stream restarting."""
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "run_v1")
    workdir = tmp_path / "run_v1"
    shutil.copytree(fixture, workdir)
    with open(workdir / "checkpoints" / "6" / "config" / "metadata") as f:
        stored = json.load(f)
    assert "rope_scaling" not in stored["model"]
    data = {**stored["data"], "data_dir": str(tmp_path / "tfds")}
    mesh = {"data": 4, "fsdp": 1, "tensor": 2}  # its data=-1 cannot split 4 rows over 8
    ours = {**cfg.upgraded(stored), "num_train_steps": 8, "data": data, "mesh": mesh}
    config = cfg.from_configdict(ours)
    lines = []
    summary = train(config, str(workdir), log=lines.append, progress=False)
    assert (summary["start_step"], summary["step"]) == (6, 8), lines
    assert math.isfinite(summary["loss"])


def test_a_new_run_inside_another_runs_checkpoints_is_refused(tmp_path):
    """eval.py's "train first" advice, given the checkpoints/ of a run, trained a new
    run in there. A folder of runs named by number is no checkpoint directory."""
    from lexjax import training

    run = tmp_path / "run_v1"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "run_v1"), run)
    config = _train_config(tmp_path)
    for inside in (run / "checkpoints", run / "checkpoints" / "new"):
        with pytest.raises(CheckpointError, match=f"^workdir {inside} is inside another run: "):
            train(config, str(inside), log=lambda _: None, progress=False)
    assert sorted(os.listdir(run / "checkpoints")) == ["6"]
    (tmp_path / "numbered" / "1" / "checkpoints").mkdir(parents=True)
    training._check_workdir(str(tmp_path / "numbered" / "2"))
    assert os.path.isdir(tmp_path / "numbered" / "2")


def test_checkpoints_of_an_older_lexjax_carry_the_byte_tokenizer():
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "run_v1")
    assert ckpt_lib.load_tokenizer(fixture) is data_lib.BYTES


def test_a_run_that_fails_on_its_data_leaves_no_workdir(tmp_path):
    corpus = tmp_path / "empty"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"")
    config = _train_config(tmp_path, **{"data.files": str(corpus / "*.txt")})
    with pytest.raises(DataError, match="no training text"):
        train(config, str(tmp_path / "run"), log=lambda _: None, progress=False)
    assert not (tmp_path / "run").exists()


def test_resume_equals_uninterrupted(tmp_path):
    """6 steps in one run == 3 steps, a restart, 3 more: same losses and parameters, exactly."""
    config = _train_config(tmp_path)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(config, straight, log=lambda _: None, progress=False)
    lines = []
    first = train(config, resumed, log=lines.append, progress=False, stop_after=3)
    assert first["step"] == 3
    # Without the progress display, the logged steps go to log (they went nowhere).
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/6", "2/6", "3/6"], lines
    assert all(re.fullmatch(r"step \d/6 loss \d+\.\d{3}( [\d,]+ tok/s)?", s) for s in steps)
    # stop_after as many steps as are left finishes the run: it was reported stopped.
    second = train(config, resumed, log=lambda _: None, progress=False, stop_after=3)
    assert second["start_step"] == 3 and second["step"] == 6
    assert second["stopped_by"] is None and first["stopped_by"] == "stop_after"
    assert _losses(straight) == _losses(resumed)
    (p1, s1), (p2, s2) = _final_params(straight, config), _final_params(resumed, config)
    assert s1 == s2 == 6
    jax.tree_util.tree_map(np.testing.assert_array_equal, p1, p2)


def test_low_precision_parameters_are_refused_or_noted(tmp_path):
    """float16 parameters: AdamW's moments are kept in their dtype, where the second
    moment of a small gradient is 0 and the step ~100× the learning rate (shown here
    with the optimizer itself). bfloat16 parameters and float16 compute train, with a
    note each."""
    config = _train_config(tmp_path, num_train_steps=1, warmup_steps=0)
    tx = make_optimizer(config)
    for dtype, ratio in (("float16", 100.0), ("float32", 1.0)):
        params = {"kernel": jnp.full((4,), 0.05, dtype)}
        update, state = tx.update({"kernel": jnp.full((4,), 1e-4, dtype)}, tx.init(params), params)
        step = float(jnp.abs(update["kernel"][0]))
        assert step == pytest.approx(ratio * config.learning_rate, rel=0.05), dtype
    f16 = dataclasses.replace(
        config, model=dataclasses.replace(config.model, param_dtype="float16")
    )
    with pytest.raises(ConfigError, match=r"^model.param_dtype=float16: AdamW's second moment"):
        train(f16, str(tmp_path / "f16"), log=lambda _: None, progress=False)
    assert not (tmp_path / "f16").exists()
    low = dataclasses.replace(
        config, model=dataclasses.replace(config.model, param_dtype="bfloat16", dtype="float16")
    )
    lines = []
    assert train(low, str(tmp_path / "low"), log=lines.append, progress=False)["step"] == 1
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == 2, lines
    assert notes[0].startswith("note: model.param_dtype=bfloat16 rounds away each update")
    assert notes[1].startswith("note: model.dtype=float16 has no loss scaling")


def test_a_second_training_of_the_same_config_compiles_nothing(tmp_path):
    """A notebook's next train() of one config (another workdir, or stop_after=N
    again) compiled its init, train and eval steps anew: seconds on a CPU, far more
    for a real model on an accelerator."""
    compiles = []

    def count(name, *_, **__):
        compiles.append(name == "/jax/core/compile/backend_compile_duration")

    config = _train_config(tmp_path, num_train_steps=2, eval_every=2, checkpoint_every=2)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        train(config, str(tmp_path / "first"), log=lambda _: None, progress=False)
        assert sum(compiles) > 0  # the listener hears compilations
        compiles.clear()
        second = train(config, str(tmp_path / "second"), log=lambda _: None, progress=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert second["step"] == 2 and sum(compiles) == 0
    assert _losses(tmp_path / "first") == _losses(tmp_path / "second")


def test_a_resume_may_compute_in_another_dtype_and_keep_parameters_in_another(tmp_path):
    """Trained in float32 (a CPU), continued in bfloat16 (an accelerator): the
    compute dtype changes no parameter, and the resume was refused as "another
    model (differs in model.dtype)". Likewise bfloat16 parameters continued in
    float32 (the way on for a float16 run, whose parameters training now refuses):
    the restore casts them."""
    config = _train_config(tmp_path, num_train_steps=9)
    workdir = str(tmp_path / "run")

    def saved_dtypes(step: int) -> set[str]:
        """The dtypes the step's arrays were written in (its integrity record), of the
        parameters and of Adam's moments: not what a restore would cast them to."""
        record = os.path.join(workdir, "checkpoints", str(step), "integrity", "metadata")
        with open(record) as f:
            leaves = json.load(f)["leaves"]
        floats = {n: r["dtype"] for n, r in leaves.items() if r["dtype"].startswith(("f", "b"))}
        assert any(".params" in n for n in floats) and any(".mu" in n for n in floats), floats
        return set(floats.values())

    train(config, workdir, log=lambda _: None, progress=False, stop_after=3)
    bf16 = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
    second = train(bf16, workdir, log=lambda _: None, progress=False, stop_after=3)
    assert second["start_step"] == 3 and second["step"] == 6
    assert saved_dtypes(6) == {"float32"}
    low = dataclasses.replace(bf16, model=dataclasses.replace(bf16.model, param_dtype="bfloat16"))
    train(low, workdir, log=lambda _: None, progress=False, stop_after=1)
    assert saved_dtypes(7) == {"bfloat16"}
    third = train(config, workdir, log=lambda _: None, progress=False)
    assert third["start_step"] == 7 and third["step"] == 9
    assert saved_dtypes(9) == {"float32"}
    assert all(math.isfinite(loss) for loss in _losses(workdir).values())


def test_the_tensorboard_writers_start_is_not_timed(tmp_path, monkeypatch):
    """The writer started at the first record (its import alone takes about 2 s), inside
    the next record's interval: step 2 logged 52 tokens/s where the others had 10,000+.
    Here its start takes 3 s; no logged rate may include them. Logged every 2 steps,
    so that the first record (step 2) is one with a rate, its interval holding the start
    (at a first record of step 1 the start fell in no interval whatever was timed)."""
    import tensorboardX

    start = tensorboardX.SummaryWriter.__init__

    def slow_start(self, *args, **kwargs):
        time.sleep(3)
        start(self, *args, **kwargs)

    monkeypatch.setattr(tensorboardX.SummaryWriter, "__init__", slow_start)
    config = _train_config(tmp_path, num_train_steps=4, log_every=2, checkpoint_every=4)
    workdir = str(tmp_path / "run")
    train(config, workdir, log=lambda _: None, progress=False)
    rates = [r["tokens_per_sec"] for r in metrics.read_metrics(workdir) if "tokens_per_sec" in r]
    assert len(rates) == 3, rates  # steps 2, 3 (validation) and 4
    seconds = [config.batch_size * config.train_len / rate for rate in rates]
    assert max(seconds) < 3, seconds


def test_a_workdir_that_is_a_file_is_named_so(tmp_path):
    """Was "cannot create workdir F: File exists", which reads as a directory in the way."""
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    with pytest.raises(CheckpointError) as e:
        train(_train_config(tmp_path), str(blocker), log=lambda _: None, progress=False)
    assert str(e.value) == f"workdir {blocker} is a file; choose a directory for workdir"
    assert blocker.read_text() == "kept"


def test_a_damaged_config_record_falls_back_to_the_step_before(tmp_path, caplog):
    """Step 6's config record is garbage: loading and resuming both name it and use step 3."""
    config = _train_config(tmp_path)
    workdir = str(tmp_path / "run")
    train(config, workdir, log=lambda _: None, progress=False)
    first = metrics.read_metrics(workdir)
    with open(os.path.join(workdir, "checkpoints", "6", "config", "metadata"), "w") as f:
        f.write("garbage{")
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 7, "lo')  # and a record torn by a kill
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        _, _, step = ckpt_lib.load_params(workdir)
        assert step == 3
        resumed = train(config, workdir, log=lambda _: None, progress=False)
    assert resumed["start_step"] == 3 and resumed["step"] == 6
    damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(damaged) == 2, damaged
    assert all("step 6 " in m and "config record unreadable" in m for m in damaged), damaged
    assert all(m.endswith("falling back to step 3") for m in damaged), damaged
    # Steps 4–6, trained twice, are recorded once (they were in metrics.jsonl twice),
    # with the same losses: the resume is exact.
    again = metrics.read_metrics(workdir)
    written = [(r["step"], key) for r in again for key in r if key != "step"]
    assert len(written) == len(set(written)) and {s for s, _ in written} == set(range(1, 7))
    assert [(r["step"], r.get("loss")) for r in again] == [
        (r["step"], r.get("loss")) for r in first
    ]
    # The resumed run's TensorBoard events start with a session at step 4, by which
    # TensorBoard hides the first run's events of steps 4 and later (purge_step).
    events = sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.*")))
    assert len(events) == 2
    starts = [e.step for e in _tensorboard_events(events[-1]) if e.session_log.status == 1]
    assert starts == [4], starts


def test_an_already_trained_resume_drops_the_records_a_killed_run_left_after_it(tmp_path):
    """A run killed after its last checkpoint (step 6) left records of steps 7–8; the
    next run, asked for no more than 6 steps, trains nothing ("already trained") and
    drops them, as a resume that trains does: metrics.jsonl and TensorBoard showed
    steps no checkpoint holds as the run's last."""
    config = _train_config(tmp_path)
    workdir = str(tmp_path / "run")
    train(config, workdir, log=lambda _: None, progress=False)
    first = metrics.read_metrics(workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        for step in (7, 8):  # the killed run of num_train_steps=20
            f.write(json.dumps({"step": step, "loss": 0.5}) + "\n")
    again = train(config, workdir, log=lambda _: None, progress=False)
    assert again["start_step"] == again["step"] == 6
    assert metrics.read_metrics(workdir) == first
    events = sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.*")))
    starts = [e.step for e in _tensorboard_events(events[-1]) if e.session_log.status == 1]
    assert len(events) == 2 and starts == [7], (events, starts)
    # With nothing after its checkpoint, an already-trained run changes nothing.
    train(config, workdir, log=lambda _: None, progress=False)
    assert len(glob.glob(os.path.join(workdir, "tensorboard", "events.*"))) == 2
    assert metrics.read_metrics(workdir) == first


def _tensorboard_events(path):
    """The events of a TensorBoard file: TFRecords of length, its CRC, an Event, its CRC."""
    from tensorboardX.proto import event_pb2

    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[at + 12 : at + 12 + length])
        yield event
        at += 12 + length + 4


def test_restore_onto_another_device_count(tmp_path):
    config = _train_config(
        tmp_path,
        **{
            "num_train_steps": 2,
            "checkpoint_every": 2,
            "mesh.data": 2,
            "mesh.fsdp": 2,
            "mesh.tensor": 2,
        },
    )
    workdir = str(tmp_path / "run")
    train(config, workdir, log=lambda _: None, progress=False)
    params_8, _ = _final_params(workdir, config)
    small = cfg.from_configdict(
        {**cfg.to_dict(config), "mesh": {"data": 2, "fsdp": 1, "tensor": 1}}
    )
    setup = TrainSetup(small, jax.devices()[:2])
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    state, _, step = ckpt.restore(abstract_state=setup.abstract_state)
    ckpt.close()
    assert step == 2 and len(state.params["embed"]["embedding"].sharding.device_set) == 2
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state.params), params_8)


def test_resume_with_another_num_train_steps_continues_on_the_new_schedule(tmp_path, capsys):
    """3 steps, then a resume asking for 5: one line names the change, steps 4-5 follow the
    5-step schedule. Also: off a terminal the progress is one plain line per log step, and
    MFU is written only with a peak (none is known for a CPU)."""
    workdir = str(tmp_path / "run")
    config = _train_config(tmp_path, num_train_steps=3)
    first = train(config, workdir, log=print)
    assert first["step"] == 3 and "mfu" not in first
    out = capsys.readouterr().out
    assert [line.split(" loss ")[0] for line in out.splitlines() if line.startswith("step ")] == [
        "step 1/3",
        "step 2/3",
        "step 3/3",
    ]
    assert "\x1b" not in out and "\r" not in out

    # The weight decay changed too: said as the schedule is (it went unannounced).
    optim = dataclasses.replace(config.optim, weight_decay=0.5)
    config = dataclasses.replace(config, num_train_steps=5, optim=optim)
    lines = []
    second = train(config, workdir, log=lines.append, progress=False, peak_flops=1e9)
    assert second["start_step"] == 3 and second["step"] == 5
    changed = [line for line in lines if "changed" in line]
    assert changed == [
        "learning-rate schedule changed: num_train_steps 3 → 5; "
        "from step 3 the rate follows the new schedule",
        "optimizer settings changed: optim.weight_decay 0.01 → 0.5; "
        "from step 3 the updates use the new values",
    ], lines
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = {r["step"]: r for r in map(json.loads, f) if "loss" in r}
    schedule = learning_rate_schedule(config)
    for step in (4, 5):  # the rate of step s is the schedule at s - 1 completed steps
        assert records[step]["learning_rate"] == pytest.approx(float(schedule(step - 1)))
    assert "mfu" not in records[3]
    expected = records[5]["tokens_per_sec"] * metrics.flops_per_token(config)
    assert records[5]["mfu"] == pytest.approx(expected / (1e9 * jax.device_count()))
    # Asked for fewer steps than done: "already trained", and no change announced for
    # updates that will not happen (it said the new schedule was followed from step 5).
    lines.clear()
    third = train(dataclasses.replace(config, num_train_steps=4), workdir, log=lines.append)
    assert third["start_step"] == third["step"] == 5
    assert not [line for line in lines if "changed" in line], lines
    # As many steps as done, with the weight decay changed back: no update follows either.
    optim = dataclasses.replace(config.optim, weight_decay=0.01)
    fourth = train(dataclasses.replace(config, optim=optim), workdir, log=lines.append)
    assert fourth["start_step"] == fourth["step"] == 5
    assert not [line for line in lines if "changed" in line], lines


def test_tokens_per_sec_times_the_training_steps_only(tmp_path, monkeypatch):
    """On a clock that moves 1 s per training step, 50 s more for the first step's
    compilation and 100 s for each validation and save, every logged rate is one
    step's tokens per second; the record after only the first step has none."""
    from lexjax import training

    clock = [0.0]
    monkeypatch.setattr(training, "time", type("Clock", (), {"perf_counter": lambda: clock[0]}))

    class TimedSetup(TrainSetup):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            inner, self.steps = self.train_step, 0

            def step(state, batch):
                self.steps += 1
                clock[0] += 1.0 + 50.0 * (self.steps == 1)
                return inner(state, batch)

            self.train_step = step

    def slow(method):
        def run(*args, **kwargs):
            clock[0] += 100.0
            return method(*args, **kwargs)

        return run

    monkeypatch.setattr(training, "TrainSetup", TimedSetup)
    monkeypatch.setattr(training._Loop, "_validate", slow(training._Loop._validate))
    monkeypatch.setattr(training._Loop, "_save", slow(training._Loop._save))
    config = _train_config(tmp_path, num_train_steps=7, eval_every=2, log_every=1)
    summary = train(config, str(tmp_path / "run"), log=lambda _: None, progress=False)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 8))
    assert "tokens_per_sec" not in records[0]
    one_step = config.batch_size * config.train_len / 1.0
    assert [r["tokens_per_sec"] for r in records[1:]] == [one_step] * 6
    assert summary["tokens_per_sec"] == one_step


def test_the_schedule_note_names_every_change_that_moves_the_rate():
    from lexjax.training import _schedule_changes

    def config(**values):
        return small_config(**{"num_train_steps": 12, "warmup_steps": 2, **values})

    def stored(c, **values):
        return cfg.to_dict(cfg.from_configdict({**cfg.to_dict(c), **values}))

    constant = config(**{"optim.schedule": "constant"})
    # A constant rate after warmup is the same rate for 7 or 12 steps.
    assert _schedule_changes(stored(constant, num_train_steps=7), constant, 7) == []
    assert _schedule_changes(stored(constant, warmup_steps=3), constant, 5) == []
    assert _schedule_changes(stored(constant, warmup_steps=3), constant, 1) == [
        "warmup_steps 3 → 2"
    ]
    cosine = config(**{"optim.schedule": "cosine", "learning_rate": 1e-3})
    assert _schedule_changes(stored(cosine, num_train_steps=7), cosine, 7) == [
        "num_train_steps 7 → 12"
    ]
    old = stored(
        cosine, learning_rate=2e-3, optim={**cfg.to_dict(cosine)["optim"], "schedule": "polynomial"}
    )
    assert _schedule_changes(old, cosine, 4) == [
        "learning_rate 0.002 → 0.001",
        "optim.schedule polynomial → cosine",
    ]
    assert _schedule_changes(stored(cosine), cosine, 4) == []
    assert _schedule_changes({}, cosine, 4) == []  # a checkpoint without a config record
    # The one update left (step 11 of 12, after warmup 11) takes the peak rate whatever
    # the end fraction: a change was announced from the rate at 12, which no update takes.
    late = config(**{"optim.schedule": "cosine", "warmup_steps": 11})
    end = {**cfg.to_dict(late)["optim"], "end_lr_fraction": 0.5}
    assert _schedule_changes(stored(late, optim=end), late, 11) == []
    assert _schedule_changes(stored(late, optim=end), late, 10) == []  # warmup: the same
    assert _schedule_changes(stored(late, optim=end), late, 12) == []  # nothing left


def test_a_record_torn_by_a_killed_writer_is_skipped_and_not_written_onto(tmp_path, caplog):
    workdir = str(tmp_path)
    writer = metrics.MetricsWriter(workdir)
    writer.write(12, {"loss": 1.0})
    writer.close()
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 13, "lo')  # killed mid-record
    writer = metrics.MetricsWriter(workdir)  # the resumed run
    writer.write(13, {"loss": 0.5})
    writer.close()
    with caplog.at_level(logging.WARNING, logger="lexjax.metrics"):
        records = metrics.read_metrics(workdir)
    assert records == [{"step": 12, "loss": 1.0}, {"step": 13, "loss": 0.5}]
    (note,) = [r.getMessage() for r in caplog.records if r.name == "lexjax.metrics"]
    assert note.startswith("note: skipped 1 torn line(s) of ")


_WRITES_METRICS = """
import sys
from lexjax import metrics
writer = metrics.MetricsWriter(sys.argv[1])
writer.write(1, {"loss": 2.5})
writer.close()
print("torch" in sys.modules, getattr(sys.modules.get("torch"), "__file__", None))
"""


def test_writing_tensorboard_events_does_not_import_an_installed_torch(tmp_path):
    """tensorboardX imports torch whenever it is installed (Colab has it): 1.5 s and
    180 MB of every training process. Here a package named torch on the path stands for
    an installed one; the events are written all the same, and a process that imported
    torch itself keeps it."""
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text("Tensor = type('Tensor', (), {})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), ROOT])}
    for preamble, imported in (("", "False None"), ("import torch\n", "True")):
        workdir = tmp_path / f"run{len(preamble)}"
        done = subprocess.run(
            [sys.executable, "-c", preamble + _WRITES_METRICS, str(workdir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith(imported), done.stdout
        assert metrics.read_metrics(str(workdir)) == [{"step": 1, "loss": 2.5}]
        assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))


def test_a_metrics_file_this_user_cannot_write_is_one_line(tmp_path, monkeypatch):
    """Another user's metrics.jsonl (a workdir shared writable, the file not): resuming
    was a PermissionError traceback, exit 1; TensorBoard's directory was one line."""
    workdir = str(tmp_path)
    writer = metrics.MetricsWriter(workdir)
    writer.write(1, {"loss": 1.0})
    writer.close()
    path = os.path.join(workdir, "metrics.jsonl")
    real_open = open

    def refused(name, mode="r", *args, **kwargs):
        if str(name) == path and mode != "r":
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return real_open(name, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refused)
    with pytest.raises(CheckpointError) as e:
        metrics.MetricsWriter(workdir)
    assert str(e.value) == (
        f"cannot write {path} (Permission denied); make it writable or free space, then "
        "restart (the checkpoints are kept)"
    )


def test_peak_flops_from_the_datasheet_table_or_an_override():
    assert metrics.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.peak_flops("NVIDIA H100 PCIe") == 756e12  # it got the SXM part's 989
    assert metrics.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert metrics.peak_flops("TPU v5 lite") == 197e12  # v5e
    assert metrics.peak_flops("TPU v5") == 459e12  # v5p
    assert metrics.peak_flops("cpu") is None  # unknown: no MFU rather than a guess
    assert metrics.peak_flops("cpu", 2.5e12) == 2.5e12


def _train_cli(*args, env_extra=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--config.model.num_heads=3", "model.num_heads=3 does not divide model.d_model=256"),
        ("--config.model.position=relative", "model.position='relative' is unknown"),
        ("--config.model.d_model=248", "head_dim = d_model/num_heads = 31 is odd"),
        ("--config.mesh.tensor=3", "mesh (-1, 1, 3) cannot fill {devices} devices"),
        ("--config.data.name=textfiles", "data.name=textfiles needs data.files"),
    ],
)
def test_bad_config_is_one_line_exit_2(tmp_path, flag, expected, program, capsys):
    """train.py in this process (tests/programs.py; test_config.py has the real
    process's exit status and line)."""
    extra = ["--config.model.num_heads=8"] if "d_model=248" in flag else []
    code, err = program("train", [f"--workdir={tmp_path}", flag, *extra], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected.format(devices=jax.device_count()) in lines[0], err


def test_a_vocabulary_the_corpus_cannot_fill_is_one_line_exit_3(tmp_path):
    """The largest supported size is named; no workdir and no tokenizer file are left."""
    workdir = tmp_path / "run"
    result = _train_cli(
        f"--workdir={workdir}",
        "--config.data.name=textfiles",
        f"--config.data.files={_textfiles(tmp_path)}",
        f"--config.data.data_dir={tmp_path / 'tfds'}",
        "--config.data.tokenizer=sentencepiece",
        "--config.data.vocab_size=8192",
        env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
    )
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "use at most" in lines[0], result.stderr
    assert "data.vocab_size=8192 is more than this corpus supports" in lines[0]
    assert not workdir.exists()
    assert not list((tmp_path / "tfds").glob("textfiles/*/*/sentencepiece-*"))


def test_a_resumed_run_says_how_many_steps_it_trained_and_from_where(tmp_path, capsys):
    """After a resume from step 2 to 5, train.py said "trained 5 steps": the workdir's
    total, not this run's (api.train is replaced by its summary of such a run)."""
    from lexjax import cli, distributed

    summary = {"start_step": 2, "step": 5, "loss": 1.25, "val_loss": 2.5, "checkpoint_dir": "c"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli.api, "train", lambda *_, **__: {"stopped_by": None, **summary})
        cluster = distributed.ClusterOptions(mode="off")
        assert cli.run_training(cfg.default_configdict(), str(tmp_path), cluster, 60.0) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [
        "trained 3 steps (2 → 5): loss 1.2500, validation loss 2.5000",
        "checkpoint: c (step 5)",
    ]


def test_train_program_end_to_end(tmp_path):
    workdir = tmp_path / "my run"  # the next: line quotes it for the shell
    argv = (
        f"--workdir={workdir}",
        "--config.num_train_steps=2",
        "--config.model.num_layers=1",
        "--config.model.d_model=32",
        "--config.model.mlp_dim=64",
        "--config.train_len=32",
        "--config.model.max_len=32",
        "--config.batch_size=8",
        "--config.eval_batches=1",
        "--config.data.name=textfiles",
        f"--config.data.files={_textfiles(tmp_path)}",
        f"--config.data.data_dir={tmp_path / 'tfds'}",
    )
    result = _train_cli(*argv)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"next: python eval.py --workdir='{workdir}'" in result.stdout
    # The corpus build is one plain line: no TFDS progress bars or warnings.
    built = f"building dataset textfiles (40 files, split by file) in {tmp_path / 'tfds'}... done"
    assert built in result.stdout
    assert "\x1b" not in result.stdout + result.stderr
    assert "Downloading and preparing" not in result.stdout
    assert "dataset_info.json" not in result.stderr
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "learning_rate", "grad_norm", "tokens_per_sec"} <= set(records[0])
    assert "mfu" not in records[0]  # a CPU has no known peak
    assert any((workdir / "tensorboard").iterdir())
    # Run again: nothing to train, and the next step is still named (it was not).
    again = _train_cli(*argv)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.splitlines()[-2:] == [
        f"already trained 2 steps; checkpoint: {workdir / 'checkpoints'}",
        f"next: python eval.py --workdir='{workdir}'",
    ], again.stdout


@pytest.mark.parametrize("schedule", ["cosine", "polynomial", "constant"])
def test_the_learning_rate_schedule_by_hand(schedule):
    """0.01 peak, 4 warmup steps, 24 in all (20 of decay), floor 10% of the peak."""
    config = small_config(
        learning_rate=0.01,
        warmup_steps=4,
        num_train_steps=24,
        **{"optim.schedule": schedule, "optim.end_lr_fraction": 0.1},
    )
    rate = learning_rate_schedule(config)
    # Warmup: linear from 0, the peak at step 4.
    for step, want in ((0, 0.0), (1, 0.0025), (2, 0.005), (4, 0.01)):
        assert float(rate(step)) == pytest.approx(want, abs=1e-9), (schedule, step)
    # Halfway through the decay (step 14) and at its end (step 24).
    halfway, end = {
        "cosine": (0.01 * (1 + 0.1) / 2, 0.001),  # peak·((1−α)·(1+cos(π/2))/2 + α)
        "polynomial": (0.01 - 0.009 / 2, 0.001),  # linear from the peak to α·peak
        "constant": (0.01, 0.01),
    }[schedule]
    assert float(rate(14)) == pytest.approx(halfway, rel=1e-5), schedule
    assert float(rate(24)) == pytest.approx(end, rel=1e-5), schedule


def test_flops_per_token_by_hand():
    """small_config: L=2 layers, d=32, mlp 64, vocabulary 264, train_len T=16.
    Matmul weights per layer 4d² + 2d·mlp = 4,096 + 4,096 = 8,192; with the
    (tied) unembedding 2·8,192 + 264·32 = 24,832, times 6 (forward and backward)
    = 148,992. Causal attention: 6·L·T·d = 6·2·16·32 = 6,144."""
    assert metrics.flops_per_token(small_config()) == 148_992 + 6_144


def test_a_signal_just_as_train_takes_over_the_handlers_is_kept(monkeypatch):
    """train()'s handlers were set, then the signals deferred while the program started
    were taken: a signal in between was recorded by the new handler and then overwritten
    by "none deferred", and the run trained on."""
    import signal

    from lexjax import signals, training

    def take_deferred():  # a SIGTERM lands first, handled by train()'s own handler
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        return None

    monkeypatch.setattr(signals, "take_deferred", take_deferred)
    with training._StopFlag() as stop:
        assert stop.signal_name == "SIGTERM"


def test_a_one_step_warmup_is_zero_at_step_0_and_the_peak_at_step_1():
    """warmup_steps=1 is a warmup too: the first update changes nothing, the second
    takes the peak (it was the schedule without warmup only for warmup_steps=0)."""
    for schedule in ("cosine", "polynomial", "constant"):
        config = small_config(
            learning_rate=0.01,
            warmup_steps=1,
            num_train_steps=11,
            **{"optim.schedule": schedule, "optim.end_lr_fraction": 0.1},
        )
        rate = learning_rate_schedule(config)
        assert float(rate(0)) == 0.0, schedule
        assert float(rate(1)) == pytest.approx(0.01, rel=1e-6), schedule


def test_one_train_step_logs_the_unclipped_norm_and_clips_what_enters_adam():
    """One step with optim.grad_clip far below the gradient's norm. By hand from the
    gradient of loss_fn (itself checked against numpy): the logged grad_norm is
    sqrt(Σ g²) over every parameter (float64), and Adam's first moment after one
    step is (1 − b1)·g·clip/‖g‖ (optax.clip_by_global_norm, then scale_by_adam's
    μ = b1·μ + (1 − b1)·g from μ = 0)."""
    from lexjax.model import Decoder
    from lexjax.steps import loss_fn

    clip = 0.01
    config = small_config(**{"mesh.data": 1, "optim.grad_clip": clip, "optim.b1": 0.8})
    setup = TrainSetup(config, jax.devices()[:1])
    batch = packed_batch(np.random.default_rng(4), 8, 16, vocab=config.model.vocab_size)
    state = setup.init_state()
    params = jax.device_get(state.params)
    grads = jax.grad(lambda p: loss_fn(p, Decoder(config.model), batch)[0])(params)
    grads = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in jax.tree.leaves(grads)))
    assert norm > 10 * clip  # the clip acts
    with jax.set_mesh(setup.mesh):
        state, step_metrics = setup.train_step(state, setup.global_batch(batch))
    assert float(step_metrics["grad_norm"]) == pytest.approx(norm, rel=1e-4)
    mu = jax.device_get(optax.tree.get(state.opt_state, "mu"))
    expected = jax.tree.map(lambda g: (1 - 0.8) * g * clip / norm, grads)
    jax.tree.map(lambda m, e: np.testing.assert_allclose(m, e, rtol=2e-4, atol=1e-9), mu, expected)


def test_optim_grad_clip_0_clips_nothing():
    """grad_clip 0 turns clipping off: a gradient of norm 10 enters Adam whole."""
    config = small_config(**{"optim.grad_clip": 0.0, "optim.b1": 0.5})
    tx = make_optimizer(config)
    params = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}
    grads = {"a": np.array([6.0, 0.0, 0.0], np.float32), "b": np.array([0.0, 8.0], np.float32)}
    _, opt_state = tx.update(grads, tx.init(params), params)
    mu = optax.tree.get(opt_state, "mu")
    np.testing.assert_allclose(mu["a"], [3.0, 0.0, 0.0])
    np.testing.assert_allclose(mu["b"], [0.0, 4.0])


def test_val_loss_is_the_mean_nll_over_every_real_validation_token(tmp_path, monkeypatch):
    """val_loss against numpy float64: the cross-entropy of every target whose
    segment id is > 0, averaged over all the validation batches' such tokens
    together (the packed rows here are full: a mean of per-batch means would agree)."""
    from lexjax import training
    from lexjax.model import Decoder

    seen = []
    validate = training._Loop._validate

    def spy(self, params, step, val_batches):
        seen.append((jax.device_get(params), [dict(b) for b in val_batches]))
        return validate(self, params, step, val_batches)

    monkeypatch.setattr(training._Loop, "_validate", spy)
    config = _train_config(tmp_path, num_train_steps=2, eval_every=2, eval_batches=3)
    summary = train(config, str(tmp_path / "run"), log=lambda _: None, progress=False)
    [(params, batches)] = seen
    model = Decoder(config.model)
    nll, count = [], []
    for b in batches:
        logits, _ = model.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"])
        real = b["segment_ids"] > 0
        nll.append(np_nll(logits, b["targets"])[real].sum())
        count.append(real.sum())
    assert summary["val_loss"] == pytest.approx(sum(nll) / sum(count), rel=1e-5)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        [logged] = [r["val_loss"] for r in map(json.loads, f) if "val_loss" in r]
    assert logged == summary["val_loss"]


def test_a_step_whose_gradient_alone_is_not_finite_changes_nothing():
    """A finite loss whose gradient is not (d√w/dw at w = 0 is infinite) is a
    non-finite step: reported so, and the state is kept as it was, step count and
    Adam's moments included; with w = 1 the same step is finite and counted."""
    from lexjax.steps import TrainState, train_step

    class SqrtLogits:
        """logits = √w for every token: a Decoder's apply signature, one parameter."""

        def apply(self, variables, inputs, positions, segment_ids):
            w = variables["params"]["w"]
            return jnp.broadcast_to(jnp.sqrt(w), (*inputs.shape, w.shape[0])), None

    config = small_config()
    tx = make_optimizer(config)
    batch = packed_batch(np.random.default_rng(0), 2, 8, vocab=4)
    for w, finite in ((np.zeros(4, np.float32), False), (np.ones(4, np.float32), True)):
        params = {"w": jnp.asarray(w)}
        state = TrainState(step=jnp.int32(3), params=params, opt_state=tx.init(params))
        new, step_metrics = train_step(state, batch, model=SqrtLogits(), tx=tx, config=config)
        assert np.isfinite(float(step_metrics["loss"]))
        assert bool(step_metrics["finite"]) is finite
        assert int(new.step) == 3 + finite
        if not finite:
            jax.tree.map(np.testing.assert_array_equal, new.params, params)
            jax.tree.map(np.testing.assert_array_equal, new.opt_state, state.opt_state)


def test_each_record_holds_its_own_steps_loss_and_the_last_step_is_validated(tmp_path, monkeypatch):
    """Logged every 2 steps of 5: the records at steps 2 and 4 (two steps read back at
    once) and at the last step hold the loss that step's train_step returned, and the
    last step is validated although 5 is not a multiple of eval_every."""
    from lexjax import training

    returned = []

    class RecordingSetup(TrainSetup):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            inner = self.train_step

            def step(state, batch):
                state, step_metrics = inner(state, batch)
                returned.append(step_metrics["loss"])
                return state, step_metrics

            self.train_step = step

    monkeypatch.setattr(training, "TrainSetup", RecordingSetup)
    config = _train_config(
        tmp_path, num_train_steps=5, log_every=2, eval_every=2, checkpoint_every=5
    )
    workdir = str(tmp_path / "run")
    train(config, workdir, log=lambda _: None, progress=False)
    records = metrics.read_metrics(workdir)
    logged = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(logged) == [2, 4, 5]
    assert logged == {s: float(returned[s - 1]) for s in logged}
    assert len(set(logged.values())) == 3  # each step's own
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 5]


@pytest.mark.parametrize("count", [1, 2])
def test_processes_stop_together_at_a_log_or_checkpoint_step(monkeypatch, count):
    """One process alone stops after the step that got the signal. With several
    (the agreement simulated, the peer's flag given), all stop at one step, also
    when only one got the signal: they agree at each log step and each checkpoint
    step, and nowhere else (a collective every process must reach alike); before
    the loop, a signal does not raise on one process alone."""
    import types

    from lexjax import distributed, training

    monkeypatch.setattr(jax, "process_count", lambda: count)
    peer, asked, at = [False], [], []
    gather = lambda flag: asked.append(at[-1]) or np.array([int(flag), int(peer[0])])
    monkeypatch.setattr(distributed, "_gather_flags", gather)
    config = types.SimpleNamespace(log_every=10, checkpoint_every=25)
    loop = types.SimpleNamespace(setup=types.SimpleNamespace(config=config))
    stop = training._StopFlag()  # not entered: no handlers
    stop.signal_name = "SIGTERM"

    def stops(*steps):
        return {at.append(s) or s: training._Loop._stop_requested(loop, stop, s) for s in steps}

    if count == 1:
        assert stops(3) == {3: True}
        with pytest.raises(training._Stopped), stop.raising():
            pass
        assert asked == []
        return
    with stop.raising():  # the processes stop together, in the loop
        pass
    assert stops(3, 20) == {3: False, 20: True} and stop.signal_name == "SIGTERM"
    stop.signal_name, peer[0] = None, True  # only the peer got a signal
    assert stops(7, 25) == {7: False, 25: True}
    assert stop.signal_name == "a signal to another process"
    stop.signal_name, peer[0] = None, False
    assert stops(30) == {30: False}
    assert asked == [20, 25, 30]


@pytest.mark.parametrize("count", [1, 2])
def test_a_batch_that_fails_is_saved_before_on_one_process_only(tmp_path, monkeypatch, count):
    """One process saves the steps trained before a batch that failed, with the
    position before it. With several (simulated) the failing process saves nothing
    (a save is collective, and its peers may have read their batch): it stops with
    the data's error as before."""
    import types

    from lexjax import training

    monkeypatch.setattr(jax, "process_count", lambda: count)
    monkeypatch.setattr(jax, "process_index", lambda: 1)

    class Failing:
        def get_state(self):
            return {"next_index": 4}

        def __next__(self):
            raise DataError("record 4 is damaged")

    saves = []
    loop = training._Loop(
        types.SimpleNamespace(config=None), None, Failing(), None, str(tmp_path),
        print, None, None,
    )  # fmt: skip
    loop.summary["start_step"] = 0
    loop._save = lambda step, state, position: saves.append((step, position.state))
    loop.checkpointer = types.SimpleNamespace(wait=lambda: None, directory=tmp_path)
    stop = training._StopFlag()  # not entered: no handlers
    with pytest.raises(DataError) as raised:
        loop._next_batch(stop)
    error = loop._save_before(raised.value, 5, None, 3)
    assert saves == ([(5, {"next_index": 4})] if count == 1 else [])
    assert ("saved (checkpoint step 5" in str(error)) == (count == 1)
