"""Evaluation on the mesh: 8 simulated devices give one device's perplexities.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (as CI does).
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lexjax import evaluation
from lexjax import sharding as shard_lib
from lexjax.config import MeshConfig
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
    config, params, step, mesh = evaluation.load_on_mesh(FIXTURE)
    assert (step, dict(mesh.shape)) == (6, {"data": 8, "fsdp": 1, "tensor": 1})
    assert config.model.remat_policy == "none"
    want = shard_lib.model_param_shardings(config, mesh)
    jax.tree.map(lambda p, s: p.sharding.is_equivalent_to(s, p.ndim) or pytest.fail(), params, want)
    _, one, _, _ = evaluation.load_on_mesh(FIXTURE, jax.devices()[:1])
    jax.tree.map(np.testing.assert_array_equal, params, one)
