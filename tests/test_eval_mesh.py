"""Evaluation on the mesh: 8 simulated devices give one device's perplexities,
passkey results and generated tokens.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (as CI does).
"""

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import evaluation, generation, passkey
from lexjax import sharding as shard_lib
from lexjax.config import ConfigError, MeshConfig
from lexjax.model import Decoder
from tests.helpers import small_config

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "run_v1")
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


@pytest.mark.parametrize(
    "mesh, devices, want",
    [
        (MeshConfig(data=-1), 8, (8, 1, 1)),
        (MeshConfig(data=1, fsdp=-1), 1, (1, 1, 1)),
        (MeshConfig(data=2, fsdp=4, tensor=1), 8, (2, 4, 1)),  # fits: unchanged
        (MeshConfig(data=2, fsdp=4, tensor=1), 2, (1, 2, 1)),  # trained on 8, evaluated on 2
        (MeshConfig(data=1, fsdp=-1, tensor=4), 8, (1, 2, 4)),
        (MeshConfig(data=1, fsdp=-1, tensor=4), 6, (1, 3, 2)),
    ],
)
def test_fit_mesh_keeps_what_fits_and_fills_the_rest(mesh, devices, want):
    fitted = shard_lib.fit_mesh(mesh, devices)
    assert shard_lib.mesh_shape(fitted, devices) == want


@pytest.mark.skipif(jax.device_count() < 6, reason="needs 6 (simulated) devices")
def test_an_fsdp_run_evaluates_on_devices_its_fill_axis_cannot_divide():
    """d_model 32 trained with fsdp=-1 on 8 devices, evaluated on 6: fsdp 6 divides
    nothing, so it keeps 2 and data takes 3 (it was a ConfigError eval.py had no flag
    to get around)."""
    config = small_config(**{"sharding": "fsdp", "mesh.data": 1, "mesh.fsdp": -1})
    assert dict(shard_lib.eval_mesh(config, jax.devices()[:6]).shape) == {
        "data": 3,
        "fsdp": 2,
        "tensor": 1,
    }
    assert dict(shard_lib.eval_mesh(config, jax.devices()[:4]).shape)["fsdp"] == 4
    # A rule that shards weights over data, which takes every device left: 6 cannot
    # divide d_model 32, and eval.py has no mesh flag to change (it said "change the
    # model or the mesh"), so the message names the devices.
    config = small_config(**{"sharding_rules": {"embed": "data"}, "mesh.data": -1})
    said = "this run's mesh does not fit 6 devices (model embed size 32 is not divisible by "
    with pytest.raises(ConfigError, match=re.escape(said) + ".*a device count that its"):
        shard_lib.eval_mesh(config, jax.devices()[:6])


def _perplexities(config, params, documents, devices):
    mesh = shard_lib.eval_mesh(config, devices)
    params = jax.device_put(params, shard_lib.model_param_shardings(config, mesh))
    with jax.set_mesh(mesh):
        results = evaluation.perplexity(
            Decoder(config.model),
            params,
            documents,
            [16, 32, 64],
            block=config.block,
            max_length=64,
            batch_sharding=shard_lib.batch_sharding(mesh, shard_lib.rules(config)),
        )
    return dict(mesh.shape), {(r.mode, r.length): r.perplexity for r in results}


@needs_8
@pytest.mark.parametrize(
    "preset, mesh", [("tensor", dict(data=2, fsdp=2, tensor=2)), ("fsdp", dict(data=1, fsdp=-1))]
)
def test_eight_devices_give_one_devices_perplexities(preset, mesh):
    config = small_config(sharding=preset, **{f"mesh.{k}": v for k, v in mesh.items()})
    model = Decoder(config.model)
    params = nn.unbox(model.init(jax.random.key(1), jnp.zeros((1, 16), jnp.int32))["params"])
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 258, 65 + i).astype(np.int32) for i in range(5)]  # 5 rows/len
    shape8, eight = _perplexities(config, params, documents, jax.devices())
    shape1, one = _perplexities(config, params, documents, jax.devices()[:1])
    assert shape1 == {"data": 1, "fsdp": 1, "tensor": 1}
    assert np.prod(list(shape8.values())) == 8 and shape8["data"] * shape8["fsdp"] >= 2
    assert eight.keys() == one.keys() and len(one) == 6
    for cell, value in one.items():
        assert eight[cell] == pytest.approx(value, rel=1e-4), cell


@needs_8
def test_load_on_mesh_reads_parameters_into_their_shardings():
    """An old workdir (model.remat stored as a bool) loads onto the 8-device mesh."""
    (config, params, step, _, _), mesh = evaluation.load_on_mesh(FIXTURE)
    assert (step, dict(mesh.shape)) == (6, {"data": 8, "fsdp": 1, "tensor": 1})
    assert config.model.remat_policy == "none"
    want = shard_lib.model_param_shardings(config, mesh)
    jax.tree.map(lambda p, s: p.sharding.is_equivalent_to(s, p.ndim) or pytest.fail(), params, want)
    (_, one, *_), _ = evaluation.load_on_mesh(FIXTURE, jax.devices()[:1])
    jax.tree.map(np.testing.assert_array_equal, params, one)


PRESETS = [("tensor", dict(data=2, fsdp=2, tensor=2)), ("fsdp", dict(data=1, fsdp=-1))]


def _on_mesh(preset, mesh, devices, train_len=16):
    """A seeded small model of ``preset`` with its parameters placed on the eval mesh."""
    config = small_config(
        sharding=preset,
        train_len=train_len,
        **{"model.max_len": 4 * train_len},
        **{f"mesh.{k}": v for k, v in mesh.items()},
    )
    model = Decoder(config.model)
    params = model.init(jax.random.key(3), jnp.zeros((1, train_len), jnp.int32))["params"]
    on = shard_lib.eval_mesh(config, devices)
    params = jax.device_put(nn.unbox(params), shard_lib.model_param_shardings(config, on))
    return config, model, params, on


@needs_8
@pytest.mark.parametrize("preset, mesh", PRESETS[:1])  # data × fsdp = 4, tensor = 2
def test_eight_devices_give_one_devices_passkey_results(preset, mesh, monkeypatch):
    """Samples are split over data × fsdp (batches rounded up to a multiple of its
    parts), and every cell's accuracy and answer log-likelihood match one device's."""
    placed = []
    real_generate = generation.generate

    def spy(model, params, prompts, **kwargs):
        placed.append(prompts.sharding)
        return real_generate(model, params, prompts, **kwargs)

    monkeypatch.setattr(generation, "generate", spy)
    cells = {}
    for devices in (jax.devices(), jax.devices()[:1]):
        config, model, params, on = _on_mesh(preset, mesh, devices, train_len=48)
        batch_sharding = shard_lib.batch_sharding(on, shard_lib.rules(config))
        with jax.set_mesh(on):
            results = passkey.passkey_accuracy(
                model,
                params,
                block=config.block,
                lengths=[144],
                depths=[0.0, 0.5],
                trials=3,
                tokens_per_batch=3 * 144,  # 3 samples a call at 144: padded to the parts
                batch_sharding=batch_sharding,
            )
        cells[len(devices)] = {(r.mode, r.length, r.depth): r for r in results}
        if len(devices) == 8:
            parts = shard_lib.batch_shards(batch_sharding)
            assert parts >= 2 and all(s.is_equivalent_to(batch_sharding, 2) for s in placed)
    assert cells[8].keys() == cells[1].keys() and len(cells[1]) == 4
    for cell, one in cells[1].items():
        eight = cells[8][cell]
        assert eight.accuracy == one.accuracy, cell
        assert eight.answer_nats == pytest.approx(one.answer_nats, rel=1e-4), cell


@needs_8
@pytest.mark.parametrize(
    "preset, mesh, mode", [(*PRESETS[0], "bca"), (*PRESETS[1], "bca"), (*PRESETS[0], "full")]
)
def test_generation_on_eight_devices_gives_one_devices_tokens(preset, mesh, mode, capfd):
    """Greedy decoding of a batch split over data × fsdp with sharded parameters writes
    one device's tokens, past the training length in the BCA mode. A single prompt's
    row is not pinned to data × fsdp shards that cannot split it, by ``complete`` or
    by a model with the run's rules: XLA's partitioner then rematerialised every
    layer's activations, printing a warning for each."""
    rng = np.random.default_rng(4)
    prompts = rng.integers(3, 258, (8, 21)).astype(np.int32)
    tokens = {}
    for devices in (jax.devices(), jax.devices()[:1]):
        config, model, params, on = _on_mesh(preset, mesh, devices)
        batch = jax.device_put(prompts, shard_lib.batch_sharding(on, shard_lib.rules(config)))
        with jax.set_mesh(on):
            out = generation.generate(
                model,
                params,
                batch,
                block=config.block,
                max_new_tokens=40 if mode == "bca" else 20,
                rng=jax.random.key(0),
                temperature=0.0,
                mode=mode,
            )
            text = generation.complete(config, params, "The pass key is", max_new_tokens=24)
            # One row through a model that pins activations (as lexjax.load's does).
            one = generation.generate(
                Decoder(config.model, shard_lib.rules(config)),
                params,
                prompts[:1],
                block=config.block,
                max_new_tokens=8,
                rng=jax.random.key(0),
                temperature=0.0,
                mode=mode,
            )
        np.testing.assert_array_equal(shard_lib.host_array(one), shard_lib.host_array(out)[:1, :8])
        tokens[len(devices)] = (shard_lib.host_array(out), text)
    np.testing.assert_array_equal(tokens[8][0], tokens[1][0])
    assert len(set(tokens[1][0].ravel().tolist())) > 3  # not one token over and over
    assert tokens[8][1] == tokens[1][1]
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_only_process_0_writes_report_files(tmp_path, monkeypatch):
    """In a multi-process evaluation every process computes the results; the JSON and
    the figures are written by process 0 alone (the others would race on one file)."""
    from lexjax import reports

    result = passkey.PasskeyResult("bca", 32, 0.5, 1.0, 2, 0.1)
    for index in (1, 0):
        monkeypatch.setattr(jax, "process_index", lambda i=index: i)
        reports.write_json(str(tmp_path / f"p{index}" / "passkey.json"), {"index": index})
        reports.plot_passkey([result], str(tmp_path / f"p{index}.png"), train_len=16, title="t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p0", "p0.png"]
    assert (tmp_path / "p0" / "passkey.json").read_text().strip() == '{\n  "index": 0\n}'


@needs_8
def test_learned_positions_on_a_tensor_mesh_are_not_rematerialised(capfd):
    """The learned position table is pinned as the token table is: looked up in its
    embed shards (tensor preset: embed over fsdp), XLA's partitioner rematerialised
    the batch's position embeddings in full, printing a warning at every compile of
    the evaluation and of generation."""
    config = small_config(
        sharding="tensor",
        **{"model.position": "learned", "model.max_len": 64, "model.num_heads": 2},
        **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
    )
    model = Decoder(config.model)
    params = nn.unbox(model.init(jax.random.key(1), jnp.zeros((1, 16), jnp.int32))["params"])
    documents = [np.random.default_rng(0).integers(0, 258, 33).astype(np.int32)] * 4
    found = {}
    for devices in (jax.devices(), jax.devices()[:1]):
        on = shard_lib.eval_mesh(config, devices)
        placed = jax.device_put(params, shard_lib.model_param_shardings(config, on))
        rules = shard_lib.rules(config)
        with jax.set_mesh(on):
            results = evaluation.perplexity(
                Decoder(config.model, rules),
                placed,
                documents,
                [16, 32],
                block=config.block,
                batch_sharding=shard_lib.batch_sharding(on, rules),
            )
            tokens = generation.generate(
                Decoder(config.model, rules),
                placed,
                np.stack(documents)[:, :20],
                block=config.block,
                max_new_tokens=4,
                rng=jax.random.key(0),
                temperature=0.0,
            )
        found[len(devices)] = {(r.mode, r.length): r.nll for r in results}, tokens
    assert found[8][0].keys() == found[1][0].keys() and len(found[1][0]) == 4
    for cell, value in found[1][0].items():
        assert found[8][0][cell] == pytest.approx(value, rel=1e-4), cell
    np.testing.assert_array_equal(*(shard_lib.host_array(found[n][1]) for n in (8, 1)))
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
